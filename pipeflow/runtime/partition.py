"""Layer list → stage boundaries: uniform, by parameters, by measured time, explicit."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from pipeflow import tree
from pipeflow.config import ConfigError

__all__ = ["partition_uniform", "partition_balanced", "check_boundaries", "partition_layers",
           "measure_layer_times", "each_layer", "clock", "grad_outputs", "leaf_input"]


def partition_uniform(n_layers: int, stages: int) -> list[int]:
    """Boundaries giving each stage `n_layers // stages` layers; the last stages get one more."""
    _check_counts(n_layers, stages)
    base, extra = divmod(n_layers, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    return _boundaries(sizes)


def partition_balanced(weights: Sequence[float], stages: int) -> list[int]:
    """Contiguous boundaries minimising the heaviest stage's total weight.

    Exact: a dynamic programme over (stages, layers) where `best[k][i]` is the lightest
    heaviest stage of the first i layers in k stages. Ties go to the partition with the
    earliest cuts. Each row costs O(n): `best[k - 1]` grows with the layers it holds and the
    last stage's weight falls as its first layer moves right, so the best cut sits where the
    two cross, and that crossing only moves right as i grows (two pointers). O(n · p) in all:
    a 514-layer list into 514 stages in a fraction of a second (the planner asks for every
    depth).
    """
    n = len(weights)
    _check_counts(n, stages)
    if any(w < 0 for w in weights):
        raise ValueError(f"layer weights must be >= 0, found {list(weights)}")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    best = [prefix[i] if i <= n - stages + 1 else inf for i in range(n + 1)]   # k = 1
    cuts: list[list[int]] = [[0] * (n + 1)]
    for k in range(2, stages + 1):
        best, cut = _next_row(best, prefix, k, n - (stages - k))
        cuts.append(cut)
    bounds = [n]
    for k in range(stages, 1, -1):
        bounds.append(cuts[k - 1][bounds[-1]])
    bounds.append(0)
    return bounds[::-1]


def _next_row(prev: list[float], prefix: list[float], k: int,
              last: int) -> tuple[list[float], list[int]]:
    """`best[k][i]` and its earliest cut j for i in [k, last], from `prev` = `best[k - 1]`:
    the smallest max(prev[j], prefix[i] - prefix[j]) over j in [k - 1, i - 1]."""
    inf = float("inf")
    best, cut = [inf] * len(prefix), [0] * len(prefix)
    c = k - 1                       # the first j where prev[j] >= the last stage's weight
    for i in range(k, last + 1):
        while c < i and prev[c] < prefix[i] - prefix[c]:
            c += 1
        if c < i and (c == k - 1 or max(prev[c], prefix[i] - prefix[c])
                      < max(prev[c - 1], prefix[i] - prefix[c - 1])):
            j = c                   # right of the crossing the cost grows with j
        else:
            j = c - 1               # left of it the cost falls: the earliest of its equals
            cost = max(prev[j], prefix[i] - prefix[j])
            while j > k - 1 and max(prev[j - 1], prefix[i] - prefix[j - 1]) == cost:
                j -= 1
        best[i], cut[i] = max(prev[j], prefix[i] - prefix[j]), j
    return best, cut


def check_boundaries(bounds: Sequence[int], n_layers: int, stages: int) -> list[int]:
    """Validate explicit boundaries `[0, b1, ..., n_layers]`: one more than the stages."""
    bounds = list(bounds)
    if len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != n_layers:
        raise ConfigError(
            f"explicit partition {bounds} does not fit {stages} stages of {n_layers} layers: "
            f"expected {stages + 1} boundaries starting at 0 and ending at {n_layers}, "
            f"e.g. {partition_uniform(n_layers, stages) if n_layers >= stages else '[0, ...]'}")
    for s in range(stages):
        if bounds[s + 1] <= bounds[s]:
            raise ConfigError(
                f"explicit partition {bounds} gives stage {s} no layers "
                f"(boundaries must strictly increase)")
    return bounds


def partition_layers(layers: Sequence, stages: int, method: str | Sequence[int],
                     times: Sequence[float] | None = None) -> list[int]:
    """Stage boundaries for a list of `LayerSpec`s by `method` (see `Config.partition`).

    `"time"` balances measured per-layer times (`measure_layer_times`), passed as `times`.
    """
    n = len(layers)
    _check_counts(n, stages)
    if not isinstance(method, str):
        return check_boundaries(method, n, stages)
    if method == "uniform":
        return partition_uniform(n, stages)
    if method == "parameters":
        return partition_balanced([spec.num_parameters() for spec in layers], stages)
    if method == "time":
        if times is None or len(times) != n:
            raise ConfigError(
                f"partition 'time' balances measured layer times: expected {n} times, found "
                f"{None if times is None else len(times)}; give the Engine a sample micro-batch "
                f"(Engine(..., sample=inputs)) to measure them on")
        return partition_balanced(times, stages)
    raise ConfigError(f"unknown partition method {method!r}: expected 'uniform', 'parameters', "
                      f"'time' or a list of boundaries")


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


def _check_counts(n_layers: int, stages: int) -> None:
    if stages < 1:
        raise ConfigError(f"the pipeline needs at least one stage, found {stages}")
    if n_layers < stages:
        raise ConfigError(
            f"cannot split {n_layers} layers into {stages} pipeline stages: every stage needs "
            f"at least one layer; use pipeline <= {n_layers} or split the model into more layers")


def _boundaries(sizes: Sequence[int]) -> list[int]:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds
