"""The registry: every schedule pipeflow runs, by name, in order of simplicity.

A schedule is one module of this package defining `SPEC` (a `ScheduleSpec`); its line in
`_MODULES` registers it. The order is `auto`'s preference among schedules within noise of
the fastest: simpler first (fewer messages, no split backward).
"""

from __future__ import annotations

import importlib

from pipeflow.schedules.ir import Layout, Programs, ScheduleError
from pipeflow.schedules.links import receives_in_send_order
from pipeflow.schedules.spec import ScheduleSpec

__all__ = ["SCHEDULES", "get", "names", "build_schedule", "stage_layout"]

_MODULES = (
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "zb_h1",
    "zbv",
    "v_half",
    "v_min",
)

SCHEDULES: dict[str, ScheduleSpec] = {}
for _module in _MODULES:
    _spec = importlib.import_module(f"pipeflow.schedules.{_module}").SPEC
    SCHEDULES[_spec.name] = _spec

# "1f1b" first: the default, and the simplest schedule `auto` prefers.
SCHEDULES = {"1f1b": SCHEDULES.pop("1f1b"), **SCHEDULES}


def names() -> list[str]:
    """Every registered schedule's name, simplest first."""
    return list(SCHEDULES)


def get(name: str) -> ScheduleSpec:
    """The spec of schedule `name`, or a `ScheduleError` listing the known ones."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ScheduleError(f"unknown schedule {name!r}; known: {names()}") from None


def build_schedule(name: str, stages: int, microbatches: int,
                   chunks: int | None = None) -> Programs:
    """Every stage's instruction list for schedule `name`, with the receives on each link put
    in the order of its sends. `chunks`: model chunks per rank, where the schedule lets the
    user choose (interleaved; default 2); the others run their own."""
    spec = get(name)
    chunks = spec.check(stages, microbatches, chunks)
    layout = spec.layout_of(stages, chunks)
    programs = [spec.program(s, stages, microbatches, chunks) for s in range(stages)]
    return Programs(receives_in_send_order(programs, layout), layout)


def stage_layout(name: str, stages: int, chunks: int = 1) -> Layout:
    """`layout[rank][chunk]` -> virtual stage for schedule `name`."""
    spec = get(name)
    return spec.layout_of(stages, spec.resolve_chunks(chunks))
