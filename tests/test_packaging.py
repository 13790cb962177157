"""Packaging: the LICENSE, ``--version`` of both commands, and the Dockerfile's build
context (parsed and built as far as pip goes, without docker or a registry)."""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_the_apache_license_pyproject_names() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_both_commands_print_the_installed_version() -> None:
    from importlib import metadata

    want = metadata.version("resilient-collectives")
    for prog, module in (("resilient", "resilient.cli"), ("resilient-run", "resilient.launcher.cli")):
        out = subprocess.run([sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())",
                              "--version"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert re.fullmatch(rf"{re.escape(prog)} {re.escape(want)} \(torch \S+\)\n", out.stdout), out.stdout


def _instructions() -> list[tuple[str, str]]:
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel.split("/")[0], p) or
               (p.startswith("**/") and fnmatch.fnmatch(rel.rsplit("/", 1)[-1], p[3:])) for p in patterns)


def test_dockerfile_is_non_root_and_pins_the_tested_torch() -> None:
    ins = _instructions()
    kinds = [k for k, _ in ins]
    assert kinds[0] == "FROM" and "python:3.11" in ins[0][1]
    users = [v.strip() for k, v in ins if k == "USER"]
    values = yaml.safe_load((ROOT / "helm" / "resilient" / "values.yaml").read_text())
    assert users and users[-1] == str(values["podSecurityContext"]["runAsUser"]) != "0"
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN"), "a RUN after USER"
    pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text())
    assert pin and f"ARG TORCH_VERSION={pin.group(1)}" in (ROOT / "Dockerfile").read_text()
    # at run time only /tmp is written: TMPDIR and HOME point there (the chart's emptyDir)
    env = " ".join(v for k, v in ins if k == "ENV")
    assert "TMPDIR=/tmp" in env and "HOME=/tmp" in env


def test_dockerfile_context_builds_the_package(tmp_path: Path) -> None:
    """Every COPY source exists in the context (.dockerignore applied), and pip builds the
    package from exactly those files, with both commands as entry points."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for kind, value in _instructions():
        if kind != "COPY":
            continue
        *sources, _dest = value.split()
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"COPY {src}: not in the build context"
            assert not _ignored(src, patterns), f"COPY {src}: excluded by .dockerignore"
            if path.is_dir():
                shutil.copytree(path, ctx / src, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
            else:
                shutil.copy(path, ctx / src)
    out = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ctx,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    info = next(tmp_path.glob("*.egg-info"))
    eps = (info / "entry_points.txt").read_text()
    assert "resilient = resilient.cli:main" in eps and "resilient-run = resilient.launcher.cli:main" in eps
    sources = (info / "SOURCES.txt").read_text().split()
    assert "coordinator/__init__.py" in sources and "resilient/torch_backend/__init__.py" in sources
