"""How a process reaches etcd: TLS files and RBAC credentials, in one place.

Every process that opens a :class:`~resilient.coordinator.store.Store` — ``resilient
status``/``coordinator``, ``resilient-run`` and its workers, the chaos and bench workers —
takes the same settings, as flags or as environment variables (the flag wins):

=========================  ==============================  =====================================
flag                       environment                     meaning
=========================  ==============================  =====================================
``--etcd-ca-cert FILE``    ``RESILIENT_ETCD_CA_CERT``      CA bundle that signed etcd's server
                                                           certificate: turns TLS on
``--etcd-cert FILE``       ``RESILIENT_ETCD_CERT``         client certificate (mutual TLS)
``--etcd-key FILE``        ``RESILIENT_ETCD_KEY``          its private key
``--etcd-user NAME``       ``RESILIENT_ETCD_USER``         etcd RBAC user
``--etcd-password-file F`` ``RESILIENT_ETCD_PASSWORD_FILE`` file holding that user's password
``--etcd-password PW``     ``RESILIENT_ETCD_PASSWORD``     the password itself (visible in
                                                           ``ps`` as a flag: prefer the file)
=========================  ==============================  =====================================

``resilient`` subcommands also accept the older spellings ``--ca-cert``, ``--cert``,
``--key``, ``--user`` and ``--password``. A process that starts others (the launcher
for its workers, the standalone control plane for its coordinator) hands the same settings
on through :meth:`EtcdAccess.child_env`, so a TLS or password-protected etcd given to
``resilient-run`` reaches every worker.

Failure behaviour: a user without a password (or a password without a user), both a
password and a password file, or an unreadable password file raise
:class:`~resilient.errors.ConfigError` naming the flag/variable and the fix, before any
connection is made. TLS file problems are reported by the Store (it names the file).
"""
from __future__ import annotations

import argparse
import logging
import os
import stat
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Mapping, Sequence, TypedDict, Unpack

from resilient.errors import ConfigError

if TYPE_CHECKING:   # pragma: no cover - the Store (and grpc) load only when a store is opened
    from resilient.coordinator.store import Store

log = logging.getLogger(__name__)

#: field -> (flag, environment variable, older flag spelling of the ``resilient`` CLI)
OPTIONS: dict[str, tuple[str, str, str | None]] = {
    "ca_cert": ("--etcd-ca-cert", "RESILIENT_ETCD_CA_CERT", "--ca-cert"),
    "cert": ("--etcd-cert", "RESILIENT_ETCD_CERT", "--cert"),
    "key": ("--etcd-key", "RESILIENT_ETCD_KEY", "--key"),
    "user": ("--etcd-user", "RESILIENT_ETCD_USER", "--user"),
    "password_file": ("--etcd-password-file", "RESILIENT_ETCD_PASSWORD_FILE", None),
    "password": ("--etcd-password", "RESILIENT_ETCD_PASSWORD", "--password"),
}
_HELP = {
    "ca_cert": "etcd CA bundle (PEM): turns TLS on",
    "cert": "client certificate (PEM) for mutual TLS",
    "key": "private key of --etcd-cert",
    "user": "etcd RBAC user",
    "password_file": "file holding the etcd user's password (keep it mode 0600)",
    "password": "etcd password (visible to `ps` as a flag: prefer the file or the variable)",
}


class StoreCredentials(TypedDict):
    """The TLS and RBAC keyword arguments of :class:`~resilient.coordinator.store.Store`."""

    ca_cert: str | None
    cert_key: str | None
    cert_cert: str | None
    user: str | None
    password: str | None


class StoreOptions(TypedDict, total=False):
    """The other keyword arguments of :class:`~resilient.coordinator.store.Store`."""

    timeout: float
    retry_timeout: float


@dataclass(frozen=True)
class EtcdAccess:
    """TLS files and credentials for etcd; every field optional (plain, unauthenticated)."""

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):  # "" (an exported but empty variable) means unset
            if getattr(self, f.name) == "":
                object.__setattr__(self, f.name, None)
        if self.password is not None and self.password_file is not None:
            raise ConfigError("both an etcd password and a password file are given "
                              "(--etcd-password/RESILIENT_ETCD_PASSWORD and --etcd-password-file/"
                              "RESILIENT_ETCD_PASSWORD_FILE): keep one")
        has_secret = self.password is not None or self.password_file is not None
        if self.user is not None and not has_secret:
            raise ConfigError(f"etcd user {self.user!r} has no password: pass --etcd-password-file FILE "
                              "(or set RESILIENT_ETCD_PASSWORD_FILE / RESILIENT_ETCD_PASSWORD)")
        if self.user is None and has_secret:
            raise ConfigError("an etcd password is given without a user: pass --etcd-user NAME "
                              "(or set RESILIENT_ETCD_USER)")

    # -- sources --------------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "EtcdAccess":
        """The settings in ``environ`` (default: this process's environment)."""
        env = os.environ if environ is None else environ
        return cls(**{name: env.get(var) for name, (_, var, _) in OPTIONS.items()})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EtcdAccess":
        """The settings parsed by :func:`add_arguments` (their defaults are the variables)."""
        return cls(**{name: getattr(args, f"etcd_{name}", None) for name in OPTIONS})

    # -- use ------------------------------------------------------------------------------

    @property
    def tls(self) -> bool:
        return self.ca_cert is not None

    def resolved_password(self) -> str | None:
        """The password (read from the file if one is named; one trailing newline dropped)."""
        if self.password_file is None:
            return self.password
        try:
            st = os.stat(self.password_file)
            with open(self.password_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read the etcd password file {self.password_file!r} "
                              f"(--etcd-password-file / RESILIENT_ETCD_PASSWORD_FILE): {exc.strerror}") from None
        if st.st_mode & stat.S_IRWXO:
            log.warning("the etcd password file %s is readable by every local user (mode %o); chmod 600 it",
                        self.password_file, stat.S_IMODE(st.st_mode))
        return text[:-1] if text.endswith("\n") else text

    def store_kwargs(self) -> StoreCredentials:
        """Keyword arguments of :class:`~resilient.coordinator.store.Store` for these settings."""
        return {"ca_cert": self.ca_cert, "cert_key": self.key, "cert_cert": self.cert,
                "user": self.user, "password": self.resolved_password()}

    def open_store(self, endpoints: str | Sequence[str], **kwargs: Unpack[StoreOptions]) -> Store:
        """A :class:`~resilient.coordinator.store.Store` on ``endpoints`` with these settings
        (``kwargs``: its other options, e.g. ``retry_timeout``)."""
        from resilient.coordinator.store import Store

        return Store(endpoints, **self.store_kwargs(), **kwargs)

    def child_env(self) -> dict[str, str]:
        """The ``RESILIENT_ETCD_*`` variables that give a child process these settings. Every
        variable is present (unset ones as ``""``), so that stale values inherited from the
        parent's own environment cannot mix in."""
        return {var: getattr(self, name) or "" for name, (_, var, _) in OPTIONS.items()}


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                  legacy_spellings: bool = False) -> None:
    """Add the ``--etcd-*`` TLS/credential flags (defaults from ``RESILIENT_ETCD_*``);
    ``legacy_spellings`` also accepts ``--ca-cert``, ``--cert``, ``--key``, ``--user``,
    ``--password`` as hidden aliases (not in ``--help``). :meth:`EtcdAccess.from_args`
    reads them back."""
    for name, (flag, var, old) in OPTIONS.items():
        metavar = "FILE" if name not in ("user", "password") else name.upper()
        parser.add_argument(flag, dest=f"etcd_{name}", default=os.environ.get(var) or None,
                            metavar=metavar, help=f"{_HELP[name]} (env {var})")
        if legacy_spellings and old:
            parser.add_argument(old, dest=f"etcd_{name}", default=argparse.SUPPRESS, metavar=metavar,
                                help=argparse.SUPPRESS)


def open_store_from_env(endpoints: str | Sequence[str], environ: Mapping[str, str] | None = None,
                        **kwargs: Unpack[StoreOptions]) -> Store:
    """A Store on ``endpoints`` with the ``RESILIENT_ETCD_*`` settings of ``environ``
    (default: this process's environment): what every worker uses."""
    return EtcdAccess.from_env(environ).open_store(endpoints, **kwargs)
