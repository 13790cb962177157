"""One validation layer for every record read from etcd.

Anything that can write to the job's keyspace can write anything, so every parser of an
etcd value (members, epochs, health, straggler scores, re-admission requests, departed
markers, suspect reports, evictions in an epoch's plan, the launcher's node slots and
``launcher/started``) goes through this module and
raises exactly one error type, :class:`~resilient.errors.RecordError` (a
:class:`~resilient.errors.StoreError`), naming the record kind, the key, the field and the
rule it broke. Limits:

* the value is at most :data:`MAX_RECORD_BYTES`, strict UTF-8, strict JSON (no ``NaN``
  or ``Infinity``; ``1e400`` overflows to infinity and is refused wherever a finite number
  is due) nested at most :data:`MAX_DEPTH` deep;
* integers (epoch numbers, pids, ranks, sequence numbers) are JSON integers (``true`` is
  not one) in ``[0, MAX_INT]``, :data:`MAX_INT` = 2**63 - 1, so they fit every 64-bit
  frame header; floats are finite;
* ids (member ids, roles' keys, …) match :func:`~.keys.check_name` in full;
* strings and collections are bounded (:data:`MAX_STR`, :data:`MAX_ITEMS`).

A reader that meets a bad record calls :func:`skip`: it logs the cause once per
(kind, key, cause) and counts it in the process-wide tally that the coordinator exports as
``resilient_bad_records_total{kind}`` (:class:`BadRecordCollector`; ``kind`` is one of
:data:`KINDS`, a bounded set). Nothing here touches the network.
"""
from __future__ import annotations

import builtins
import enum
import json
import logging
import math
import threading
from typing import TYPE_CHECKING, Callable, Final, Iterator, NoReturn, TypeGuard, TypeVar, overload

from resilient.coordinator import keys
from resilient.errors import ConfigError, RecordError

if TYPE_CHECKING:   # pragma: no cover - prometheus-client loads only when a collector collects
    from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

#: Largest value accepted (etcd's default request limit is 1.5 MiB).
MAX_RECORD_BYTES = 1 << 20
#: Deepest nesting of arrays/objects accepted (the deepest real record, an epoch, has 4).
MAX_DEPTH = 16
#: Largest integer accepted anywhere: it must fit a signed 64-bit field.
MAX_INT = 2 ** 63 - 1
#: Longest string field accepted.
MAX_STR = 4096
#: Most entries of one list or object field accepted.
MAX_ITEMS = 65536

#: Record kinds (the ``kind`` label of ``resilient_bad_records_total``).
KINDS = ("member", "epoch", "health", "scores", "readmit", "departed", "suspect", "eviction", "leader",
         "node", "rendezvous")

T = TypeVar("T")
D = TypeVar("D")

_counts: dict[str, int] = {k: 0 for k in KINDS}
_logged: set[tuple[str, str, str]] = set()
_lock = threading.Lock()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def reject_constant(name: str) -> float:
    """``json.loads``'s ``parse_constant``: ``NaN`` and ``Infinity`` are refused (ValueError)."""
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _depth_ok(value: object) -> bool:
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > MAX_DEPTH:
                return False
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def load(kind: str, raw: bytes | bytearray | memoryview | str, key: str = "") -> object:
    """Parse ``raw`` as one JSON value under the limits above; :class:`RecordError` if
    it is too large, not UTF-8, not JSON or nested deeper than :data:`MAX_DEPTH`. The
    value's shape is not checked yet (hence ``object``): read it through :class:`Fields`."""
    where = f" at {key}" if key else ""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise RecordError(f"bad {kind} record{where}: value is {type(raw).__name__}, not bytes", kind, key)
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"bad {kind} record{where}: {len(raw)} bytes, more than the {MAX_RECORD_BYTES} "
                          "accepted", kind, key)
    try:
        text = bytes(raw).decode("utf-8")
        value: object = json.loads(text, parse_constant=reject_constant)
    except UnicodeDecodeError as exc:
        raise RecordError(f"bad {kind} record{where}: not UTF-8 ({exc.reason} at byte {exc.start})",
                          kind, key) from None
    except RecursionError:
        raise RecordError(f"bad {kind} record{where}: nested deeper than {MAX_DEPTH}", kind, key) from None
    except ValueError as exc:   # JSONDecodeError, too many digits, NaN/Infinity
        raise RecordError(f"bad {kind} record{where}: not JSON ({exc})", kind, key) from None
    if not _depth_ok(value):
        raise RecordError(f"bad {kind} record{where}: nested deeper than {MAX_DEPTH}", kind, key)
    return value


def _check_int(value: object, lo: int, hi: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return None
    return value


def _check_float(value: object, lo: float, hi: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:   # an int beyond float range
        return None
    if not math.isfinite(f) or not lo <= f <= hi:
        return None
    return f


def _check_name(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    try:
        return keys.check_name("id", value)
    except ConfigError:
        return None


def is_id(value: object) -> TypeGuard[str]:
    """True if ``value`` is a valid job/member/coordinator id (:func:`~.keys.check_name`)."""
    return _check_name(value) is not None


def is_int(value: object, lo: int = 0, hi: int = MAX_INT) -> TypeGuard[int]:
    """True if ``value`` is a JSON integer (not a bool) in [lo, hi]."""
    return _check_int(value, lo, hi) is not None


class _Required(enum.Enum):
    """The type of :data:`_REQUIRED`, the default that makes a field required."""

    REQUIRED = "required"


_REQUIRED: Final = _Required.REQUIRED


class Fields:
    """Typed, range-checked access to the fields of one JSON object of a record.

    Every getter takes ``default``: returned when the field is absent (or JSON ``null``);
    without it the field is required. A present field of the wrong type or out of range
    raises :class:`RecordError` naming the field and the rule. (The getters ``int``,
    ``float`` and ``str`` shadow the builtins inside this class: its annotations spell
    them ``builtins.int`` etc.)"""

    def __init__(self, kind: str, value: object, key: str = "", where: str = "") -> None:
        self.kind, self.key, self.where = kind, key, where
        if not isinstance(value, dict):
            self._fail(f"{where or 'the record'} is {type(value).__name__}, not a JSON object")
        if len(value) > MAX_ITEMS:
            self._fail(f"{where or 'the record'} has {len(value)} fields, more than {MAX_ITEMS}")
        #: the object itself (JSON: string keys, values not yet checked)
        self.d: dict[str, object] = value

    def _fail(self, what: str) -> NoReturn:
        at = f" at {self.key}" if self.key else ""
        raise RecordError(f"bad {self.kind} record{at}: {what}", self.kind, self.key)

    def _path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def _get(self, name: str, default: object) -> object:
        """The field's value, or :data:`_REQUIRED` when it is absent and ``default`` is not."""
        v = self.d.get(name)
        if v is None:
            if default is _REQUIRED:
                self._fail(f"field {self._path(name)!r} is missing")
            return _REQUIRED
        return v

    def has(self, name: str) -> bool:
        return self.d.get(name) is not None

    def _scalar(self, name: str, default: D | _Required, check: Callable[[object], T | None], rule: str) -> T | D:
        """The field checked by ``check(value) -> value | None`` (None: it broke ``rule``)."""
        v = self._get(name, default)
        if v is _REQUIRED:
            assert not isinstance(default, _Required)   # _get raised for a required field
            return default
        out = check(v)
        if out is None:
            self._fail(f"field {self._path(name)!r} = {_short(v)} is not {rule}")
        return out

    @overload
    def int(self, name: builtins.str, *, lo: builtins.int = 0, hi: builtins.int = MAX_INT) -> builtins.int: ...
    @overload
    def int(self, name: builtins.str, default: D, lo: builtins.int = 0,
            hi: builtins.int = MAX_INT) -> builtins.int | D: ...

    def int(self, name: builtins.str, default: object = _REQUIRED, lo: builtins.int = 0,
            hi: builtins.int = MAX_INT) -> object:
        return self._scalar(name, default, lambda v: _check_int(v, lo, hi), f"an integer in [{lo}, {hi}]")

    @overload
    def float(self, name: builtins.str, *, lo: builtins.float = -math.inf,
              hi: builtins.float = math.inf) -> builtins.float: ...
    @overload
    def float(self, name: builtins.str, default: D, lo: builtins.float = -math.inf,
              hi: builtins.float = math.inf) -> builtins.float | D: ...

    def float(self, name: builtins.str, default: object = _REQUIRED, lo: builtins.float = -math.inf,
              hi: builtins.float = math.inf) -> object:
        return self._scalar(name, default, lambda v: _check_float(v, lo, hi), f"a finite number in [{lo}, {hi}]")

    @overload
    def str(self, name: builtins.str, *, max_len: builtins.int = MAX_STR) -> builtins.str: ...
    @overload
    def str(self, name: builtins.str, default: D, max_len: builtins.int = MAX_STR) -> builtins.str | D: ...

    def str(self, name: builtins.str, default: object = _REQUIRED, max_len: builtins.int = MAX_STR) -> object:
        return self._scalar(name, default, lambda v: v if isinstance(v, builtins.str) and len(v) <= max_len else None,
                            f"a string of at most {max_len} characters")

    @overload
    def name(self, name: builtins.str) -> builtins.str: ...
    @overload
    def name(self, name: builtins.str, default: D) -> builtins.str | D: ...

    def name(self, name: builtins.str, default: object = _REQUIRED) -> object:
        return self._scalar(name, default, _check_name, "a valid id (1-128 of letters, digits, '.', '_', '-', "
                            "starting with a letter or digit)")

    def _list(self, name: builtins.str, default: object) -> list[object] | None:
        """The field as a list of at most :data:`MAX_ITEMS` items, or None when it is absent
        (and not required)."""
        v = self._get(name, default)
        if v is _REQUIRED:
            return None
        if not isinstance(v, list) or len(v) > MAX_ITEMS:
            self._fail(f"field {self._path(name)!r} = {_short(v)} is not a list of at most {MAX_ITEMS} items")
        return v

    @overload
    def names(self, name: builtins.str, *, unique: bool = False) -> tuple[builtins.str, ...]: ...
    @overload
    def names(self, name: builtins.str, default: D, unique: bool = False) -> tuple[builtins.str, ...] | D: ...

    def names(self, name: builtins.str, default: object = _REQUIRED, unique: bool = False) -> object:
        """A list of valid ids (a tuple)."""
        v = self._list(name, default)
        if v is None:
            return default
        out: list[builtins.str] = []
        for item in v:
            checked = _check_name(item)
            if checked is None:
                self._fail(f"field {self._path(name)!r} holds {_short(item)}, not a valid id")
            out.append(checked)
        if unique and len(set(out)) != len(out):
            self._fail(f"field {self._path(name)!r} lists an id twice")
        return tuple(out)

    @overload
    def ints(self, name: builtins.str, *, lo: builtins.int = 0,
             hi: builtins.int = MAX_INT) -> list[builtins.int]: ...
    @overload
    def ints(self, name: builtins.str, default: D, lo: builtins.int = 0,
             hi: builtins.int = MAX_INT) -> list[builtins.int] | D: ...

    def ints(self, name: builtins.str, default: object = _REQUIRED, lo: builtins.int = 0,
             hi: builtins.int = MAX_INT) -> object:
        """A list of integers in [lo, hi] (a list)."""
        v = self._list(name, default)
        if v is None:
            return default
        out: list[builtins.int] = []
        for item in v:
            checked = _check_int(item, lo, hi)
            if checked is None:
                self._fail(f"field {self._path(name)!r} holds {_short(item)}, not an integer in [{lo}, {hi}]")
            out.append(checked)
        return out

    @overload
    def items(self, name: builtins.str) -> list[object] | tuple[()]: ...
    @overload
    def items(self, name: builtins.str, default: D) -> list[object] | D: ...

    def items(self, name: builtins.str, default: object = ()) -> object:
        """A list of at most :data:`MAX_ITEMS` items of any type (the caller checks them)."""
        v = self._list(name, default)
        return default if v is None else list(v)

    @overload
    def rows(self, name: builtins.str) -> list[list[object]]: ...
    @overload
    def rows(self, name: builtins.str, default: D) -> list[list[object]] | D: ...

    def rows(self, name: builtins.str, default: object = _REQUIRED) -> object:
        """A list of lists (e.g. ``[[a, b], ...]``); the caller checks the items."""
        v = self._list(name, default)
        if v is None:
            return default
        out: list[list[object]] = []
        for item in v:
            if not isinstance(item, list):
                self._fail(f"field {self._path(name)!r} holds {_short(item)}, not a list")
            out.append(item)
        return out

    @overload
    def str_map(self, name: builtins.str, *,
                max_len: builtins.int = MAX_STR) -> dict[builtins.str, builtins.str]: ...
    @overload
    def str_map(self, name: builtins.str, default: D,
                max_len: builtins.int = MAX_STR) -> dict[builtins.str, builtins.str] | D: ...

    def str_map(self, name: builtins.str, default: object = _REQUIRED, max_len: builtins.int = MAX_STR) -> object:
        """An object of string -> string."""
        sub = self._obj(name, default)
        if sub is None:
            return default
        out: dict[builtins.str, builtins.str] = {}
        for k, v in sub.d.items():
            if len(k) > max_len or not isinstance(v, builtins.str) or len(v) > max_len:
                self._fail(f"field {self._path(name)!r} maps {_short(k)} to {_short(v)}, not a string of at most "
                           f"{max_len} characters")
            out[k] = v
        return out

    @overload
    def float_map(self, name: builtins.str, *,
                  lo: builtins.float = -math.inf) -> dict[builtins.str, builtins.float]: ...
    @overload
    def float_map(self, name: builtins.str, default: D,
                  lo: builtins.float = -math.inf) -> dict[builtins.str, builtins.float] | D: ...

    def float_map(self, name: builtins.str, default: object = _REQUIRED, lo: builtins.float = -math.inf) -> object:
        """An object of valid id -> finite number >= ``lo``."""
        sub = self._obj(name, default)
        if sub is None:
            return default
        out: dict[builtins.str, builtins.float] = {}
        for k, v in sub.d.items():
            f = _check_float(v, lo, math.inf)
            if _check_name(k) is None or f is None:
                self._fail(f"field {self._path(name)!r} maps {_short(k)} to {_short(v)}; want an id -> finite "
                           f"number >= {lo}")
            out[k] = f
        return out

    @overload
    def obj(self, name: builtins.str) -> Fields: ...
    @overload
    def obj(self, name: builtins.str, default: object) -> Fields | None: ...

    def obj(self, name: builtins.str, default: object = _REQUIRED) -> Fields | None:
        """A nested object, as :class:`Fields` (None when absent and ``default`` given)."""
        return self._obj(name, default)

    def _obj(self, name: builtins.str, default: object) -> Fields | None:
        v = self._get(name, default)
        if v is _REQUIRED:
            return None
        return Fields(self.kind, v, self.key, self._path(name))

    def by_name(self) -> Iterator[tuple[builtins.str, object]]:
        """Items of this object, whose keys must all be valid ids."""
        for k, v in self.d.items():
            if _check_name(k) is None:
                self._fail(f"{self.where or 'the record'} has key {_short(k)}, not a valid id")
            yield k, v

    def fail(self, what: builtins.str) -> NoReturn:
        """Raise :class:`RecordError` for this record with ``what`` as the cause."""
        self._fail(what)


def fields(kind: str, raw: bytes | bytearray | memoryview | str, key: str = "") -> Fields:
    """:func:`load` a record whose value must be a JSON object."""
    return Fields(kind, load(kind, raw, key), key)


def skip(exc: RecordError, key: str = "", level: int = logging.WARNING) -> None:
    """A reader skips a bad record: count it under its kind and log the cause (once per
    distinct key and cause, so a record re-read every pass does not flood the log)."""
    kind = exc.kind if exc.kind in KINDS else "member"
    sig = (kind, key or exc.key, str(exc))
    with _lock:
        _counts[kind] += 1
        first = sig not in _logged
        if first and len(_logged) < 10000:
            _logged.add(sig)
    if first:
        log.log(level, "skipping %s; rewrite it or delete the key", exc)


def bad_counts() -> dict[str, int]:
    """Bad records skipped in this process so far, by kind (every kind listed)."""
    with _lock:
        return dict(_counts)


class BadRecordCollector:
    """A prometheus-client collector of ``resilient_bad_records_total{kind}`` from this
    process's tally (register it with a registry: ``registry.register(BadRecordCollector())``)."""

    def collect(self) -> Iterator[Metric]:  # noqa: D401 - prometheus-client API
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily("resilient_bad_records", "Records read from etcd that were malformed and "
                                  "skipped, by kind of record", labels=["kind"])
        for kind, n in bad_counts().items():
            fam.add_metric([kind], n)
        yield fam

    def describe(self) -> list[Metric]:
        return []


def timestamp(kind: str, raw: bytes, key: str = "") -> float:
    """The ``at`` field (wall seconds, finite, >= 0) of a small marker record
    (``departed/``, ``suspects/``); :class:`RecordError` if the record is malformed."""
    return Fields(kind, load(kind, raw, key), key).float("at", 0.0, lo=0.0)

