"""What one survivor of a recovery learns: the facts of the round and its slice of the plan.

Beyond :data:`~.status_exchange.DIRECT_MAX` survivors a recovery no longer gives every
survivor every other survivor's ledger summary (N² summaries, each up to 16.7 KB at 100k
members). The summaries go up a tree to one *planner* (the first survivor), which derives
what every survivor's recovery loop asks of them (:class:`RoundFacts`) and runs the same
deterministic planner (:func:`~.resume.build_plan`) once; each survivor then receives only
its *decision*: the facts and the part of the plan it takes part in (its local steps and
the transfers it sends or receives, with the round count and each piece's contributor
set). Up to ``DIRECT_MAX`` survivors, and for a survivor that gathered every summary
through etcd, the same facts and plan are derived locally from the summaries: the planner
is pure, so both give the same plan.

Wire format: compact JSON (never pickle), members by their index in the op's member order
(which the decision names by count and digest, as a ledger summary does), masks in
:mod:`.mask_codec` form (no N-digit integers), each piece's contributor set as runs of a
small table. :func:`decode_decision` validates every field before anything is used.

Failure behaviour: a malformed decision -> :class:`~resilient.errors.CollectiveError`
naming the field (nothing of it is used); a decision whose op layout (seq, member count
and digest, pieces) differs from the member's ledger -> :class:`CollectiveError` from
:meth:`Decision.plan_for`; a planner that could not plan (``strict`` policy with a lost
contribution, a copy piece no survivor holds) -> the same exception class on every
survivor (:class:`~resilient.errors.CollectiveAborted`, :class:`~resilient.errors.DataLost`),
raised by :meth:`Decision.plan_for`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from resilient.collectives.ledger import MAX_STATUS_MEMBERS, MAX_STATUS_PIECES, Ledger
from resilient.collectives.mask_codec import decode_mask, encode_mask
from resilient.collectives.recovery import LocalStep, Policy, RecoveryPlan, Transfer
from resilient.errors import CollectiveAborted, CollectiveError, DataLost

DECISION_VERSION = 1
#: the planner's failures a decision carries to every survivor, by name
_ERRORS: dict[str, type[CollectiveError]] = {
    "CollectiveAborted": CollectiveAborted, "DataLost": DataLost, "CollectiveError": CollectiveError}
#: bounds a decoded decision must respect (a corrupt planner cannot make a survivor
#: allocate beyond them): rounds of one plan, and the transfers one survivor takes part in
MAX_ROUNDS = 1 << 24
MAX_MOVES = 1 << 24


@dataclass(frozen=True)
class RoundFacts:
    """What a recovery round's decisions need from the survivors' ledger summaries.

    ``lowest``: the lowest op seq a survivor is still in (None: none is); ``next_min``:
    the lowest ``next`` op seq a survivor between ops has not started (None: none is
    between ops); ``progress``: the op seqs some survivor holds partial or final results
    of (a non-empty contributor mask; from the planner only ``lowest``, the op the
    recovery loop asks about)."""

    lowest: int | None
    next_min: int | None
    progress: frozenset[int]

    def not_started(self, seq: int) -> bool:
        """Whether a survivor said it has not started op ``seq`` yet (a member between
        ops): it runs the op later, in this epoch, so the others rerun it with it rather
        than finish it without its input."""
        return self.next_min is not None and self.next_min <= seq

    def progressed(self, seq: int) -> bool:
        """Whether some survivor holds progress on op ``seq`` (else it is simply rerun)."""
        return seq in self.progress


def facts_of(statuses: Mapping[str, Mapping[str, Any]]) -> RoundFacts:
    """The :class:`RoundFacts` of validated summaries (:func:`~.ledger.decode_status`)."""
    inflight = [s["inflight"]["seq"] for s in statuses.values() if s.get("inflight")]
    nexts = [s["next"] for s in statuses.values()
             if s.get("inflight") is None and isinstance(s.get("next"), int) and not isinstance(s.get("next"), bool)]
    progress = {summ["seq"] for s in statuses.values() for key in ("inflight", "retained")
                for summ in [s.get(key)] if summ and any(summ.get("masks", []))}
    return RoundFacts(min(inflight) if inflight else None, min(nexts) if nexts else None, frozenset(progress))


@dataclass(frozen=True)
class Decision:
    """One survivor's decision (see the module docstring): the round's facts, and either
    its slice of the plan of op ``facts.lowest`` (``plan``: a validated, still index-based
    record), the planner's failure (``error``), or neither (the planner held no ledger of
    that op: no survivor can need a plan then)."""

    member: str
    facts: RoundFacts
    plan: dict[str, Any] | None
    error: tuple[str, str] | None

    def plan_for(self, ledger: Ledger) -> RecoveryPlan:
        """This survivor's slice of the plan for ``ledger``'s op, as a :class:`RecoveryPlan`
        (``need`` for every piece, ``rounds`` with only the transfers it sends or receives,
        ``prepare`` with only its steps, no ``final_holders``). Raises the planner's own
        failure (:class:`CollectiveAborted`, :class:`DataLost`), or
        :class:`CollectiveError` when there is no plan or the planner's op layout differs
        from ``ledger``'s (the plan's masks would index another member order)."""
        if self.error is not None:
            raise _ERRORS[self.error[0]](f"recovery planner: {self.error[1]}")
        p = self.plan
        if p is None:
            raise CollectiveError(f"op #{ledger.seq}: the recovery planner held no ledger of op #{self.facts.lowest} "
                                  "and sent no plan")
        if (p["seq"] != ledger.seq or p["n_members"] != len(ledger.members) or p["members_sha"] != ledger.members_digest()
                or p["n_pieces"] != len(ledger.pieces)):
            raise CollectiveError(
                f"op #{ledger.seq}: the recovery planner's ledger (op #{p['seq']}, {p['n_members']} members, "
                f"{p['n_pieces']} pieces) differs from this member's ({len(ledger.members)} members, "
                f"{len(ledger.pieces)} pieces): the plan's masks cannot be read")
        members = ledger.members
        need: list[int] = []
        for count, idx in p["need_runs"]:
            need.extend([p["need_table"][idx]] * count)
        rounds: list[list[Transfer]] = [[] for _ in range(p["rounds"])]
        for r, piece, src, dst, sent, add_acc, add_input in p["moves"]:
            rounds[r].append(Transfer(r, piece, members[src], members[dst], sent, add_acc, add_input))
        prepare = [LocalStep(piece, members[m], use_acc) for piece, m, use_acc in p["prepare"]]
        return RecoveryPlan(need=need, rounds=rounds, prepare=prepare, total_transfers=p["transfers"])


def _error_of(exc: BaseException) -> tuple[str, str]:
    for name, cls in _ERRORS.items():
        if type(exc) is cls:
            return name, str(exc)
    return "CollectiveError", f"{type(exc).__name__}: {exc}"


def op_policy(statuses: Mapping[str, Mapping[str, Any]], seq: int, default: Policy) -> Policy:
    """The contributor policy op ``seq`` runs under: the one a survivor in that op put in
    its summary (the first in ring order; every member of an op calls it with the same
    arguments), else ``default`` (the planner's)."""
    for s in statuses.values():
        summ = s.get("inflight")
        if summ and summ.get("seq") == seq and summ.get("policy"):
            return Policy.parse(summ["policy"])
    return default


def plan_decisions(ring: Sequence[str], statuses: Mapping[str, Mapping[str, Any]],
                   ledgers: Sequence[Ledger | None], policy: Policy,
                   build: Callable[[Ledger, list[str], dict[str, dict[str, Any]], Policy], RecoveryPlan]
                   ) -> dict[str, bytes]:
    """The planner's side: every survivor's encoded decision from every survivor's
    validated summary. The plan is built once, for op ``facts.lowest``, from the first of
    ``ledgers`` (the planner's in-flight and retained ledgers) of that op, under the op's
    policy (:func:`op_policy`; ``policy`` where no summary names it); the planner's
    failure to plan — any exception of ``build`` — is carried in every decision (see
    :meth:`Decision.plan_for`). A decision's ``progress`` names ``facts.lowest`` only
    (the one op the recovery loop asks about). O(survivors + the plan's transfers)."""
    facts = facts_of(statuses)
    plan_rec: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    slices: dict[str, tuple[list[list[Any]], list[list[Any]]]] = {m: ([], []) for m in ring}
    L = next((x for x in ledgers if x is not None and facts.lowest is not None and x.seq == facts.lowest), None)
    if L is not None:
        try:
            plan = build(L, list(ring), {m: dict(statuses[m]) for m in ring}, op_policy(statuses, L.seq, policy))
        except Exception as exc:  # noqa: BLE001 - every survivor must learn it, not wait for a timeout
            error = _error_of(exc)
        else:
            n = len(L.members)
            index = {m: i for i, m in enumerate(L.members)}
            table: list[Any] = []
            where: dict[int, int] = {}
            runs: list[list[int]] = []
            for mask in plan.need:
                i = where.get(mask)
                if i is None:
                    i = where[mask] = len(table)
                    table.append(encode_mask(mask, n))
                if runs and runs[-1][1] == i:
                    runs[-1][0] += 1
                else:
                    runs.append([1, i])
            enc: dict[int, Any] = {}

            def code(mask: int) -> Any:
                v = enc.get(mask)
                if v is None:
                    v = enc[mask] = encode_mask(mask, n)
                return v

            total = 0
            for r, transfers in enumerate(plan.rounds):
                for t in transfers:
                    total += 1
                    move = [r, t.piece, index[t.src], index[t.dst], code(t.sent), code(t.add_acc), bool(t.add_input)]
                    for m in {t.src, t.dst}:
                        if m in slices:
                            slices[m][0].append(move)
            for s in plan.prepare:
                if s.member in slices:
                    slices[s.member][1].append([s.piece, index[s.member], bool(s.use_acc)])
            plan_rec = {"seq": L.seq, "n_members": n, "members_sha": L.members_digest(), "n_pieces": len(L.pieces),
                        "rounds": len(plan.rounds), "transfers": total, "need_table": table, "need_runs": runs}
    head = {"v": DECISION_VERSION, "lowest": facts.lowest, "next_min": facts.next_min,
            "progress": [facts.lowest] if facts.lowest is not None and facts.progressed(facts.lowest) else [],
            "error": list(error) if error is not None else None}
    out: dict[str, bytes] = {}
    for m in ring:
        rec: dict[str, Any] = dict(head, member=m)
        if plan_rec is not None:
            moves, prepare = slices[m]
            rec["plan"] = dict(plan_rec, moves=moves, prepare=prepare)
        else:
            rec["plan"] = None
        out[m] = json.dumps(rec, separators=(",", ":")).encode()
    return out


def fatal_decisions(ring: Sequence[str], message: str) -> dict[str, bytes]:
    """Every survivor's decision when the planner could not read the summaries (a
    malformed one): :func:`decode_decision` raises :class:`CollectiveError` with
    ``message`` on every survivor, as each would have on decoding it itself."""
    return {m: json.dumps({"v": DECISION_VERSION, "member": m, "fatal": message}, separators=(",", ":")).encode()
            for m in ring}


# -- decoding ------------------------------------------------------------------------------

def _int(v: object, where: str, lo: int = 0, hi: int | None = None, none: bool = False) -> Any:
    if v is None and none:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise CollectiveError(f"recovery decision: {where} is {v!r}, expected an integer {bound}")
    return v


def _list(v: object, where: str, size: int | None = None, limit: int = MAX_MOVES) -> list[Any]:
    if not isinstance(v, list) or (size is not None and len(v) != size) or len(v) > limit:
        raise CollectiveError(f"recovery decision: {where} is not a list"
                              + (f" of {size}" if size is not None else "") + f" (at most {limit})")
    return v


def _plan(p: object) -> dict[str, Any] | None:
    if p is None:
        return None
    if not isinstance(p, dict):
        raise CollectiveError("recovery decision: plan is not an object")
    n = _int(p.get("n_members"), "plan.n_members", 1, MAX_STATUS_MEMBERS)
    n_pieces = _int(p.get("n_pieces"), "plan.n_pieces", 0, MAX_STATUS_PIECES)
    rounds = _int(p.get("rounds"), "plan.rounds", 0, MAX_ROUNDS)
    sha = p.get("members_sha")
    if not isinstance(sha, str) or len(sha) != 32 or any(c not in "0123456789abcdef" for c in sha):
        raise CollectiveError("recovery decision: plan.members_sha is not 32 lowercase hex digits")
    table = [decode_mask(m, n, f"plan.need_table[{i}]")
             for i, m in enumerate(_list(p.get("need_table"), "plan.need_table", limit=max(n_pieces, 1)))]
    runs, covered = [], 0
    for i, run in enumerate(_list(p.get("need_runs"), "plan.need_runs", limit=max(n_pieces, 1))):
        count, idx = _list(run, f"plan.need_runs[{i}]", 2)
        runs.append((_int(count, f"plan.need_runs[{i}] count", 1, n_pieces),
                     _int(idx, f"plan.need_runs[{i}] index", 0, len(table) - 1)))
        covered += runs[-1][0]
    if covered != n_pieces:
        raise CollectiveError(f"recovery decision: plan.need_runs cover {covered} pieces, the op has {n_pieces}")
    moves = []
    for i, mv in enumerate(_list(p.get("moves"), "plan.moves")):
        r, piece, src, dst, sent, add_acc, add_input = _list(mv, f"plan.moves[{i}]", 7)
        if not isinstance(add_input, bool):
            raise CollectiveError(f"recovery decision: plan.moves[{i}] add_input is not a boolean")
        moves.append((_int(r, f"plan.moves[{i}] round", 0, rounds - 1), _int(piece, f"plan.moves[{i}] piece", 0, n_pieces - 1),
                      _int(src, f"plan.moves[{i}] src", 0, n - 1), _int(dst, f"plan.moves[{i}] dst", 0, n - 1),
                      decode_mask(sent, n, f"plan.moves[{i}] sent"), decode_mask(add_acc, n, f"plan.moves[{i}] add_acc"),
                      add_input))
    prepare = []
    for i, st in enumerate(_list(p.get("prepare"), "plan.prepare")):
        piece, m, use_acc = _list(st, f"plan.prepare[{i}]", 3)
        if not isinstance(use_acc, bool):
            raise CollectiveError(f"recovery decision: plan.prepare[{i}] use_acc is not a boolean")
        prepare.append((_int(piece, f"plan.prepare[{i}] piece", 0, n_pieces - 1), _int(m, f"plan.prepare[{i}] member", 0, n - 1),
                        use_acc))
    return {"seq": _int(p.get("seq"), "plan.seq"), "n_members": n, "members_sha": sha, "n_pieces": n_pieces,
            "rounds": rounds, "transfers": _int(p.get("transfers"), "plan.transfers", len(moves)),
            "need_table": table, "need_runs": runs, "moves": moves, "prepare": prepare}


def decode_decision(raw: bytes, member: str) -> Decision:
    """The validated decision ``raw`` for ``member``; :class:`CollectiveError` naming the
    field for anything malformed (not JSON, a wrong version or member, a field of the wrong
    type or out of range, masks wider than the op)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CollectiveError("recovery decision: not valid UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise CollectiveError("recovery decision: not a JSON object")
    if obj.get("v") != DECISION_VERSION:
        raise CollectiveError(f"recovery decision: version {obj.get('v')!r}, this release reads {DECISION_VERSION}")
    if obj.get("member") != member:
        raise CollectiveError(f"recovery decision: addressed to {obj.get('member')!r}, not {member!r}")
    fatal = obj.get("fatal")
    if fatal is not None:
        raise CollectiveError(f"recovery planner: {fatal}" if isinstance(fatal, str)
                              else "recovery decision: field 'fatal' is not a string")
    lowest = _int(obj.get("lowest"), "lowest", none=True)
    next_min = _int(obj.get("next_min"), "next_min", none=True)
    progress = frozenset(_int(s, f"progress[{i}]") for i, s in enumerate(_list(obj.get("progress"), "progress", limit=1024)))
    err = obj.get("error")
    error: tuple[str, str] | None = None
    if err is not None:
        kind, message = _list(err, "error", 2)
        if not isinstance(kind, str) or kind not in _ERRORS or not isinstance(message, str):
            raise CollectiveError(f"recovery decision: error {err!r} is not [one of {sorted(_ERRORS)}, message]")
        error = (kind, message)
    plan = _plan(obj.get("plan"))
    if plan is not None and error is not None:
        raise CollectiveError("recovery decision: both a plan and an error")
    if plan is not None and plan["seq"] != lowest:
        raise CollectiveError(f"recovery decision: a plan for op #{plan['seq']} where the lowest op is {lowest!r}")
    return Decision(member, RoundFacts(lowest, next_min, progress), plan, error)
