"""The generated reference pages (launcher flags, metrics, the chart's values) are what the
code gives today, and the CLI help carries examples and hides old spellings."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gen_reference  # noqa: E402


def test_generated_pages_are_current() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_reference.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_every_metric_family_and_launcher_flag_is_documented() -> None:
    from prometheus_client import CollectorRegistry

    from resilient import metrics
    from resilient.coordinator.metrics import CoordinatorMetrics
    from resilient.launcher.args import build_parser

    doc = (ROOT / "docs" / "metrics.md").read_text()
    names = [f[0] for f in gen_reference._families(CoordinatorMetrics().registry)]
    reg = CollectorRegistry()
    metrics.RankMetrics(reg)
    names += [f[0] for f in gen_reference._families(reg)]
    assert len(names) >= 15
    for name in names:
        assert f"`{name}`" in doc, name
    flags = (ROOT / "docs" / "launcher.md").read_text()
    for action in build_parser()._actions:
        for opt in action.option_strings:
            assert f"`{opt}`" in flags, opt


def test_chart_readme_lists_every_top_level_value() -> None:
    import yaml

    values = yaml.safe_load((ROOT / "helm" / "resilient" / "values.yaml").read_text())
    readme = (ROOT / "helm" / "resilient" / "README.md").read_text()
    for key in values:
        assert f"`{key}" in readme, key


def test_cli_help_has_examples_and_hides_old_spellings() -> None:
    from resilient.cli import build_parser as resilient_parser
    from resilient.launcher.args import build_parser as run_parser

    assert "examples:" in run_parser().format_help()
    top = resilient_parser()
    assert "examples:" in top.format_help()
    sub = next(a for a in top._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in ("status", "coordinator", "chaos"):
        assert "examples:" in sub.choices[name].format_help(), name
    status = sub.choices["status"]
    assert "--ca-cert" not in status.format_help() and "--etcd-ca-cert" in status.format_help()
    args = top.parse_args(["status", "--ca-cert", "/x/ca.pem"])
    assert args.etcd_ca_cert == "/x/ca.pem"  # the old spelling still works
