"""Split backward's cost: one stage's full backward against B (input gradients) then W."""

# Run: python benchmarks/bench_split_backward.py   (one process, one torch thread; rewrites
# its section of BENCHMARKS.md; --output '' only prints). Zero-bubble schedules pay off only
# if B + W costs about one full backward: this measures both on a stage of GPT blocks.

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

from pipeflow.runtime.hostmem import keep_freed_memory
from pipeflow.models.gpt import Block, GPTConfig
from pipeflow.schedules.split_backward import backward_input, backward_weight

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (DEFAULT_OUTPUT, add_model_args, busy_note, header,  # noqa: E402
                     load_average, write_section)


def rounds(blocks: nn.Module, x: torch.Tensor, n: int) -> dict[str, list[float]]:
    """Per round, alternated: the full backward, then B and W, each after its own forward."""
    times: dict[str, list[float]] = {"forward": [], "full backward": [], "B": [], "W": []}
    for _ in range(n):
        t = time.perf_counter()
        out = blocks(x)
        times["forward"].append(time.perf_counter() - t)
        g = torch.randn_like(out)
        t = time.perf_counter()
        out.backward(g)
        times["full backward"].append(time.perf_counter() - t)
        out = blocks(x)
        t = time.perf_counter()
        _, pending = backward_input(out, g, [x], blocks.parameters())
        times["B"].append(time.perf_counter() - t)
        del out
        t = time.perf_counter()
        backward_weight(pending)
        times["W"].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap, layers=4)
    ap.add_argument("--batch", type=int, default=2, help="micro-batch size")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq)
    blocks = nn.Sequential(*[Block(cfg) for _ in range(args.layers)])
    x = torch.randn(args.batch, args.seq, args.width, requires_grad=True)
    before = load_average()
    # glibc's defaults first, then with freed memory kept (what the engine sets on CPUs under
    # a split-backward schedule): the setting cannot be undone within a process.
    phases = [("glibc defaults", rounds(blocks, x, args.rounds))]
    if keep_freed_memory():
        phases.append(("freed memory kept (`keep_host_memory`)", rounds(blocks, x, args.rounds)))
    after = load_average()
    rows = ["| host memory | | forward | full backward | B | W | B + W | (B + W) / full |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for phase, times in phases:
        best = {k: min(v) * 1e3 for k, v in times.items()}
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        for name, t in (("best round (ms)", best), ("median (ms)", med)):
            rows.append(f"| {phase} | {name} | {t['forward']:.1f} | {t['full backward']:.1f} | "
                        f"{t['B']:.1f} | {t['W']:.1f} | {t['B'] + t['W']:.1f} | "
                        f"{(t['B'] + t['W']) / t['full backward']:.2f} |")
    text = (f"## Split backward (zero bubble): B + W against one full backward\n\n{header(1)}\n\n"
            f"{args.layers} GPT blocks (width {args.width}, {args.heads} heads, sequence "
            f"{args.seq}), micro-batch {args.batch}, {args.rounds} alternated rounds under "
            f"glibc malloc's defaults, then {args.rounds} with freed memory kept for reuse "
            f"(`pipeflow.runtime.hostmem`: B keeps each graph alive until W, and with the defaults "
            f"malloc returns large freed blocks to the kernel, so every step faults them in "
            f"again).\n\n"
            + "\n".join(rows) + f"\n\n{busy_note(before, after, 1)}")
    print(text)
    if args.output:
        write_section(args.output, text, "split-backward")


if __name__ == "__main__":
    main()
