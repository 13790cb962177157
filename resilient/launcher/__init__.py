"""``resilient-run``: the torchrun-compatible node agent (entry point ``cli.main``).

Modules: ``args`` (flags), ``env`` (worker environment), ``logs`` (log files and tee),
``rendezvous`` (node slots in etcd, lease keep-alive, agent TCPStore), ``standalone``
(local etcd + coordinator), ``agent`` (spawn, watch, revoke, restart), ``cli``; node-lease
mode: ``node_members`` (the ``nodes/<node>`` record), ``node_channel`` (the agent's local
channel to its ranks), ``channel_wire`` (that channel's frames and messages).
"""
