"""Byte-level text corpora and a deterministic batch sampler; the default needs no download."""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
from typing import Iterator

import torch

from pipeflow.layers import layer_seed

__all__ = ["Corpus", "Batches", "load_corpus", "stdlib_source",
           "DEFAULT_MAX_BYTES", "VAL_FRACTION"]

DEFAULT_MAX_BYTES = 8 << 20   # 8 MiB: plenty for examples, read in a few hundredths of a second
VAL_FRACTION = 0.05           # the last 5% of the bytes are held out for validation
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                        "__pycache__"})


@functools.lru_cache(maxsize=4)
def stdlib_source(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The running Python's standard-library source: sorted `*.py` files, concatenated.

    Every machine with the same Python version gets the same bytes, so examples and tests
    train on a real corpus without downloading one. The result is cached in-process.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    # Sort by path relative to the root so the order does not depend on where Python lives.
    files.sort(key=lambda p: os.path.relpath(p, root))
    parts, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            text = f.read()
        # A header between files marks the boundary, as a model reading code would see it.
        part = f"\n# ==== {os.path.relpath(path, root)} ====\n".encode() + text
        parts.append(part)
        total += len(part)
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(
            f"found no *.py files under the standard library at {root}; pass a file to "
            f"load_corpus(path) instead")
    return b"".join(parts)[:max_bytes]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A byte corpus split into training and validation bytes (uint8 tensors)."""

    train: torch.Tensor
    val: torch.Tensor
    source: str                # where the bytes came from, for logs

    def __len__(self) -> int:
        return len(self.train) + len(self.val)

    def split(self, name: str) -> torch.Tensor:
        if name not in ("train", "val"):
            raise ValueError(f"corpus split must be 'train' or 'val', found {name!r}")
        return self.train if name == "train" else self.val


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = None,
                val_fraction: float = VAL_FRACTION) -> Corpus:
    """Bytes of `path` (any text or binary file), or by default the stdlib source.

    `max_bytes` caps the corpus: by default `DEFAULT_MAX_BYTES` for the stdlib source and the
    whole file for a path. The last `val_fraction` of the bytes is the validation split.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), found {val_fraction!r}")
    if path is None:
        data = stdlib_source(DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
        source = f"python {sysconfig.get_python_version()} standard library"
    else:
        with open(path, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes)
        source = os.fspath(path)
        if not data:
            raise ValueError(f"corpus file {source} is empty")
    # bytearray: torch.frombuffer wants a writable buffer; uint8 keeps the corpus 1 byte/token.
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = int(len(tokens) * val_fraction)
    return Corpus(train=tokens[:len(tokens) - n_val], val=tokens[len(tokens) - n_val:],
                  source=source)


class Batches:
    """Random byte windows: `(inputs, targets)` int64 [B, T], targets shifted by one byte.

    Batch `k` depends only on `(seed, k)`, so every rank that builds `Batches` with the same
    seed sees the same global batches (each takes the part it needs), and a resumed run can
    continue at its step with `batch(step)`. Iterating yields batch 0, 1, 2, ...
    """

    def __init__(self, corpus: Corpus | torch.Tensor, batch_size: int, seq_len: int,
                 seed: int = 0, split: str = "train") -> None:
        data = corpus.split(split) if isinstance(corpus, Corpus) else corpus
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, found "
                             f"batch_size={batch_size}, seq_len={seq_len}")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"the {split} split has {len(data)} bytes, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use a larger corpus or a shorter seq_len")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self._window = torch.arange(seq_len + 1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The same splitmix mixing that seeds layers turns (seed, step) into a stream seed.
        gen = torch.Generator().manual_seed(layer_seed(self.seed, step))
        starts = torch.randint(0, len(self.data) - self.seq_len, (self.batch_size,),
                               generator=gen)
        windows = self.data[starts[:, None] + self._window].long()
        # Contiguous copies: the engine slices them into micro-batches and sends them as is.
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
