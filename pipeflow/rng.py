"""Random state of one rank: seeded from `(Config.seed, rank)`, captured and restored whole.

Dropout draws from the global generators (torch CPU and CUDA, Python's `random`, NumPy).
Seeding them per rank makes a run reproducible from its config while every rank (and so every
data-parallel replica) draws its own masks; saving them with a checkpoint makes a resumed run
draw what the uninterrupted one would have.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rank_seed", "seed_everything", "get_rng_state", "set_rng_state"]

_MASK64 = 0xFFFFFFFFFFFFFFFF


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed that depends only on `(seed, rank)`; nearby pairs land far apart."""
    # splitmix64 finaliser; a distinct odd constant keeps it apart from `layer_seed`.
    x = (seed * 0xBF58476D1CE4E5B9 + rank * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def seed_everything(seed: int, rank: int) -> int:
    """Seed torch (CPU and every CUDA device), `random` and NumPy for this rank; returns the
    derived seed. The engine calls it at construction with `Config.seed` and its world rank."""
    s = rank_seed(seed, rank)
    torch.manual_seed(s)                  # seeds the CUDA generators too
    random.seed(s)
    np.random.seed(s % 2**32)
    return s


def get_rng_state() -> dict[str, Any]:
    """Every generator's state, as values `torch.load(weights_only=True)` reads back."""
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": _to_lists(random.getstate()),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
    }


def set_rng_state(state: dict[str, Any]) -> list[str]:
    """Restore what `get_rng_state` captured; returns what could not be (a CUDA device count
    that differs), for the caller to report."""
    torch.set_rng_state(state["torch"])
    skipped = []
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    elif cuda or torch.cuda.is_available():
        skipped.append(f"CUDA random state ({len(cuda)} saved devices, "
                       f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} here)")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    return skipped


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value
