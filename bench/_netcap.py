"""Where the network benchmarks put their members: capped namespaces or plain loopback.

One responsibility: the member placement that bench/compression.py and
bench/compression_quality.py share. :func:`cap_egress` caps all of one namespace's
egress with an ``htb`` root class (every peer and etcd alike: a node's NIC at ``mb_s``
MB/s); :class:`Loopback` stands in for a :class:`resilient.chaos.netns.NetnsLab` when
the members run on 127.0.0.1 (no root, uncapped); :func:`member_lab` picks one of the
two, :func:`capped_lab` also caps every member at one rate. The lab builds and removes the namespaces and veths (also on errors: it is a
context manager); the caps go with the namespaces.

Failure behaviour: :func:`cap_egress` raises :class:`subprocess.CalledProcessError`
(with tc's stderr on the terminal) when ``tc`` refuses the htb tree; removing a qdisc
that is not there is not an error. :func:`member_lab` raises
:class:`resilient.chaos.netns.NetnsUnavailable` on enter where namespaces cannot be
made (not root, no ``ip``).
"""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

from resilient.chaos.netns import NetnsLab


class MemberLab(Protocol):
    """What the benchmarks use of a lab: addresses, interface names, the exec prefix."""

    host_ip: str
    ips: list[str]
    ns_veths: list[str]

    def exec_prefix(self, i: int) -> list[str]: ...


class Loopback:
    """``n`` members on 127.0.0.1 of this namespace (no root; uncapped only)."""

    host_ip = "127.0.0.1"

    def __init__(self, n: int) -> None:
        self.ips = [self.host_ip] * n
        self.ns_veths = ["lo"] * n

    def exec_prefix(self, i: int) -> list[str]:
        return []


def cap_egress(lab: NetnsLab, i: int, mb_s: float) -> None:
    """htb root on namespace ``i``'s veth: all its egress at ``mb_s`` MB/s (0: remove the cap)."""
    tc = ["ip", "netns", "exec", lab.namespaces[i], "tc"]
    dev = lab.ns_veths[i]
    subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if mb_s:
        rate = f"{int(mb_s * 8)}mbit"
        subprocess.run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"], check=True)
        subprocess.run([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
                        "ceil", rate, "burst", "256k", "cburst", "256k", "quantum", "60000"], check=True)


def member_lab(n: int, loopback: bool) -> AbstractContextManager[MemberLab]:
    """A context giving ``n`` member places: :class:`Loopback` or a fresh :class:`NetnsLab`
    (its namespaces and veths removed on exit, by an error too)."""
    return nullcontext(Loopback(n)) if loopback else NetnsLab(n)


@contextmanager
def capped_lab(n: int, mb_s: float) -> Iterator[MemberLab]:
    """``n`` namespaces, every one's egress capped at ``mb_s`` MB/s; ``mb_s == 0``:
    :class:`Loopback`. Namespaces, veths and caps are removed on exit, by an error too."""
    if not mb_s:
        yield Loopback(n)
        return
    with NetnsLab(n) as lab:
        for i in range(n):
            cap_egress(lab, i, mb_s)
        yield lab
