"""The planner's calibrated step-time predictions against the engine's measured steps."""

# Run: mpirun -n 2 python benchmarks/planner_accuracy.py   (writes BENCHMARKS.md; --help)
#
# 1. Calibrate this machine for the benchmark's GPT (pipeflow.planner.calibrate): layer
#    times on rank 0 (one torch thread; the block and head also cut for tensor = 2), the
#    optimizer step, the MPI link by ping-pong and the tensor group's all-reduce.
# 2. Every grid the planner would consider for 2 ranks and the global batch (pipeline 1 or
#    2, data 1 or 2 when the engine reduces gradients, tensor 1 or 2 with and without
#    sequence parallelism, every micro-batch size, 1F1B, GPipe and ZB-H1): predict its step
#    time from the calibration, then run the real engine on it (1-rank grids on COMM_SELF
#    while rank 1 sleeps) and time its steps.
# 3. Report the error per grid, and whether the planner's first choice was the fastest.

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time

import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss
from pipeflow.planner.calibrate import calibrate, measure_layer_times
from pipeflow.planner.cost import PLANNED_SCHEDULES, Grid, estimate, schedule_chunks
from pipeflow.planner.hardware import Cluster
from pipeflow.planner.search import SearchOptions, divisors, search
from pipeflow.planner.shapes import Shape
from pipeflow.comm.waiting import sleeping_barrier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_model_args, write_section  # noqa: E402

COMM = MPI.COMM_WORLD
TARGET = 0.15
# ZBV runs 2p virtual stages, which the planner's p-stage partition (the one each engine
# here is built with, to compare like with like) cannot give: the one-chunk schedules only.
SCHEDULES = tuple(s for s in PLANNED_SCHEDULES if schedule_chunks(s) == 1)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch, sequences")
    p.add_argument("--max-micro-batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8,
                   help="interleaved rounds, each timing one step of every grid")
    p.add_argument("--quiet-wait", type=float, default=300,
                   help="seconds to wait, before each sample, for other processes to leave "
                        "the cores")
    p.add_argument("--tries", type=int, default=4,
                   help="attempts per sample before a disturbed one is kept (and marked)")
    p.add_argument("--tensor", default="1,2",
                   help="tensor degrees of the grids compared (comma-separated)")
    p.add_argument("--output", default="BENCHMARKS.md", help="'' to skip writing")
    p.add_argument("--section", default="planner-accuracy",
                   help="the BENCHMARKS.md section written (e.g. planner-accuracy-tensor for a "
                        "run of --tensor 2 alone, which keeps the other's figures)")
    return p.parse_args()


class Monitor:
    """CPU time other processes take while this benchmark measures (from /proc, Linux).

    The machine is shared: a sample during which other processes ran is not a measurement of
    the engine. `others(since)` is the CPU-seconds all processes but this job's ranks used
    since `since = snapshot()`; `wait_quiet` sleeps until a short window shows none.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")

    def snapshot(self) -> tuple[int, int]:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
        busy = sum(cpu) - cpu[3] - cpu[4]             # all but idle and iowait
        own = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                own += int(fields[11]) + int(fields[12])  # utime, stime of every thread
            except OSError:
                pass
        return busy, own

    def others(self, since: tuple[int, int]) -> float:
        busy, own = self.snapshot()
        return max(0, (busy - since[0]) - (own - since[1])) / self.tick

    def wait_quiet(self, limit: float) -> bool:
        """Sleep until 0.5 s pass with other processes using under 5% of a core."""
        deadline = time.time() + limit
        while True:
            start = self.snapshot()
            time.sleep(0.5)
            if self.others(start) <= 0.025:
                return True
            if time.time() > deadline:
                return False
            time.sleep(2)


def data_parallel_works(shape: Shape, batch: int) -> bool:
    """Probe: after one step on different shards, do both replicas hold the same weights?
    Without a gradient all-reduce AdamW's first step moves them apart."""
    layers = gpt_layers(_gpt(shape))
    engine = pf.Engine(layers, gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                       pf.Config(pipeline=1, data=2, microbatches=1), comm=COMM)
    x, y = _batch(shape, batch, seed=1)
    engine.train_step(x, y)
    total = float(sum(p.detach().double().sum() for p in engine.stage.module.parameters()))
    engine.close()
    views = COMM.allgather(total)
    return abs(views[0] - views[1]) <= 1e-9 * max(1.0, abs(views[0]))


def _gpt(shape: Shape) -> GPTConfig:
    return GPTConfig(n_layers=shape.n_layers, d_model=shape.d_model, n_heads=shape.n_heads,
                     seq_len=shape.seq_len, vocab_size=shape.vocab_size)


def _batch(shape: Shape, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, shape.vocab_size, (batch, shape.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def build_engine(shape: Shape, grid: Grid, boundaries: list[int]):
    """The engine for `grid` on the ranks it uses (None elsewhere), warmed up by one step."""
    comm = COMM if grid.gpus == COMM.size else (MPI.COMM_SELF if COMM.rank == 0 else None)
    if comm is None:
        return None
    config = pf.Config(pipeline=grid.pipeline, data=grid.data, tensor=grid.tensor,
                       sequence_parallel=grid.sequence_parallel,
                       microbatches=grid.microbatches, schedule=grid.schedule,
                       partition=boundaries)
    return pf.Engine(gpt_layers(_gpt(shape)), gpt_loss,
                     lambda ps: torch.optim.AdamW(ps, lr=1e-4), config, comm=comm)


def sample(monitor: Monitor, args, fn) -> tuple[float | None, bool]:
    """Run `fn()` (on every rank; it returns seconds on rank 0) until a run sees other
    processes take no more than 2% of its time, at most `args.tries` times. Returns
    (seconds, clean) on rank 0. Waiting ranks sleep: a spinning one would disturb the rest."""
    for attempt in range(args.tries):
        if COMM.rank == 0:
            monitor.wait_quiet(args.quiet_wait)
        sleeping_barrier(COMM)
        before = monitor.snapshot()
        seconds = fn()
        clean = COMM.rank != 0 or monitor.others(before) <= 0.02 * seconds
        sleeping_barrier(COMM)
        clean = COMM.bcast(clean, root=0)
        if clean or attempt == args.tries - 1:
            return seconds, clean
    raise AssertionError("unreachable")


def time_step(engine, batch) -> float | None:
    """Seconds of one train_step on the ranks running `engine`; ranks outside it sleep."""
    sleeping_barrier(COMM)
    if engine is None:
        return None
    t0 = time.perf_counter()
    engine.train_step(*batch)
    return time.perf_counter() - t0


def main() -> int:
    args = parse_args()
    if COMM.size != 2:
        if COMM.rank == 0:
            print(f"planner_accuracy: run with exactly 2 ranks (`mpirun -n 2 python "
                  f"{sys.argv[0]}`), found {COMM.size}; timing needs one core per rank",
                  file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    log = (lambda msg: print(msg, flush=True)) if COMM.rank == 0 else None
    shape = Shape(args.layers, args.width, args.heads, args.seq, args.vocab)
    monitor = Monitor(COMM.allgather(os.getpid()))
    load_before = os.getloadavg()[0]
    if COMM.rank == 0:
        monitor.wait_quiet(args.quiet_wait)
    sleeping_barrier(COMM)
    sizes = [b for b in divisors(args.batch) if b <= args.max_micro_batch]
    tensors = tuple(int(t) for t in args.tensor.split(","))
    hw = calibrate(shape, comm=COMM, ranks_per_node=2, micro_batch_sizes=sizes, repeats=3,
                   log=log, tensors=tensors)
    dp = data_parallel_works(shape, args.batch)
    keep = (lambda g: True) if dp else (lambda g: g.data == 1)
    # Every grid that fits is measured: the exhaustive search ranks them all.
    options = SearchOptions("fp32", SCHEDULES, ("none",), args.max_micro_batch,
                            grid_filter=keep, prune=False, tensor=tensors)
    first = search(shape, Cluster(hw, 2, 2), args.batch, options)
    grids = [e.grid for e in first.ranked]
    bounds = {e.grid: e.boundaries for e in first.ranked}
    batch = _batch(shape, args.batch)
    # Engines stay alive across rounds: each round times one step of every grid in turn, so a
    # burst of load from elsewhere on the machine hits one sample of many grids, not all
    # samples of one.
    engines = {g: build_engine(shape, g, bounds[g]) for g in grids}
    for g in grids:
        time_step(engines[g], batch)                      # warm-up
    samples: dict[Grid, list[float]] = {g: [] for g in grids}
    disturbed: dict[Grid, int] = {g: 0 for g in grids}
    clean_times = None          # the layer calibration from undisturbed passes only
    any_times = None            # from every pass: used when none was undisturbed
    calib_passes = 0

    latest: dict[str, object] = {}

    def calibration_pass() -> float | None:
        if COMM.rank != 0:
            return None
        t0 = time.perf_counter()
        latest["times"] = measure_layer_times(shape, sizes, repeats=1, tensors=tensors)
        return time.perf_counter() - t0

    for r in range(args.rounds):
        for g in grids:
            t, clean = sample(monitor, args, lambda: time_step(engines[g], batch))
            if COMM.rank == 0:
                samples[g].append(t)
                disturbed[g] += not clean
        # The calibration is repeated every round, so that both sides of the comparison take
        # the fastest of as many undisturbed samples spread over the same stretch of time.
        _, clean = sample(monitor, args, calibration_pass)
        if COMM.rank == 0:
            lt = latest["times"]
            any_times = lt if any_times is None else any_times.fastest(lt)
        if COMM.rank == 0 and clean:
            clean_times = lt if clean_times is None else clean_times.fastest(lt)
            calib_passes += 1
        if log and (r + 1) % 2 == 0:
            log(f"round {r + 1}/{args.rounds} done")
    for engine in engines.values():
        if engine is not None:
            engine.close()
    if COMM.rank != 0:
        return 0
    # On a machine never quiet, both sides take the fastest of their disturbed samples alike.
    hw = dataclasses.replace(hw, layer_times=clean_times or any_times or hw.layer_times)
    cluster = Cluster(hw, gpus=2, gpus_per_node=2)
    final = search(shape, cluster, args.batch, options)
    choice = final.best.grid
    rows = []
    for g in grids:
        # Predicted with the partition the engine ran (the planner's, from the first
        # calibration); the final search's partition for the chosen grid is checked below.
        predicted = estimate(shape, cluster, g, "none", "fp32", bounds[g]).step_time_s
        measured = min(samples[g])
        rows.append((g, predicted, measured, statistics.median(samples[g]),
                     predicted / measured - 1, disturbed[g]))
    if final.best.boundaries != bounds[choice]:
        log(f"note: the final calibration partitions {choice.describe()} as "
            f"{final.best.boundaries}, the engine ran {bounds[choice]}")
    best_measured = min(rows, key=lambda row: row[2])
    text = report(args, shape, hw, dp, rows, choice, best_measured, calib_passes,
                  (load_before, os.getloadavg()[0]))
    print(text)
    if args.output:
        write_section(args.output, text, args.section)
    return 0


def report(args, shape: Shape, hw, dp: bool, rows, choice: Grid, best_measured,
           calib_passes: int, load: tuple[float, float]) -> str:
    errors = [abs(r[4]) for r in rows]
    within = sum(e <= TARGET for e in errors)
    measured_of = {r[0]: r[2] for r in rows}
    predicted_of = {r[0]: r[1] for r in rows}
    order = sorted(rows, key=lambda r: r[2])
    rank = [r[0] for r in order].index(choice) + 1
    lt = hw.layer_times
    rows = sorted(rows, key=lambda r: r[1])
    lines = [
        "## Planner: predicted against measured step time (CPU, calibrated"
        + ("" if args.tensor == "1,2" else f", tensor {args.tensor}") + ")",
        "",
        f"`mpirun -n 2 python benchmarks/planner_accuracy.py` · {datetime.date.today()} · "
        f"torch {torch.__version__} · {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} cores) · Python {platform.python_version()}",
        "",
        f"GPT of {shape.n_layers} layers, width {shape.d_model}, {shape.n_heads} heads, "
        f"sequence {shape.seq_len}, vocabulary {shape.vocab_size}; global batch {args.batch} "
        f"sequences; AdamW; one torch thread per rank. The planner is calibrated first "
        f"(`pipeflow.planner.calibrate`: each layer kind's forward and backward at micro-batch "
        f"sizes {sorted({r[0].micro_batch_size for r in rows})}, one torch thread; the "
        f"optimizer at {lt.optimizer_s_per_param * 1e9:.2f} ns/parameter; the MPI link at "
        f"{hw.intra_node_bandwidth / 1e9:.2f} GB/s and {hw.intra_node_latency * 1e6:.1f} µs "
        f"latency by ping-pong"
        + (f"; at tensor 2 the block and head cut as one rank holds them, and the tensor "
           f"group's all-reduce on the engine's MPI communicator at "
           f"{hw.tensor_bandwidth / 1e9:.2f} GB/s and {hw.tensor_latency * 1e6:.1f} µs a "
           f"ring step" if hw.tensor_bandwidth is not None else "")
        + "), then predicts every grid it considers for 2 ranks, and the "
        f"engine runs each: one warm-up step, then {args.rounds} rounds timing one step of "
        f"every grid, each round followed by a repeat of the layer calibration. The machine "
        f"is shared with other jobs, so every sample waits for the other processes to leave "
        f"the cores and is retried (up to {args.tries} times) when they took more than 2% of "
        f"its time (CPU accounting from /proc); measured = the fastest step, predicted = from "
        + (f"the fastest samples of the {calib_passes} undisturbed calibration passes"
           if calib_passes else
           f"the fastest samples of all {args.rounds} calibration passes (none was "
           f"undisturbed)")
        + "; the median step alongside; † marks a grid with a disturbed sample kept after "
          f"the retries. Load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at "
          f"the end, on {os.cpu_count()} cores: a grid that synchronises its ranks often "
          f"(the tensor group's collectives, several per layer) waits, each time, until both "
          f"ranks hold a core again."
        + ("" if dp else " Data-parallel grids are left out: this engine does not yet "
                         "all-reduce gradients across replicas (checked by a probe)."),
        "",
        "| grid | predicted (ms) | measured (ms) | median (ms) | error |",
        "|---|---:|---:|---:|---:|",
    ]
    for g, pred, meas, med, err, bad in rows:
        mark = (" †" if bad else "") + (" **planner's choice**" if g == choice else "")
        lines.append(f"| {g.describe()}{mark} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | "
                     f"{med * 1e3:.1f} | {err:+.1%} |")
    lines += [
        "",
        f"**{within} of {len(rows)} grids within ±{TARGET:.0%}**; mean |error| "
        f"{statistics.mean(errors):.1%}, largest {max(errors):.1%}.",
        "",
        f"Planner's first choice: {choice.describe()} ({measured_of[choice] * 1e3:.1f} ms "
        f"measured). Measured best: {best_measured[0].describe()} "
        f"({best_measured[2] * 1e3:.1f} ms). "
        + ("**The planner's choice was the measured best.**" if choice == best_measured[0] else
           f"The planner's choice ranked {rank} of {len(rows)} measured, "
           f"{measured_of[choice] / best_measured[2] - 1:+.1%} slower than the best, which "
           f"the planner had predicted "
           f"{predicted_of[best_measured[0]] / predicted_of[choice] - 1:+.1%} slower than its "
           f"choice."),
    ]
    return "\n".join(lines)




if __name__ == "__main__":
    sys.exit(main())
