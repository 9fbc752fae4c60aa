"""Measuring layers for `partition = "time"` (and `auto`); the boundaries themselves are
`balance`'s (pure), re-exported here."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from pipeflow import tree
from pipeflow.runtime.balance import (check_boundaries, partition_balanced, partition_layers,
                                      partition_uniform)

__all__ = ["partition_uniform", "partition_balanced", "check_boundaries", "partition_layers",
           "measure_layer_times", "each_layer", "clock", "grad_outputs", "leaf_input"]


def measure_layer_times(layers: Sequence, sample: Any, seed: int = 0, repeats: int = 3,
                        device: torch.device | str = "cpu", precision: str = "fp32",
                        fp32_modules: Sequence[Any] = ()) -> list[float]:
    """Forward + backward seconds of each layer on `sample` (a micro-batch of inputs), in
    the run's `precision`."""
    def run(layer: torch.nn.Module, x: Any) -> tuple[list[float], None, Any]:
        inputs = tree.map_tensors(lambda t: leaf_input(t, device), x)
        start = clock(device)
        out = layer(inputs)
        floats, grads = grad_outputs(out)
        if floats:
            torch.autograd.backward(floats, grads)
        return [clock(device) - start], None, out

    return [seconds[0] for seconds, _ in each_layer(layers, sample, run, seed, repeats, device,
                                                     precision, fp32_modules)]


def each_layer(layers: Sequence, sample: Any,
               run: Callable[[torch.nn.Module, Any], tuple[list[float], Any, Any]],
               seed: int = 0, repeats: int = 3, device: torch.device | str = "cpu",
               precision: str = "fp32", fp32_modules: Sequence[Any] = ()
               ) -> list[tuple[list[float], Any]]:
    """`run(layer, x) -> (seconds, extra, output)` on each layer, fed the previous layer's
    output (the first gets `sample`); per layer, the elementwise minimum of the seconds of
    `repeats` runs after one untimed (the minimum resists noise from other work), and the
    last run's `extra`.

    Layers are built one at a time (with their real seeds) and freed, so this needs the memory
    of one layer, not the model. Under bf16/fp16 each runs as in training (`Precision`: the
    working dtype, `fp32_modules` kept, inputs cast): an fp32 layer's times are not those.
    """
    from pipeflow.layers import build_layer
    from pipeflow.runtime.precision import Precision

    x = sample
    rows: list[tuple[list[float], Any]] = []
    for i, spec in enumerate(layers):
        layer = build_layer(spec, seed, i).to(device)
        if precision != "fp32":
            x = Precision(layer, precision, fp32_modules).cast_input(x)
        best: list[float] | None = None
        for attempt in range(repeats + 1):
            seconds, extra, out = run(layer, x)
            if attempt:
                best = seconds if best is None else [min(a, b) for a, b in zip(best, seconds)]
        rows.append((best if best is not None else [float("inf")] * len(seconds), extra))
        x = tree.detach(out)
        del layer
    return rows


def clock(device: torch.device | str) -> float:
    """`time.perf_counter()` once the device's queued work is done (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def grad_outputs(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A layer's floating outputs that carry a gradient, and a gradient of ones for each."""
    floats = [t for t in tree.tensors(out) if t.is_floating_point() and t.requires_grad]
    return floats, [torch.ones_like(t) for t in floats]


def leaf_input(t: torch.Tensor, device: Any) -> torch.Tensor:
    """A fresh leaf on `device`: floating tensors require grad, as a stage input does."""
    t = t.detach().to(device)
    return t.requires_grad_(True) if t.is_floating_point() else t



