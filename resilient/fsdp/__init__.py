"""FSDP2 and HSDP (``fully_shard`` over a ``DeviceMesh``) on the resilient backend: a lost
member drops its replica group, and the other replica groups finish the step exactly
(``docs/fsdp.md``).

- :mod:`.layout`: which members form each replica group, which groups are broken;
- :mod:`.pause`: a broken group's survivors step aside (exit 0, the job goes on);
- :mod:`.step_ledger`: each step averages every shard over one set of whole replica groups;
- :mod:`.patches`: the wrappers around torch's FSDP2 functions, installed by :func:`install`
  when the first resilient process group is created.
"""
from __future__ import annotations

from resilient.fsdp.patches import install

__all__ = ["install"]
