"""The command line: `pipeflow train CONFIG`, `pipeflow plan …`, `pipeflow schedule …`."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]


def _train(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from pipeflow.config import ConfigError
    from pipeflow.train import load_run_config, train

    try:
        config, model, run = load_run_config(args.config)
        if args.steps is not None:
            run.steps = args.steps
        if args.save_dir is not None:
            run.save_dir = args.save_dir
        if args.resume:
            run.resume = True
        train(config, model, run, trace=args.trace)
    except ConfigError as exc:
        # Raised alike on every rank (grid, batch and config checks agree before any
        # message moves): one report from rank 0, a clean exit everywhere.
        if MPI.COMM_WORLD.rank == 0:
            print(f"pipeflow: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _schedule(args: argparse.Namespace) -> int:
    from pipeflow.schedule import ScheduleError, build_schedule, format_table, simulate

    p, m = args.stages, args.microbatches
    v = args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else None)
    try:
        programs = build_schedule(args.schedule, p, m, v)
    except ScheduleError as exc:
        print(f"pipeflow: error: {exc}", file=sys.stderr)
        return 2
    v = len(programs.layout[0])
    result = simulate(programs)
    print(format_table(programs))
    if any(a.op == "W" for a in programs[0]):
        # Split backward: F = B = W = 1 unit; 1F1B's whole backward takes B + W = 2.
        print(f"\nbubble {result.bubble:.3f} (F = B = W; 1F1B with the same times: "
              f"{simulate(build_schedule('1f1b', p, m)).bubble:.3f}); peak stash per stage "
              f"{result.peak_stash}, waiting for W {result.peak_pending_w}, held in all "
              f"{result.peak_held}" + (f" (in chunks: 1/{v} of a stage's layers each)"
                                       if v > 1 else ""))
        return 0
    print(f"\nbubble {result.bubble:.3f} (formula (p-1)/(v·m+p-1) = "
          f"{(p - 1) / (v * m + p - 1):.3f}); peak stash per stage {result.peak_stash}"
          + (f" (in chunks: 1/{v} of a stage's layers each)" if v > 1 else ""))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeflow", description="Pipeline-parallel training across MPI ranks. "
        "Launch training as `mpirun -n N pipeflow train CONFIG.toml`.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the GPT described by a TOML file")
    train.add_argument("config", help="TOML file with [engine], [model] and [train] tables")
    train.add_argument("--steps", type=int, help="override [train] steps")
    train.add_argument("--save-dir", help="override [train] save_dir (checkpoint folder)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in save_dir")
    train.add_argument("--trace", metavar="FILE.json",
                       help="write the last step's per-rank instruction timeline as a "
                       "Chrome/Perfetto trace")
    train.set_defaults(func=_train)

    show = sub.add_parser("schedule", help="print a schedule's pipeline order, bubble and stash")
    show.add_argument("--stages", "-p", type=int, default=4)
    show.add_argument("--microbatches", "-m", type=int, default=8)
    show.add_argument("--schedule", "-s", default="1f1b",
                      help="1f1b, gpipe, interleaved, zb-h1 or zbv")
    show.add_argument("--chunks", "-v", type=int, default=None,
                      help="model chunks per rank (interleaved; default 2; zbv: 2)")
    show.set_defaults(func=_schedule)

    try:
        from pipeflow.planner import cli as planner_cli
    except ImportError:  # pragma: no cover - the planner is optional at import time
        planner_cli = None
    if planner_cli is not None:
        plan = sub.add_parser("plan", help="from a compute budget and a cluster to a launch "
                              "command (Chinchilla sizing, cost model, search)")
        planner_cli.add_arguments(plan)
        plan.set_defaults(func=planner_cli.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
