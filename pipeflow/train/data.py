"""Byte corpora, flat token files (memmap) and a deterministic batch sampler; the default
needs no download."""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
from typing import Any, Iterator

import numpy as np
import torch

from pipeflow.layers import layer_seed

__all__ = ["Corpus", "Batches", "load_corpus", "stdlib_source", "token_file", "TOKEN_DTYPES",
           "DEFAULT_MAX_BYTES", "VAL_FRACTION", "packed_positions"]

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
    """Random windows: `(inputs, targets)` int64 [B, T], targets shifted by one token.

    `data` is a byte corpus (a `Corpus` or a uint8 tensor) or a flat token array such as a
    `numpy.memmap` of a `.bin` file (`TokenFile`). Batch `k` depends only on `(seed, k)`, so
    every rank that builds `Batches` with the same seed sees the same global batches, and a
    resumed run continues at its data position with `batch(position)`. Iterating yields batch
    0, 1, 2, ...

    `rows(k, lo, hi)` reads only rows `lo:hi` of batch `k` (a memmap reads only those
    windows from disk); `local_batch` is what one data-parallel replica needs.
    """

    def __init__(self, corpus: "Corpus | torch.Tensor | np.ndarray", batch_size: int,
                 seq_len: int, seed: int = 0, split: str = "train") -> None:
        data = corpus.split(split) if isinstance(corpus, Corpus) else corpus
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, found "
                             f"batch_size={batch_size}, seq_len={seq_len}")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"the {split} split has {len(data)} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use a larger corpus or a shorter seq_len")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self._window = torch.arange(seq_len + 1)

    def starts(self, step: int) -> torch.Tensor:
        """Where each of batch `step`'s `batch_size` windows begins."""
        # The same splitmix mixing that seeds layers turns (seed, step) into a stream seed.
        gen = torch.Generator().manual_seed(layer_seed(self.seed, step))
        return torch.randint(0, len(self.data) - self.seq_len, (self.batch_size,),
                             generator=gen)

    def rows(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `lo:hi` of batch `step`, reading only their windows."""
        index = self.starts(step)[lo:hi, None] + self._window
        _check_not_truncated(self.data)
        if isinstance(self.data, np.ndarray):
            windows = torch.from_numpy(self.data[index.numpy()].astype(np.int64))
        else:
            windows = self.data[index].long()
        # Contiguous copies: the engine slices them into micro-batches and sends them as is.
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(step, 0, self.batch_size)

    def local_batch(self, step: int, replica: int,
                    replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replica `replica`'s rows `r·B/d:(r+1)·B/d` of batch `step`, and only those read:
        what an engine with `Config(batch="local")` takes on that replica."""
        shard = self.batch_size // replicas
        lo = replica * shard
        return self.rows(step, lo, lo + shard)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1


def packed_positions(ids: torch.Tensor, eot: int) -> torch.Tensor:
    """Position ids (B, T) restarting at 0 after each end-of-text token `eot` of `ids`.

    A row of packed documents with these positions keeps attention inside each document (a
    model reads a restart of the positions as a new sequence, as flash-attention's varlen
    path and transformers' packed masks do). The row's first token starts at 0: a window cut
    mid-document sees only that document's tail."""
    t = ids.shape[-1]
    index = torch.arange(t, device=ids.device).expand_as(ids)
    start = torch.zeros_like(ids, dtype=torch.bool)
    start[..., 1:] = ids[..., :-1] == eot        # the token after an end-of-text starts anew
    start[..., 0] = True
    first = torch.where(start, index, torch.zeros_like(index)).cummax(dim=-1).values
    return (index - first).contiguous()


TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def _check_not_truncated(data: Any) -> None:
    """A memory-mapped token file cut short under a running job (rewritten, a full disk)
    would kill the process with a bus error at the first read past its new end: one stat a
    batch names the file instead."""
    path = getattr(data, "filename", None)
    if not isinstance(data, np.memmap) or not path:
        return
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if size < data.nbytes + data.offset:
        raise ValueError(f"token file {path!r} shrank to {size} bytes while in use "
                         f"({data.nbytes + data.offset} when opened): it was truncated or "
                         f"rewritten under the run; restore it, then resume")


def token_file(path: str | os.PathLike, dtype: str = "uint16") -> np.ndarray:
    """A flat token file (nanoGPT's `.bin`: no header, native-endian) as a read-only memmap."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype must be one of {list(TOKEN_DTYPES)}, found {dtype!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"token file {path!r} not found; write one with `pipeflow "
                                f"prepare TEXT... --out DIR`")
    size = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if os.path.getsize(path) == 0:
        raise ValueError(f"token file {path!r} is empty; write it again with `pipeflow "
                         f"prepare`, or point [data] train at another file")
    if os.path.getsize(path) % size:
        raise ValueError(f"token file {path!r} has {os.path.getsize(path)} bytes, not a "
                         f"multiple of {size} ({dtype}): is [data] dtype right?")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
