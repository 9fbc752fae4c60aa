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

from pipeflow.layers import layer_seed

__all__ = ["rank_seed", "seed_everything", "get_rng_state", "set_rng_state"]


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed that depends only on `(seed, rank)`, apart from every layer's seed."""
    # layer_seed's mixing at negative indices (layers are built at 0, 1, ...); below -1, as
    # index -1 with seed 0 mixes the value 0.
    return layer_seed(seed, -2 - rank)


def seed_everything(seed: int, rank: int) -> int:
    """Seed torch (CPU and every CUDA device), `random` and NumPy for this rank; returns the
    derived seed. The engine calls it at construction with `Config.seed` and its world rank."""
    s = rank_seed(seed, rank)
    torch.manual_seed(s)                  # seeds the CUDA generators too
    random.seed(s)
    np.random.seed(s % 2**32)
    return s


def get_rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """Every generator's state, as values `torch.load(weights_only=True)` reads back.

    `device` is the GPU this rank computes on: its generator alone is saved (asking every
    visible GPU would open a context on each of them from every rank).
    """
    np_state = np.random.get_state(legacy=False)
    cuda = _cuda(device)
    return {
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(cuda)] if cuda is not None else [],
        "python": _to_lists(random.getstate()),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
    }


def set_rng_state(state: dict[str, Any], device: torch.device | str | None = None) -> list[str]:
    """Restore what `get_rng_state` captured, the CUDA generator onto `device`; returns what
    could not be restored (a CUDA state saved on a CPU run, or none for this GPU)."""
    torch.set_rng_state(state["torch"])
    skipped = []
    saved, cuda = state.get("cuda") or [], _cuda(device)
    if saved and cuda is not None:
        torch.cuda.set_rng_state(saved[0], cuda)
    elif saved or cuda is not None:
        skipped.append(f"the CUDA random state (saved: {'yes' if saved else 'no'}, "
                       f"device here: {device})")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    return skipped


def _cuda(device: torch.device | str | None) -> torch.device | None:
    d = torch.device(device) if device is not None else None
    return d if d is not None and d.type == "cuda" else None


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value
