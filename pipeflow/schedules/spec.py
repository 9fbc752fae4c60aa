"""`ScheduleSpec`: everything the rest of pipeflow may know about a schedule, in one record.

A schedule is a generator of each rank's compute order plus a few facts: how many model chunks
a rank runs, how virtual stages lie over the ranks (looped or V), whether it splits the
backward into B and W, and its constraints. Config validation, `auto`, the planner's cost
model, the stage and the runner read these facts from the registry (`schedules.registry`);
none of them names a schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from pipeflow.schedules.ir import Action, Layout, ScheduleError, looped_layout, v_layout, \
    with_messages

__all__ = ["ScheduleSpec", "Order"]

# (stage, stages, micro-batches, chunks) -> the stage's compute order: (op, micro-batch, chunk)
Order = Callable[[int, int, int, int], list[tuple[str, int, int]]]


def _one(p: int) -> int:
    return 1


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """One schedule, as data.

    `chunks`: model chunks per rank, fixed (1; 2 for a V), or None where the user chooses
    (`virtual_stages`, at least `min_chunks`, by default `default_chunks`). `layout`:
    "looped" (rank r holds r, r + p, ...) or "v" (rank r holds r and 2p - 1 - r).
    `microbatch_multiple(p)`: micro-batches must be a multiple of it (interleaved: p).
    `min_stages`: the least pipeline size it runs on. The planner fields say how the cost
    model weighs it.
    """

    name: str
    order: Order
    summary: str
    chunks: int | None = 1
    default_chunks: int = 1
    min_chunks: int = 1
    layout: str = "looped"
    split_backward: bool = False
    microbatch_multiple: Callable[[int], int] = _one
    min_stages: int = 1
    # For the planner's cost model: whether it times this schedule, the least micro-batches
    # it weighs it at (a V fills at 2p - 1), and where known in closed form, for F = B = W
    # = 1 unit, (peak stash per stage, peak held per stage, (idle units,)) or None.
    planned: bool = True
    planner_min_microbatches: Callable[[int], int] = _one
    steady: Callable[[int, int], tuple[tuple[float, ...], ...] | None] | None = None

    # -- chunks and layout ---------------------------------------------------------------
    def resolve_chunks(self, chunks: int | None) -> int:
        """The model chunks per rank for a request (None or 1: the schedule's own), or a
        `ScheduleError` that says what to set."""
        if self.chunks is not None:
            if chunks in (None, 1, self.chunks):
                return self.chunks
            raise ScheduleError(
                f"schedule {self.name!r} runs exactly {self.chunks} model "
                f"chunk{'s' if self.chunks > 1 else ''} per rank"
                + (" (a V)" if self.layout == "v" else "") + f", found virtual_stages = "
                f"{chunks}; leave virtual_stages out (or set {self.chunks}), or use schedule "
                f"'interleaved' for another count")
        chunks = self.default_chunks if chunks is None else chunks
        if chunks < self.min_chunks:
            raise ScheduleError(
                f"schedule {self.name!r} runs several model chunks per rank: set "
                f"virtual_stages >= {self.min_chunks} (2 halves the bubble), found "
                f"virtual_stages = {chunks}")
        return chunks

    def ring(self, chunks: int) -> bool:
        """Whether the pipeline's last rank sends to its first (a looped layout with more
        than one chunk a rank); a V turns on one rank and needs no such link."""
        return self.layout == "looped" and chunks > 1

    def layout_of(self, stages: int, chunks: int) -> Layout:
        """`layout[rank][chunk]` -> virtual stage."""
        return v_layout(stages, chunks) if self.layout == "v" else looped_layout(stages, chunks)

    # -- constraints ---------------------------------------------------------------------
    def problem(self, stages: int, microbatches: int, chunks: int | None = None) -> str:
        """Why this schedule cannot run `microbatches` on `stages` ranks with `chunks` model
        chunks a rank, in the words a user sees; "" when it can."""
        if stages < 1 or microbatches < 1:
            return (f"a pipeline needs stages >= 1 and microbatches >= 1, found "
                    f"stages = {stages}, microbatches = {microbatches}")
        try:
            chunks = self.resolve_chunks(chunks)
        except ScheduleError as exc:
            return str(exc)
        if stages < self.min_stages:
            return (f"schedule {self.name!r} passes model chunks between pipeline stages and "
                    f"needs Config.pipeline >= {self.min_stages}, found pipeline = {stages}: one "
                    f"stage has no bubble to shrink; use schedule '1f1b' (or 'gpipe')")
        group = self.microbatch_multiple(stages)
        if microbatches % group:
            return (f"schedule {self.name!r} runs micro-batches in groups of {group}: "
                    f"microbatches must be a multiple of {group}, found {microbatches}; set "
                    f"microbatches = {-(-microbatches // group) * group}")
        return ""

    def check(self, stages: int, microbatches: int, chunks: int | None = None) -> int:
        """`problem` as a `ScheduleError`; returns the chunks per rank that will run."""
        found = self.problem(stages, microbatches, chunks)
        if found:
            raise ScheduleError(found)
        return self.resolve_chunks(chunks)

    # -- programs ------------------------------------------------------------------------
    def program(self, stage: int, stages: int, microbatches: int,
                chunks: int | None = None) -> list[Action]:
        """One rank's instruction list, messages included (receives not yet reordered per
        link: `registry.build_schedule` does that over all ranks)."""
        chunks = self.check(stages, microbatches, chunks)
        if not 0 <= stage < stages:
            raise ScheduleError(f"need 0 <= stage < stages, found stage = {stage}, "
                                f"stages = {stages}")
        order = self.order(stage, stages, microbatches, chunks)
        return with_messages(order, self.layout_of(stages, chunks)[stage],
                             stages * chunks - 1)
