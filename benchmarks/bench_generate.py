"""Generation on the CPU: tokens a second with the key/value cache preallocated to the call's
positions against the cache grown by `torch.cat` each token (the path before), side by side.

# Run: python benchmarks/bench_generate.py   (writes BENCHMARKS.md; --help)

One process, one GPT, greedy: `engine.generate` of one prompt for each length of text, the
two caches taking turns (`Decoding.preallocate`, the old path kept selectable for this
comparison), the first of each round alternating so a slow spell of a shared machine falls
on both alike. Growing by concatenation copies the whole cache of every layer each token, a
cost quadratic in the text's length; preallocated, a token copies its own keys and values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (DEFAULT_OUTPUT, add_model_args, busy_note, header,  # noqa: E402
                     load_average, run_main, write_section)

import pipeflow as pf  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss  # noqa: E402
from pipeflow.runtime.generate import Decoding  # noqa: E402

__all__ = ["main"]

PROMPT = 16      # tokens of the prompt


def _seconds(engine: pf.Engine, prompt: list[int], new: int,
             preallocate: bool) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one call (the CPU's: this process's own time, what a
    machine shared with other work disturbs least)."""
    Decoding.preallocate = preallocate
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        engine.generate([prompt], new)
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        Decoding.preallocate = True


def _length(engine: pf.Engine, new: int, rounds: int) -> dict:
    """Tokens a second of each cache over `rounds` alternating rounds (medians), and the
    speed-up of the best rounds (wall-clock)."""
    prompt = list(range(1, PROMPT + 1))
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for r in range(rounds):
        for preallocate in ((False, True) if r % 2 == 0 else (True, False)):
            times[preallocate].append(_seconds(engine, prompt, new, preallocate))
    rate = {(p, k): new / statistics.median(t[k] for t in times[p])
            for p in times for k in (0, 1)}
    best = min(t[0] for t in times[False]) / min(t[0] for t in times[True])
    return {"new": new, "cat": rate[False, 0], "pre": rate[True, 0],
            "cat_cpu": rate[False, 1], "pre_cpu": rate[True, 1], "best": best}


def _report(rows: list[dict], args, cfg: GPTConfig, before: float, after: float) -> str:
    head_dim = cfg.d_model // cfg.n_heads
    lines = ["## Generation: the key/value cache preallocated (generate)", "", header(1), "",
             f"GPT {cfg.n_layers} layers x {cfg.d_model} wide, {cfg.n_heads} heads of "
             f"{head_dim}, fp32, one torch thread; greedy `engine.generate` of one prompt of "
             f"{PROMPT} tokens; medians of {args.rounds} rounds a length, the two caches "
             f"alternating which goes first; tokens a second of wall-clock time and of this "
             f"process's CPU time.", "",
             "| new tokens | concatenated tok/s | preallocated tok/s | speed-up (median) | "
             "speed-up (best rounds) | concatenated tok/CPU-s | preallocated tok/CPU-s | "
             "speed-up (CPU time) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['new']} | {r['cat']:.0f} | {r['pre']:.0f} | "
                     f"{r['pre'] / r['cat']:.2f}x | {r['best']:.2f}x | {r['cat_cpu']:.0f} | "
                     f"{r['pre_cpu']:.0f} | {r['pre_cpu'] / r['cat_cpu']:.2f}x |")
    lines += ["", "Concatenated: each layer's keys and values grown by `torch.cat` every "
              "token (the path before; every token copies the whole cache, "
              f"{2 * cfg.n_layers * head_dim * cfg.n_heads * 4} bytes a position). "
              "Preallocated: `runtime.kv_cache.KeyValues`, allocated once for the call's "
              "positions and written in place. Attention reads the whole cache every token "
              "either way, so the copy saved is a part of a token's cost that grows with the "
              "text's length. Both run the call as it is now otherwise: "
              "tokens chosen on the device, read once a call in one process "
              "(`tests/test_generate.py`), headers agreed once a call per link "
              "(`tests/test_generate_mpi.py`).", "", busy_note(before, after, 1)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, layers=2, width=128, heads=4, seq=0)
    parser.add_argument("--lengths", default="256,1024,3072",
                        help="new tokens a call, comma-separated (default 256,1024,3072)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq or PROMPT + max(lengths), vocab_size=256)
    engine = pf.Engine(gpt_layers(cfg), gpt_loss, lambda ps: torch.optim.SGD(ps, lr=0.0),
                       pf.Config())
    engine.generate([[1, 2]], 4)                     # warm-up: allocations, first calls
    before = load_average()
    rows = [_length(engine, new, args.rounds) for new in lengths]
    after = load_average()
    engine.close()
    text = _report(rows, args, cfg, before, after)
    print(text)
    write_section(args.output, text, "generate")


if __name__ == "__main__":
    run_main(main)
