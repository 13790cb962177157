"""resilient-run accepts torchrun's flags (both spellings, same defaults, PET_* env) plus ours."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest

from resilient.errors import ConfigError
from resilient.launcher.args import build_parser, parse

VENV_BIN = os.path.dirname(sys.executable)
_OPT = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9_-]*)")


def _options(help_text: str) -> set[str]:
    """Option strings of argparse's option lines ("  -r REDIRECTS, --redirects ..."), not
    options mentioned in help prose."""
    found: set[str] = set()
    for line in help_text.splitlines():
        m = re.match(r"^ {2}(-\S.*?)(?: {2,}|$)", line)
        if m:
            found |= set(_OPT.findall(m.group(1)))
    return found


def test_every_torchrun_flag_is_in_resilient_run_help():
    torch_help = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"],
                                capture_output=True, text=True, timeout=120, check=True).stdout
    ours_help = subprocess.run([os.path.join(VENV_BIN, "resilient-run"), "--help"],
                               capture_output=True, text=True, timeout=60, check=True).stdout
    torch_flags = _options(torch_help)
    assert {"--nproc-per-node", "--nproc_per_node", "--rdzv-endpoint", "-m", "-r", "-t"} <= torch_flags
    missing = sorted(torch_flags - _options(ours_help))
    assert not missing, f"torchrun flags missing from resilient-run --help: {missing}"
    for ours in ("--etcd", "--job", "--lease-ttl", "--no-node-lease", "--metrics-port", "--fail-fast"):
        assert ours in ours_help


def test_every_torchrun_flag_parses_with_both_spellings():
    """Each option of torch's own parser is accepted by ours, with the same default."""
    from torch.distributed.run import get_args_parser

    torch_parser = get_args_parser()
    ours = build_parser()
    torch_defaults = vars(torch_parser.parse_args(["x.py"]))
    our_defaults = vars(ours.parse_args(["x.py"]))
    for action in torch_parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert our_defaults[action.dest] == torch_defaults[action.dest], action.dest
        for opt in action.option_strings:
            argv = [opt] if action.nargs == 0 else [opt, _sample(action)]
            ns = ours.parse_args([*argv, "x.py"])
            assert getattr(ns, action.dest) == getattr(torch_parser.parse_args([*argv, "x.py"]), action.dest), opt


def _sample(action) -> str:
    if action.choices:
        return list(action.choices)[-1]
    if action.type is int:
        return "7"
    if action.type is float:
        return "0.5"
    return {"nnodes": "1:2", "redirects": "3", "tee": "1"}.get(action.dest, "a,b")


def test_pet_environment_gives_defaults(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "10.0.0.5:2379")
    monkeypatch.setenv("PET_RDZV_ID", "job7")
    monkeypatch.setenv("PET_NNODES", "1:4")
    monkeypatch.setenv("PET_STANDALONE", "0")
    cfg = parse(["train.py", "--lr", "1"])
    assert (cfg.nproc_per_node, cfg.min_nodes, cfg.max_nodes) == (3, 1, 4)
    assert cfg.etcd == ["10.0.0.5:2379"] and cfg.job == "job7" and cfg.run_id == "job7"
    assert cfg.cmd[1:] == ["-u", "train.py", "--lr", "1"]
    # the command line wins over PET_*
    assert parse(["--nproc_per_node", "2", "train.py"]).nproc_per_node == 2


def test_standalone_assigns_a_fresh_run_id_and_job():
    a, b = parse(["--standalone", "t.py"]), parse(["--standalone", "t.py"])
    assert a.standalone and a.uses_etcd and a.elastic_nodes
    uuid.UUID(a.run_id)
    assert a.run_id != b.run_id and a.job == a.run_id
    assert parse(["--standalone", "--job", "mine", "t.py"]).job == "mine"


def test_module_and_no_python_commands():
    assert parse(["-m", "pkg.train", "a"]).cmd[1:] == ["-u", "-m", "pkg.train", "a"]
    assert parse(["--no-python", "/bin/echo", "hi"]).cmd == ["/bin/echo", "hi"]
    with pytest.raises(ConfigError, match="--no-python and --module"):
        parse(["--no-python", "-m", "x"])


@pytest.mark.parametrize("argv, cause", [
    (["--nnodes", "2:1", "t.py"], "MIN <= MAX"),
    (["--nnodes", "a", "t.py"], "MIN:MAX"),
    (["--nnodes", "1:3", "t.py"], "needs --rdzv-backend etcd"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "t.py"], "rendezvous is etcd"),
    (["--rdzv-backend", "etcd", "t.py"], "needs --rdzv-endpoint"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "nohost", "t.py"], "HOST:PORT"),
    (["--etcd", "h:99999", "t.py"], "HOST:PORT"),
    (["--redirects", "5", "t.py"], "--redirects"),
    (["--tee", "0:9", "t.py"], "--tee"),
    (["--local-ranks-filter", "0,x", "t.py"], "comma-separated integers"),
    (["--nproc-per-node", "many", "t.py"], "--nproc-per-node"),
    (["--max-restarts", "-1", "t.py"], "--max-restarts"),
    (["--lease-ttl", "0", "t.py"], "--lease-ttl"),
    (["--signals-to-handle", "SIGNOPE", "t.py"], "not a signal name"),
    (["--rdzv-conf", "justakey", "t.py"], "key=value"),
])
def test_bad_flags_raise_config_error_naming_the_cause(argv, cause):
    with pytest.raises(ConfigError, match=re.escape(cause)):
        parse(argv)


def test_bad_flag_exits_2_with_message_and_starts_nothing():
    proc = subprocess.run([os.path.join(VENV_BIN, "resilient-run"), "--nnodes", "3:1", "t.py"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "resilient-run: error: --nnodes '3:1'" in proc.stderr


@pytest.mark.parametrize("backend", ["c10d", "C10D"])
def test_c10d_backend_is_rejected_in_one_line_naming_the_fix(backend):
    """torchrun's default multi-node backend: resilient's rendezvous is etcd, so c10d exits 2
    before anything starts, with one line that names the flags to use instead."""
    proc = subprocess.run([os.path.join(VENV_BIN, "resilient-run"), "--rdzv-backend", backend,
                           "--rdzv-endpoint", "node0:29400", "--nnodes", "2", "t.py"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"resilient-run: error: --rdzv-backend {backend!r} is not supported")
    assert "--rdzv-backend etcd --rdzv-endpoint HOST:2379" in lines[0] and "--standalone" in lines[0]


def test_metrics_host_flag_env_and_standalone_default(monkeypatch):
    assert parse(["--standalone", "train.py"]).metrics_host == "127.0.0.1"     # nothing standalone leaves loopback
    assert parse(["train.py"]).metrics_host == "0.0.0.0"
    assert parse(["--metrics-host", "127.0.0.2", "train.py"]).metrics_host == "127.0.0.2"
    monkeypatch.setenv("PET_METRICS_HOST", "::1")
    assert parse(["--standalone", "train.py"]).metrics_host == "::1"
    assert "--metrics-host" in build_parser().format_help()


@pytest.mark.parametrize("argv", [["--rdzv-id", "x/../y"], ["--rdzv-id", "ok\n"], ["--job", "a b"],
                                  ["--rdzv-id=-x"]])
def test_job_names_are_validated_like_every_other_entry_point(argv):
    with pytest.raises(ConfigError, match=r"is not a valid job id: use 1-128 characters"):
        parse([*argv, "train.py"])
    assert parse(["--rdzv-id", "job.1_a-b", "train.py"]).job == "job.1_a-b"
def test_fail_fast_default_off_and_env_spellings(monkeypatch):
    """Survive-by-default: fail_fast is off unless --fail-fast, PET_FAIL_FAST or
    RESILIENT_FAIL_FAST (PET_ wins when both are set, as for every torchrun-style flag)."""
    from resilient.launcher.args import parse

    for var in ("PET_FAIL_FAST", "RESILIENT_FAIL_FAST"):
        monkeypatch.delenv(var, raising=False)
    assert parse(["t.py"]).fail_fast is False
    assert parse(["--fail-fast", "t.py"]).fail_fast is True
    monkeypatch.setenv("RESILIENT_FAIL_FAST", "1")
    assert parse(["t.py"]).fail_fast is True
    monkeypatch.setenv("PET_FAIL_FAST", "0")
    assert parse(["t.py"]).fail_fast is False
    monkeypatch.setenv("PET_FAIL_FAST", "yes")
    with pytest.raises(ConfigError, match="PET_FAIL_FAST='yes' must be 0 or 1"):
        parse(["t.py"])


def test_node_agent_is_the_default_and_both_opt_outs_work(monkeypatch):
    """The node agent (node lease + local channel) is on unless --no-node-lease or
    RESILIENT_NODE_LEASE=0."""
    monkeypatch.delenv("RESILIENT_NODE_LEASE", raising=False)
    assert parse(["t.py"]).node_lease is True
    assert parse(["--no-node-lease", "t.py"]).node_lease is False
    monkeypatch.setenv("RESILIENT_NODE_LEASE", "0")
    assert parse(["t.py"]).node_lease is False
    monkeypatch.setenv("RESILIENT_NODE_LEASE", "1")
    assert parse(["--no_node_lease", "t.py"]).node_lease is False
