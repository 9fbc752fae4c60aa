"""Layer list → stage boundaries: uniform, by parameters, by measured time, explicit (pure: the
engine, the planner and `auto` share this one solver; measuring the times is `partition`)."""

from __future__ import annotations

from typing import Sequence

from pipeflow.config import ConfigError

__all__ = ["partition_uniform", "partition_balanced", "check_boundaries", "partition_layers"]


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
