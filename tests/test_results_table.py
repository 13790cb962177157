"""The README's results table is rendered from bench/results/*.json and current; the
README carries no run-by-run narration and no line over 300 characters."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import render_results  # noqa: E402
from results_file import load_all  # noqa: E402


def test_readme_table_is_the_rendered_one() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "render_results.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_changed_results_file_makes_the_table_stale(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    text = (ROOT / "README.md").read_text()
    assert render_results.render(text, results) == text
    path = results / "fsdp.json"
    rec = json.loads(path.read_text())
    rec["headline"][0]["figure"] = "a new figure"
    path.write_text(json.dumps(rec))
    assert render_results.render(text, results) != text
    assert "**a new figure**" in render_results.render(text, results)


def test_every_results_file_is_valid_and_every_bench_in_it_exists() -> None:
    recs = load_all()
    assert len(recs) >= 10
    for rec in recs:
        script = re.search(r"bench/(\w+)\.py", rec["command"])
        assert script and (ROOT / "bench" / f"{script.group(1)}.py").exists(), rec["command"]


def test_malformed_results_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"bench": "x"}))
    with pytest.raises(ValueError, match="bad.json"):
        load_all(tmp_path)


NARRATION = re.compile(r"(first|second|third|[a-z]+th) session|this session|session \d", re.I)


def test_readme_and_docs_have_no_narration_and_short_readme_lines() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            assert not NARRATION.search(line), f"{path.name}:{i}: {line[:120]}"
    long = [i for i, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1) if len(line) > 300]
    assert not long, f"README lines over 300 characters: {long}"
