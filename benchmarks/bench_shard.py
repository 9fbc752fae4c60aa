"""The distributed optimizer (`Config.shard_optimizer`): step time against unsharded, and
bytes per parameter against the formula.

# Run: mpirun -n 4 python benchmarks/bench_shard.py   (writes BENCHMARKS.md; --help)

On 4 ranks, grids pipeline 2 x data 2 and 1 x 4, bf16 + AdamW: a sharded and an unsharded
engine are built side by side and take blocks of steps in turn, alternating which goes
first every round, so a slow spell of a shared machine falls on both alike. The bytes per
parameter are `engine.memory_report()`'s model states (masters + gradient buffers +
optimizer state), the largest over the ranks, against Megatron-Core's 6 + 12/d (which counts
the 2 bytes of bf16 weights and no separate block of the summed gradient) and against
pipeflow's own layout, 4 + 16/d without the weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

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


def _engines(cfg: GPTConfig, pipeline: int, data: int, microbatches: int):
    """A sharded and an unsharded engine of the same model on the whole world."""
    layers = gpt_layers(cfg)
    return {shard: pf.Engine(layers, gpt_loss, _adamw,
                             pf.Config(pipeline=pipeline, data=data, microbatches=microbatches,
                                       precision="bf16", shard_optimizer=shard))
            for shard in (False, True)}


def _grid(cfg: GPTConfig, pipeline: int, data: int, args) -> dict:
    """Per-step seconds of each engine over alternating rounds, and the sharded memory."""
    engines = _engines(cfg, pipeline, data, args.microbatches)
    g = torch.Generator().manual_seed(0)
    batch = data * args.microbatches * args.micro_batch
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    times = {False: [], True: []}
    for shard in (False, True):                     # warm-up: allocations, first step
        engines[shard].train_step(x, y)
    for r in range(args.rounds):
        for shard in ((False, True) if r % 2 == 0 else (True, False)):
            e = engines[shard]
            times[shard].append(time_block(lambda k: e.train_step(x, y), 0, args.steps, True))
    reports = {shard: WORLD.allgather(engines[shard].memory_report()) for shard in engines}
    for e in engines.values():
        e.close()
    states = {shard: max(r["bytes_per_parameter"]["model_states"] for r in reports[shard])
              for shard in reports}
    return {"grid": f"{pipeline} x {data}", "d": data,
            "plain_s": statistics.median(times[False]), "shard_s": statistics.median(times[True]),
            "best_ratio": min(times[True]) / min(times[False]),
            "plain_states": states[False], "shard_states": states[True]}


def _report(rows: list[dict], args, before: float, after: float) -> str:
    lines = ["## Distributed optimizer (shard_optimizer)", "", header(WORLD.size), "",
             f"GPT {args.layers} layers x {args.width} wide, seq {args.seq}, bf16, AdamW; "
             f"{args.microbatches} micro-batches of {args.micro_batch}; {args.rounds} rounds "
             f"of {args.steps} steps each, sharded and unsharded alternating. One torch "
             f"thread a rank; {WORLD.size} ranks on {os.cpu_count()} cores.", "",
             "| grid | unsharded s/step | sharded s/step | ratio (median) | ratio (best "
             "rounds) | model states B/param unsharded | sharded | 4 + 16/d | 6 + 12/d |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["d"]
        lines.append(f"| {r['grid']} | {r['plain_s']:.4f} | {r['shard_s']:.4f} | "
                     f"{r['shard_s'] / r['plain_s']:.3f} | {r['best_ratio']:.3f} | "
                     f"{r['plain_states']:.2f} | {r['shard_states']:.2f} | {4 + 16 / d:.2f} | "
                     f"{6 + 12 / d:.2f} |")
    lines += ["", "Model states = masters + gradient buffers + optimizer state per parameter "
              "of the stage (the fullest rank), bf16 weights not counted; Megatron-Core's "
              "6 + 12/d counts the weights' 2 bytes and has no separate gradient block, "
              "pipeflow keeps the whole fp32 gradient (micro-batches accumulate into it) and "
              "the reduce-scatter's block (4/d).", "", busy_note(before, after, WORLD.size)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, layers=4, width=128, heads=4, seq=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
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
