"""The search: every grid, micro-batching, schedule and per-stage recomputation; fastest fit."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

from pipeflow.config import SCHEDULES
from pipeflow.schedules import registry
from pipeflow.planner.cost import (PLANNED_SCHEDULES, PRECISIONS, RECOMPUTE, Estimate, Grid,
                                   estimate, layer_kinds, stage_memory, state_floor,
                                   time_balanced_boundaries)
from pipeflow.planner.hardware import GB, Cluster
from pipeflow.planner.shapes import Shape

__all__ = ["PlanError", "Rejection", "SearchResult", "divisors", "enumerate_grids",
           "choose_recompute", "search", "minimum_gpus"]


class PlanError(ValueError):
    """No plan fits; the message says what would (more GPUs, more memory, a smaller model)."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A grid the search threw out, and why."""

    grid: Grid
    reason: str
    peak_memory_gb: float   # the least its fullest stage needs, every recomputation allowed


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """All plans that fit, fastest first, and the grids that did not."""

    ranked: tuple[Estimate, ...]
    rejected: tuple[Rejection, ...]
    considered: int

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_grids(shape: Shape, gpus: int, global_batch: int,
                    schedules: Sequence[str] = PLANNED_SCHEDULES,
                    max_micro_batch: int = 16) -> Iterator[Grid]:
    """Every (pipeline, data, micro-batch size, micro-batch count, schedule) with
    pipeline·data ≤ gpus and data·count·size = global_batch sequences.

    Grids using fewer GPUs than the cluster has stay in: when the batch does not divide
    evenly they may be the fastest, and it makes the search's answer never slower with more
    GPUs. A stage holds at least one layer of the n_layers + 2 (embedding, blocks, head).
    """
    n_items = len(layer_kinds(shape))
    for p in range(1, min(gpus, n_items) + 1):
        for d in divisors(global_batch):
            if p * d > gpus:
                break
            for b in divisors(global_batch // d):
                if b > max_micro_batch:
                    break
                m = global_batch // (d * b)
                # One stage runs every schedule alike: keep only the first. A schedule only
                # from its `planner_min_microbatches` (a V where it fills, m >= 2p - 1:
                # below, ZB-H1 is as near at less memory and half the messages, and
                # simulating every short V of a deep pipeline would cost the search minutes).
                for schedule in (schedules if p > 1 else schedules[:1]):
                    if m >= registry.get(schedule).planner_min_microbatches(p):
                        yield Grid(p, d, b, m, schedule)


def choose_recompute(shape: Shape, cluster: Cluster, grid: Grid, precision: str,
                     boundaries: Sequence[int],
                     modes: Sequence[str] = RECOMPUTE) -> tuple[list[str] | None, float]:
    """Per stage, the cheapest recomputation (in `modes` order) whose memory fits.

    Stages are independent in memory, so choosing each stage's cheapest fit is the
    cheapest fit overall. Returns (modes per stage or None, the least peak memory any
    choice reaches, in bytes).
    """
    prec = PRECISIONS[precision]
    usable = cluster.hardware.usable_memory
    chosen: list[str] | None = []
    least_peak = 0.0
    for st in range(grid.pipeline):
        layers = (boundaries[st], boundaries[st + 1])
        least = None
        pick = None
        for mode in modes:
            need = sum(stage_memory(shape, prec, grid, st, layers, mode))
            least = need if least is None else min(least, need)
            if need <= usable:
                pick = mode
                break
        least_peak = max(least_peak, least)
        if pick is None:
            chosen = None
        elif chosen is not None:
            chosen.append(pick)
    return chosen, least_peak


def search(shape: Shape, cluster: Cluster, global_batch: int, precision: str = "bf16",
           schedules: Sequence[str] = PLANNED_SCHEDULES, recompute: Sequence[str] = RECOMPUTE,
           max_micro_batch: int = 16,
           grid_filter: Callable[[Grid], bool] | None = None,
           shard_optimizer: str = "auto") -> SearchResult:
    """Evaluate every grid of `enumerate_grids` (those `grid_filter` keeps); rank those that
    fit by step time.

    `shard_optimizer` ("auto", "on", "off") for grids with data > 1: "on" shards every one
    (`Config.shard_optimizer`); "auto" shards a grid only where the unsharded one does not
    fit any stage's memory with any recomputation allowed, so a plan that fits as it is
    keeps the simpler all-reduce, and a plan that fits only sharded is not thrown away.

    Raises PlanError, naming what would fit, when none does.
    """
    _check_search(global_batch, precision, schedules, recompute, shard_optimizer)
    prec = PRECISIONS[precision]
    fitting: list[Estimate] = []
    rejected: list[Rejection] = []
    considered = 0
    for grid in enumerate_grids(shape, cluster.gpus, global_batch, schedules, max_micro_batch):
        if grid_filter is not None and not grid_filter(grid):
            continue
        considered += 1
        bounds = time_balanced_boundaries(shape, cluster, prec, grid.pipeline,
                                          grid.micro_batch_size)
        grid, modes, least = _fit(shape, cluster, grid, precision, bounds, recompute,
                                  shard_optimizer)
        if modes is None:
            rejected.append(Rejection(grid, _memory_reason(least, cluster, recompute), least / GB))
            continue
        fitting.append(estimate(shape, cluster, grid, modes, precision, bounds))
    if not fitting and considered == 0:
        raise PlanError(f"no grid to consider: {global_batch} sequences on {cluster.gpus} GPU(s) "
                        f"with micro-batches of at most {max_micro_batch}"
                        + (" and the grid filter given" if grid_filter is not None else ""))
    if not fitting:
        raise PlanError(_nothing_fits(shape, cluster, global_batch, precision, schedules,
                                      recompute, max_micro_batch, rejected))
    # Fastest first. Among equals (to 9 digits): fewer GPUs; then fewer, larger micro-batches
    # (the model keeps efficiency constant in the micro-batch size, while real kernels only
    # gain from larger ones); then less memory.
    fitting.sort(key=lambda e: (float(f"{e.step_time_s:.9g}"), e.grid.gpus, e.grid.microbatches,
                                e.peak_memory_bytes, SCHEDULES.index(e.grid.schedule)))
    return SearchResult(tuple(fitting), tuple(rejected), considered)


def _check_search(global_batch: int, precision: str, schedules: Sequence[str],
                  recompute: Sequence[str], shard_optimizer: str) -> None:
    """`search`'s arguments, each refused with what is expected."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"the global batch must be a positive number of sequences, found "
                        f"{global_batch!r}")
    for s in schedules:
        if s not in PLANNED_SCHEDULES:
            known = "the cost model does not time it yet" if s in SCHEDULES else "unknown"
            raise PlanError(f"schedule {s!r}: {known}; expected some of "
                            f"{list(PLANNED_SCHEDULES)}")
    for r in recompute:
        if r not in RECOMPUTE:
            raise PlanError(f"unknown recomputation {r!r}; expected some of {list(RECOMPUTE)}")
    if precision not in PRECISIONS:
        raise PlanError(f"unknown precision {precision!r}; expected one of {list(PRECISIONS)}")
    if shard_optimizer not in ("auto", "on", "off"):
        raise PlanError(f"shard_optimizer must be 'auto', 'on' or 'off', found "
                        f"{shard_optimizer!r}")


def _fit(shape: Shape, cluster: Cluster, grid: Grid, precision: str, bounds: Sequence[int],
         recompute: Sequence[str], shard_optimizer: str
         ) -> tuple[Grid, list[str] | None, float]:
    """(the grid as planned, its recomputation per stage or None when nothing fits, the
    least peak memory any choice reaches), sharding the optimizer as `search` says."""
    if shard_optimizer == "on" and grid.data > 1:
        grid = dataclasses.replace(grid, shard_optimizer=True)
    modes, least = choose_recompute(shape, cluster, grid, precision, bounds, recompute)
    if modes is None and shard_optimizer == "auto" and grid.data > 1:
        sharded = dataclasses.replace(grid, shard_optimizer=True)
        modes, least_sharded = choose_recompute(shape, cluster, sharded, precision, bounds,
                                                recompute)
        if modes is not None:
            return sharded, modes, least_sharded
        least = least_sharded               # the least any choice reaches
    return grid, modes, least


def _memory_reason(least: float, cluster: Cluster, recompute: Sequence[str]) -> str:
    usable = cluster.hardware.usable_memory
    return (f"a stage needs {least / GB:.1f} GB even with {recompute[-1]} recomputation; "
            f"{usable / GB:.1f} GB usable per GPU")


def minimum_gpus(shape: Shape, cluster: Cluster, global_batch: int, precision: str,
                 schedules: Sequence[str] = PLANNED_SCHEDULES, recompute: Sequence[str] = RECOMPUTE,
                 max_micro_batch: int = 16) -> tuple[int | None, float]:
    """(The fewest GPUs on which some plan fits this GPU's memory, or None when no pipeline
    depth does; the least memory in bytes the fullest stage needs at the deepest pipeline).

    Only pipeline stages divide the memory (data replicas each hold a whole stage), so the
    fewest GPUs is the shallowest pipeline that fits. A stage's memory falls with depth (it
    holds fewer layers; 1F1B's stage s stashes p - s micro-batches of about n/p layers each),
    so the depth is found by bisection, about log2(n) depths evaluated, not all n + 2: a
    model of hundreds of layers is answered in seconds. The depth returned was evaluated and
    fits.
    """
    n_items = len(layer_kinds(shape))
    big = dataclasses.replace(cluster, gpus=n_items)
    # GPipe stashes m ≥ min(p - s, m) micro-batches: 1F1B never needs more memory.
    lean = ["1f1b"] if "1f1b" in schedules else list(schedules)
    by_depth: dict[int, list[Grid]] = {}
    for grid in enumerate_grids(shape, n_items, global_batch, lean, max_micro_batch):
        if grid.data == 1:
            by_depth.setdefault(grid.pipeline, []).append(grid)
    depths = sorted(by_depth)
    if not depths:
        return None, float("inf")

    def fits(depth: int) -> tuple[bool, float]:
        return _fits_at_depth(shape, big, by_depth[depth], precision, recompute)

    deepest_fits, least = _fits_at_depth(shape, big, by_depth[depths[-1]], precision,
                                         recompute, exact=True)
    if not deepest_fits:
        return None, least
    lo, hi = 0, len(depths) - 1          # depths[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(depths[mid])[0]:
            hi = mid
        else:
            lo = mid + 1
    return depths[hi], least


def _fits_at_depth(shape: Shape, cluster: Cluster, grids: Sequence[Grid], precision: str,
                   recompute: Sequence[str], exact: bool = False) -> tuple[bool, float]:
    """Whether one of `grids` (one pipeline depth, data 1) fits; else the least peak bytes
    of its fullest stage. Unless `exact`, a depth whose fullest stage's weights and optimizer
    state alone exceed the memory is answered without partitioning it (peak: that floor)."""
    prec = PRECISIONS[precision]
    floor = state_floor(shape, prec, grids[0].pipeline)
    if not exact and floor > cluster.hardware.usable_memory:
        return False, floor
    least = float("inf")
    for grid in grids:
        bounds = time_balanced_boundaries(shape, cluster, prec, grid.pipeline,
                                          grid.micro_batch_size)
        modes, peak = choose_recompute(shape, cluster, grid, precision, bounds, recompute)
        if modes is not None:
            return True, peak
        least = min(least, peak)
    return False, least


def _nothing_fits(shape: Shape, cluster: Cluster, global_batch: int, precision: str,
                  schedules: Sequence[str], recompute: Sequence[str], max_micro_batch: int,
                  rejected: list[Rejection]) -> str:
    hw = cluster.hardware
    least = min(r.peak_memory_gb for r in rejected) if rejected else float("nan")
    head = (f"no plan fits: the {shape.params / 1e9:.2f}B-parameter model ({shape.describe()}) "
            f"needs at least {least:.1f} GB on its fullest stage on {cluster.gpus} GPU(s), with "
            f"every recomputation allowed ({', '.join(recompute)}); a {hw.name} has "
            f"{hw.usable_memory / GB:.1f} GB usable ({hw.memory_reserve_fraction:.0%} of "
            f"{hw.memory_bytes / GB:.0f} GB kept for the runtime).")
    reserve = 1 - hw.memory_reserve_fraction
    more, deepest = minimum_gpus(shape, cluster, global_batch, precision, schedules, recompute,
                                 max_micro_batch)
    if more is not None and more > cluster.gpus:
        return (f"{head} It fits on {more} GPUs (a {more}-stage pipeline): use --gpus {more} "
                f"or more, or a smaller model; on {cluster.gpus} GPU(s) it needs GPUs with at "
                f"least {least / reserve:.0f} GB.")
    advice = ("a shorter --seq-len, a smaller --global-batch-tokens, allowing full "
              "recomputation" if "full" not in recompute else "a shorter --seq-len")
    return (f"{head} No pipeline depth fits it on this GPU (pipeflow splits layers, not "
            f"matrices; the deepest pipeline still needs {deepest / GB:.1f} GB on a stage): use "
            f"GPUs with at least {deepest / GB / reserve:.0f} GB, a smaller model, or {advice}.")
