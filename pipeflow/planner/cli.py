"""`pipeflow plan`: budget and cluster in; model size, tokens, grid and launch command out."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
from typing import Any, Sequence

from pipeflow.planner.cost import PLANNED_SCHEDULES, PRECISIONS, RECOMPUTE
from pipeflow.planner.hardware import PRESETS, Cluster, Hardware, HardwareError, get_hardware
from pipeflow.planner.sizing import size_run, render_table, to_json, train_toml
from pipeflow.planner.scaling import METHODS, ScalingError, allocate
from pipeflow.planner.search import PlanError, SearchOptions
from pipeflow.planner.shapes import (DEFAULT_SEQ_LEN, DEFAULT_VOCAB, Shape, ShapeError,
                                     shape_for_params)

__all__ = ["add_arguments", "run", "main", "parse_number"]

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_number(text: str) -> float:
    """'1e21', '500M', '1.5B', '2T' -> float (k, M, B or G, T suffixes)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(
            f"expected a number such as 1e21, 500M, 1.5B or 2T, found {text!r}")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, found {text!r}")
    return value


def _int(text: str) -> int:
    value = parse_number(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, found {text!r}")
    return int(value)


def _list(allowed: Sequence[str]):
    def parse(text: str) -> list[str]:
        items = [t.strip().lower() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {list(allowed)}, found {text!r}")
        return items
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `pipeflow plan`."""
    budget = parser.add_argument_group("budget (one of; default: compute-optimal tokens for "
                                       "the given model)")
    budget.add_argument("--compute", type=parse_number, metavar="FLOPS",
                        help="training compute budget in FLOPs, e.g. 1e21")
    budget.add_argument("--days", type=float,
                        help="wall-clock days on all --gpus (FLOPs = GPUs × days × peak × MFU)")
    budget.add_argument("--tokens", type=parse_number,
                        help="training tokens for a fixed model (--params or --layers/--width)")
    budget.add_argument("--mfu", type=float,
                        help="model FLOPs utilisation for --days (default: the plan's own "
                             "prediction)")
    budget.add_argument("--method", choices=list(METHODS), default="hoffmann",
                        help="scaling law: hoffmann (approach 1, default), parametric "
                             "(approach 3), besiroglu (corrected approach 3)")
    model = parser.add_argument_group("model (default: a GPT shaped for the budget)")
    model.add_argument("--params", type=parse_number, help="parameter count, e.g. 1.3B")
    model.add_argument("--layers", type=_int, help="transformer blocks")
    model.add_argument("--width", type=_int, help="d_model")
    model.add_argument("--heads", type=_int, help="attention heads (default: head dim 64 or 128)")
    model.add_argument("--seq-len", type=_int, default=DEFAULT_SEQ_LEN)
    model.add_argument("--vocab", type=_int, default=DEFAULT_VOCAB)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=_int,
                         help="GPUs available (default: 8; with --calibrate the MPI ranks or "
                              "CPU cores)")
    cluster.add_argument("--gpu", default="h100",
                         help=f"GPU preset: {', '.join(sorted(PRESETS))} (default h100)")
    cluster.add_argument("--gpus-per-node", type=_int, default=None,
                         help="GPUs per node (default 8)")
    cluster.add_argument("--hardware-file", metavar="JSON",
                         help="hardware description, e.g. written by --calibrate "
                              "--save-hardware")
    cluster.add_argument("--efficiency", type=float,
                         help="fraction of peak FLOP/s the layers reach (preset: 0.5)")
    _add_search_arguments(parser.add_argument_group("search"))
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--write-config", metavar="FILE", help="write the TOML `pipeflow train` runs")
    out.add_argument("--top", type=_int, default=5, help="runners-up to show")
    cal = parser.add_argument_group("calibration")
    cal.add_argument("--calibrate", action="store_true",
                     help="measure this machine (layer time, optimizer; link bandwidth under "
                          "mpirun -n 2) and plan for it")
    cal.add_argument("--save-hardware", metavar="JSON",
                     help="with --calibrate: save the measured hardware for --hardware-file")


def _add_search_arguments(search: Any) -> None:
    """The options of the grid search: batch, precision, schedules, recompute, sharding."""
    search.add_argument("--global-batch-tokens", type=parse_number,
                        help="tokens per optimizer step (default: GPT-3's for the size)")
    search.add_argument("--global-batch", type=_int, metavar="SEQUENCES",
                        help="sequences per optimizer step (overrides --global-batch-tokens)")
    search.add_argument("--precision", choices=list(PRECISIONS), default=None,
                        help="bf16 (default) or fp32 (the default with --calibrate)")
    search.add_argument("--schedules", type=_list(PLANNED_SCHEDULES),
                        default=list(PLANNED_SCHEDULES),
                        help=f"schedules to consider (default {','.join(PLANNED_SCHEDULES)})")
    search.add_argument("--recompute", type=_list(RECOMPUTE), default=list(RECOMPUTE),
                        help="recomputation allowed per stage, cheapest first "
                             "(default none,selective,full)")
    search.add_argument("--max-micro-batch", type=_int, default=16)
    shard = search.add_mutually_exclusive_group()
    shard.add_argument("--shard-optimizer", dest="shard_optimizer", action="store_const",
                       const=True, default=None,
                       help="shard masters and optimizer state over the data group on every "
                            "grid with data > 1 (default: only where a grid fits no other way)")
    shard.add_argument("--no-shard-optimizer", dest="shard_optimizer", action="store_const",
                       const=False, help="never shard the optimizer")
    search.add_argument("--tensor", type=_degrees, default=None, metavar="T[,T...]",
                        help="tensor degrees to consider, e.g. 1 (no tensor axis) or 2,4 "
                             "(default: 1, 2, 4, ... up to the GPUs per node, dividing the "
                             "heads)")
    sp = search.add_mutually_exclusive_group()
    sp.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_const",
                    const=True, default=None,
                    help="at tensor > 1, always with sequence parallelism (default: the "
                         "search tries with and without)")
    sp.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_const",
                    const=False, help="at tensor > 1, never with sequence parallelism")


def _degrees(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]."""
    try:
        return [_int(t) for t in text.split(",") if t.strip()] or [_int(text)]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated tensor degrees such as 1 or 2,4, found {text!r}") from None


def _search_options(args: argparse.Namespace, precision: str) -> SearchOptions:
    """The grid search's options from the command line: the runners-up shown (`--top`) are
    ranked exactly."""
    return SearchOptions(precision=precision, schedules=tuple(args.schedules),
                         recompute=tuple(args.recompute), max_micro_batch=args.max_micro_batch,
                         shard_optimizer=args.shard_optimizer, rank=max(0, args.top) + 1,
                         tensor=None if args.tensor is None else tuple(args.tensor),
                         sequence_parallel=args.sequence_parallel)


def _shape_from_args(args: argparse.Namespace) -> Shape | None:
    if args.layers is None and args.width is None:
        if args.heads is not None:
            raise ShapeError("--heads needs --layers and --width")
        return None
    if args.layers is None or args.width is None:
        raise ShapeError(f"a model shape needs both --layers and --width, found --layers "
                         f"{args.layers} --width {args.width}")
    if args.params is not None:
        raise ShapeError("give --params or --layers/--width, not both")
    if args.heads is None and args.width % 64:
        raise ShapeError(f"--width {args.width}: heads of 64 or 128 need a width that is a "
                         f"multiple of 64 (e.g. {max(64, round(args.width / 64) * 64)}), or "
                         f"give --heads")
    heads = args.heads or max(1, args.width // (128 if args.width % 128 == 0
                                                and args.width >= 2048 else 64))
    return Shape(args.layers, args.width, heads, args.seq_len, args.vocab)


def _world() -> tuple[object | None, int, int]:
    """(communicator, rank, size) when running under mpirun, else (None, 0, 1)."""
    if not any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                                          "PMI_SIZE")):
        return None, 0, 1
    from mpi4py import MPI
    return MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _calibrated_cluster(args: argparse.Namespace,
                        shape: Shape | None) -> tuple[Cluster | None, Shape]:
    """Measure this machine on the model to plan (sized from the request when not given);
    (None, shape) on every MPI rank but 0, which plans."""
    if args.days is not None:
        raise PlanError("--calibrate sizes the model before measuring it: give --compute, "
                        "--params or --layers/--width instead of --days")
    comm, rank, size = _world()
    if shape is None:
        if args.params is not None:
            shape = shape_for_params(args.params, args.seq_len, args.vocab)
        elif args.compute is not None:
            shape = shape_for_params(allocate(args.compute, args.method).params,
                                     args.seq_len, args.vocab)
        else:
            raise PlanError("--calibrate needs a model to measure: give --compute, "
                            "--params or --layers/--width (small: it runs on this CPU)")
    from pipeflow.logs import get_logger
    from pipeflow.planner.calibrate import calibrate
    gpus = args.gpus or (size if size > 1 else (os.cpu_count() or 1))
    hw = calibrate(shape, comm=comm, ranks_per_node=gpus,
                   log=get_logger(__name__).info if rank == 0 else None)
    if rank != 0:
        return None, shape
    if args.save_hardware:
        hw.save(args.save_hardware)
    return Cluster(hw, gpus, gpus if args.gpus_per_node is None else args.gpus_per_node), shape


def _plan(args: argparse.Namespace, rank: int) -> int:
    shape = _shape_from_args(args)
    if args.gpus is not None and args.gpus < 1:
        raise PlanError(f"--gpus must be at least 1, found {args.gpus}: a plan runs on "
                        f"pipeline × data × tensor ≥ 1 GPUs. {_what_fits(args)}")
    precision = args.precision or ("fp32" if args.calibrate else "bf16")
    if args.calibrate:
        cluster, shape = _calibrated_cluster(args, shape)
        if cluster is None:
            return 0                                  # rank 0 plans; the others measured
    else:
        if args.save_hardware:
            raise PlanError("--save-hardware saves what --calibrate measures: add --calibrate")
        hw = Hardware.load(args.hardware_file) if args.hardware_file else get_hardware(args.gpu)
        gpus = args.gpus if args.gpus is not None else 8
        # 0 is a value to refuse (Cluster names it), not "unset": only None takes the default.
        per_node = min(8, gpus) or 1 if args.gpus_per_node is None else args.gpus_per_node
        cluster = Cluster(hw, gpus, per_node)
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise PlanError(f"--efficiency must be in (0, 1], found {args.efficiency}")
        import dataclasses
        cluster = dataclasses.replace(
            cluster, hardware=dataclasses.replace(cluster.hardware, efficiency=args.efficiency))
    sizing = size_run(cluster, compute=args.compute, days=args.days, params=args.params,
                     shape=shape, tokens=args.tokens, method=args.method,
                     seq_len=args.seq_len, vocab_size=args.vocab,
                     global_batch=args.global_batch, global_batch_tokens=args.global_batch_tokens,
                     mfu=args.mfu, options=_search_options(args, precision))
    config_path = args.write_config or "plan.toml"
    if args.write_config:
        # `pipeflow plan ...` and `python -m pipeflow.planner ...` alike: one "plan".
        given = sys.argv[2:] if sys.argv[1:2] == ["plan"] else sys.argv[1:]
        text = train_toml(sizing, shlex.join(["pipeflow", "plan", *given]))
        from pipeflow._io import atomic_write_bytes
        atomic_write_bytes(args.write_config, text.encode())
    if args.json:
        print(json.dumps(to_json(sizing, config_path, args.top)))
    else:
        print(render_table(sizing, config_path, args.top))
        if args.write_config:
            print(f"wrote {args.write_config}")
    return 0


def _what_fits(args: argparse.Namespace) -> str:
    """For --gpus 0: the same request planned on one GPU, or what that plan would need."""
    import copy
    trial = copy.copy(args)
    trial.gpus, trial.json, trial.write_config, trial.calibrate = 1, False, None, False
    trial.save_hardware = None
    try:
        _plan_quietly(trial)
    except (PlanError, ShapeError, HardwareError, ScalingError) as e:
        text = str(e)
        return text[text.index("It fits on"):] if "It fits on" in text else text
    return "The request fits on one GPU: try --gpus 1."


def _plan_quietly(args: argparse.Namespace) -> None:
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        _plan(args, 0)


def _is_rank_zero() -> bool:
    # Under mpirun every rank runs the command; one error report is enough.
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if key in os.environ:
            return os.environ[key] == "0"
    return True


def run(args: argparse.Namespace) -> int:
    """Run `pipeflow plan`; returns the exit code (2 for input no plan can satisfy)."""
    try:
        return _plan(args, 0)
    except (PlanError, ShapeError, HardwareError, ScalingError, OSError) as e:
        if _is_rank_zero():
            print(f"pipeflow plan: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeflow plan",
        description="Size a model for a compute budget (Chinchilla) and plan its pipeline × "
                    "data × tensor grid on a cluster.")
    add_arguments(parser)
    from pipeflow.logs import configured
    with configured():              # the calibration's lines, as `pipeflow plan` shows them
        return run(parser.parse_args(argv))
