"""Auxiliary losses: a scalar a layer adds to the step's loss from inside its `forward`.

A mixture-of-experts router's load-balancing loss, a z-loss, any regulariser computed inside a
layer: the layer calls `pf.add_aux_loss(value)` and the engine adds `value` to the loss of the
micro-batch whose forward produced it, on whichever stage that is. The backward of that
micro-batch (on that stage) then includes the value's gradient, and the step's reported loss
includes its value.

Scaling: an auxiliary loss is a per-micro-batch mean, like the main loss without `count_items`.
The engine weights it `1 / (microbatches x data)`: the step's auxiliary loss is the mean of
every micro-batch's, whatever the main loss's normalisation (with `count_items` the main loss is
a sum over the step's items; the auxiliary one stays a mean). Multiply by your coefficient
before adding (`pf.add_aux_loss(0.01 * balance)`).

Outside an engine's forward (a plain `build_sequential` model), `add_aux_loss` is ignored
unless the caller collects them itself:

    with pf.collect_aux_losses() as aux:
        logits = model(ids)
    loss = loss_fn(logits, labels) + sum(aux)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["add_aux_loss", "collect_aux_losses"]

_state = threading.local()


def add_aux_loss(value: torch.Tensor) -> None:
    """Add `value` (a scalar tensor, usually with a gradient) to the loss of the micro-batch
    being forwarded. Ignored where no one collects (see the module's docstring)."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(
            f"add_aux_loss expects a scalar tensor (one element), found "
            f"{type(value).__name__}" + (f" of shape {tuple(value.shape)}"
                                         if isinstance(value, torch.Tensor) else "")
            + "; reduce it first, e.g. value.mean() or value.sum()")
    sink = getattr(_state, "sink", None)
    if sink is not None:
        sink.append(value.reshape(()))


@contextlib.contextmanager
def collect_aux_losses() -> Iterator[list[torch.Tensor]]:
    """Within the block, every `add_aux_loss` appends to the list yielded (nested blocks:
    the innermost collects)."""
    outer = getattr(_state, "sink", None)
    sink: list[torch.Tensor] = []
    _state.sink = sink
    try:
        yield sink
    finally:
        _state.sink = outer
