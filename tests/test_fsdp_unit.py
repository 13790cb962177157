"""Pure logic of resilient.fsdp: the replica layout, the step-aside decision, the patches'
factor stand-in (the processes' behaviour: tests/test_fsdp_hsdp_procs.py)."""
from __future__ import annotations

import pytest

from resilient.errors import ConfigError
from resilient.fsdp.layout import ReplicaLayout
from resilient.fsdp.pause import Pauser

ROWS = [[0, 1], [2, 3], [4, 5]]
WORLD = ["a", "b", "c", "d", "e", "f"]


def test_layout_from_mesh_and_broken_rows() -> None:
    layout = ReplicaLayout.from_mesh(ROWS, WORLD)
    assert layout.rows == (("a", "b"), ("c", "d"), ("e", "f"))
    assert layout.row_of("d") == 1 and layout.row_of("zz") is None
    assert layout.broken(WORLD) == frozenset()
    assert layout.broken(["a", "b", "c", "e", "f"]) == {1}
    # a column sees only whole rows; a member outside the mesh is kept
    assert layout.keep(["a", "c", "e", "x"]) == ("x",)  # every row lacks a member
    assert layout.keep(["a", "b", "c", "e", "f", "x"]) == ("a", "b", "e", "f", "x")


def test_layout_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(ConfigError, match="outside the world of 6 members"):
        ReplicaLayout.from_mesh([[0, 1], [2, 9]], WORLD)


def test_pause_only_when_own_row_is_broken() -> None:
    members = list(WORLD)
    exits: list[int] = []
    p = Pauser()
    p.exit = exits.append
    p.maybe_pause()  # nothing registered: returns
    p.register(ReplicaLayout.from_mesh(ROWS, WORLD), "c", lambda: tuple(members))
    p.maybe_pause()
    assert exits == []
    members.remove("a")  # another row broke: this member goes on
    p.maybe_pause()
    assert exits == []
    members.remove("d")  # its own row broke
    p.maybe_pause(RuntimeError("boom"))
    assert exits == [0]


def test_factor_stand_in_gives_torchs_factors_for_the_agreed_size() -> None:
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    from resilient.fsdp.patches import _Sized

    pre8, post8, _, _ = _get_gradient_divide_factors(_Sized(4), _Sized(2), torch.float64)
    pre4, post4, _, _ = _get_gradient_divide_factors(_Sized(4), _Sized(1), torch.float64)
    assert (pre8, post8, pre4, post4) == (4, 2.0, 2, 2.0)
    # the redo rescales by pre ratios: always a power of two, so exact
    ratio = pre8 / pre4
    assert ratio == 2 ** round(__import__("math").log2(ratio))


_INSTALL_ORDER = """
import sys
import torch
import resilient.fsdp.patches as patches
if {before}:
    from torch.distributed.fsdp import fully_shard
patches.install()
deferred = "torch.distributed.fsdp" not in sys.modules
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll, _fsdp_param_group as pgroup
wrapped = [hasattr(f, "__wrapped__") for f in (pgroup.FSDPParamGroup.__init__, pgroup.foreach_reduce,
                                               coll._get_gradient_divide_factors)]
print(deferred, wrapped)
"""


@pytest.mark.parametrize("before", [False, True], ids=["fsdp-imported-later", "fsdp-imported-first"])
def test_install_leaves_fsdp_unimported_and_wraps_it_when_a_script_imports_it(before: bool) -> None:
    """A group's creation must not import torch's FSDP (sympy, seconds of CPU per process):
    the wrappers go in when the script imports it, or at once when it already has."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _INSTALL_ORDER.format(before=before)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split(maxsplit=1)
    assert out == [str(not before), "[True, True, True]\n"], out
