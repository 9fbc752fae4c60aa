"""Throughput of pipeline x data grids (2x1, 1x2, 2x2) on one global batch, side by side."""

# Run: mpirun -n 4 python benchmarks/bench_grids.py   (writes BENCHMARKS.md; --help for sizes)
#
# Every grid trains the same GPT on the same global batches. A grid of fewer ranks than the
# job runs on the first ranks (an MPI sub-communicator handed to the engine as `comm=`) while
# the others wait in a sleeping barrier, so they take no CPU from it. The grids alternate
# within each round, in an order rotated every round, so that a slow spell of the machine
# falls on all of them alike.

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (DEFAULT_OUTPUT, add_model_args, busy_note, header,  # noqa: E402
                     load_average, run_main, sync, time_block, write_section)

import pipeflow as pf  # noqa: E402
from pipeflow.train.data import Batches, load_corpus  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss, num_parameters  # noqa: E402

__all__ = ["main", "Grid", "parse_grid"]

SECTION = "grids"
COMM = MPI.COMM_WORLD
# Grids differ only in the order of fp32 sums (stages, replicas, micro-batch sizes). AdamW's
# first update is about lr·sign(g): rounding moves it by ~1e-6 where |g| is near AdamW's eps,
# a wrong gradient (a replica not averaged, a stage's gradient lost) by ~lr.
PARAM_TOL_LR = 0.1          # the tolerance, as a fraction of the learning rate


def parse_grid(text: str) -> tuple[int, int]:
    """Parse "2x1" as (pipeline 2, data 1)."""
    try:
        p, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"a grid is PIPELINExDATA such as 2x1, found {text!r}") from None
    if p < 1 or d < 1:
        raise SystemExit(f"a grid needs pipeline >= 1 and data >= 1, found {text!r}")
    return p, d


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=16, help="global batch, sequences")
    p.add_argument("--microbatches", type=int, default=4, help="per replica")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--grids", default="2x1,1x2,2x2",
                   help="pipeline x data grids; the first is the reference of the ratios")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per grid, after the "
                   "first (checked) step")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=3, help="timed steps per grid per round")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="'' to skip writing")
    return p.parse_args()


class Grid:
    """One `pipeline x data` engine on the first `pipeline · data` ranks of the job."""

    def __init__(self, pipeline: int, data: int, layers, args: argparse.Namespace,
                 batches: Batches) -> None:
        self.pipeline, self.data = pipeline, data
        self.name = f"{pipeline}x{data}"
        self.ranks = pipeline * data
        self.microbatches = args.microbatches      # per replica
        # Collective over the world: the ranks outside the grid get COMM_NULL.
        self.comm = COMM.Split(0 if COMM.rank < self.ranks else MPI.UNDEFINED, COMM.rank)
        self.active = self.comm != MPI.COMM_NULL
        self.batches = batches
        self.engine: pf.Engine | None = None
        if self.active:
            config = pf.Config(pipeline=pipeline, data=data, microbatches=args.microbatches,
                               schedule="1f1b", seed=0)
            self.engine = pf.Engine(layers, gpt_loss,
                                    lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                                    config, comm=self.comm)
        self.loss: float | None = None

    def step(self, k: int) -> None:
        # Every rank passes the whole global batch; the engine takes its replica's shard.
        assert self.engine is not None
        self.loss = self.engine.train_step(*self.batches.batch(k))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.comm.Free()


def first_step_check(grids: list[Grid]) -> list[dict[str, float]]:
    """Each grid's first step on batch 0, from the same initial weights: its loss and the
    largest parameter difference from the reference grid's (the first) after the update.
    Figures are valid on rank 0."""
    ref_state = None
    out = []
    for g in grids:
        sync()
        state = None
        if g.active:
            g.step(0)
            state = g.engine.gather_state_dict()
        sync()
        if COMM.rank != 0:
            out.append({})
            continue
        if ref_state is None:
            ref_state = state
        if state.keys() != ref_state.keys():
            raise SystemExit(f"grid {g.name} holds other parameters than {grids[0].name}: "
                             f"{sorted(set(state) ^ set(ref_state))[:5]}")
        out.append(dict(loss=g.loss,
                        dparam=max((state[k] - ref_state[k]).abs().max().item()
                                   for k in state)))
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)    # one core per rank; the machine decides the rest
    shapes = [parse_grid(s) for s in args.grids.split(",") if s.strip()]
    need = max(p * d for p, d in shapes)
    if COMM.size < need:
        raise SystemExit(f"grids {args.grids} need {need} ranks, the job has {COMM.size}; "
                         f"launch with `mpirun -n {need}` (or drop the larger grids)")
    for p, d in shapes:
        if args.batch % (d * args.microbatches):
            raise SystemExit(f"--batch {args.batch} does not divide into {d} replicas x "
                             f"{args.microbatches} micro-batches (grid {p}x{d})")
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq)
    layers = gpt_layers(cfg)
    if any(p > len(layers) for p, _ in shapes):
        raise SystemExit(f"a grid has more stages than the model's {len(layers)} layers")
    batches = Batches(load_corpus(), args.batch, cfg.seq_len, seed=0)
    rank0 = COMM.rank == 0
    load_before = load_average()
    if rank0:
        print(f"GPT {num_parameters(cfg) / 1e6:.2f}M parameters, global batch {args.batch} x "
              f"{cfg.seq_len}, {args.microbatches} micro-batches per replica, grids "
              f"{[f'{p}x{d}' for p, d in shapes]} on {COMM.size} ranks", flush=True)

    grids = [Grid(p, d, layers, args, batches) for p, d in shapes]
    check = first_step_check(grids)
    if rank0:
        print("first step: " + "  ".join(f"{g.name} loss {c['loss']:.5f} "
                                         f"dparam {c['dparam']:.2g}"
                                         for g, c in zip(grids, check)), flush=True)
    next_batch = 1
    for g in grids:
        time_block(g.step, next_batch, args.warmup, g.active)
    next_batch += args.warmup

    times: dict[str, list[float]] = {g.name: [] for g in grids}
    for r in range(args.rounds):
        shift = r % len(grids)
        for g in grids[shift:] + grids[:shift]:
            times[g.name].append(time_block(g.step, next_batch, args.steps, g.active))
        next_batch += args.steps      # every grid sees the same batches in a round
        if rank0:
            print(f"round {r}: " + "  ".join(f"{n} {t[-1] * 1e3:.0f} ms"
                                             for n, t in times.items()), flush=True)
    load_after = load_average()

    if rank0:
        report = make_report(args, cfg, grids, times, check, load_before, load_after)
        print(report, flush=True)
        if args.output:
            write_section(args.output, report, SECTION)
            print(f"wrote {args.output}")
    sync()
    for g in grids:
        g.close()


def ideal(g: Grid) -> float:
    """Relative throughput on free cores from the work split and the bubble alone."""
    return g.ranks * 1.0 / (1 + (g.pipeline - 1) / g.microbatches)


def make_report(args, cfg: GPTConfig, grids: list[Grid], times: dict[str, list[float]],
                check: list[dict[str, float]], load_before: float,
                load_after: float) -> str:
    tokens = args.batch * cfg.seq_len
    m = args.microbatches
    ref = grids[0].name
    med = {n: statistics.median(t) for n, t in times.items()}
    best = {n: min(t) for n, t in times.items()}
    cores = os.cpu_count() or 1
    rows = []
    for g, c in zip(grids, check):
        over = " (oversubscribed)" if g.ranks > cores else ""
        rows.append(
            f"| {g.name}{over} | {g.ranks} | {m} × {args.batch // (g.data * m)} | "
            f"{med[g.name] * 1e3:.0f} | {tokens / med[g.name]:.0f} | "
            f"**{med[ref] / med[g.name]:.2f}** | {best[g.name] * 1e3:.0f} | "
            f"{best[ref] / best[g.name]:.2f} | {ideal(g) / ideal(grids[0]):.2f} | "
            f"{c['loss']:.5f} | {c['dparam']:.1g} |")
    worst = max(c["dparam"] for c in check)
    tol = PARAM_TOL_LR * args.lr
    same = worst <= tol
    grad_mib = num_parameters(cfg) * 4 / 2**20
    crowded = [g.name for g in grids if g.ranks > cores]
    lines = [
        "## Grids: pipeline × data on one global batch (CPU, MPI)",
        "",
        header(COMM.size),
        "",
        f"GPT of {cfg.n_layers} layers, width {cfg.d_model}, {cfg.n_heads} heads, sequence "
        f"{cfg.seq_len}, {num_parameters(cfg) / 1e6:.2f}M parameters (tied embedding); global "
        f"batch {args.batch} ({tokens} tokens) per step, {m} micro-batches per replica, 1F1B, "
        f"AdamW, fp32, MPI backend, one torch thread per rank. Each grid runs on the first "
        f"pipeline × data ranks of the {COMM.size}-rank job (an MPI sub-communicator) while "
        f"the other ranks sleep in a barrier. Step times are medians over {args.rounds} "
        f"rounds of {args.steps} step(s) per grid after {args.warmup + 1} untimed step(s), "
        f"the grids interleaved within each round in an order rotated every round. "
        f"{busy_note(load_before, load_after, COMM.size)}",
        "",
        f"| grid (pipeline × data) | ranks | micro-batches × sequences per replica | median "
        f"step (ms) | tokens/s | throughput vs {ref} | best round (ms) | vs {ref}, best "
        f"rounds | ideal vs {ref} on free cores | first-step loss | max abs. Δparam vs {ref} "
        f"after step 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        (f"Every grid takes the same first update (max |Δparam| {worst:.1g} ≤ lr/10 = "
         f"{tol:.1g}; fp32 sums in another order), so the grids differ in speed only."
         if same else
         f"**The grids' first updates differ by up to {worst:.1g} (> lr/10 = {tol:.1g}): "
         f"they do not train the same model alike, and the speeds are not comparable.**"),
        "",
        f"Reading the figures. *Ideal* counts only each grid's share of the work (1/ranks) and "
        f"its 1F1B bubble, (p - 1)/(m + p - 1) of the step: throughput ∝ p·d·m/(m + p - 1). "
        f"It leaves out what data parallelism adds (an all-reduce of every gradient, "
        f"{grad_mib:.1f} MiB in fp32, between the replicas of each stage) and that a replica's "
        f"micro-batches are 1/d as large (smaller matrix products run less efficiently), and "
        f"it assumes a free core for every rank."
        + (f" {', '.join(crowded)} {'runs' if len(crowded) == 1 else 'run'} more ranks than "
           f"this machine's {cores} cores: "
           f"oversubscribed, several processes to a core, and MPI's waits spin, so "
           f"{'that figure measures' if len(crowded) == 1 else 'those figures measure'} "
           f"contention, not scaling; showing the scaling needs a machine with a free core "
           f"per rank." if crowded else ""),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
