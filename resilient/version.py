"""The installed version of resilient (``resilient --version``, ``resilient-run --version``).

Failure behaviour: never raises; a source tree that is not installed reports ``unknown``.
"""
from __future__ import annotations

from importlib import metadata

__all__ = ["DISTRIBUTION", "version", "version_line"]

#: the distribution name in pyproject.toml
DISTRIBUTION = "resilient-collectives"


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def version_line(prog: str) -> str:
    """What ``--version`` prints: the program, our version and torch's (when importable)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"{prog} {version()} (torch {torch_version})"
