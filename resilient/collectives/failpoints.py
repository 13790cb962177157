"""Failpoints (like etcd's gofail): a process sends *itself* a real signal at an exact
point of a collective, for tests, benchmarks and chaos runs.

``RESILIENT_FAILPOINTS`` holds ``;``-separated specs ``ACTION@key=value,...``::

    kill@op=3,phase=rs,frac=0.5      SIGKILL when op #3 has done half of its reduce-scatter
    stop@op=2,phase=ag,frac=0.25     SIGSTOP (resume it with SIGCONT from outside)
    kill@op=1,phase=recovery         SIGKILL at the first transfer round of a recovery
    kill@op=4,phase=rd               recursive doubling (small messages), frac per step
    kill@op=1,phase=plan             the recovery planner (beyond RESILIENT_LEDGER_DIRECT_MAX
                                     survivors), holding every summary, before it decides

``phase`` is ``rs`` / ``ag`` (ring), ``rd`` (recursive doubling), ``chain`` (broadcast),
``recovery``, ``plan`` (the recovery planner), ``intra_rs`` / ``cross_rs`` / ``cross_ag`` / ``intra_ag`` (the levels of
the hierarchical allreduce), ``peer_copy`` (plain FSDP's copy after optimizer step ``op``, counted
from 0: ``frac=0`` before its send, ``frac=1`` once the send is posted); ``frac`` (default 0) fires at the first point whose progress in that phase
is >= frac. ``epoch=N`` restricts a spec to ops run in epoch N. Each spec fires once.

Zero cost when unset: call sites test the module constant :data:`ACTIVE` first.
A malformed spec raises :class:`~resilient.errors.ConfigError` at import, naming it.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from resilient.errors import ConfigError

ENV = "RESILIENT_FAILPOINTS"
_ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_PHASES = {"rs", "ag", "rd", "chain", "recovery", "plan",
           "intra_rs", "cross_rs", "cross_ag", "intra_ag",  # these four: algorithms/hierarchical.py
           "peer_copy"}  # plain FSDP's copy refresh (resilient/fsdp/plain.py): op = the optimizer step


@dataclass
class Spec:
    action: str
    op: int
    phase: str
    frac: float = 0.0
    epoch: int | None = None
    fired: bool = False


def parse(text: str) -> list[Spec]:
    specs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        action, _, rest = part.partition("@")
        if action not in _ACTIONS:
            raise ConfigError(f"{ENV}: unknown action {action!r} in {part!r}; use kill or stop")
        kv = {}
        for item in filter(None, rest.split(",")):
            k, sep, v = item.partition("=")
            if not sep:
                raise ConfigError(f"{ENV}: {item!r} in {part!r} is not key=value")
            kv[k.strip()] = v.strip()
        try:
            spec = Spec(action, int(kv.pop("op")), kv.pop("phase"), float(kv.pop("frac", 0.0)),
                        int(kv["epoch"]) if "epoch" in kv else None)
            kv.pop("epoch", None)
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{ENV}: {part!r} needs op=INT,phase=NAME[,frac=F][,epoch=N] ({exc})") from None
        if spec.phase not in _PHASES or kv:
            raise ConfigError(f"{ENV}: bad phase or extra keys in {part!r}; phases: {sorted(_PHASES)}")
        specs.append(spec)
    return specs


SPECS: list[Spec] = parse(os.environ.get(ENV, ""))
ACTIVE: bool = bool(SPECS)


def check(op: int, phase: str, frac: float, epoch: int | None = None) -> None:
    """Fire the first matching spec (signals this very process)."""
    for spec in SPECS:
        if (not spec.fired and spec.op == op and spec.phase == phase and frac >= spec.frac
                and (spec.epoch is None or spec.epoch == epoch)):
            spec.fired = True
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), _ACTIONS[spec.action])
