"""The type check of `make test`: ``mypy --strict`` over the installed package's layout.

setup.py maps the folders ``coordinator/``, ``kernels/`` and ``chaos/`` onto
``resilient.coordinator`` etc.; mypy cannot follow that mapping, so this lays the package
out as it is installed (links under ``.venv/typecheck``) and checks it there. The
settings are ``[tool.mypy]`` in pyproject.toml. A failure lists every error with the
source path it came from."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"coordinator": "coordinator", "kernels": "kernels", "chaos": "chaos"}


def package_tree(dest: Path) -> Path:
    """``dest/resilient``: links to every entry of ``resilient/`` plus the mapped folders."""
    pkg = dest / "resilient"
    pkg.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (ROOT / "resilient").iterdir() if p.name != "__pycache__"}
    wanted.update({name: ROOT / folder for name, folder in MAPPED.items()})
    for entry in pkg.iterdir():
        if entry.name not in wanted or not entry.is_symlink() or entry.resolve() != wanted[entry.name]:
            entry.unlink()
    for name, target in wanted.items():
        link = pkg / name
        if not link.is_symlink():
            link.symlink_to(target)
    return dest


def test_package_type_checks_strict_with_no_errors() -> None:
    api = pytest.importorskip("mypy.api", reason="mypy is in the dev extras: pip install -e '.[dev]'")
    tree = package_tree(ROOT / ".venv" / "typecheck")
    cwd = os.getcwd()
    os.chdir(tree)
    try:
        out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                    "--python-executable", sys.executable,
                                    "--cache-dir", str(ROOT / ".venv" / "mypy_cache"),
                                    "--no-error-summary", "-p", "resilient"])
    finally:
        os.chdir(cwd)
    mapped = {f"resilient/{name}/": f"{folder}/" for name, folder in MAPPED.items()}
    lines = []
    for line in out.splitlines():
        for prefix, folder in mapped.items():
            if line.startswith(prefix):
                line = folder + line[len(prefix):]
                break
        lines.append(line)
    assert status == 0 and not err, f"mypy --strict found {len(lines)} problem(s):\n" + "\n".join(lines) + err
