"""The distributed optimizer (`Config.shard_optimizer`): step time against unsharded, the
all-gather overlapped with the next step's forwards against waited in the step, and bytes
per parameter against the formula.

# Run: mpirun -n 4 python benchmarks/bench_shard.py   (writes BENCHMARKS.md; --help)

On 4 ranks, grids pipeline 2 x data 2 and 1 x 4, bf16 + AdamW, buckets of `--bucket-mb`
(small: several a stage, as a large model has): an unsharded engine and two sharded ones, one
waiting for its all-gathers at the step's end (`shards.overlap_gather = False`) and one
leaving them to the next step's forwards (the default), are built side by side and take
blocks of steps in turn, rotating which goes first every round, so a slow spell of a shared
machine falls on all alike. Per sharded step it also counts the optimizer's `step()` calls
and times `ShardedOptimizer.step` on the host (the optimizer, the cast and the gathers'
launch; waited: their completion too). The bytes per parameter are
`engine.memory_report()`'s model states (masters + gradient buffers + optimizer state), the
largest over the ranks, against Megatron-Core's 6 + 12/d (which counts the 2 bytes of bf16
weights and no separate block of the summed gradient) and against pipeflow's own layout,
4 + 16/d without the weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (DEFAULT_OUTPUT, add_model_args, busy_note, header,  # noqa: E402
                     load_average, run_main, time_block, write_section)

import pipeflow as pf  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss  # noqa: E402

__all__ = ["main"]

WORLD = MPI.COMM_WORLD


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


KINDS = ("plain", "waited", "overlapped")     # unsharded; sharded, gathers waited in the
                                             # step; sharded, gathers in the next forwards


def _engines(cfg: GPTConfig, pipeline: int, data: int, args) -> dict:
    """The three engines of the same model on the whole world, each sharded one with a
    counter of its optimizer's steps and of its `ShardedOptimizer.step`'s host seconds."""
    layers = gpt_layers(cfg)
    engines = {}
    for kind in KINDS:
        engines[kind] = e = pf.Engine(
            layers, gpt_loss, _adamw,
            pf.Config(pipeline=pipeline, data=data, microbatches=args.microbatches,
                      precision="bf16", bucket_mb=args.bucket_mb,
                      shard_optimizer=kind != "plain"))
        if kind != "plain":
            e.stage.shards.overlap_gather = kind == "overlapped"
            _count(e)
    return engines


def _count(engine) -> None:
    """`engine.counts`: optimizer steps and host seconds in `ShardedOptimizer.step`."""
    shards, counts = engine.stage.shards, {"steps": 0, "seconds": 0.0}
    engine.counts = counts
    shards.optimizer.register_step_post_hook(
        lambda *a: counts.__setitem__("steps", counts["steps"] + 1))
    real = shards.step

    def step(coef: float = 1.0) -> None:
        t0 = time.perf_counter()
        real(coef)
        counts["seconds"] += time.perf_counter() - t0
    shards.step = step


def _grid(cfg: GPTConfig, pipeline: int, data: int, args) -> dict:
    """Per-step seconds of each engine over rotating rounds, counts and the memory."""
    engines = _engines(cfg, pipeline, data, args)
    g = torch.Generator().manual_seed(0)
    batch = data * args.microbatches * args.micro_batch
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    times = {kind: [] for kind in KINDS}
    for kind in KINDS:                              # warm-up: allocations, first step
        engines[kind].train_step(x, y)
    for kind in KINDS[1:]:
        engines[kind].counts.update(steps=0, seconds=0.0)
    for r in range(args.rounds):
        for kind in KINDS[r % 3:] + KINDS[:r % 3]:
            e = engines[kind]
            times[kind].append(time_block(lambda k: e.train_step(x, y), 0, args.steps, True))
    steps = args.rounds * args.steps
    counts = {kind: WORLD.allgather(engines[kind].counts) for kind in KINDS[1:]}
    buckets = max(WORLD.allgather(len(engines["overlapped"].stage.shards.buckets)))
    reports = {kind: WORLD.allgather(engines[kind].memory_report()) for kind in engines}
    for e in engines.values():
        e.close()
    states = {kind: max(r["bytes_per_parameter"]["model_states"] for r in reports[kind])
              for kind in reports}
    med = {kind: statistics.median(times[kind]) for kind in KINDS}
    return {"grid": f"{pipeline} x {data}", "d": data, "buckets": buckets, "s": med,
            "ratio": statistics.median(o / p for o, p in zip(times["overlapped"],
                                                             times["plain"])),
            "best_ratio": min(times["overlapped"]) / min(times["plain"]),
            "opt_steps": max(c["steps"] for c in counts["overlapped"]) / steps,
            "step_ms": {kind: 1e3 * max(c["seconds"] for c in counts[kind]) / steps
                        for kind in counts},
            "plain_states": states["plain"], "shard_states": states["overlapped"]}


def _report(rows: list[dict], args, before: float, after: float) -> str:
    lines = ["## Distributed optimizer (shard_optimizer)", "", header(WORLD.size), "",
             f"GPT {args.layers} layers x {args.width} wide, seq {args.seq}, bf16, AdamW, "
             f"buckets of {args.bucket_mb} MiB; {args.microbatches} micro-batches of "
             f"{args.micro_batch}; {args.rounds} rounds of {args.steps} steps each, the "
             f"three engines rotating. One torch thread a rank; {WORLD.size} ranks on "
             f"{os.cpu_count()} cores.", "",
             "| grid | buckets a stage | unsharded s/step | sharded, gather waited in the "
             "step | sharded, gather in the next forwards | overlapped / unsharded (median, "
             "best) | optimizer.step() a step | ShardedOptimizer.step host ms (waited, "
             "overlapped) | model states B/param unsharded | sharded | 4 + 16/d | 6 + 12/d |",
             "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        d, s, ms = r["d"], r["s"], r["step_ms"]
        lines.append(f"| {r['grid']} | {r['buckets']} | {s['plain']:.4f} | {s['waited']:.4f} | "
                     f"{s['overlapped']:.4f} | {r['ratio']:.3f} ({r['best_ratio']:.3f}) | "
                     f"{r['opt_steps']:g} | {ms['waited']:.1f}, {ms['overlapped']:.1f} | "
                     f"{r['plain_states']:.2f} | {r['shard_states']:.2f} | {4 + 16 / d:.2f} | "
                     f"{6 + 12 / d:.2f} |")
    lines += ["", "One `optimizer.step()` a step over every block; the all-gathers launched at "
              "its end in the next forwards' order and waited by each layer's forward "
              "pre-hook, so the step's own host time leaves out their completion (on a GPU "
              "they run on the communication stream under the next forwards). Before "
              "(issue 45): one `optimizer.step()` a bucket, every pending gather tested after "
              "each bucket's launch (n(n + 1)/2 tests a step), all waited in the step.", "",
              "Model states = masters + gradient buffers + optimizer state per parameter "
              "of the stage (the fullest rank), bf16 weights not counted; Megatron-Core's "
              "6 + 12/d counts the weights' 2 bytes and has no separate gradient block, "
              "pipeflow keeps the whole fp32 gradient (micro-batches accumulate into it) and "
              "the reduce-scatter's block (4/d).", "", busy_note(before, after, WORLD.size)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, layers=4, width=64, heads=4, seq=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=0.02)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    if WORLD.size != 4:
        raise SystemExit(f"bench_shard.py runs on 4 ranks (grids 2 x 2 and 1 x 4), found "
                         f"{WORLD.size}: mpirun -n 4 python benchmarks/bench_shard.py")
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq)
    before = load_average()
    rows = [_grid(cfg, p, d, args) for p, d in ((2, 2), (1, 4))]
    after = load_average()
    if WORLD.rank == 0:
        text = _report(rows, args, before, after)
        print(text)
        write_section(args.output, text, "shard")


if __name__ == "__main__":
    run_main(main)
