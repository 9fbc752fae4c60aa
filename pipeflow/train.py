"""`pipeflow train CONFIG.toml`: the GPT example trained from a TOML file, logged on rank 0."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, Mapping

import torch
from mpi4py import MPI

from pipeflow.config import Config, ConfigError
from pipeflow.data import Batches, load_corpus
from pipeflow.engine import Engine
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss, num_parameters
from pipeflow.trace import write_trace

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["TrainConfig", "lr_at", "load_run_config", "train"]


@dataclasses.dataclass
class TrainConfig:
    """The `[train]` table: the loop around the engine."""

    steps: int = 200
    batch_size: int = 16          # global batch in sequences, split into micro-batches
    lr: float = 2e-3              # peak AdamW learning rate
    min_lr_ratio: float = 0.1     # cosine decay ends at min_lr_ratio x lr
    warmup: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    log_every: int = 10
    eval_every: int = 0           # 0: evaluate once, at the end
    eval_batches: int = 4
    threads: int = 1              # torch threads per rank: one core per rank
    corpus: str = ""              # a file to train on; empty: the Python stdlib source
    save_dir: str = ""            # checkpoint folder; empty: no checkpoints
    save_every: int = 0           # 0: only at the end (when save_dir is set)
    resume: bool = False          # continue from the latest checkpoint in save_dir


def lr_at(step: int, train: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak (as nanoGPT does)."""
    if step < train.warmup:
        return train.lr * (step + 1) / train.warmup
    progress = min(1.0, (step - train.warmup) / max(1, train.steps - train.warmup))
    floor = train.min_lr_ratio
    return train.lr * (floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _dataclass_from(cls, table: Mapping[str, Any], name: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{name}]; known keys: {sorted(known)}")
    return cls(**table)


def load_run_config(path: str | os.PathLike) -> tuple[Config, GPTConfig, TrainConfig]:
    """The three tables of a run's TOML file: `[engine]`, `[model]`, `[train]`."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {os.fspath(path)!r} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} is not valid TOML: {exc}") from None
    extra = sorted(set(doc) - {"engine", "model", "train"})
    if extra:
        raise ConfigError(f"unknown table(s) {extra} in {os.fspath(path)!r}; expected "
                          f"[engine], [model] and [train]")
    return (Config.from_dict(doc.get("engine", {})),
            _dataclass_from(GPTConfig, doc.get("model", {}), "model"),
            _dataclass_from(TrainConfig, doc.get("train", {}), "train"))


def train(config: Config, model: GPTConfig, run: TrainConfig,
          comm: MPI.Comm | None = None, log=print, trace: str | None = None) -> list[float]:
    """Train the GPT; rank 0 logs loss, tokens/s and step time. Returns the losses.

    With `trace`, the last step's instruction timeline of every rank is written there as a
    Chrome/Perfetto trace.
    """
    comm = comm if comm is not None else MPI.COMM_WORLD
    torch.set_num_threads(run.threads)
    rank0 = comm.rank == 0
    corpus = load_corpus(run.corpus or None)
    batches = Batches(corpus, run.batch_size, model.seq_len, seed=config.seed)
    val = Batches(corpus, run.batch_size, model.seq_len, seed=config.seed, split="val")
    # partition = "time" measures the layers on one micro-batch of the real data.
    micro = max(1, run.batch_size // (config.data * config.microbatches))
    engine = Engine(gpt_layers(model), gpt_loss,
                    lambda ps: torch.optim.AdamW(ps, lr=run.lr, betas=(run.beta1, run.beta2),
                                                 weight_decay=run.weight_decay),
                    config, comm=comm, trace=trace is not None,
                    sample=batches.batch(0)[0][:micro] if config.partition == "time" else None)
    if run.resume and run.save_dir and os.path.exists(os.path.join(run.save_dir, "latest")):
        engine.load(run.save_dir)
    tokens = run.batch_size * model.seq_len
    if rank0:
        log(f"pipeflow: GPT of {num_parameters(model) / 1e6:.2f}M parameters on "
            f"{corpus.source} ({len(corpus) / 2**20:.1f} MiB); grid pipeline={config.pipeline} "
            f"x data={config.data}, {config.microbatches} micro-batches, {config.schedule}, "
            f"stages {engine.boundaries}", flush=True)

    def evaluate() -> float:
        return sum(engine.eval_step(*val.batch(i)) for i in range(run.eval_batches)) / max(
            1, run.eval_batches)

    losses: list[float] = []
    first = engine.step_count
    start = time.perf_counter()
    for step in range(first, run.steps):
        if engine.optimizer is not None:
            for group in engine.optimizer.param_groups:
                group["lr"] = lr_at(step, run)
        # Count saved activations on the first step only: the meter costs time.
        engine.measure_activations = step == first and config.recompute != "none"
        loss = engine.train_step(*batches.batch(step))
        losses.append(loss)
        if step == first and config.recompute != "none":
            # "auto" is resolved on each stage's first micro-batch: say what it chose.
            chosen = comm.gather((engine.stage, engine.recompute,
                                  engine.peak_activation_bytes), root=0)
            if rank0:
                per_stage = {s: (p, b) for s, p, b in chosen}
                log("pipeflow: recompute per stage: " + ", ".join(
                    f"{s}: {p} ({b / 2**20:.1f} MiB stashed)"
                    for s, (p, b) in sorted(per_stage.items())), flush=True)
        dt = engine.last_step_time
        if rank0 and (step % run.log_every == 0 or step == run.steps - 1):
            log(f"step {step:5d}  loss {loss:.4f}  lr {lr_at(step, run):.2e}  "
                f"{tokens / dt:8.0f} tok/s  {dt * 1e3:7.1f} ms/step", flush=True)
        if run.eval_every and (step + 1) % run.eval_every == 0:
            val_loss = evaluate()
            if rank0:
                log(f"step {step:5d}  validation loss {val_loss:.4f}", flush=True)
        if run.save_dir and run.save_every and (step + 1) % run.save_every == 0:
            engine.save(run.save_dir)
    elapsed = time.perf_counter() - start
    if trace is not None:
        write_trace(engine, trace)
        if rank0:
            log(f"pipeflow: wrote the last step's timeline to {trace} (open it in "
                f"https://ui.perfetto.dev)", flush=True)
    val_loss = evaluate()
    if run.save_dir:
        engine.save(run.save_dir)
    if rank0 and losses:
        done = len(losses)
        log(f"pipeflow: {done} steps in {elapsed:.1f} s ({done * tokens / elapsed:.0f} tok/s); "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, validation loss {val_loss:.3f}",
            flush=True)
    engine.close()
    return losses
