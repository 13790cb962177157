"""Import graph of the package (every ``import``/``from`` statement, function-level and
``TYPE_CHECKING`` ones included, modules mapped to their files as setup.py installs them):
the torch backend and its DDP and FSDP integrations form no cycle, nor do the Communicator
and the compressed allreduce (typed against ``compression_host.CompressionHost``)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"resilient": "resilient", "coordinator": "resilient.coordinator", "kernels": "resilient.kernels",
           "chaos": "resilient.chaos"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


def graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != mod and not mod.startswith(t + "."):  # a submodule's own packages
                    edges[mod].add(t)
    return edges


def _reaches(edges: dict[str, set[str]], a: str, b: str) -> bool:
    seen, todo = set(), [a]
    while todo:
        m = todo.pop()
        if m == b:
            return True
        if m in seen:
            continue
        seen.add(m)
        todo.extend(edges.get(m, ()))
    return False


def test_torch_backend_does_not_import_its_integrations() -> None:
    edges = graph()
    assert "resilient.torch_backend" in edges and edges["resilient.ddp"]
    for integration in ("resilient.ddp", "resilient.fsdp", "resilient.fsdp.patches"):
        for backend in ("resilient.torch_backend", "resilient.torch_backend.process_group",
                        "resilient.torch_backend.work"):
            assert not (_reaches(edges, integration, backend) and _reaches(edges, backend, integration)), \
                f"import cycle between {integration} and {backend}"


def test_the_graph_sees_function_level_imports() -> None:
    # resilient.torch_backend imports process_group inside functions only
    assert "resilient.torch_backend.process_group" in graph()["resilient.torch_backend"]


def test_communicator_and_compressed_allreduce_form_no_cycle() -> None:
    edges = graph()
    comm = "resilient.collectives.communicator"
    assert _reaches(edges, comm, "resilient.collectives.compressed")
    for mod in ("resilient.collectives.compressed", "resilient.collectives.compression_switch",
                "resilient.collectives.compression_host"):
        assert not _reaches(edges, mod, comm), f"{mod} imports the Communicator back"
