"""Run every built-in scenario with K seeds against the real collectives and print one
JSON summary line per scenario plus a Markdown table (for docs/chaos.md).

    python -m resilient.chaos.run_all [--seeds 5] [--only NAME ...] [--skip NAME ...]
        [--backend resilient] [--json PATH]

Not part of ``make test`` (the whole set takes many minutes). Scenarios that need root
(netem) are reported as SKIPPED with the reason. Exit 0 only if every scenario that ran
held every invariant (0 wrong, 0 hangs, 0 lost, no vacuous fault) on every seed.

Failure behaviour: a scenario whose runner raised (a process did not come up) is reported
as ERROR with the message and counts as a failure; the next scenario still runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--only", nargs="*", default=None, metavar="NAME")
    p.add_argument("--skip", nargs="*", default=(), metavar="NAME")
    p.add_argument("--backend", choices=("resilient", "oracle"), default="resilient")
    p.add_argument("--json", metavar="PATH", help="also write every summary (a JSON list) to PATH")
    args = p.parse_args(argv)

    from resilient.chaos import report, runner
    from resilient.chaos.scenario import builtin_scenarios
    from resilient.chaos.verifier import verify
    from resilient.errors import ResilientError

    rows, summaries, ok = [], [], True
    for sc in builtin_scenarios():
        if (args.only and sc.name not in args.only) or sc.name in args.skip:
            continue
        skip = runner.skip_reason(sc)
        if skip is not None:
            rows.append(f"| {sc.name} | - | SKIPPED: {skip} |" + " - |" * 7)
            print(json.dumps({"scenario": sc.name, "skipped": skip}), flush=True)
            continue
        t0 = time.monotonic()
        verdicts = []
        try:
            for seed in range(args.seeds):
                verdicts.append(verify(runner.run_scenario(sc, seed, backend=args.backend)))
        except ResilientError as exc:
            ok = False
            rows.append(f"| {sc.name} | {len(verdicts)}/{args.seeds} | ERROR: {exc} |" + " - |" * 7)
            print(json.dumps({"scenario": sc.name, "error": str(exc)}), flush=True)
            continue
        s = report.summarize(verdicts)
        s["wall_s"] = round(time.monotonic() - t0, 1)
        summaries.append(s)
        ok &= bool(s["passed"])
        skipped = f"; skipped: {'; '.join(s['skipped'])}" if s["skipped"] else ""
        result = "FAIL" if not s["passed"] else "SKIPPED (no fault injected)" if sc.faults and not s["faults"] \
            else "PASS, but not every fault was injected" if s["skipped"] else "PASS"
        rows.append(f"| {sc.name} | {args.seeds} | {result}{skipped} | {s['ops']} | {s['faults']} | {s['wrong']} | "
                    f"{s['hangs']} | {s['lost']} | {s['vacuous']} | {s['recovery_p50_s']} / {s['recovery_p99_s']} |")
        print(json.dumps(s), flush=True)
        for f in s.get("findings", [])[:5]:
            print(f"  {f}", file=sys.stderr)
    print("| scenario | seeds | result | ops | faults | wrong | hangs | lost | vacuous | recovery p50 / p99 s |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
