"""Rank side of resilient: ``connect`` (a ready ``Communicator`` in one call),
``Communicator``, ``Work``, ``ReduceOp``, ``Policy`` (imported lazily, so ``import resilient``
stays light) and every error of :mod:`resilient.errors`."""
from typing import Any

from resilient import errors
from resilient.errors import (
    Cancelled, ClosedError, CollectiveAborted, CollectiveError, ConfigError, DataLost, EpochChanged, Evicted, FrameError,
    GroupChanged, InputMismatch, LeaseExpired, MetricLabelError, OpMismatch, PeerLost, PeerReportedError, PeerUnreachable,
    RecordError, RemovedFromGroup, RendezvousTimeout, ResilientError, ResilientTimeout, ScenarioError, StoreError,
    StoreUnavailable, TrainingFinished, TransportAborted, TransportError, UnsupportedOperation,
)

# The "resilient" torch.distributed backend: registered now if torch.distributed is loaded,
# else the moment it is (no torch import here). See resilient/torch_backend/__init__.py.
from resilient.torch_backend import add_creation_hook as _add_creation_hook  # noqa: E402
from resilient.torch_backend import autoregister as _autoregister_torch_backend  # noqa: E402


def _install_integrations() -> None:
    """Once a resilient world group exists: plain DDP over it averages over the contributors
    (docs/ddp.md), and FSDP2's HSDP drops a broken replica group (docs/fsdp.md)."""
    from resilient.ddp import install_auto_hook
    from resilient.fsdp import install as install_fsdp

    install_auto_hook()
    install_fsdp()


_add_creation_hook(_install_integrations)
_autoregister_torch_backend()

# under resilient-run: the agent tells a finished script from a process that ended early with code 0
from resilient.script_exit import arm as _arm_exit_marker  # noqa: E402

_arm_exit_marker()
# ...and its workers' lines on the shared console stay whole (docs/launcher.md)
from resilient.console_lines import whole_lines as _whole_lines  # noqa: E402

_whole_lines()

__all__ = ["Communicator", "Work", "ReduceOp", "Policy", "world", "World", "connect", "ConnectedCommunicator", "errors", *errors.__all__]


def __getattr__(name: str) -> Any:
    if name in ("Communicator", "Work", "Policy"):
        import resilient.collectives as c

        return getattr(c, name)
    if name in ("world", "World"):
        # the live view (rank, size, epoch, members), kept right by the torch backend
        import resilient.live_world as w

        return getattr(w, name)
    if name in ("connect", "ConnectedCommunicator"):
        # Store -> MemberSession -> EpochWatcher -> GroupView -> transport -> Communicator
        import resilient.connection as conn

        return getattr(conn, name)
    if name == "ReduceOp":
        from resilient.kernels import ReduceOp

        return ReduceOp
    raise AttributeError(f"module 'resilient' has no attribute {name!r}")
