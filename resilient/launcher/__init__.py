"""``resilient-run``: the torchrun-compatible node agent (entry point ``cli.main``).

Modules: ``args`` (flags), ``env`` (worker environment), ``logs`` (log files and tee),
``rendezvous`` (node slots in etcd, lease keep-alive, agent TCPStore), ``standalone``
(local etcd + coordinator), ``agent`` (spawn, watch, revoke, restart), ``cli``.
"""
