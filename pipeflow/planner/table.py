"""One partition's stages tabulated once for the search: memory fit and a step-time bound.

A partition of the layers into p stages at micro-batch size b is shared by every grid of that
(p, b): what each stage holds and computes per micro-batch does not depend on the data size,
the micro-batch count or the schedule. The search tabulates it once, then answers each grid
from the table: which recomputation fits each stage (`fit`, the figures of
`cost.stage_memory`, bit for bit) and a lower bound on the step time `cost.estimate` would
give (`step_time_bound`), so that grids which cannot beat the fastest found are never
estimated.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pipeflow.planner.cost import (Grid, PrecisionBytes, idle_units, layer_times,
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

    def fit(self, grid: Grid, precision: PrecisionBytes,
            usable: float) -> tuple[list[int] | None, float]:
        """(per stage the index in `modes` of the first recomputation whose memory fits
        `usable` bytes, or None when a stage fits none; the least peak bytes any choice
        reaches): `search.choose_recompute`'s answer."""
        per_param = precision.state_bytes_on(grid)
        chunks = schedule_chunks(grid.schedule)
        held = peak_held(grid.schedule, grid.pipeline, grid.microbatches, chunks)
        picks: list[int] | None = []
        least_peak = 0.0
        for st, params in enumerate(self.params):
            state, h = params * per_param, held[st]
            least, pick = None, None
            for i in range(len(self.modes)):
                # sum(cost.stage_memory(...)): the same operations in the same order.
                need = state + h * self.per_microbatch[i][st] / chunks + self.transient[i][st]
                least = need if least is None else min(least, need)
                if need <= usable:
                    pick = i
                    break
            least_peak = max(least_peak, least)
            if pick is None:
                picks = None
            elif picks is not None:
                picks.append(pick)
        return picks, least_peak

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


def stage_table(shape: Shape, cluster: Cluster, precision: PrecisionBytes,
                boundaries: Sequence[int], micro_batch_size: int,
                modes: Sequence[str]) -> StageTable:
    """The table of the partition `boundaries` at `micro_batch_size`, for `modes`."""
    b = micro_batch_size
    layers = [(boundaries[st], boundaries[st + 1]) for st in range(len(boundaries) - 1)]
    times = layer_times(shape, cluster, precision, b)
    memory = [[stage_bytes(shape, precision, b, lay, mode) for lay in layers] for mode in modes]
    compute = [[stage_compute(shape, cluster, precision, b, lay, mode, times) for lay in layers]
               for mode in modes]
    first = compute[0]

    def column(rows: list[list[tuple]], i: int) -> tuple[tuple, ...]:
        return tuple(tuple(x[i] for x in row) for row in rows)

    return StageTable(tuple(boundaries), tuple(modes), column(memory, 0)[0], column(memory, 1),
                      column(memory, 2), tuple(x[0] for x in first), column(compute, 1),
                      tuple(x[2] for x in first))
