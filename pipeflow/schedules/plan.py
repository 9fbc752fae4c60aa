"""`Plan`: what every rank runs, computed once, the same everywhere, with no MPI and no torch.

From the schedule's name, its chunks per rank, the pipeline size, the micro-batches and the
stage boundaries, a `Plan` holds the layout of virtual stages over ranks, each rank's training
and evaluation programs, where each message goes (`route`), each rank's layers by chunk, the
instruction after which a rank's weight gradients are final, the simulated stash per rank and
each rank's recomputation policy. The engine executes it; `auto`, the planner and
`pipeflow schedule` build the same object for their candidates.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pipeflow.schedules import registry
from pipeflow.schedules.ir import (BACKWARD, FORWARD, RECV_ACT, SEND_ACT, WEIGHT, Action, Layout,
                                   Programs, Route, ScheduleError, route, with_messages)
from pipeflow.schedules.simulate import simulate
from pipeflow.schedules.spec import ScheduleSpec

__all__ = ["Plan"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One pipeline's plan; see the module's docstring. Build it with `Plan.build`."""

    spec: ScheduleSpec
    chunks: int
    stages: int
    microbatches: int
    boundaries: tuple[int, ...]        # virtual stage v runs layers boundaries[v]:boundaries[v+1]
    programs: Programs
    eval_programs: tuple[tuple[Action, ...], ...]
    peak_stash: tuple[int, ...]        # simulated, per rank
    recompute: tuple[str, ...]         # per rank ("auto" resolved by the stage on first use)

    @staticmethod
    def build(schedule: str, stages: int, microbatches: int, chunks: int | None = None,
              boundaries: Sequence[int] | None = None,
              recompute: Sequence[str] | None = None) -> "Plan":
        """The plan of `schedule` on `stages` ranks; `boundaries` (virtual stages + 1 of
        them; default one layer a virtual stage) and `recompute` (one policy a rank)."""
        spec = registry.get(schedule)
        chunks = spec.check(stages, microbatches, chunks)
        programs = registry.build_schedule(schedule, stages, microbatches, chunks)
        virtual = stages * chunks
        bounds = tuple(range(virtual + 1)) if boundaries is None else tuple(boundaries)
        if len(bounds) != virtual + 1:
            raise ScheduleError(f"{schedule} on {stages} stages with {chunks} chunk(s) a rank "
                                f"runs {virtual} virtual stages: expected {virtual + 1} "
                                f"boundaries, found {len(bounds)}: {list(bounds)}")
        policies = tuple(recompute) if recompute is not None else ("none",) * stages
        if len(policies) != stages:
            raise ScheduleError(f"expected one recompute policy per stage ({stages}), found "
                                f"{list(policies)}")
        evals = tuple(tuple(_eval_program(programs, r, microbatches)) for r in range(stages))
        return Plan(spec, chunks, stages, microbatches, bounds, programs, evals,
                    tuple(simulate(programs).peak_stash), policies)

    # -- where things are (the schedule's own facts: `spec`; the layout: `programs.layout`) --
    @property
    def last_virtual(self) -> int:
        return self.stages * self.chunks - 1

    def owner(self, virtual: int) -> tuple[int, int]:
        """(rank, chunk) of virtual stage `virtual`."""
        return self.programs.layout.owner[virtual]

    def rank_of_layer(self, layer: int) -> int:
        for v in range(self.last_virtual + 1):
            if self.boundaries[v] <= layer < self.boundaries[v + 1]:
                return self.owner(v)[0]
        raise IndexError(f"layer {layer} is outside the plan's {self.boundaries[-1]} layers")

    def holds_first(self, rank: int) -> bool:
        return self.owner(0)[0] == rank

    def holds_last(self, rank: int) -> bool:
        return self.owner(self.last_virtual)[0] == rank

    def layer_ranges(self, rank: int) -> list[range]:
        """The layers of each of `rank`'s chunks, in chunk order."""
        return [range(self.boundaries[v], self.boundaries[v + 1])
                for v in self.programs.layout[rank]]

    def route(self, act: Action, rank: int) -> Route:
        """Where the send or receive `act` of `rank` goes: peer, receiving chunk, tag."""
        return route(act, rank, self.programs.layout, self.microbatches)

    def last_gradient_action(self, rank: int) -> Action | None:
        """The instruction after which `rank`'s weight gradients are final for the step (its
        last W under split backward, else its last B)."""
        last = self.last_gradient_actions(rank)
        return max(last.values(), key=self.programs[rank].index) if last else None

    def last_gradient_actions(self, rank: int) -> dict[int, Action]:
        """Chunk -> the instruction after which that chunk's weight gradients are final (its
        last W under split backward, else its last B): each chunk's data-parallel buckets
        launch as they become final during it, so with several chunks a rank (interleaved,
        V) the earlier chunks' reductions overlap the later chunks' backwards."""
        op = WEIGHT if self.spec.split_backward else BACKWARD
        last: dict[int, Action] = {}
        for a in self.programs[rank]:
            if a.op == op:
                last[a.chunk] = a
        return last


def _eval_program(programs: Programs, rank: int, microbatches: int) -> list[Action]:
    """Forwards alone, in the training program's order with several chunks a rank, else in
    micro-batch order, so every rank meets its inputs in the order they are sent."""
    layout = programs.layout
    if len(layout[rank]) > 1:
        return [a for a in programs[rank] if a.op in (RECV_ACT, FORWARD, SEND_ACT)]
    order = [(FORWARD, mb, 0) for mb in range(microbatches)]
    return with_messages(order, layout[rank], layout.stages - 1)
