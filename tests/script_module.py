"""Import a script that is not part of the package (a bench, an example, a chart file)
as a module, by path, so tests can call its functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """The module at ``path``, imported under ``name`` (raises what its import raises)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path} is not an importable Python file"
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
