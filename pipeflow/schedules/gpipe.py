"""GPipe (Huang et al. 2019): all forwards, then all backwards."""

from __future__ import annotations

from pipeflow.schedules.ir import BACKWARD, FORWARD
from pipeflow.schedules.spec import ScheduleSpec

# GPipe, 3 stages, 4 micro-batches (time runs right; one column a unit of compute):
#
#   stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
#   stage 1 | .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .
#   stage 2 | .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .  .
#
# Every stage stashes all m micro-batches before its first backward.
def order(stage: int, stages: int, microbatches: int,
          chunks: int = 1) -> list[tuple[str, int, int]]:
    """All forwards, then all backwards: stash `m` on every stage."""
    return [(op, mb, 0) for op in (FORWARD, BACKWARD) for mb in range(microbatches)]


def steady(p: int, m: int) -> tuple[tuple[float, ...], ...]:
    """m stashed on every stage, 3(p - 1) idle units."""
    return (float(m),) * p, (float(m),) * p, (3.0 * (p - 1),)


SPEC = ScheduleSpec("gpipe", order, "all forwards, then all backwards: bubble (p-1)/(m+p-1), "
                    "stash m on every stage", steady=steady)
