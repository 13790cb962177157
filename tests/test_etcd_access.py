"""EtcdAccess: the one place that turns flags/variables into Store TLS and credential options."""
from __future__ import annotations

import argparse

import pytest

from resilient.coordinator.etcd_access import OPTIONS, EtcdAccess, add_arguments
from resilient.errors import ConfigError


def test_env_round_trip_and_empty_means_unset(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    a = EtcdAccess(ca_cert="/ca.pem", cert="/c.pem", key="/k.pem", user="u", password_file=str(pw))
    env = a.child_env()
    assert set(env) == {var for _, var, _ in OPTIONS.values()}
    assert env["RESILIENT_ETCD_PASSWORD"] == ""  # present, so an inherited value cannot mix in
    assert EtcdAccess.from_env(env) == a
    assert a.store_kwargs() == {"ca_cert": "/ca.pem", "cert_key": "/k.pem", "cert_cert": "/c.pem",
                                "user": "u", "password": "s3cret"}
    assert EtcdAccess.from_env({v: "" for v in env}) == EtcdAccess()
    assert EtcdAccess().store_kwargs() == {"ca_cert": None, "cert_key": None, "cert_cert": None,
                                           "user": None, "password": None}


@pytest.mark.parametrize("kwargs, message", [
    ({"user": "u"}, "has no password: pass --etcd-password-file"),
    ({"password": "p"}, "without a user: pass --etcd-user"),
    ({"user": "u", "password": "p", "password_file": "/f"}, "keep one"),
])
def test_inconsistent_credentials_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EtcdAccess(**kwargs)


def test_unreadable_password_file_names_the_file(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=f"cannot read the etcd password file '{missing}'"):
        EtcdAccess(user="u", password_file=missing).resolved_password()


def test_flags_override_variables_and_legacy_spellings(monkeypatch):
    monkeypatch.setenv("RESILIENT_ETCD_CA_CERT", "/env-ca.pem")
    monkeypatch.setenv("RESILIENT_ETCD_USER", "env-user")
    monkeypatch.setenv("RESILIENT_ETCD_PASSWORD", "env-pw")
    p = argparse.ArgumentParser()
    add_arguments(p, legacy_spellings=True)
    a = EtcdAccess.from_args(p.parse_args(["--user", "flag-user"]))
    assert (a.ca_cert, a.user, a.password) == ("/env-ca.pem", "flag-user", "env-pw")
    a = EtcdAccess.from_args(p.parse_args(["--etcd-ca-cert", "/flag-ca.pem"]))
    assert a.ca_cert == "/flag-ca.pem"
    strict = argparse.ArgumentParser()
    add_arguments(strict)
    with pytest.raises(SystemExit):
        strict.parse_args(["--cert", "/c.pem"])  # resilient-run: only the --etcd-* names
