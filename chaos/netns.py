"""Test hosts in Linux network namespaces: probes, and a lab of N namespaces on a bridge.

Used by the chaos runner for the ``netem`` fault and by tests that want each "node" on
its own network stack (the two-node-agent test)::

    reason = netns_unavailable_reason()          # None: root, `ip`, `ip netns add` all work
    with NetnsLab(4) as lab:                     # bridge + 4 namespaces, one veth each
        LocalEtcd(host=lab.host_ip)              # the host side listens on the bridge
        Popen([*lab.exec_prefix(2), sys.executable, ...])   # runs inside namespace 2
        lab.ips[2]                               # that namespace's address
        if qdisc_unavailable_reason("netem") is None:
            lab.apply_netem(0, 1, delay_ms=10, loss_pct=1)  # only traffic between 0 and 1
            lab.clear_netem(0, 1)

Layout of one lab: a Linux bridge ``rzb<token>`` in the host namespace with address
``10.A.B.1/24`` (a /24 no host address or route overlaps, picked under a lock file so
parallel labs never pick the same one); namespace ``i`` is ``rzlab-<pid>-<token>-<i>``
with a veth pair ``rzh<token><i>`` (host end, enslaved to the bridge) /
``rzn<token><i>`` (namespace end, address ``10.A.B.<i+2>/24``) and its ``lo`` up.
Interface names stay within IFNAMSIZ (15 bytes); the bridge and host veths carry the
alias ``resilient-netns-lab pid=<pid> token=<token>``, namespaces carry the creating PID
in their name, so :func:`cleanup_leftovers` can delete what a killed run left behind
(only entries whose creating PID is dead — a live lab is never touched).

Link faults (:meth:`NetnsLab.apply_netem`): on each end's namespace veth an ``htb`` root
qdisc sends everything to an unshaped default class; one class per faulted peer has a
``netem`` leaf, selected by a ``u32`` filter on the peer's destination IP. So only
traffic between the two namespaces is delayed/dropped — each direction on its sender's
egress, i.e. ``delay_ms`` one way (the round trip gains ``2 * delay_ms``) and
``loss_pct`` per direction. Traffic to etcd on the host IP or to other members is not
touched. (Verified on a kernel without netem by using a ``pfifo`` leaf and the class
counters: see tests/test_chaos_netns.py.)

Link caps (:meth:`NetnsLab.cap_link`, the two-host chaos layout's ``host_link_mbit``):
the same tree, the peer's ``htb`` class at the cap (rate and ceiling) with a ``pfifo``
leaf — htb only, so it works where netem is missing.

Failure behaviour: the probes never raise; they return ``None`` or a sentence naming the
cause and the fix. :class:`NetnsLab` raises :class:`NetnsUnavailable` (a
:class:`~resilient.errors.ConfigError`) on enter when namespaces cannot be made here, and
:class:`NetnsError` when an ``ip``/``tc`` command fails (the message has the command and
its stderr); a failure while building the lab tears down what was built before raising.
:meth:`NetnsLab.close` (and ``__exit__``) try to remove every namespace and interface
even after errors, then raise :class:`NetnsError` listing what could not be removed —
unless an exception is already propagating through ``__exit__``, in which case the
leftovers are reported on stderr and the original exception wins.
"""
from __future__ import annotations

import fcntl
import functools
import ipaddress
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from types import TracebackType
from typing import Callable, Sequence

from resilient.errors import ConfigError, ResilientError

NS_PREFIX = "rzlab-"
ALIAS_PREFIX = "resilient-netns-lab"
IFNAMSIZ = 15  # bytes of an interface name, without the trailing NUL
MAX_NAMESPACES = 250  # host .1 and namespaces .2 .. .251 of one /24

_NS_RE = re.compile(rf"^{re.escape(NS_PREFIX)}(\d+)-([0-9a-f]+)-(\d+)$")
_ALIAS_RE = re.compile(rf"^{re.escape(ALIAS_PREFIX)} pid=(\d+) token=([0-9a-f]+)$")
#: extra arguments a probe of that qdisc kind needs to be a valid command
_PROBE_ARGS: dict[str, tuple[str, ...]] = {
    "netem": ("delay", "1ms"),
    "tbf": ("rate", "1mbit", "burst", "32kbit", "latency", "400ms"),
    "htb": ("default", "1"),
}


class NetnsError(ResilientError):
    """An ``ip``/``tc`` command of the lab failed; the message has the command and its stderr."""


class NetnsUnavailable(ConfigError):
    """Network namespaces cannot be made on this machine; the message says why and what to do."""


def _run(cmd: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run one command; with ``check`` raise :class:`NetnsError` naming it and its stderr."""
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(cmd)}` could not run: {exc}") from None
    if check and res.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed (exit {res.returncode}): {_err(res)}")
    return res


def _err(res: subprocess.CompletedProcess[str]) -> str:
    text = (res.stderr or res.stdout or "").strip()
    lines = [ln for ln in text.splitlines() if not ln.startswith("Warning:")]
    return " ".join(lines) or f"exit {res.returncode}"


def _token() -> str:
    return uuid.uuid4().hex[:6]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is as good as dead: its namespaces are nobody's
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# -- probes --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def netns_unavailable_reason() -> str | None:
    """``None`` when this process can build a :class:`NetnsLab` (root, ``ip`` on PATH, and
    a probe namespace, veth pair and bridge could actually be created and deleted);
    otherwise one sentence with the cause and the fix. Probed once per process; never
    raises."""
    if os.geteuid() != 0:
        return (f"network namespaces need root (this process runs as uid {os.geteuid()}); "
                "run as root, or use the loopback placement instead")
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not on PATH; install iproute2 (Debian: apt-get install iproute2)"
    tok = _token()
    ns, va, vb, br = f"{NS_PREFIX}{os.getpid()}-{tok}-0", f"rzh{tok}p", f"rzn{tok}p", f"rzb{tok}"
    steps = [("ip", "netns", "add", ns),
             ("ip", "link", "add", va, "type", "veth", "peer", "name", vb),
             ("ip", "link", "set", vb, "netns", ns),
             ("ip", "link", "add", br, "type", "bridge"),
             ("ip", "link", "set", va, "master", br)]
    try:
        for cmd in steps:
            res = _run(cmd, check=False)
            if res.returncode != 0:
                return (f"`{' '.join(cmd[:3])}` failed here ({_err(res)}); network namespaces with veth pairs and a "
                        "bridge need CAP_NET_ADMIN and CAP_SYS_ADMIN (a privileged container or a VM)")
        return None
    finally:
        _run(("ip", "link", "del", va), check=False)
        _run(("ip", "link", "del", br), check=False)
        _run(("ip", "netns", "del", ns), check=False)


@functools.lru_cache(maxsize=None)
def qdisc_unavailable_reason(kind: str) -> str | None:
    """``None`` when ``tc qdisc add ... root <kind>`` works on a throw-away veth pair of
    this kernel; otherwise why not, e.g. ``"this kernel has no netem qdisc (tc: Specified
    qdisc kind is unknown); ..."``. Probed once per kind and process; never raises."""
    if not re.fullmatch(r"[a-z_]+", kind):
        return f"{kind!r} is not a qdisc kind (lower-case letters, e.g. netem, htb, tbf)"
    if os.geteuid() != 0:
        return f"adding a {kind} qdisc needs root (this process runs as uid {os.geteuid()}); run as root"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is not on PATH; install {pkg}"
    def probe(va: str) -> str | None:
        res = _run(("tc", "qdisc", "add", "dev", va, "root", kind, *_PROBE_ARGS.get(kind, ())), check=False)
        if res.returncode == 0:
            return None
        err = _err(res).removeprefix("Error:").strip().rstrip(".")
        if "unknown" in err.lower():
            return (f"this kernel has no {kind} qdisc (tc: {err}); load its module (`modprobe sch_{kind}`) or run "
                    f"on a kernel built with it (CONFIG_NET_SCH_{kind.upper()})")
        return f"`tc qdisc add ... root {kind}` failed on a probe veth: {err}"

    return _on_probe_veth(f"the {kind} qdisc", probe)


def _on_probe_veth(what: str, probe: Callable[[str], str | None]) -> str | None:
    """``probe(name of one end)`` run on a throw-away veth pair that is deleted afterwards:
    its result, or why the pair could not be made."""
    tok = _token()
    va, vb = f"rzq{tok}a", f"rzq{tok}b"
    res = _run(("ip", "link", "add", va, "type", "veth", "peer", "name", vb), check=False)
    if res.returncode != 0:
        return f"could not create a probe veth pair to test {what}: {_err(res)}"
    try:
        return probe(va)
    finally:
        _run(("ip", "link", "del", va), check=False)


@functools.lru_cache(maxsize=None)
def u32_unavailable_reason() -> str | None:
    """``None`` when an ``htb`` root with a ``u32`` destination-IP filter can be set up on a
    throw-away veth (what :meth:`NetnsLab.apply_netem` classifies with); otherwise why not.
    Never raises."""
    reason = qdisc_unavailable_reason("htb")
    if reason is not None:
        return reason
    def probe(va: str) -> str | None:
        for cmd in (("tc", "qdisc", "add", "dev", va, "root", "handle", "1:", "htb", "default", "1"),
                    ("tc", "class", "add", "dev", va, "parent", "1:", "classid", "1:2", "htb", "rate", "1gbit"),
                    ("tc", "filter", "add", "dev", va, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "dst", "10.0.0.1/32", "flowid", "1:2")):
            res = _run(cmd, check=False)
            if res.returncode != 0:
                return f"`{' '.join(cmd)}` failed on a probe veth: {_err(res)}"
        return None

    return _on_probe_veth("the u32 filter", probe)


def netem_unavailable_reason() -> str | None:
    """``None`` when :meth:`NetnsLab.apply_netem` can work here (namespaces, the ``htb``
    qdisc, the ``u32`` filter and the ``netem`` qdisc all probed); otherwise the first
    missing part's reason. Never raises."""
    return netns_unavailable_reason() or u32_unavailable_reason() or qdisc_unavailable_reason("netem")


# -- leftovers -----------------------------------------------------------------------------


def lab_namespaces() -> list[str]:
    """Names of every namespace of this module's naming scheme (any lab, any PID)."""
    res = _run(("ip", "netns", "list"), check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if _NS_RE.match(n)]


def lab_links() -> dict[str, str]:
    """Host-namespace interfaces made by a lab: name -> alias."""
    res = _run(("ip", "-j", "link", "show"), check=False)
    try:
        links = json.loads(res.stdout or "[]")
    except ValueError:
        return {}
    return {ln["ifname"]: ln["ifalias"] for ln in links
            if isinstance(ln.get("ifalias"), str) and _ALIAS_RE.match(ln["ifalias"])}


def cleanup_leftovers() -> list[str]:
    """Delete namespaces and interfaces of this naming scheme whose creating PID is dead
    (a run killed before its teardown); return what was deleted. Entries of live PIDs are
    never touched. Errors deleting one entry are ignored (it is retried next time)."""
    removed: list[str] = []
    for name, alias in lab_links().items():
        m = _ALIAS_RE.match(alias)
        if m and not _pid_alive(int(m.group(1))):
            if _run(("ip", "link", "del", name), check=False).returncode == 0:
                removed.append(name)
    for ns in lab_namespaces():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            if _run(("ip", "netns", "del", ns), check=False).returncode == 0:
                removed.append(ns)
    return removed


# -- the lab -------------------------------------------------------------------------------


def _lock_path() -> Path:
    run = Path("/run")
    base = run if os.access(run, os.W_OK) else Path(tempfile.gettempdir())
    return base / "resilient-netns.lock"


def _used_networks() -> list[ipaddress.IPv4Network]:
    out: list[ipaddress.IPv4Network] = []
    for cmd in (("ip", "-j", "-4", "addr", "show"), ("ip", "-j", "-4", "route", "show", "table", "all")):
        try:
            data = json.loads(_run(cmd, check=False).stdout or "[]")
        except ValueError:
            continue
        for entry in data:
            for a in entry.get("addr_info", []):
                out.append(ipaddress.IPv4Network(f"{a['local']}/{a.get('prefixlen', 32)}", strict=False))
            dst = entry.get("dst")
            if dst and dst != "default":
                try:
                    out.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
                except ValueError:
                    pass
    return out


class NetnsLab:
    """``n`` network namespaces on one bridge; see the module docstring.

    Attributes (after enter): ``namespaces`` (names), ``ips`` (namespace ``i``'s address),
    ``host_ip`` (the bridge's address in the host namespace: where host-side services
    listen so namespaces reach them), ``subnet``, ``bridge``, ``token``.
    """

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or not 1 <= n <= MAX_NAMESPACES:
            raise ConfigError(f"NetnsLab needs 1..{MAX_NAMESPACES} namespaces, got {n!r}")
        self.n = n
        self.pid = os.getpid()
        self.token = _token()
        self.bridge = f"rzb{self.token}"
        self.namespaces = [f"{NS_PREFIX}{self.pid}-{self.token}-{i}" for i in range(n)]
        self.host_veths = [f"rzh{self.token}{i}" for i in range(n)]
        self.ns_veths = [f"rzn{self.token}{i}" for i in range(n)]
        assert all(len(x) <= IFNAMSIZ for x in (self.bridge, *self.host_veths, *self.ns_veths))
        self.alias = f"{ALIAS_PREFIX} pid={self.pid} token={self.token}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.host_ip = ""
        self.ips: list[str] = []
        self._links: dict[int, dict[int, list[str]]] = {}  # namespace -> {shaped peer: leaf qdisc spec}
        self._rates: dict[int, dict[int, str]] = {}  # namespace -> {capped peer: htb rate}
        self._open = False

    # -- lifecycle

    def __enter__(self) -> "NetnsLab":
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.close()
        except NetnsError as err:
            if exc_type is None:
                raise
            print(f"resilient.chaos.netns: {err}", file=sys.stderr, flush=True)

    def open(self) -> "NetnsLab":
        """Build the bridge and the namespaces. Raises :class:`NetnsUnavailable` when
        namespaces cannot be made here, :class:`NetnsError` when a command fails (after
        removing what was built)."""
        reason = netns_unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        cleanup_leftovers()
        self._open = True
        try:
            with open(_lock_path(), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # no two labs pick the same /24
                self.subnet = self._pick_subnet()
                hosts = list(self.subnet.hosts())
                self.host_ip = str(hosts[0])
                self.ips = [str(hosts[i + 1]) for i in range(self.n)]
                _run(("ip", "link", "add", self.bridge, "type", "bridge"))
                _run(("ip", "link", "set", "dev", self.bridge, "alias", self.alias))
                _run(("ip", "addr", "add", f"{self.host_ip}/{self.subnet.prefixlen}", "dev", self.bridge))
            _run(("ip", "link", "set", self.bridge, "up"))
            for i in range(self.n):
                self._add_namespace(i)
        except BaseException:
            try:
                self.close()
            except NetnsError as err:
                print(f"resilient.chaos.netns: {err}", file=sys.stderr, flush=True)
            raise
        return self

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _used_networks()
        rng = random.Random()
        for _ in range(200):
            net = ipaddress.IPv4Network(f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}.0/24")
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        raise NetnsError("no free 10.200-254.x.0/24 subnet for a network-namespace lab: every one tried overlaps "
                         "an address or route of this host; remove stale labs (`ip link show`, aliases "
                         f"'{ALIAS_PREFIX} ...')")

    def _add_namespace(self, i: int) -> None:
        ns, hv, nv = self.namespaces[i], self.host_veths[i], self.ns_veths[i]
        prefix = self.subnet.prefixlen  # type: ignore[union-attr]
        _run(("ip", "netns", "add", ns))
        _run(("ip", "link", "add", hv, "type", "veth", "peer", "name", nv))
        _run(("ip", "link", "set", "dev", hv, "alias", self.alias))
        _run(("ip", "link", "set", hv, "master", self.bridge))
        _run(("ip", "link", "set", hv, "up"))
        _run(("ip", "link", "set", nv, "netns", ns))
        inside = ("ip", "-n", ns)
        _run((*inside, "addr", "add", f"{self.ips[i]}/{prefix}", "dev", nv))
        _run((*inside, "link", "set", nv, "up"))
        _run((*inside, "link", "set", "lo", "up"))

    def close(self) -> None:
        """Remove every namespace and interface of this lab (idempotent). Tries them all,
        then raises :class:`NetnsError` naming the ones still present."""
        if not self._open:
            return
        for hv in self.host_veths:  # deleting one end of a veth deletes both
            _run(("ip", "link", "del", hv), check=False)
        _run(("ip", "link", "del", self.bridge), check=False)
        for ns in self.namespaces:
            _run(("ip", "netns", "del", ns), check=False)
        self._links.clear()
        self._open = False
        left = [x for x in self.namespaces if x in lab_namespaces()]
        links = _run(("ip", "-o", "link", "show"), check=False).stdout
        left += [x for x in (self.bridge, *self.host_veths) if re.search(rf"\d+: {re.escape(x)}[@:]", links)]
        if left:
            raise NetnsError(f"network-namespace lab {self.token}: could not remove {', '.join(left)}; "
                             f"delete them by hand (`ip netns del NAME`, `ip link del NAME`)")

    # -- use

    def exec_prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command inside namespace ``i``
        (``ip netns exec NAME``; it execs the command, so the PID is the command's own)."""
        self._check_index(i)
        return ["ip", "netns", "exec", self.namespaces[i]]

    def _check_index(self, i: int) -> None:
        if not isinstance(i, int) or not 0 <= i < self.n:
            raise ConfigError(f"namespace index {i!r} is outside this lab's 0..{self.n - 1}")

    def apply_netem(self, a: int, b: int, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay (one way, ms) and drop (percent, per direction) the traffic between
        namespaces ``a`` and ``b`` only. Replaces an earlier fault on that link. Raises
        :class:`NetnsError` when ``tc`` refuses (e.g. no netem qdisc: probe with
        :func:`netem_unavailable_reason` first), :class:`ConfigError` on bad arguments."""
        if delay_ms < 0 or not 0 <= loss_pct <= 100:
            raise ConfigError(f"netem needs delay_ms >= 0 and 0 <= loss_pct <= 100, got {delay_ms}, {loss_pct}")
        self.shape_link(a, b, ["netem", "delay", f"{delay_ms:g}ms", "loss", f"{loss_pct:g}%", "limit", "100000"])

    def clear_netem(self, a: int, b: int) -> None:
        """Remove the fault :meth:`apply_netem` put on the link ``a``-``b`` (no-op if none)."""
        self.clear_link(a, b)

    def shape_link(self, a: int, b: int, leaf: Sequence[str]) -> None:
        """Put the qdisc ``leaf`` (a ``tc qdisc`` spec such as ``["netem", "delay",
        "10ms"]``, or ``["pfifo"]`` to test the classification where netem is missing) on
        the traffic from ``a`` to ``b`` and from ``b`` to ``a``, and on nothing else.
        Each end's egress tree is rebuilt: ``htb`` root, unshaped default class ``1:1``, one
        class ``1:<peer+2>`` per shaped peer with the leaf, selected by a ``u32`` filter on
        the peer's IP (rebuilding drops what that veth had queued; TCP resends it).
        Raises :class:`NetnsError` when a ``tc`` command fails (the link is then left
        unshaped on both ends), :class:`ConfigError` on bad indices."""
        self._check_link(a, b)
        self._links.setdefault(a, {})[b] = list(leaf)
        self._links.setdefault(b, {})[a] = list(leaf)
        try:
            self._rebuild(a)
            self._rebuild(b)
        except NetnsError:
            self._links[a].pop(b, None)
            self._links[b].pop(a, None)
            for i in (a, b):
                try:
                    self._rebuild(i)
                except NetnsError:
                    pass
            raise

    def cap_link(self, a: int, b: int, mbit: float) -> None:
        """Cap the traffic between namespaces ``a`` and ``b`` at ``mbit`` Mbit/s each way
        (the peer's ``htb`` class rate and ceiling; a ``pfifo`` leaf), and nothing else —
        e.g. the link between two emulated hosts (a kernel without netem still has htb).
        Raises :class:`NetnsError` when ``tc`` fails (the link is then left uncapped),
        :class:`ConfigError` on bad indices or a rate that is not a positive number."""
        if not isinstance(mbit, (int, float)) or not 0 < mbit < 1e6:
            raise ConfigError(f"a link cap is a positive number of Mbit/s below 1e6, got {mbit!r}")
        self._check_link(a, b)
        rate = f"{float(mbit):g}mbit"
        for x, y in ((a, b), (b, a)):
            self._rates.setdefault(x, {})[y] = rate
            self._links.setdefault(x, {}).setdefault(y, ["pfifo", "limit", "1000"])
        try:
            self._rebuild(a)
            self._rebuild(b)
        except NetnsError:
            for x, y in ((a, b), (b, a)):
                self._rates[x].pop(y, None)
                self._links[x].pop(y, None)
                try:
                    self._rebuild(x)
                except NetnsError:
                    pass
            raise

    def clear_link(self, a: int, b: int) -> None:
        """Remove what :meth:`shape_link` put on the link ``a``-``b`` (no-op if nothing).
        Raises :class:`NetnsError` when ``tc`` fails."""
        self._check_link(a, b)
        self._links.get(a, {}).pop(b, None)
        self._links.get(b, {}).pop(a, None)
        self._rates.get(a, {}).pop(b, None)
        self._rates.get(b, {}).pop(a, None)
        self._rebuild(a)
        self._rebuild(b)

    def _check_link(self, a: int, b: int) -> None:
        self._check_index(a)
        self._check_index(b)
        if a == b:
            raise ConfigError(f"a link needs two different namespaces, got {a} and {b}")
        if not self._open:
            raise NetnsError("the lab is closed; open it (with NetnsLab(...) as lab:) before shaping links")

    def _rebuild(self, i: int) -> None:
        nv, ns = self.ns_veths[i], self.namespaces[i]
        tc = ("ip", "netns", "exec", ns, "tc")
        _run((*tc, "qdisc", "del", "dev", nv, "root"), check=False)  # back to the default qdisc
        peers = self._links.get(i, {})
        if not peers:
            return
        _run((*tc, "qdisc", "add", "dev", nv, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000"))
        _run((*tc, "class", "add", "dev", nv, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit"))
        for peer, leaf in sorted(peers.items()):
            cls = f"1:{peer + 2:x}"
            rate = self._rates.get(i, {}).get(peer, "100gbit")
            _run((*tc, "class", "add", "dev", nv, "parent", "1:", "classid", cls, "htb", "rate", rate, "ceil", rate))

            _run((*tc, "qdisc", "add", "dev", nv, "parent", cls, "handle", f"{peer + 10:x}:", *leaf))
            _run((*tc, "filter", "add", "dev", nv, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                  "match", "ip", "dst", f"{self.ips[peer]}/32", "flowid", cls))

    def class_packets(self, i: int, peer: int) -> int:
        """Packets namespace ``i`` sent through the class of faulted ``peer`` (0 if none)."""
        out = _run(("ip", "netns", "exec", self.namespaces[i], "tc", "-s", "class", "show", "dev",
                    self.ns_veths[i])).stdout
        cls = f"1:{peer + 2:x}"
        m = re.search(rf"class htb {re.escape(cls)} .*?Sent \d+ bytes (\d+) pkt", out, re.S)
        return int(m.group(1)) if m else 0
