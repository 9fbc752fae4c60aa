"""What freeing sent activations saves: the stash of each stage, with and without.

# Run: mpirun -n 2 python benchmarks/bench_free_outputs.py   (writes its BENCHMARKS.md section)

At every backward, the bytes the stash holds are measured: the stashed micro-batches'
outputs (their storage: zero once freed after the send) plus what autograd saved for their
backward (the saved-tensor meter). The peak over the step is reported per stage, with
`free_sent_outputs` off and on, and the trained weights are checked equal bit for bit.
"""

from __future__ import annotations

import argparse
import datetime

import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow import tree
from pipeflow.train.data import Batches, load_corpus
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss
from pipeflow.runtime.runner import Runner

from _common import add_model_args, cpu_model, write_section  # noqa: E402

COMM = MPI.COMM_WORLD


def held_at_backward(config: pf.Config, cfg: GPTConfig, batch: int, steps: int):
    """(peak stash bytes on this rank, the trained state) for one configuration."""
    peak = [0]
    original = Runner.backward

    def watching(self, act, st):
        outs = sum(t.untyped_storage().nbytes() for _, out in st.stash.values()
                   for t in tree.tensors(out) if t.requires_grad and t.dim())
        peak[0] = max(peak[0], outs + self.activation_meter.current)
        return original(self, act, st)

    Runner.backward = watching
    try:
        engine = pf.Engine(gpt_layers(cfg), gpt_loss,
                           lambda ps: torch.optim.SGD(ps, lr=0.1), config,
                           measure_activations=True)
        data = Batches(load_corpus(), batch, cfg.seq_len, seed=0)
        for i in range(steps):
            engine.train_step(*data.batch(i))
        state = engine.gather_state_dict()
        engine.close()
    finally:
        Runner.backward = original
    return peak[0], state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output", default="BENCHMARKS.md", help="'' to skip writing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq, dropout=0.0)
    rows = []
    for schedule, recompute in (("1f1b", "none"), ("1f1b", "full"), ("gpipe", "none")):
        held, states = {}, {}
        for free in (False, True):
            config = pf.Config(pipeline=COMM.size, microbatches=args.microbatches,
                               schedule=schedule, recompute=recompute,
                               free_sent_outputs=free)
            mine, states[free] = held_at_backward(config, cfg, args.batch, args.steps)
            held[free] = COMM.allgather(mine)
        if COMM.rank == 0:
            same = all(torch.equal(states[True][k], states[False][k]) for k in states[True])
            for s, (off, on) in enumerate(zip(held[False], held[True])):
                rows.append(f"| {schedule} | {recompute} | {s} | {off / 2**20:.2f} | {on / 2**20:.2f} | "
                            f"{1 - on / off:.1%} | {'yes' if same else '**NO**'} |")
    if COMM.rank != 0:
        return
    report = "\n".join([
        "## Freeing sent activations (Megatron-Core's deallocate_output_tensor)",
        "",
        f"`mpirun -n {COMM.size} python benchmarks/bench_free_outputs.py` · "
        f"{datetime.date.today()} · torch {torch.__version__} · {cpu_model()}",
        "",
        f"GPT of {cfg.n_layers} layers, width {cfg.d_model}, sequence {cfg.seq_len}, fp32; "
        f"batch {args.batch} in {args.microbatches} micro-batches, {COMM.size} stages. Peak "
        f"bytes the stash holds at a backward: the stashed outputs' storage plus what "
        f"autograd saved for them (last stage: the loss, nothing sent). With "
        f"`free_sent_outputs` (the default) an activation's storage goes once its send is "
        f"done; the stash keeps its graph. Without recomputation the blocks' own saved "
        f"tensors dwarf one output; with full recomputation the stash is little more than "
        f"each micro-batch's input and output, and freeing the output halves it.",
        "",
        "| schedule | recompute | stage | stash, kept (MiB) | stash, freed (MiB) | saved "
        "| same weights |",
        "|---|---|---:|---:|---:|---:|---|",
        *rows,
    ])
    print(report)
    if args.output:
        write_section(args.output, report, "free-outputs")


if __name__ == "__main__":
    main()
