"""etcd TLS and authentication, end to end with real processes (docs/security.md).

* A job (``resilient coordinator`` + ``resilient-run`` + resilient-backend workers doing an
  allreduce) over an etcd that requires mutual TLS, certificates made here with openssl.
* TLS failures are named as TLS problems, with the file involved.
* An etcd with RBAC: the coordinators' and members' user holds a role limited to the
  job's prefix, tokens live 2 s (``--auth-token-ttl 2``), and etcd is restarted under a
  running job with a leader and a standby coordinator: every client re-authenticates, and
  after killing the leader and a member the standby publishes the next epoch.
* ``--standalone``: the local etcd needs credentials, which live in a 0600 file another
  local user cannot read, and no command line carries them.
"""
from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
import sys
import time

import pytest

from launcher_util import RESILIENT_RUN, ROOT, SCRIPTS, Launcher, alive, wait_for
from resilient.coordinator import keys
from resilient.coordinator.epoch import read_epoch
from resilient.coordinator.etcd_access import OPTIONS, EtcdAccess
from resilient.coordinator.local_etcd import LocalEtcd, TlsFiles
from resilient.coordinator.membership import read_members
from resilient.coordinator.store import Store
from resilient.errors import ConfigError, StoreError, StoreUnavailable

CLI = [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main(sys.argv[1:]))"]
_ACCESS_VARS = [var for _, var, _ in OPTIONS.values()]
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without inherited RESILIENT_ETCD_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _ACCESS_VARS}
    env["PYTHONPATH"] = ROOT
    env.update(extra)
    return env


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _make_cert(d, name: str, ca: str | None, san: str | None = None) -> tuple[str, str]:
    """An EC key and certificate ``name`` signed by CA ``ca`` (self-signed when None)."""
    key, crt = str(d / f"{name}.key"), str(d / f"{name}.crt")
    if ca is None:
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", key, "-out", crt, "-days", "1", "-subj", f"/CN={name}")
        return key, crt
    csr = str(d / f"{name}.csr")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", csr, "-CA", str(d / f"{ca}.crt"), "-CAkey", str(d / f"{ca}.key"),
             "-CAcreateserial", "-out", crt, "-days", "1", "-extfile", str(ext))
    return key, crt


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    _make_cert(d, "ca", None)
    _make_cert(d, "other-ca", None)
    _make_cert(d, "server", "ca", san="IP:127.0.0.1,DNS:localhost")
    _make_cert(d, "client", "ca")
    _make_cert(d, "stranger", "other-ca")
    return d


@pytest.fixture(scope="module")
def tls_etcd(certs):
    """An etcd that serves only TLS and requires client certificates signed by ``ca``."""
    files = TlsFiles(ca=str(certs / "ca.crt"), server_cert=str(certs / "server.crt"),
                     server_key=str(certs / "server.key"), client_cert=str(certs / "client.crt"),
                     client_key=str(certs / "client.key"))
    with LocalEtcd(tls=files) as etcd:
        yield etcd


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def _coordinator(etcd: LocalEtcd, job: str, env: dict[str, str], log, *extra: str) -> subprocess.Popen:
    """``resilient coordinator`` writing to the file ``log`` (a path)."""
    with open(log, "ab") as out:
        return subprocess.Popen([*CLI, "coordinator", "--etcd", etcd.endpoint_arg, "--job", job,
                                 "--metrics-port", "-1", *extra],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


# -- TLS -----------------------------------------------------------------------------------


def test_job_runs_over_mutual_tls(tls_etcd, certs, job_name, tmp_path):
    """Coordinator (TLS from RESILIENT_ETCD_* variables) and resilient-run (TLS from flags,
    handed on to its workers) run an allreduce job on an etcd that requires client certs."""
    a = tls_etcd.access
    coord = _coordinator(tls_etcd, job_name, _clean_env(**a.child_env()), tmp_path / "coordinator.log",
                         "--min-members", "2")
    try:
        run = subprocess.run(
            [RESILIENT_RUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
             "--rdzv-endpoint", tls_etcd.endpoint_arg, "--rdzv-id", job_name,
             "--etcd-ca-cert", a.ca_cert, "--etcd-cert", a.cert, "--etcd-key", a.key,
             QUICKSTART],
            env=_clean_env(), capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert run.stdout.count("[1.0, 1.0, 1.0, 1.0] from 2 members") == 2, run.stdout + run.stderr[-3000:]
        assert coord.poll() is None, (tmp_path / "coordinator.log").read_text()
    finally:
        _stop(coord)


def test_tls_failures_name_the_file(tls_etcd, certs):
    ep = tls_etcd.endpoints
    a = tls_etcd.access
    other_ca = str(certs / "other-ca.crt")
    with pytest.raises(ConfigError, match=r"TLS handshake .* not signed by the CA in '%s'" % other_ca):
        Store(ep, ca_cert=other_ca, cert_key=a.key, cert_cert=a.cert).revision()
    with pytest.raises(ConfigError, match=r"TLS session .* requires a client certificate; pass --etcd-cert"):
        Store(ep, ca_cert=a.ca_cert).revision()
    stranger = str(certs / "stranger.crt")
    with pytest.raises(ConfigError, match=r"TLS session .* did not accept the client certificate '%s'" % stranger):
        Store(ep, ca_cert=a.ca_cert, cert_key=str(certs / "stranger.key"), cert_cert=stranger).revision()
    with pytest.raises(StoreUnavailable, match=r"if etcd serves TLS .* pass its CA with --etcd-ca-cert"):
        Store(ep, retry_timeout=1.0).revision()


def test_tls_client_against_a_plain_etcd_is_named(etcd_session, certs):
    ca = str(certs / "ca.crt")
    with pytest.raises(ConfigError, match=r"TLS handshake .* likely does not serve TLS .*'%s'" % ca):
        Store(etcd_session.endpoints, ca_cert=ca).revision()


def test_tls_file_problems_are_named_before_connecting(certs, tmp_path):
    missing = str(tmp_path / "nope.crt")
    with pytest.raises(ConfigError, match=r"TLS: cannot read the etcd CA file '%s'" % missing):
        Store(["127.0.0.1:1"], ca_cert=missing)
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"TLS: the etcd CA file '%s' .* no usable PEM" % garbage):
        Store(["127.0.0.1:1"], ca_cert=str(garbage))
    with pytest.raises(ConfigError, match=r"client certificate '%s' and key '%s'" % (certs / "client.crt",
                                                                                   certs / "stranger.key")):
        Store(["127.0.0.1:1"], ca_cert=str(certs / "ca.crt"), cert_cert=str(certs / "client.crt"),
              cert_key=str(certs / "stranger.key"))


def test_cli_reports_tls_failure_with_the_file(tls_etcd, certs, job_name):
    """``resilient status`` and ``resilient-run`` exit with the TLS message, not 'is etcd running'."""
    other_ca = str(certs / "other-ca.crt")
    env = _clean_env(RESILIENT_ETCD_CA_CERT=other_ca, RESILIENT_ETCD_CERT=tls_etcd.access.cert,
                     RESILIENT_ETCD_KEY=tls_etcd.access.key)
    st = subprocess.run([*CLI, "status", "--etcd", tls_etcd.endpoint_arg, "--job", job_name],
                        env=env, capture_output=True, text=True, timeout=60)
    assert st.returncode == 2 and "TLS handshake" in st.stderr and other_ca in st.stderr, st.stderr
    run = subprocess.run([RESILIENT_RUN, "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                          "--rdzv-endpoint", tls_etcd.endpoint_arg, "--rdzv-id", job_name,
                          "--etcd-ca-cert", other_ca, "--etcd-cert", tls_etcd.access.cert,
                          "--etcd-key", tls_etcd.access.key, "true"],
                         env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "TLS handshake" in run.stderr and other_ca in run.stderr, run.stderr
    assert "check that etcd is running" not in run.stderr


# -- RBAC, token expiry, etcd restart -------------------------------------------------------


def test_rbac_prefix_role_token_expiry_and_etcd_restart(tmp_path, job_name):
    """Role limited to /resilient/<job>/, 2 s tokens, etcd restarted under the job: the
    leader, the standby, a node agent (credentials as flags, handed to its worker) and the
    members carry on; the standby publishes the next epoch."""
    import grpc
    from pyetcd import etcdrpc

    # --snapshot-count 1: the restart cannot replay (and so forgets) the tokens issued before it
    with LocalEtcd(extra_args=["--auth-token-ttl", "2", "--snapshot-count", "1"]) as etcd:
        root_pw, job_pw = "root-secret", "job-secret"
        with Store(etcd.endpoints) as admin:
            admin.add_role("root")
            admin.add_user("root", root_pw, ["root"])
            admin.add_role("job", prefix=keys.root(job_name))
            admin.add_user("trainer", job_pw, ["job"])
            admin.enable_auth()
        pw_file = tmp_path / "trainer.password"
        pw_file.write_text(job_pw + "\n")
        pw_file.chmod(0o600)
        access = EtcdAccess(user="trainer", password_file=str(pw_file))
        env = _clean_env(**access.child_env())
        procs: list[subprocess.Popen] = []
        stop = tmp_path / "stop"
        agent = Launcher(["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                          "--rdzv-endpoint", etcd.endpoint_arg, "--rdzv-id", job_name, "--lease-ttl", "2",
                          "--etcd-user", "trainer", "--etcd-password-file", str(pw_file),
                          os.path.join(SCRIPTS, "member_worker.py")],
                         str(tmp_path / "dump"), extra_env={"STOP_FILE": str(stop), **{v: "" for v in _ACCESS_VARS}})
        observer = Store(etcd.endpoints, user="root", password=root_pw)
        try:
            # the role really is limited: outside the prefix the job's user gets nothing
            with access.open_store(etcd.endpoints) as scoped, pytest.raises(StoreError, match="permission denied"):
                scoped.get("/resilient/other-job/epoch")
            coords = {cid: _coordinator(etcd, job_name, env, tmp_path / f"{cid}.log", "--id", cid, "--ttl", "2",
                                        "--min-members", "2",
                                        "--join-debounce-ms", "50") for cid in ("c0", "c1")}
            procs += coords.values()
            members = {}
            for m in ("m0", "m2"):
                members[m] = subprocess.Popen(
                    [sys.executable, "-m", "resilient.coordinator.member_process", "--etcd", etcd.endpoint_arg,
                     "--job", job_name, "--id", m, "--ttl", "2"],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                procs.append(members[m])
            worker = agent.dump(0)  # the agent's worker, registered with the agent's credentials
            assert worker["RESILIENT_ETCD_USER"] == "trainer"
            expected = {"m0", "m2", worker["RESILIENT_MEMBER_ID"]}

            def epoch():
                return read_epoch(observer, job_name)[0]

            def logs() -> str:
                return ", ".join(f"pid {p.pid} exit {p.poll()}" for p in procs)

            first = wait_for(lambda: (e := epoch()) and set(e.members) == expected and e, 60,
                             f"the first epoch with all members ({logs()})")
            with access.open_store(etcd.endpoints) as probe:
                idle_token = probe._client.metadata  # never used again: expires after the TTL

            def rejected(token) -> bool:
                with grpc.insecure_channel(etcd.endpoints[0]) as ch:
                    try:
                        etcdrpc.KVStub(ch).Range(etcdrpc.RangeRequest(key=keys.root(job_name).encode()),
                                                 metadata=token, timeout=5)
                    except grpc.RpcError as exc:
                        return "invalid auth token" in str(exc.details())
                return False

            # etcd drops an unused token within TTL + 1 s; meanwhile the standby has only
            # been waiting on a watch. Checked after the wait: a use would renew the token.
            time.sleep(3.0)
            assert rejected(idle_token), "the 2 s token outlived its TTL: the test would prove nothing"
            etcd.kill(0)
            etcd.restart(0)  # and the restart forgets every token: all clients re-authenticate
            wait_for(lambda: set(read_members(observer, job_name)[0]) == expected, 20,
                     "the members to be registered after the restart")
            for name, p in {**coords, **members, "agent": agent.proc}.items():
                assert p.poll() is None, f"{name} exited after the etcd restart"
            leader = observer.get(keys.leader(job_name)).value.decode()
            standby = "c1" if leader == "c0" else "c0"
            coords[leader].send_signal(signal.SIGKILL)
            members["m2"].send_signal(signal.SIGKILL)
            nxt = wait_for(lambda: (e := epoch()) and e.number > first.number and "m2" not in e.members and e, 60,
                           "a new epoch without the killed member")
            assert set(nxt.members) == expected - {"m2"}
            assert nxt.leader == standby, (nxt.leader, standby)
            assert coords[standby].poll() is None
            stop.write_text("")
            assert agent.wait() == 0, agent.output()
        finally:
            agent.close()
            for p in procs:
                _stop(p)
            observer.close()


def test_password_without_tls_and_wrong_password(etcd_session):
    """Password auth on a plain loopback channel works (no gRPC 'insufficient security
    level'); a wrong password is named as such."""
    with LocalEtcd(auth=True) as etcd:
        a = etcd.access
        with a.open_store(etcd.endpoints) as s:
            s.put("/resilient/x/k", b"v")
            assert s.get("/resilient/x/k").value == b"v"
        with pytest.raises(StoreError, match="check the user 'root' and its password"):
            Store(etcd.endpoints, user="root", password="wrong")
    with pytest.raises(StoreError, match="authentication off but user 'root' was given"):
        Store(etcd_session.endpoints, user="root", password="x")


def test_watch_renews_its_own_token_after_an_etcd_restart():
    """A Store that only watches (no other call could renew its token) keeps receiving
    events after etcd restarts and forgets its token (``--snapshot-count 1``: the
    Authenticate entries are in the snapshot, so the restart does not replay them)."""
    import grpc
    from pyetcd import etcdrpc

    with LocalEtcd(auth=True, extra_args=["--snapshot-count", "1"]) as etcd:
        got: list = []
        with etcd.access.open_store(etcd.endpoints) as watcher, etcd.access.open_store(etcd.endpoints) as writer:
            handle = watcher.watch_prefix("/resilient/w/", None, got.extend)
            assert handle.connected.wait(10)
            for i in range(3):
                writer.put(f"/resilient/w/before-{i}", b"0")
            gen, old_token = watcher._token_gen, watcher._client.metadata
            etcd.kill(0)
            etcd.restart(0)
            with grpc.insecure_channel(etcd.endpoints[0]) as ch, pytest.raises(grpc.RpcError) as denied:
                etcdrpc.KVStub(ch).Range(etcdrpc.RangeRequest(key=b"/resilient/w/"), metadata=old_token, timeout=5)
            assert "invalid auth token" in denied.value.details()  # the restart really forgot it
            writer.put("/resilient/w/after-restart", b"1")
            wait_for(lambda: any(e.key == "/resilient/w/after-restart" for e in got), 20,
                     "the watch to deliver an event written after the restart")
            assert watcher._token_gen > gen  # the watch itself re-authenticated


# -- standalone --------------------------------------------------------------------------


def test_standalone_credentials_are_private(tmp_path):
    """Under --standalone another local user reads neither etcd nor its password."""
    stop = tmp_path / "stop"
    agent = Launcher(["--standalone", "--nproc-per-node", "1", os.path.join(SCRIPTS, "member_worker.py")],
                     str(tmp_path / "dump"), extra_env={"STOP_FILE": str(stop), **{v: "" for v in _ACCESS_VARS}})
    try:
        env = agent.dump(0)
        pw_file = env["RESILIENT_ETCD_PASSWORD_FILE"]
        assert env["RESILIENT_ETCD_USER"] == "root" and not env.get("RESILIENT_ETCD_PASSWORD")
        st = os.stat(pw_file)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert stat.S_IMODE(os.stat(os.path.dirname(pw_file)).st_mode) == 0o700
        password = open(pw_file).read()
        if os.getuid() == 0:  # a throwaway unprivileged identity cannot read it
            pwd.getpwnam("nobody")
            peek = subprocess.run(["runuser", "-u", "nobody", "--", "cat", pw_file], capture_output=True, timeout=30)
            assert peek.returncode != 0 and password.encode() not in peek.stdout
        # no process command line carries the password
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            assert password.encode() not in cmdline, pid
        # without credentials, the epoch (and its transport token) cannot be read
        endpoint = env["RESILIENT_ETCD"]
        with pytest.raises(StoreError, match="user name is empty"):
            Store(endpoint).get(keys.epoch(env["RESILIENT_JOB"]))
        with EtcdAccess(user="root", password_file=pw_file).open_store(endpoint) as s:
            wait_for(lambda: s.get(keys.epoch(env["RESILIENT_JOB"])), 30, "the standalone epoch")
        stop.write_text("")
        assert agent.wait() == 0, agent.output()
        assert not os.path.exists(pw_file)
        assert not alive(int(env["PID"]))
    finally:
        agent.close()
