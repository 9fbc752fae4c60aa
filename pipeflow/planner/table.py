"""One partition's stages tabulated once for the search: memory fit and a step-time bound.

A partition of the layers into p stages at micro-batch size b and tensor degree t (with or
without sequence parallelism) is shared by every grid of that (p, b, t, sp): what each stage
holds and computes per micro-batch does not depend on the data size,
the micro-batch count or the schedule. The search tabulates it once, then answers each grid
from the table: which recomputation fits each stage (`fit`, the figures of
`cost.stage_memory`, bit for bit) and a lower bound on the step time `cost.estimate` would
give (`step_time_bound`), so that grids which cannot beat the fastest found are never
estimated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

from pipeflow.planner.cost import (Grid, PrecisionBytes, _stage_kinds, idle_units, layer_times,
                                   optimizer_time, peak_held, schedule_chunks, split_backward,
                                   stage_bytes, stage_compute)
from pipeflow.planner.hardware import Cluster
from pipeflow.planner.shapes import Shape

__all__ = ["StageTable", "stage_table"]

# `step_time_bound` is lowered by this share, so that rounding in a sum taken in another
# order can never lift it above the estimate.
_SLACK = 1e-9


@dataclasses.dataclass(frozen=True)
class StageTable:
    """Per stage of one partition at one micro-batch size, per recomputation in `modes`
    order (`[mode][stage]`): the figures `cost.stage_memory` and `cost.estimate` scale by
    the grid."""

    boundaries: tuple[int, ...]
    modes: tuple[str, ...]
    params: tuple[int, ...]
    per_microbatch: tuple[tuple[float, ...], ...]   # activation bytes one micro-batch leaves
    transient: tuple[tuple[float, ...], ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[tuple[float, ...], ...]       # recomputation included
    plain_backward_s: tuple[float, ...]

    @property
    def pipeline(self) -> int:
        return len(self.params)

    def __post_init__(self) -> None:
        import numpy as np          # not at module level: the planner imports without it
        # The columns as arrays, for `fit`'s per-grid arithmetic on every stage at once (the
        # search asks tens of thousands of grids on a large cluster; a loop over stages and
        # modes in Python took most of `pipeflow plan --gpus 16384`'s 10 s).
        arrays = (np.asarray(self.params, dtype=np.float64),
                  np.asarray(self.per_microbatch, dtype=np.float64),
                  np.asarray(self.transient, dtype=np.float64), np.arange(len(self.params)))
        object.__setattr__(self, "_arrays", arrays)

    def fit(self, grid: Grid, precision: PrecisionBytes,
            usable: float) -> tuple[list[int] | None, float]:
        """(per stage the index in `modes` of the first recomputation whose memory fits
        `usable` bytes, or None when a stage fits none; the least peak bytes any choice
        reaches): `search.choose_recompute`'s answer."""
        per_param = precision.state_bytes_on(grid)
        chunks = schedule_chunks(grid.schedule)
        held = peak_held(grid.schedule, grid.pipeline, grid.microbatches, chunks)
        import numpy as np
        params, per_microbatch, transient, stages = self._arrays
        # sum(cost.stage_memory(...)): the same operations in the same order, element-wise in
        # float64 (IEEE arithmetic: bit for bit the Python floats), [mode][stage].
        h = _held_column(held, len(self.params))
        need = params * per_param + h * per_microbatch / chunks + transient
        fits = need <= usable
        pick = fits.argmax(axis=0)
        # The least need among the modes tried: the one picked where one fits (those tried
        # before it need more than `usable`), the least of all where none does.
        least = need[pick, stages]
        fitting = fits[pick, stages]
        if fitting.all():
            return pick.tolist(), max(0.0, float(least.max()))
        least = np.where(fitting, least, need.min(axis=0))
        return None, max(0.0, float(least.max()))

    def step_time_bound(self, cluster: Cluster, grid: Grid, picks: Sequence[int]) -> float:
        """A lower bound on `cost.estimate(...).step_time_s` with recomputation `picks`:
        its pipeline span without the point-to-point sends, and of its tail the optimizer
        step alone (the all-reduce left out). Each left-out term is >= 0 and the span's
        bubble, Σ gaps - gap of the slowest, only grows with any stage's gap."""
        p, m = grid.pipeline, grid.microbatches
        fwd = self.forward_s
        bwd = [self.backward_s[i][st] for st, i in enumerate(picks)]
        per_mb = [f + b for f, b in zip(fwd, bwd)]
        if split_backward(grid.schedule):
            # cost._pipeline_time's F + (B - W) - W + sends, W half the plain backward.
            gaps = [f + (b - w / 2) - w / 2
                    for f, b, w in zip(fwd, bwd, self.plain_backward_s)]
        else:
            gaps = [t / 3 for t in per_mb]
        scale = idle_units(grid.schedule, p, m, schedule_chunks(grid.schedule)) / (p - 1) \
            if p > 1 else 0.0
        pipeline = m * max(per_mb) + scale * (sum(gaps) - max(gaps))
        sharded = grid.shard_optimizer and grid.data > 1
        tail = max(optimizer_time(cluster, n, grid.data, sharded) for n in self.params)
        return (pipeline + tail) * (1 - _SLACK)


@functools.lru_cache(maxsize=4096)
def _held_column(held: tuple[int, ...], stages: int) -> Any:
    """`peak_held`'s first `stages` counts as a float64 column (read-only: it is shared)."""
    import numpy as np
    column = np.asarray(held[:stages], dtype=np.float64)
    column.flags.writeable = False
    return column


def stage_table(shape: Shape, cluster: Cluster, precision: PrecisionBytes,
                boundaries: Sequence[int], micro_batch_size: int,
                modes: Sequence[str], tensor: int = 1,
                sequence_parallel: bool = False) -> StageTable:
    """The table of the partition `boundaries` at `micro_batch_size` and `tensor` (one rank
    of each stage's tensor group), for `modes`."""
    b, t, sp = micro_batch_size, tensor, sequence_parallel
    layers = [(boundaries[st], boundaries[st + 1]) for st in range(len(boundaries) - 1)]
    times = layer_times(shape, cluster, precision, b, t, sp)
    # A stage's figures depend on its layers only through how many of each kind it holds:
    # most stages of a deep pipeline hold alike, so each kind count is computed once.
    kinds = [tuple(_stage_kinds(shape, lay).values()) for lay in layers]
    first_of: dict[tuple[int, ...], tuple[int, int]] = {}
    for k, lay in zip(kinds, layers):
        first_of.setdefault(k, lay)
    memory, compute = [], []
    for mode in modes:
        by_bytes = {k: stage_bytes(shape, precision, b, lay, mode, t, sp)
                    for k, lay in first_of.items()}
        by_time = {k: stage_compute(shape, cluster, precision, b, lay, mode, times, t)
                   for k, lay in first_of.items()}
        memory.append([by_bytes[k] for k in kinds])
        compute.append([by_time[k] for k in kinds])
    first = compute[0]

    def column(rows: list[list[tuple]], i: int) -> tuple[tuple, ...]:
        return tuple(tuple(x[i] for x in row) for row in rows)

    return StageTable(tuple(boundaries), tuple(modes), column(memory, 0)[0], column(memory, 1),
                      column(memory, 2), tuple(x[0] for x in first), column(compute, 1),
                      tuple(x[2] for x in first))
