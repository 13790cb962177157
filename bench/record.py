"""Run a benchmark and write its results file (``bench/results/<bench>.json``).

    .venv/bin/python bench/record.py --claim "allreduce, 4 ranks, vs gloo" \\
        --figure "2.0× at 1 MiB" -- bench/collectives.py --world 4

Every JSON line the bench prints goes into ``results``; the claim and the figure (what the
README's table shows, read off those lines) are given here. Then run
``bench/render_results.py``. ``bench/fsdp.py`` writes its own file.

Failure behaviour: a bench that exits non-zero writes nothing (its exit status is
returned); lines that are not JSON are passed through to stdout and not recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--claim", required=True)
    ap.add_argument("--figure", required=True)
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- bench/NAME.py [args]")
    args = ap.parse_args()
    script = [a for a in args.script if a != "--"]
    if not script or not script[0].endswith(".py"):
        ap.error("give the bench after --: bench/NAME.py [args]")
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, *script], stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            print(line)
    if proc.returncode != 0:
        return proc.returncode
    name = Path(script[0]).stem
    print(write(name, ".venv/bin/python " + " ".join(script), load, [{"claim": args.claim, "figure": args.figure}], lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
