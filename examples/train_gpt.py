"""Train a small GPT with pipeflow: `mpirun -n 2 python examples/train_gpt.py [CONFIG.toml]`."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.train.data import Batches, load_corpus
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss, num_parameters
from pipeflow.train.loop import weight_decay_groups

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_DEFAULTS = dict(steps=200, batch_size=16, lr=2e-3, warmup=10, log_every=10, threads=1)


def lr_at(step: int, peak: float, warmup: int, steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak (as nanoGPT does)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default=os.path.join(HERE, "gpt_small.toml"))
    parser.add_argument("--corpus", default=None,
                        help="a text file to train on (default: the Python stdlib source)")
    args = parser.parse_args()
    with open(args.config, "rb") as f:
        doc = tomllib.load(f)
    train = {**TRAIN_DEFAULTS, **doc.get("train", {})}
    torch.set_num_threads(train["threads"])
    rank0 = MPI.COMM_WORLD.rank == 0

    cfg = GPTConfig(**doc.get("model", {}))
    config = pf.Config.from_dict(doc.get("engine", {}))
    # Each stage builds its own optimizer over its own parameters; keep them to set the lr.
    optimizers: list[torch.optim.Optimizer] = []

    def make_optimizer(params):
        # Weight decay on matrices only, not on biases and LayerNorms (nanoGPT's rule).
        groups = weight_decay_groups(params, train.get("weight_decay", 0.1))
        optimizers.append(torch.optim.AdamW(groups, lr=train["lr"]))
        return optimizers[-1]

    engine = pf.Engine(gpt_layers(cfg), gpt_loss, make_optimizer, config)

    # Every rank draws the same global batches from the same seed; the engine takes its part.
    corpus = load_corpus(args.corpus)
    batches = iter(Batches(corpus, train["batch_size"], cfg.seq_len, seed=config.seed))
    tokens_per_step = train["batch_size"] * cfg.seq_len
    if rank0:
        print(f"GPT {num_parameters(cfg) / 1e6:.2f}M parameters on {corpus.source} "
              f"({len(corpus) / 2**20:.1f} MiB); grid pipeline={config.pipeline} "
              f"data={config.data}, {config.microbatches} micro-batches, {config.schedule}")

    start = time.perf_counter()
    for step in range(train["steps"]):
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, train["lr"], train["warmup"], train["steps"])
        t0 = time.perf_counter()
        inputs, targets = next(batches)
        loss = engine.train_step(inputs, targets)
        dt = time.perf_counter() - t0
        if rank0 and (step % train["log_every"] == 0 or step == train["steps"] - 1):
            print(f"step {step:4d}  loss {loss:.3f}  {tokens_per_step / dt:7.0f} tok/s  "
                  f"{dt * 1e3:6.1f} ms/step", flush=True)

    val = Batches(corpus, train["batch_size"], cfg.seq_len, seed=1, split="val")
    val_loss = sum(engine.eval_step(*val.batch(i)) for i in range(4)) / 4
    if rank0:
        print(f"done in {time.perf_counter() - start:.1f} s; validation loss {val_loss:.3f}")


if __name__ == "__main__":
    main()
