"""``resilient chaos``: list, check and run chaos scenarios, or export them to Chaos Mesh.

    resilient chaos list
    resilient chaos check FILE|NAME...
    resilient chaos run FILE|NAME [--seeds K] [--json PATH] [--report DIR]
    resilient chaos k8s FILE|NAME [--namespace NS] [--release R] [--flat] [-o PATH]

``run`` exits 0 only if every invariant held on every seed (0 wrong, 0 hangs, 0 lost),
and every fault hit the workload; 1 if one did not (a vacuous fault — one that hit no op —
is a failure), 3 when the scenario was skipped here (netem without root, or none of its
faults could be injected), and 2 on a bad scenario or when the runner cannot start. Its last stdout line is the JSON summary.
Heavy imports happen inside :func:`run`.
"""
from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_VIOLATED, EXIT_ERROR, EXIT_SKIPPED = 0, 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="chaos_command", metavar="ACTION")
    sub.required = True
    sub.add_parser("list", help="built-in scenarios, one line each")
    check = sub.add_parser("check", help="parse and validate scenario files (nothing is started)")
    check.add_argument("scenarios", nargs="+", metavar="FILE|NAME")
    run = sub.add_parser("run", help="run a scenario for real and verify every op")
    run.add_argument("scenario", metavar="FILE|NAME", help="a scenario file or a built-in name (see `list`)")
    run.add_argument("--seeds", type=_positive, default=None, metavar="K",
                     help="run seeds 0..K-1 (default: the scenario's `seeds`)")
    run.add_argument("--json", metavar="PATH", help="also write the JSON summary to PATH")
    run.add_argument("--report", metavar="DIR", help="write summary.json, table.txt and PNG timelines to DIR")
    run.add_argument("--workdir", metavar="DIR", help="keep logs of every process here (default: a temp dir, removed)")
    run.add_argument("--backend", choices=("resilient", "oracle"), default="resilient",
                     help="resilient: the collectives under test (default); oracle: members compute results "
                          "without collectives, a self-test of the runner, fault injection and verifier")
    k8s = sub.add_parser("k8s", help="write the equivalent Chaos Mesh manifests for the Helm chart")
    k8s.add_argument("scenario", metavar="FILE|NAME")
    k8s.add_argument("--namespace", "-n", default="default", help="namespace of the Helm release (default: default)")
    k8s.add_argument("--release", help="Helm release name (adds app.kubernetes.io/instance to selectors)")
    k8s.add_argument("--flat", action="store_true",
                     help="emit the chaos objects themselves (apply at once) instead of one timed Workflow")
    k8s.add_argument("--seed", type=int, default=0, help="seed that resolves `member: random` (default 0)")
    k8s.add_argument("-o", "--output", metavar="PATH", help="write to PATH instead of stdout")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    return {"list": _list, "check": _check, "run": _run, "k8s": _k8s}[args.chaos_command](args)


def _list(args: argparse.Namespace) -> int:
    from resilient.chaos.scenario import builtin_scenarios

    scenarios = builtin_scenarios()
    width = max(len(s.name) for s in scenarios)
    for s in scenarios:
        print(f"{s.name.ljust(width)}  {s.description}")
    return EXIT_OK


def _check(args: argparse.Namespace) -> int:
    from resilient.chaos.scenario import find_scenario

    for ref in args.scenarios:
        s = find_scenario(ref)  # raises ScenarioError naming line and field
        print(f"{s.source}: ok: {s.name}: world {s.world_size}, {len(s.faults)} faults "
              f"({', '.join(sorted(k.name for k in s.fault_kinds())) or 'none'})")
    return EXIT_OK


def _k8s(args: argparse.Namespace) -> int:
    from resilient.chaos.k8s import render
    from resilient.chaos.scenario import find_scenario

    text = render(find_scenario(args.scenario), args.namespace, args.release, args.flat, args.seed)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    import json

    from resilient.chaos import report, runner
    from resilient.chaos.scenario import find_scenario
    from resilient.chaos.verifier import verify

    scenario = find_scenario(args.scenario)
    skip = runner.skip_reason(scenario)
    if skip is not None:
        print(f"SKIPPED: {skip}", file=sys.stderr)
        return EXIT_SKIPPED
    unavailable = runner.runner_unavailable_reason(args.backend)
    if unavailable is not None:
        raise runner.RunnerUnavailable(unavailable)
    import signal

    # SIGTERM ends a run like Ctrl-C: the runner's cleanup stops every process it started
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    seeds = list(range(args.seeds if args.seeds is not None else scenario.seeds))
    runs, verdicts = [], []
    for seed in seeds:
        log = runner.run_scenario(scenario, seed, args.workdir, backend=args.backend)
        runs.append(log)
        verdicts.append(verify(log))
    print(report.render_table(verdicts))
    summary = report.summarize(verdicts)
    if args.json:
        report.write_json(summary, args.json)
    if args.report:
        report.write_reports(runs, verdicts, args.report)
    print(json.dumps(summary))
    if not summary["passed"]:
        return EXIT_VIOLATED
    if scenario.faults and summary["faults"] == 0:  # nothing was proven
        print(f"SKIPPED: no fault of {scenario.name!r} could be injected here: "
              f"{'; '.join(summary['skipped'])}", file=sys.stderr)
        return EXIT_SKIPPED
    return EXIT_OK
