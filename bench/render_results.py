"""Render ``bench/results/*.json`` into the README's results table (between the
``<!-- results:begin -->`` and ``<!-- results:end -->`` markers).

    .venv/bin/python bench/render_results.py          # rewrite the table
    .venv/bin/python bench/render_results.py --check  # exit 1 when the README's table is stale

Failure behaviour: a README without both markers, or a malformed results file, exits 2
with a message naming it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import RESULTS, load_all  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def table(directory: Path = RESULTS) -> str:
    """The table, then one line per machine (the table names them by letter)."""
    recs = load_all(directory)
    machines: dict[str, str] = {}
    for rec in recs:
        machines.setdefault(rec["machine"], chr(ord("A") + len(machines)))
    rows = ["| claim | figure | machine, load, date | command |", "|---|---|---|---|"]
    for rec in recs:
        for h in rec["headline"]:
            rows.append(f"| {h['claim']} | **{h['figure']}** | {machines[rec['machine']]}, load {rec['load']}, "
                        f"{rec['date']} | `{rec['command']}` |")
    rows.append("")
    rows += [f"Machine {letter}: {name}." for name, letter in machines.items()]
    return "\n".join(rows)


def render(text: str, directory: Path = RESULTS) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(directory)}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the README's table is not the rendered one")
    args = ap.parse_args()
    try:
        text = README.read_text()
        new = render(text)
    except ValueError as exc:
        print(f"render_results: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print("README.md's results table is stale: run .venv/bin/python bench/render_results.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
