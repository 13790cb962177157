"""Optional mutual TLS for the TCP transport (off by default).

Settings (environment, read by :meth:`TlsConfig.from_env`; all unset: plain TCP)::

    RESILIENT_TLS_CERT           PEM certificate of this member (chain allowed)
    RESILIENT_TLS_KEY            its PEM private key
    RESILIENT_TLS_CA             PEM bundle of the CA(s) that sign members' certificates
    RESILIENT_TLS_VERIFY_MEMBER  1: a peer's certificate must name its member id (subject
                                 CN or a DNS/URI subjectAltName); default 0

Both ends present a certificate and verify the other's against the CA (TLS 1.2+), so a
client without a certificate from the job's CA cannot get past the TLS handshake (and
cannot read or forge the epoch token on the wire). With ``verify_member`` the HELLO's
member id must also be named by the dialler's certificate, and the acceptor's by the
certificate the dialler sees: the token then no longer stands in for identity. Host names
are not checked (members are addressed by ``host:port`` from the epoch record).

Failure behaviour: :meth:`TlsConfig.from_env` / :meth:`TlsConfig.contexts` raise
:class:`~resilient.errors.ConfigError` naming the variable or file when only part of the
settings is given or a file cannot be loaded; a failed handshake or a certificate that
does not name the member closes that connection only (the transport counts it).
"""
from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from resilient.errors import ConfigError

ENV_CERT, ENV_KEY, ENV_CA, ENV_VERIFY = ("RESILIENT_TLS_CERT", "RESILIENT_TLS_KEY", "RESILIENT_TLS_CA",
                                         "RESILIENT_TLS_VERIFY_MEMBER")


@dataclass(frozen=True)
class TlsConfig:
    cert: str
    key: str
    ca: str
    verify_member: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TlsConfig | None":
        """The settings from the environment, or None when none of them is set."""
        env = os.environ if environ is None else environ
        paths = {v: env.get(v, "") for v in (ENV_CERT, ENV_KEY, ENV_CA)}
        if not any(paths.values()):
            return None
        missing = [v for v, p in paths.items() if not p]
        if missing:
            raise ConfigError(f"mutual TLS needs {', '.join(missing)} as well (set all of {ENV_CERT}, {ENV_KEY}, "
                              f"{ENV_CA}, or none for plain TCP)")
        verify = env.get(ENV_VERIFY, "0").strip().lower()
        if verify not in ("0", "1", "true", "false", ""):
            raise ConfigError(f"{ENV_VERIFY}={verify!r} must be 0 or 1")
        return cls(paths[ENV_CERT], paths[ENV_KEY], paths[ENV_CA], verify in ("1", "true"))

    def contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """(server context, client context), both requiring the peer's certificate."""
        out = []
        for purpose, side in ((ssl.Purpose.CLIENT_AUTH, ssl.PROTOCOL_TLS_SERVER),
                              (ssl.Purpose.SERVER_AUTH, ssl.PROTOCOL_TLS_CLIENT)):
            ctx = ssl.SSLContext(side)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_REQUIRED
            loaders: tuple[tuple[str, Callable[[], None]], ...] = (
                ("certificate/key", lambda: ctx.load_cert_chain(self.cert, self.key)),
                ("CA bundle", lambda: ctx.load_verify_locations(cafile=self.ca)))
            for what, load in loaders:
                try:
                    load()
                except (OSError, ssl.SSLError) as exc:
                    raise ConfigError(f"cannot load the TLS {what} ({self.cert}, {self.key}, {self.ca}): {exc}; "
                                      f"check {ENV_CERT}/{ENV_KEY}/{ENV_CA}") from None
            out.append(ctx)
        return out[0], out[1]


def names_of(cert: dict[str, Any] | None) -> set[str]:
    """The subject CNs and DNS/URI subjectAltNames of a peer certificate
    (``SSLSocket.getpeercert()``); empty for None."""
    if not cert:
        return set()
    names = {v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"}
    names |= {v for k, v in cert.get("subjectAltName", ()) if k in ("DNS", "URI")}
    return names
