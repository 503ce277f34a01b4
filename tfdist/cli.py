"""The `tfdist` command: `tfdist demo`, and more subcommands as they land."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

# Subcommands register here: name -> (add_arguments(parser), run(args) -> exit code).
SUBCOMMANDS: dict[str, tuple[Callable, Callable, str]] = {}


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="logical CPU devices to split the host into (default 2)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per strategy (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size (default 64)")
    p.add_argument("--strategy", action="append", help="run only this strategy (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress bars, only the table")


def _demo_run(args: argparse.Namespace) -> int:
    for flag, value in (("--devices", args.devices), ("--epochs", args.epochs), ("--batch-size", args.batch_size)):
        if value < 1:
            print(f"tfdist demo: {flag} must be a positive integer. Received: {flag} {value}", file=sys.stderr)
            return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfdist import demo, devices, registry

    unknown = [s for s in (args.strategy or []) if s not in registry.strategy_names()]
    if unknown:
        print(
            f"tfdist demo: unknown strategy {unknown[0]!r}. Valid names: {registry.strategy_names()}",
            file=sys.stderr,
        )
        return 2
    runnable = [name for name, _ in demo.demo_strategies()]
    elsewhere = [s for s in (args.strategy or []) if s not in runnable]
    if elsewhere:
        print(
            f"tfdist demo: strategy {elsewhere[0]!r} needs a cluster of processes, which the demo does not "
            f"start; it runs {runnable}. Run a job of several processes with `tfdist launch` "
            "(docs/operations.md) or see examples/.",
            file=sys.stderr,
        )
        return 2
    devices.configure_local_devices(args.devices)
    rows = demo.run_demo(
        epochs=args.epochs,
        batch_size=args.batch_size,
        verbose=0 if args.quiet else 1,
        only=args.strategy,
    )
    print()
    print(demo.format_table(rows))
    return 0


SUBCOMMANDS["demo"] = (
    _demo_arguments,
    _demo_run,
    "train one model on the bundled digits under every strategy and print a table",
)


def _launch_arguments(p: argparse.ArgumentParser) -> None:
    from tfdist import launch

    launch.add_arguments(p)


def _launch_run(args: argparse.Namespace) -> int:
    from tfdist import launch

    return launch.main(args)


SUBCOMMANDS["launch"] = (
    _launch_arguments,
    _launch_run,
    "run every process of a multi-worker job on this machine (TF_CONFIG per process)",
)


def _tune_arguments(p: argparse.ArgumentParser) -> None:
    import tfdist.tuning  # not `from tfdist import tuning`: that asks tfdist for the name, which loads TensorFlow

    tfdist.tuning.add_arguments(p)


def _tune_run(args: argparse.Namespace) -> int:
    import tfdist.tuning

    return tfdist.tuning.main(args)


SUBCOMMANDS["tune"] = (
    _tune_arguments,
    _tune_run,
    "try bucket_bytes, sink_size, hierarchical (allreduce_dtype) on your script; print samples/s; --apply writes a preset",
)
# Subcommands that run a command given after `--` (its flags are its own).
_RUNS_A_COMMAND = ("launch", "tune")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tfdist", description="Distribution strategies for Keras 3 and TensorFlow.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers = {}
    for name, (add_arguments, _, help_text) in sorted(SUBCOMMANDS.items()):
        parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(parsers[name])
    argv = list(sys.argv[1:] if argv is None else argv)
    # `tfdist launch [flags] -- command`: the flags are parsed strictly, the
    # command after `--` not at all (it has flags of its own).
    command = None
    if argv[:1] and argv[0] in _RUNS_A_COMMAND and "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command not in _RUNS_A_COMMAND:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    elif command is not None:
        if rest:
            parsers[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
        rest = command
    elif rest and rest[0].startswith("-"):
        parsers[args.command].error(
            f"unrecognized arguments: {' '.join(rest)}. Put the command after --, e.g. "
            "tfdist launch --workers 2 -- python train.py"
        )
    args.rest = rest
    return SUBCOMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
