"""Compact contributor masks (resilient/collectives/mask_codec.py) and the ledger
summaries that carry them (ledger.encode_status / decode_status)."""
from __future__ import annotations

import base64
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from resilient.collectives.ledger import Ledger, decode_status, encode_status, members_digest, split
from resilient.collectives.mask_codec import decode_mask, encode_mask, max_encoded_chars
from resilient.errors import CollectiveError

BIG = 100_000


@st.composite
def masks(draw: st.DrawFn, max_n: int = BIG) -> tuple[int, int]:
    """(n, mask): arbitrary bitmaps, sets of arcs (wrapping too), empty and full masks."""
    n = draw(st.integers(1, max_n))
    kind = draw(st.sampled_from(["bits", "arcs", "empty", "full"]))
    if kind == "empty":
        return n, 0
    if kind == "full":
        return n, (1 << n) - 1
    if kind == "bits":
        return n, draw(st.integers(0, (1 << min(n, 4096)) - 1)) << draw(st.integers(0, max(n - 4096, 0)))
    mask = 0
    for _ in range(draw(st.integers(1, 6))):
        start, length = draw(st.integers(0, n - 1)), draw(st.integers(1, n))
        run = ((1 << length) - 1) << start
        mask |= (run | (run >> n)) & ((1 << n) - 1)
    return n, mask


@settings(max_examples=150, deadline=None)
@given(masks())
def test_masks_round_trip_up_to_100k_members(nm: tuple[int, int]) -> None:
    n, mask = nm
    enc = encode_mask(mask, n)
    assert decode_mask(json.loads(json.dumps(enc)), n) == mask
    assert len(json.dumps(enc, separators=(",", ":"))) <= max_encoded_chars(n)


@settings(max_examples=60, deadline=None)
@given(masks(max_n=300))
def test_the_shorter_form_is_chosen(nm: tuple[int, int]) -> None:
    n, mask = nm
    enc = json.dumps(encode_mask(mask, n), separators=(",", ":"))
    bitmap = json.dumps(base64.b64encode(mask.to_bytes((n + 7) // 8, "little")).decode())
    runs, i = [], 0
    while i < n:
        if mask >> i & 1:
            j = i
            while j < n and mask >> j & 1:
                j += 1
            runs += [i, j - i]
            i = j
        else:
            i += 1
    if len(runs) >= 4 and runs[0] == 0 and runs[-2] + runs[-1] == n:
        runs = runs[2:-1] + [runs[-1] + runs[1]]
    assert len(enc) <= min(len(bitmap), len(json.dumps(runs, separators=(",", ":"))))


def test_a_wrapping_arc_is_one_arc() -> None:
    n = 10
    mask = 0b1100000111   # members 8, 9, 0, 1, 2
    assert encode_mask(mask, n) == [8, 5]
    assert decode_mask([8, 5], n) == mask
    assert encode_mask((1 << n) - 1, n) == [0, 10]
    assert encode_mask(0, n) == []


def _ledger(n: int, pieces: int) -> Ledger:
    members = tuple(f"m{i:06d}" for i in range(n))
    L = Ledger(seq=7, kind="allreduce", members=members, me=3, epoch=2, digest=12345,
               inp=torch.zeros(pieces), out=torch.zeros(pieces), pieces=split(pieces, pieces))
    return L


def test_100k_member_summary_encodes_within_its_bound() -> None:
    n, pieces = BIG, 64
    L = _ledger(n, pieces)
    full = L.full
    # ring-like arcs (some wrapping), the full mask, a scattered bitmap, empty
    L.masks = [((((1 << (p * 997 + 1)) - 1) << (p * 1531 % n)) | 0) & full for p in range(pieces - 3)]
    L.masks += [full, int.from_bytes(bytes(range(256)) * (n // 2048), "little") & full, 0]
    L.done, L.need = True, [full] * pieces
    raw = encode_status("m000003", L, None)     # as JSON integers this raised ValueError
    assert len(raw) <= 1024 + 2 * pieces * (max_encoded_chars(n) + 1)
    # contiguous masks are arcs: a few bytes each, not n / 8; the members are a count and a digest
    assert len(raw) <= 4096 + max_encoded_chars(n)
    got = decode_status(raw)["inflight"]
    assert got["masks"] == L.masks and got["need"] == L.need
    assert got["n_members"] == n and got["members_sha"] == members_digest(L.members) == L.members_digest()


def test_a_summary_does_not_grow_with_the_members_it_names() -> None:
    """The op's members travel as (count, digest): a 100k-member summary of ring-like
    masks is as long as a 5-member one, within the digits of the numbers in it."""
    sizes = []
    for n in (5, BIG):
        L = _ledger(n, 4)
        L.masks = [((1 << (n // 2)) - 1) << (p % 2) for p in range(4)]
        sizes.append(len(encode_status("m000003", L, L)))
    assert sizes[1] - sizes[0] <= 2 * 4 * 2 * 6 + 2 * 6   # arcs' and n_members' extra digits only


def test_the_members_digest_names_the_order() -> None:
    ids = [f"m{i:06d}" for i in range(6)]
    assert members_digest(ids) != members_digest(ids[::-1]) != members_digest(ids[:5])
    assert members_digest(ids) == members_digest(tuple(ids))


def test_summary_round_trip_small() -> None:
    L = _ledger(5, 4)
    L.masks = [0b00111, 0b10001, 0, 0b11111]
    st_ = decode_status(encode_status("m000003", L, L))
    assert st_["member"] == "m000003"
    for key in ("inflight", "retained"):
        assert st_[key]["masks"] == L.masks and st_[key]["need"] is None
        assert st_[key]["seq"] == 7 and st_[key]["n_pieces"] == 4


def test_older_integer_masks_are_still_read() -> None:
    old = {"member": "a", "retained": None, "inflight": {
        "seq": 1, "kind": "allreduce", "members": ["a", "b", "c"], "epoch": 1, "digest": 9, "n_pieces": 2,
        "masks": [5, 7], "has_input": True, "done": False, "need": None}}
    got = decode_status(json.dumps(old).encode())["inflight"]
    assert got["masks"] == [5, 7] and got["n_members"] == 3 and got["members_sha"] == members_digest("abc")


@pytest.mark.parametrize("value, cause", [
    ([0], "pairs"), ([0, 0], "out of range"), ([3, 1], "out of range"), ([0, 4], "out of range"),
    ([0, True], "integers"), ("!!!!", "base64"), (base64.b64encode(b"\x00\x00").decode(), "bytes"),
    (base64.b64encode(b"\xf0").decode(), "beyond"), (8, "out of range"), (-1, "out of range"),
    (True, "boolean"), (1.5, "expected"), ({"a": 1}, "expected"), ([0, 1] * 4, "arcs"),
])
def test_bad_masks_are_clear_errors(value: object, cause: str) -> None:
    with pytest.raises(CollectiveError, match=cause):
        decode_mask(value, 3)


def _summary(**over: object) -> bytes:
    s: dict[str, object] = {"seq": 1, "kind": "allreduce", "members": ["a", "b"], "epoch": 1, "digest": 3,
                            "n_pieces": 1, "masks": [[0, 2]], "has_input": True, "done": False, "need": None}
    s.update(over)
    return json.dumps({"v": 2, "member": "a", "inflight": s, "retained": None}).encode()


def _summary3(**over: object) -> bytes:
    s: dict[str, object] = {"seq": 1, "kind": "allreduce", "n_members": 2, "members_sha": members_digest("ab"),
                            "epoch": 1, "digest": 3, "n_pieces": 1, "masks": [[0, 2]], "has_input": True,
                            "done": False, "need": None}
    s.update(over)
    return json.dumps({"v": 3, "member": "a", "inflight": s, "retained": None}).encode()


@pytest.mark.parametrize("raw, cause", [
    (_summary3(n_members="2"), "'n_members'"), (_summary3(n_members=-1), "n_members -1 is out of range"),
    (_summary3(n_members=(1 << 20) + 1), "out of range"), (_summary3(members_sha=5), "'members_sha'"),
    (_summary3(members_sha="ABC"), "32 lowercase hex"), (_summary3(members=["a", "b"], n_members=None), "'n_members'"),
    (_summary3(masks=[[0, 3]]), "out of range"), (_summary3(n_members=True), "'n_members'"),
])
def test_bad_current_summaries_are_clear_errors(raw: bytes, cause: str) -> None:
    with pytest.raises(CollectiveError, match=cause):
        decode_status(raw)


def test_a_current_summary_round_trips_the_members_by_count_and_digest() -> None:
    got = decode_status(_summary3())["inflight"]
    assert got["n_members"] == 2 and got["members_sha"] == members_digest(["a", "b"]) and got["masks"] == [3]


@pytest.mark.parametrize("raw, cause", [
    (b"\xff", "not valid JSON"), (b"[1]", "JSON object"), (b'{"member": 3}', "names no member"),
    (b'{"member": "a", "v": 9}', "format version"),
    (_summary(seq="1"), "'seq'"), (_summary(done=1), "'done'"), (_summary(members=[1, 2]), "member ids"),
    (_summary(n_pieces=-1), "n_pieces"), (_summary(masks=[]), "one mask per piece"),
    (_summary(masks=[[0, 3]]), "out of range"), (_summary(need=[1, 2]), "one mask per piece"),
    (_summary(seq=True), "'seq'"),
])
def test_bad_summaries_are_clear_errors(raw: bytes, cause: str) -> None:
    with pytest.raises(CollectiveError, match=cause):
        decode_status(raw)


def test_recovery_uses_a_peers_masks_only_when_its_member_order_digest_is_ours() -> None:
    """The summary names the op's member order by digest, checked on read: a survivor
    whose summary indexes another order (same count) holds nothing usable for the plan."""
    from resilient.collectives.recovery import Policy
    from resilient.collectives.resume import build_plan

    def ledger(members: tuple[str, ...], masks: list[int]) -> Ledger:
        L = Ledger(seq=1, kind="allreduce", members=members, me=0, epoch=1, digest=1,
                   inp=torch.zeros(2), out=torch.zeros(2), pieces=split(2, 2))
        L.masks = masks
        return L

    mine = ledger(("a", "b", "c"), [0b001, 0b001])

    def need(peer_members: tuple[str, ...]) -> list[int]:
        statuses = {"a": decode_status(encode_status("a", mine, None)),
                    "b": decode_status(encode_status("b", ledger(peer_members, [0b111, 0b010]), None))}
        return build_plan(mine, ["a", "b"], statuses, Policy.PER_SEGMENT).need

    assert need(("a", "b", "c")) == [0b111, 0b011]   # b's full accumulator of piece 0 keeps c's part
    assert need(("a", "b", "x")) == [0b011, 0b011]   # another order: only the survivors' inputs
