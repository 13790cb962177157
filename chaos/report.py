"""Chaos run reports: a terminal table, a JSON summary and a PNG timeline.

:func:`summarize` folds the verdicts of all seeds of one scenario into the JSON summary
whose first keys are always ``ops, faults, wrong, hangs, recovery_p50_s, recovery_p99_s``
(counts are totals over seeds; percentiles over every recovery; ``null`` when no fault
caused one). :func:`render_table` formats verdicts for a terminal. :func:`render_timeline`
draws members x time (op spans, wrong ops in red, unfinished ops hatched, faults and
epochs marked) with matplotlib's Agg backend, so it needs no display.

Failure behaviour: writing a report to an unwritable path raises ``OSError`` from the
write; nothing here starts or stops processes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from resilient.chaos.verifier import RunLog, Verdict, percentile

SUMMARY_KEYS = ("ops", "faults", "wrong", "hangs", "recovery_p50_s", "recovery_p99_s")


def summarize(verdicts: Sequence[Verdict], max_findings: int = 20) -> dict[str, Any]:
    """The JSON summary of one scenario over its seeds (see the module docstring)."""
    recoveries = [r for v in verdicts for r in v.recoveries]
    out: dict[str, Any] = {
        "ops": sum(v.ops for v in verdicts),
        "faults": sum(v.faults for v in verdicts),
        "wrong": sum(len(v.wrong) for v in verdicts),
        "hangs": sum(len(v.hangs) for v in verdicts),
        "recovery_p50_s": _round(percentile(recoveries, 50)),
        "recovery_p99_s": _round(percentile(recoveries, 99)),
        "lost": sum(len(v.lost) for v in verdicts),
        "data_lost": sum(len(v.data_lost) for v in verdicts),
        "vacuous": sum(len(v.vacuous) for v in verdicts),
        "passed": all(v.passed for v in verdicts) and bool(verdicts),
        "scenario": verdicts[0].scenario if verdicts else None,
        "seeds": [v.seed for v in verdicts],
        "results_checked": sum(v.results_checked for v in verdicts),
        "recoveries": len(recoveries),
        "bytes_resent": sum(v.bytes_resent for v in verdicts),
        "bytes_restart": sum(v.bytes_restart for v in verdicts),
        "skipped": sorted({s for v in verdicts for s in v.skipped}),
    }
    findings = [f"seed {v.seed}: {kind}: {f}" for v in verdicts
                for kind, fs in (("wrong", v.wrong), ("hang", v.hangs), ("lost", v.lost)) for f in fs]
    findings += [f"seed {v.seed}: vacuous fault: {f}" for v in verdicts for f in v.vacuous]
    findings += [f"seed {v.seed}: data lost by contract (not a failure): {f}" for v in verdicts for f in v.data_lost]
    out["findings"] = findings[:max_findings]
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def render_table(verdicts: Sequence[Verdict]) -> str:
    """A fixed-width table, one row per seed plus a total row."""
    head = ("scenario", "seed", "ops", "faults", "wrong", "hangs", "lost", "rec p50 s", "rec p99 s", "result")
    rows: list[tuple[str, ...]] = []
    for v in verdicts:
        rows.append((v.scenario, str(v.seed), str(v.ops), str(v.faults), str(len(v.wrong)), str(len(v.hangs)),
                     str(len(v.lost)), _fmt(percentile(v.recoveries, 50)), _fmt(percentile(v.recoveries, 99)),
                     "PASS" if v.passed else "FAIL"))
    if len(verdicts) > 1:
        s = summarize(verdicts)
        rows.append(("total", "-", str(s["ops"]), str(s["faults"]), str(s["wrong"]), str(s["hangs"]), str(s["lost"]),
                     _fmt(s["recovery_p50_s"]), _fmt(s["recovery_p99_s"]), "PASS" if s["passed"] else "FAIL"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), line(tuple("-" * w for w in widths))] + [line(r) for r in rows]
    for v in verdicts:
        for kind, fs in (("WRONG", v.wrong), ("HANG", v.hangs), ("LOST", v.lost)):
            out += [f"  seed {v.seed} {kind}: {f}" for f in fs[:10]]
        out += [f"  seed {v.seed} VACUOUS (the fault hit no op; the run is not a pass): {f}" for f in v.vacuous]
        out += [f"  seed {v.seed} skipped: {s}" for s in v.skipped]
    return "\n".join(out)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def write_json(summary: dict[str, Any], path: str | os.PathLike[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")


#: Timeline image size in pixels: fixed width, height grows with the member count.
TIMELINE_WIDTH_PX = 1200
TIMELINE_DPI = 100


def timeline_size(members: int) -> tuple[int, int]:
    """``(width, height)`` in pixels of the PNG :func:`render_timeline` writes."""
    return TIMELINE_WIDTH_PX, 160 + 40 * members


def render_timeline(run: RunLog, verdict: Verdict, path: str | os.PathLike[str]) -> Path:
    """Write a PNG timeline of ``run`` to ``path``: one row per member, each op a bar
    (wrong ops red, ops that never finished hatched to the end of the run), faults as red
    lines labelled with their kind (shaded while they last), epochs as dashed lines."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    n = run.scenario.world_size
    w, h = timeline_size(n)
    fig = Figure(figsize=(w / TIMELINE_DPI, h / TIMELINE_DPI), dpi=TIMELINE_DPI)
    ax = fig.add_axes((0.09, 60 / h, 0.88, 1 - 120 / h))
    ends = [r.end_s for r in run.records if r.end_s is not None] + [f.end_s or f.time_s for f in run.faults]
    t_end = max([run.duration_s, *ends, 1e-3])
    wrong = {(f.seq, f.member) for f in verdict.wrong} | {(f.seq, None) for f in verdict.wrong if f.member is None}
    for r in run.records:
        y = r.member
        is_wrong = (r.seq, r.member) in wrong or (r.seq, None) in wrong
        if r.end_s is None:
            ax.broken_barh([(r.start_s, t_end - r.start_s)], (y - 0.35, 0.7), facecolors="none",
                           edgecolors="tab:orange", hatch="//")
            continue
        color = "tab:red" if is_wrong else ("tab:blue" if r.seq % 2 == 0 else "tab:cyan")
        ax.broken_barh([(r.start_s, max(r.end_s - r.start_s, t_end / 2000))], (y - 0.35, 0.7), facecolors=color)
    for f in run.faults:
        style = dict(color="grey", alpha=0.5) if f.skipped else dict(color="tab:red")
        ax.axvline(f.time_s, lw=1.5, **style)
        label = f.kind + (" (skipped)" if f.skipped else "")
        ax.annotate(label, (f.time_s, 0.98), xycoords=ax.get_xaxis_transform(), rotation=90, va="top", ha="right",
                    fontsize=7, **style)
        if f.end_s is not None and not f.skipped:
            if f.victim is not None:
                ax.broken_barh([(f.time_s, f.end_s - f.time_s)], (f.victim - 0.45, 0.9), facecolors="tab:red",
                               alpha=0.15)
            else:
                ax.axvspan(f.time_s, f.end_s, color="tab:red", alpha=0.08)
        if f.victim is not None and not f.skipped:
            ax.plot([f.time_s], [f.victim], marker="X", color="tab:red", markersize=9)
    for e in run.epochs:
        ax.axvline(e.time_s, color="k", ls="--", lw=0.8)
        ax.annotate(f"e{e.number}", (e.time_s, 0.01), xycoords=ax.get_xaxis_transform(), fontsize=7, ha="left",
                    va="bottom")
    ax.set_xlim(0, t_end * 1.02)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_yticks(range(n), [f"member {m}" for m in range(n)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the workload started")
    status = "PASS" if verdict.passed else "FAIL"
    ax.set_title(f"{run.scenario.name} seed {run.seed}: {verdict.ops} ops, {len(verdict.wrong)} wrong, "
                 f"{len(verdict.hangs)} hangs, {len(verdict.lost)} lost: {status}", fontsize=10)
    ax.legend(handles=[Patch(color="tab:blue", label="op"), Patch(color="tab:red", label="wrong / fault"),
                       Patch(facecolor="none", edgecolor="tab:orange", hatch="//", label="never finished")],
              loc="lower right", fontsize=7, ncols=3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=TIMELINE_DPI)
    return path


def write_reports(runs: Sequence[RunLog], verdicts: Sequence[Verdict], report_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``summary.json``, ``table.txt`` and one ``timeline-seed<K>.png`` per seed to
    ``report_dir``; returns the paths written."""
    d = Path(report_dir)
    d.mkdir(parents=True, exist_ok=True)
    written = [d / "summary.json", d / "table.txt"]
    write_json(summarize(verdicts), written[0])
    written[1].write_text(render_table(verdicts) + "\n")
    for run, v in zip(runs, verdicts):
        written.append(render_timeline(run, v, d / f"timeline-seed{run.seed}.png"))
    return written
