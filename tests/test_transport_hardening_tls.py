"""Optional mutual TLS of the TCP transport (issue 14), over real loopback sockets with
certificates made by the ``openssl`` CLI: members with certificates from the job's CA
exchange data (and keep their link across an abort); a plain-TCP client, a client with
a certificate from another CA and — with ``verify_member`` — a member whose certificate
names someone else are refused, and the member keeps serving its real peer."""
from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from resilient.errors import ConfigError
from resilient.transport import frames
from resilient.transport.tcp import TcpTransport
from resilient.transport.tls import TlsConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport_helpers import both  # noqa: E402

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")]

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
             "-subj", f"/CN={name}", cwd=d)


def _leaf(d: Path, ca: str, cn: str) -> TlsConfig:
    _openssl("req", *EC, "-keyout", f"{cn}.key", "-out", f"{cn}.csr", "-subj", f"/CN={cn}", cwd=d)
    _openssl("x509", "-req", "-in", f"{cn}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{cn}.pem", "-days", "1", cwd=d)
    return TlsConfig(str(d / f"{cn}.pem"), str(d / f"{cn}.key"), str(d / f"{ca}.pem"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")
    return {"a": _leaf(d, "ca", "a"), "b": _leaf(d, "ca", "b"), "0x": _leaf(d, "ca", "0x"),
            "rogue": _leaf(d, "other-ca", "rogue")}


def _pump(t: TcpTransport, cond, timeout: float = 10.0, what: str = "condition", also: tuple = ()) -> None:
    """Progress ``t`` (and the transports ``also``) until ``cond()``; fail after ``timeout``."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        for o in also:
            o.idle(0.005)
        t.idle(0.02)


def _pair(pki, verify: bool = False):
    from dataclasses import replace
    a = TcpTransport("a", "job", tls=replace(pki["a"], verify_member=verify))
    b = TcpTransport("b", "job", tls=replace(pki["b"], verify_member=verify))
    addrs = {"a": a.address, "b": b.address}
    a.configure(1, "tok", addrs)
    b.configure(1, "tok", addrs)
    return a, b, addrs


def test_members_exchange_data_over_mutual_tls_and_keep_the_link(pki):
    a, b, addrs = _pair(pki, verify=True)
    try:
        x = np.arange(3 << 20, dtype=np.int64)     # 24 MiB: many TLS records, partial progress
        y = np.zeros_like(x)
        both(a, a.isend("b", x, 1, 0), b, b.irecv("a", y, 1, 0), timeout=30)
        assert (x == y).all() and isinstance(b._conns["a"].sock, ssl.SSLSocket)
        sock = a._conns["b"].sock
        a.configure(2, "tok2", addrs)
        b.configure(2, "tok2", addrs)
        z, rz = np.arange(100, dtype=np.int64), np.zeros(100, np.int64)
        both(b, b.isend("a", z, 2, 0), a, a.irecv("b", rz, 2, 0), timeout=10)
        assert (z == rz).all() and a._conns["b"].sock is sock
    finally:
        a.close()
        b.close()


def test_plain_and_foreign_ca_clients_are_refused(pki):
    a, b, _ = _pair(pki)
    host, port = b.address.rsplit(":", 1)
    plain = socket.create_connection((host, int(port)), timeout=5)
    rogue_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    rogue_ctx.check_hostname, rogue_ctx.verify_mode = False, ssl.CERT_NONE
    rogue_ctx.load_cert_chain(pki["rogue"].cert, pki["rogue"].key)
    raw = socket.create_connection((host, int(port)), timeout=5)
    raw.setblocking(False)
    rogue = rogue_ctx.wrap_socket(raw, do_handshake_on_connect=False)
    try:
        plain.sendall(frames.encode_hello(frames.Hello("job", 1, "tok", "a", "x")))   # the token alone is not enough
        end = time.monotonic() + 10
        while True:   # drive the rogue client's handshake while b progresses its side
            try:
                rogue.do_handshake()
                break
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                assert time.monotonic() < end, "rogue handshake neither finished nor failed"
                b.idle(0.02)
            except (ssl.SSLError, OSError):
                break
        _pump(b, lambda: b.stats.dropped.get("tls_refused", 0) >= 2, what="two TLS refusals")
        x, y = np.arange(10, dtype=np.int64), np.zeros(10, np.int64)
        both(a, a.isend("b", x, 1, 0), b, b.irecv("a", y, 1, 0), timeout=10)
        assert (x == y).all() and "0x" not in b._conns
    finally:
        plain.close()
        rogue.close()
        a.close()
        b.close()


def test_verify_member_refuses_a_certificate_naming_someone_else(pki):
    from dataclasses import replace
    a, b, addrs = _pair(pki, verify=True)
    imp = TcpTransport("0x", "job", tls=replace(pki["0x"], verify_member=True))
    try:
        # "0x" holds a valid certificate (CN=0x) and the token, but claims to be member "a"
        imp.member_id = "a"
        for t in (a, b):
            t.configure(2, "tok", addrs)
        imp.configure(2, "tok", addrs)
        imp.isend("b", np.zeros(4, np.int64), 1, 0)
        _pump(b, lambda: b.stats.dropped.get("tls_identity", 0) == 1, what="the identity refusal", also=(imp,))
        x, y = np.arange(10, dtype=np.int64), np.zeros(10, np.int64)
        both(a, a.isend("b", x, 1, 0), b, b.irecv("a", y, 1, 0), timeout=10)
        assert (x == y).all() and b._conns["a"].session == a._session   # b's link "a" is the real a
    finally:
        imp.close()
        a.close()
        b.close()


def test_partial_tls_settings_are_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="RESILIENT_TLS_KEY"):
        TlsConfig.from_env({"RESILIENT_TLS_CERT": "c.pem", "RESILIENT_TLS_CA": "ca.pem"})
    assert TlsConfig.from_env({}) is None
    with pytest.raises(ConfigError, match="cannot load"):
        TlsConfig(str(tmp_path / "no.pem"), str(tmp_path / "no.key"), str(tmp_path / "no-ca.pem")).contexts()
