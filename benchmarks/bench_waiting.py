"""How ranks wait on MPI: spinning inside MPI against yielding the core (`Config.wait`)."""

# Run: mpirun -n 4 python benchmarks/bench_waiting.py   (and -n 2; each job size rewrites its
# own section of BENCHMARKS.md; --output '' only prints).
#
# On purpose this may run more ranks than cores: that is the case `Config.wait = "auto"`
# yields in. One pipeline over every rank of the job (interleaved, two chunks a rank) trains
# a small GPT, once over MPI and once over gloo (torch.distributed's CPU transport, the NCCL
# code path: headers over MPI, tensors over TCP). Both policies run on the same engine
# (`pipeflow.comm.waiting.use` switches them between steps), alternated within every round, in an
# order rotated each round. Each step is timed alone, from a common start to a common end.

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
from pipeflow import waiting  # noqa: E402
from pipeflow.train.data import Batches, load_corpus  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss, num_parameters  # noqa: E402

COMM = MPI.COMM_WORLD
POLICIES = ("spin", "yield")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p, layers=8, width=128, heads=4, seq=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--backends", default="mpi,gloo")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="timed steps per policy per round")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="'' to skip writing")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    p = COMM.size
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq)
    batches = Batches(load_corpus(), args.batch, cfg.seq_len, seed=0)
    backends = [b for b in args.backends.split(",") if b]
    engines = {b: pf.Engine(gpt_layers(cfg), gpt_loss, lambda ps: torch.optim.AdamW(ps, 1e-3),
                            pf.Config(pipeline=p, microbatches=2 * p, schedule="interleaved",
                                      virtual_stages=2, backend=b))
               for b in backends}
    topo = next(iter(engines.values())).stage.topo
    auto = waiting.choose("auto", topo.local_size, topo.local_cores)
    runs = [(b, w) for b in backends for w in POLICIES]
    times: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
    load_before = load_average()
    def timed(backend: str, wait: str, batch: int) -> float:
        """One step on batch `batch`, alone, under `wait`: seconds from a common start."""
        waiting.use(wait)
        return time_block(lambda j: engines[backend].train_step(*batches.batch(j)), batch, 1,
                          True)

    for k, (b, w) in enumerate(runs):          # warm-up: one step each
        timed(b, w, k)
    for r in range(args.rounds):
        shift = r % len(runs)
        for b, w in runs[shift:] + runs[:shift]:
            times[(b, w)] += [timed(b, w, 100 + r * args.steps + i) for i in range(args.steps)]
        if COMM.rank == 0:
            print(f"round {r}: " + "  ".join(
                f"{b}/{w} {statistics.median(t[-args.steps:]) * 1e3:.0f} ms"
                for (b, w), t in times.items()), flush=True)
    load_after = load_average()
    if COMM.rank == 0:
        report = make_report(args, cfg, topo, auto, times, load_before, load_after)
        print(report, flush=True)
        if args.output:
            write_section(args.output, report, f"waiting-{p}")
            print(f"wrote {args.output}")
    sync()
    for e in engines.values():
        e.close()


def make_report(args, cfg, topo, auto, times, load_before, load_after) -> str:
    p = COMM.size
    rows = []
    for b in dict.fromkeys(b for b, _ in times):
        med = {w: statistics.median(times[(b, w)]) * 1e3 for w in POLICIES}
        worst = {w: max(times[(b, w)]) * 1e3 for w in POLICIES}
        rows.append(f"| {b} | {med['spin']:.0f} | {med['yield']:.0f} | "
                    f"**{med['spin'] / med['yield']:.2f}** | {worst['spin']:.0f} | "
                    f"{worst['yield']:.0f} |")
    return "\n".join([
        f"### {p} ranks on {topo.local_cores} cores: `auto` chooses {auto}",
        "",
        header(p),
        "",
        f"GPT {num_parameters(cfg) / 1e6:.2f}M parameters ({cfg.n_layers} layers, width "
        f"{cfg.d_model}, sequence {cfg.seq_len}), global batch {args.batch}, one pipeline of "
        f"{p} stages, interleaved with 2 chunks a rank, {2 * p} micro-batches. "
        f"{args.rounds} rounds x {args.steps} steps per cell, each step timed alone.",
        "",
        "| backend | spin, median ms | yield, median ms | spin / yield | spin, worst ms "
        "| yield, worst ms |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        busy_note(load_before, load_after, p),
    ])


if __name__ == "__main__":
    run_main(main)
