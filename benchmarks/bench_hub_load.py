"""Host memory a rank spends loading a Hub folder (`[model] pretrained`), per grid.

# Run: mpirun -n 4 python benchmarks/bench_hub_load.py   (writes BENCHMARKS.md; --help)

Rank 0 saves a Llama (`save_pretrained`, bf16, sharded) into a temporary folder; then, for
each grid `pipeline × tensor` of the world (and one process alone on rank 0), every rank
builds the engine and loads the folder as `pipeflow train` does (`_load_pretrained`: its
stage's layers, at `tensor > 1` only the slices it keeps), once more reading whole tensors
and cutting them afterwards (the way before slices were read). Measured around the load
alone, on each rank:

- the bytes of the tensors it read (what it keeps: its slices and its whole tensors);
- its peak resident memory above the start of the load (Linux's VmHWM, reset by
  `/proc/self/clear_refs` just before): private memory plus the pages of the mmapped
  safetensors files it touched (shared page cache, counted for each process; the kernel maps
  a faulted page's neighbours too);
- its peak private memory (RssAnon, sampled every millisecond by a thread) above the start.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import re
import shutil
import sys
import tempfile
import threading
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (DEFAULT_OUTPUT, busy_note, header, load_average, run_main,  # noqa: E402
                     sync, write_section)

import pipeflow as pf  # noqa: E402
from pipeflow.models import hf  # noqa: E402
from pipeflow.train import hub  # noqa: E402
from pipeflow.train.model_table import build_model  # noqa: E402

__all__ = ["main"]

WORLD = MPI.COMM_WORLD
MB = 2 ** 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


class _Peak:
    """The peak of RssAnon while it lasts, sampled by a thread every millisecond."""

    def __enter__(self) -> "_Peak":
        self.start = self.peak = _status("RssAnon")
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _trim() -> None:
    """Hand malloc's freed memory back to the kernel (glibc's `malloc_trim`), so that what
    an earlier grid's engine freed is not reused unseen by the next load's figures."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _save(folder: str, args: argparse.Namespace) -> int:
    """A random Llama saved in bf16, sharded; the folder's weight bytes."""
    import transformers
    config = transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.width,
        intermediate_size=args.width * 11 // 4, num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2, vocab_size=args.vocab, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=args.shard)
    return sum(t.nbytes for t in model.state_dict().values())


def _load(folder: str, comm: MPI.Comm, pipeline: int, tensor: int, slices: bool) -> tuple:
    """(bytes read, peak VmHWM rise, peak RssAnon rise) of one rank's load."""
    model = build_model({"kind": "hf", "pretrained": folder})
    engine = pf.Engine(model.layers, hf.causal_lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                       pf.Config(pipeline=pipeline, tensor=tensor), comm=comm)
    gc.collect()
    _trim()
    sync(comm)
    start = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                   # VmHWM := VmRSS
    with _Peak() as anon:
        state, _ = hub.read_layers(folder, model.hf_config, engine.stage.module.indices,
                                   engine.kept_ranges if slices else None)
        read = sum(t.nbytes for t in state.values())
        engine.load_state_dict(state)
        del state
    rise = _status("VmHWM") - start
    engine.close()
    return read, rise, anon.peak - anon.start


def _row(name: str, figures: list[tuple], folder_bytes: int) -> str:
    read = max(f[0] for f in figures)
    resident = max(f[1] for f in figures)
    return (f"| {name} | {read / MB:.1f} | {read / folder_bytes:.3f} | {resident / MB:.1f} | "
            f"{resident / folder_bytes:.3f} | {max(f[2] for f in figures) / MB:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--shard", default="50MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, load_before = WORLD.size, load_average()
    root = tempfile.mkdtemp(prefix="bench_hub_") if WORLD.rank == 0 else None
    folder_bytes = _save(root, args) if WORLD.rank == 0 else 0
    root, folder_bytes = WORLD.bcast((root, folder_bytes), 0)
    rows = []
    try:
        if WORLD.rank == 0:
            alone = _load(root, MPI.COMM_SELF, 1, 1, True)
            rows.append(_row("p1×t1 (one process)", [alone], folder_bytes))
        sync()
        grids = [(p, n // p) for p in (1, 2, 4, 8) if n % p == 0 and p <= args.layers]
        for p, t in grids:
            for slices in ([True, False] if t > 1 else [True]):
                started = time.perf_counter()
                figures = WORLD.gather(_load(root, WORLD, p, t, slices), 0)
                how = "slices" if slices else "whole, then cut"
                if WORLD.rank == 0:
                    rows.append(_row(f"p{p}×t{t} ({how})", figures, folder_bytes))
                    print(rows[-1], f"({time.perf_counter() - started:.1f} s)", flush=True)
    finally:
        sync()
        if WORLD.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if WORLD.rank != 0:
        return
    text = "\n".join([
        "## Loading a Hub folder: bytes and host memory a rank (CPU)", "", header(n), "",
        f"Llama {args.layers} blocks × {args.width} wide, vocabulary {args.vocab}, bf16, "
        f"saved by `save_pretrained` in {args.shard} shards: {folder_bytes / MB:.1f} MiB of "
        f"weights. Each rank loads as `[model] pretrained` does (fp32 masters); the largest "
        f"rank's figures, measured around the load alone. Peak resident: VmHWM after "
        f"`clear_refs`, the mmapped files' touched pages included (shared page cache, "
        f"counted per process); peak private: RssAnon, sampled every ms.", "",
        "The bytes read are a stage's blocks over t, plus the embedding or head, which the "
        "families' plans keep whole (here each an eighth of the folder).", "",
        "safetensors hands out views of its mmapped files (nothing is read until used), "
        "which the engine copies straight into the parameters it already holds: the load "
        "allocates next to nothing of its own, and what it reads is what it keeps. The "
        "resident peak is the files' pages a rank touches: a slice by rows (q, k, v, gate, "
        "up: contiguous) touches its own pages, a slice by columns (o_proj, down_proj: a "
        "piece of every row) touches every page where a row is shorter than a few pages, "
        "and the kernel maps more of the cached file than the bytes touched (fault-around, "
        "the page cache's large folios: here a contiguous quarter of q_proj mapped 2.5 times "
        "its bytes). So the resident peak falls with the pipeline as the bytes read do, and "
        "less than they do with the tensor degree; it is shared, clean page cache, which the "
        "kernel takes back under pressure, while what a rank allocates is the parameters it "
        "held before the load.", "",
        "| grid (how) | MiB read | of the folder | peak resident MiB | of the folder | "
        "peak private MiB |", "|---|---|---|---|---|---|", *rows, "",
        busy_note(load_before, load_average(), n) + " Memory, not time: the figures hold."])
    print(text)
    if not args.no_write:
        write_section(args.output, text, "hub-load")


if __name__ == "__main__":
    run_main(main)
