"""resilient.settings: every RESILIENT_* variable in one typed, validated object (pure logic)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from resilient.errors import ConfigError
from resilient.settings import DELEGATED, Settings, markdown_table, variables

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_when_nothing_is_set():
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.etcd, s.job, s.lease_id, s.lease_ttl, s.joiner, s.host, s.transport, s.shm) == (
        None, None, None, 5.0, False, "127.0.0.1", "auto", True)


def test_values_are_parsed_to_their_types():
    s = Settings.from_env({
        "RESILIENT_ETCD": "127.0.0.1:2379,127.0.0.1:2380", "RESILIENT_JOB": "j", "RESILIENT_MEMBER_ID": "m-1",
        "RESILIENT_LEASE_ID": "7587886913477455108", "RESILIENT_LEASE_TTL": "2.5", "RESILIENT_JOINER": "1",
        "RESILIENT_HOST": "10.0.0.3", "RESILIENT_TRANSPORT": "tcp", "RESILIENT_SHM": "0",
        "RESILIENT_SHM_RING": str(1 << 20), "RESILIENT_TCP_SOCKBUF": "0", "RESILIENT_TCP_EARLY_CAP": "1024",
        "RESILIENT_SELECTOR": "PollSelector", "RESILIENT_NODE_LEASE": "1", "RESILIENT_LOG_LEVEL": "debug",
    })
    assert s.etcd == "127.0.0.1:2379,127.0.0.1:2380" and s.job == "j" and s.member_id == "m-1"
    assert s.lease_id == 7587886913477455108 and s.lease_ttl == 2.5 and s.joiner is True
    assert (s.host, s.transport, s.shm, s.shm_ring) == ("10.0.0.3", "tcp", False, 1 << 20)
    assert (s.tcp_sockbuf, s.tcp_early_cap, s.selector, s.node_lease, s.log_level) == (0, 1024, "PollSelector", True, "DEBUG")
    assert type(s.make_selector()).__name__ == "PollSelector"


def test_empty_values_mean_unset_where_the_launcher_writes_them():
    s = Settings.from_env({"RESILIENT_LEASE_ID": "", "RESILIENT_MEMBER_ID": "", "RESILIENT_NODE_LEASE": ""})
    assert (s.lease_id, s.member_id, s.node_lease) == (None, None, False)


@pytest.mark.parametrize("name, raw, fix", [
    ("RESILIENT_LEASE_TTL", "soon", "seconds > 0"),
    ("RESILIENT_LEASE_TTL", "0", "seconds > 0"),
    ("RESILIENT_LEASE_ID", "-3", "whole number"),
    ("RESILIENT_JOINER", "maybe", "use 1 or 0"),
    ("RESILIENT_TRANSPORT", "gloo", "use 'auto'"),
    ("RESILIENT_SHM_RING", "100", "65536..1073741824"),
    ("RESILIENT_TCP_SOCKBUF", "4M", "whole number"),
    ("RESILIENT_SELECTOR", "BaseSelector", "DefaultSelector"),
    ("RESILIENT_SELECTOR", "socket", "DefaultSelector"),
    ("RESILIENT_LOG_LEVEL", "LOUD", "INFO"),
    ("RESILIENT_HOST", " ", "non-empty"),
])
def test_a_bad_value_names_the_variable_the_value_and_the_fix(name, raw, fix):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({name: raw})
    assert f"{name}={raw!r}" in str(info.value) and fix in str(info.value)


def test_frozen():
    with pytest.raises(AttributeError):
        Settings().host = "x"  # type: ignore[misc]


def test_the_docs_table_is_the_generated_one():
    doc = (ROOT / "docs" / "settings.md").read_text()
    block = re.search(r"<!-- settings-table[^>]*-->\n(.*?)<!-- /settings-table -->", doc, re.S)
    assert block is not None, "docs/settings.md lost its table markers"
    assert block.group(1) == markdown_table(), "docs/settings.md is stale: regenerate with python -m resilient.settings"


def test_every_variable_the_package_reads_is_in_the_table():
    used = set()
    for folder in ("resilient", "coordinator", "kernels", "chaos"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"\bRESILIENT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    known = set(variables())
    assert len(known) == len(variables()), "a variable is listed twice"
    assert used - known == set(), "add these to resilient.settings (a Settings field or DELEGATED)"
    assert {name for name, _, _ in DELEGATED} <= used  # no stale row either
