"""1F1B (PipeDream-Flush, Narayanan et al. 2021): one forward, one backward."""

from __future__ import annotations

from pipeflow.schedules.ir import BACKWARD, FORWARD, Action
from pipeflow.schedules.spec import ScheduleSpec

def order(stage: int, stages: int, microbatches: int,
          chunks: int = 1) -> list[tuple[str, int, int]]:
    """p - s - 1 warm-up forwards, then one forward one backward, then the drain."""
    warmup = min(stages - stage - 1, microbatches)
    out = [(FORWARD, mb, 0) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        out += [(FORWARD, warmup + i, 0), (BACKWARD, i, 0)]
    return out + [(BACKWARD, mb, 0) for mb in range(microbatches - warmup, microbatches)]


# 1F1B (PipeDream-Flush), 3 stages, 4 micro-batches:
#
#   stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
#   stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
#   stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
#
# (`format_table(build_schedule("1f1b", 3, 4))` prints this table.)
#
# Stage s runs p - s - 1 warm-up forwards, then alternates one forward and one backward, then
# drains: it never holds more than min(p - s, m) micro-batches, against GPipe's m, for the same
# bubble (p - 1) / (m + p - 1).
def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    """Warm-up forwards, then one forward one backward, then the remaining backwards."""
    return SPEC.program(stage, stages, microbatches)


def steady(p: int, m: int) -> tuple[tuple[float, ...], ...] | None:
    """Stash min(p - s, m) on stage s and 3(p - 1) idle units, for every m (with m < p the
    warm-up never ends: GPipe's m forwards then m backwards). No simulation, so the planner
    answers for a pipeline of hundreds of stages at once."""
    stash = tuple(float(min(p - s, m)) for s in range(p))
    return stash, stash, (3.0 * (p - 1),)


SPEC = ScheduleSpec("1f1b", order, "PipeDream-Flush: bubble (p-1)/(m+p-1), stash min(p-s, m) "
                    "on stage s", steady=steady)
