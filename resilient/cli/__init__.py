"""The ``resilient`` command.

Each subcommand lives in its own module of this package and is imported lazily, only when
it runs, so that ``resilient status`` does not pay for importing torch. To add a
subcommand, add a module with ``add_arguments(parser)`` and ``run(args) -> int`` and one
line to :data:`SUBCOMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "coordinator": ("resilient.cli.coordinator", "run a coordinator (leader-elected; start several for standbys)"),
    "status": ("resilient.cli.status", "show members, their state and lease, the epoch, the ring and the leader"),
    "chaos": ("resilient.cli.chaos", "list, check and run chaos scenarios; export them to Chaos Mesh"),
}


#: name -> the examples ``resilient NAME --help`` ends with
EXAMPLES: dict[str, str] = {
    "coordinator": """examples:
  resilient coordinator --etcd 10.0.0.1:2379 --job train          # one per job; start 2 for a standby
  resilient coordinator --etcd 10.0.0.1:2379 --job train --straggler-policy deadline --leaf-deadline-ms 50""",
    "status": """examples:
  resilient status --etcd 10.0.0.1:2379 --job train               # members, epoch, ring, leader
  resilient status --etcd 10.0.0.1:2379 --job train --json""",
    "chaos": """examples:
  resilient chaos list
  resilient chaos run kill-reduce-scatter --seeds 5 --json out.json --report report/
  resilient chaos k8s kill-reduce-scatter -n ml --release train -o chaos.yaml""",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resilient",
        description="Fault-tolerant, elastic collectives for PyTorch: control plane and tools.",
        epilog="examples:\n  resilient coordinator --etcd 10.0.0.1:2379 --job train\n"
               "  resilient status --etcd 10.0.0.1:2379 --job train\n  resilient chaos list\n\n"
               "Launch workers with resilient-run (torchrun's flags): resilient-run --help. Docs: docs/launcher.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from resilient.version import version_line

    parser.add_argument("--version", action="version", version=version_line("resilient"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES.get(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:  # pragma: no cover - only while a subcommand is being written
            if exc.name != module:
                raise
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from resilient.errors import ResilientError

    args = build_parser().parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ResilientError as exc:
        print(f"resilient {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
