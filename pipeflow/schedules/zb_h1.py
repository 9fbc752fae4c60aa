"""ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", handcrafted H1)."""

from __future__ import annotations

from pipeflow.schedules.ir import BACKWARD, WEIGHT
from pipeflow.schedules.one_f_one_b import order as one_f_one_b_order
from pipeflow.schedules.spec import ScheduleSpec

# ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", the handcrafted H1), 3 stages,
# 4 micro-batches, F = B = W = 1 unit:
#
#   stage 0 | F0 F1 F2 .  .  B0 W0 F3 B1 W1 B2 W2 B3 W3
#   stage 1 | .  F0 F1 .  B0 F2 B1 W0 F3 B2 W1 B3 W2 W3
#   stage 2 | .  .  F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3
#
# (`format_table(build_schedule("zb-h1", 3, 4))` prints this table.)
#
# 1F1B's order of F and B, each backward split into B (the input gradient the previous stage
# waits for) and W (the weight gradient nobody waits for). Stage s defers W(i) to right after
# B(i + s): the deferred W's fill the gaps where 1F1B's drain waits on gradients. The stash
# (forwarded, B not done) stays 1F1B's min(p - s, m) and, counting the micro-batches whose W
# waits, no stage holds more than min(p, m), 1F1B's stage 0. With F = B = W the step takes
# 3m + p - 1 + max(0, p - m) units against 1F1B's 3(m + p - 1): for m >= p a bubble of p - 1
# units instead of 3(p - 1), a third.
def order(stage: int, stages: int, microbatches: int,
          chunks: int = 1) -> list[tuple[str, int, int]]:
    """1F1B with split backward; stage s runs W(i) right after B(i + s) (or after its last B)."""
    m = microbatches
    due: dict[int, list[int]] = {}
    for i in range(m):
        due.setdefault(min(i + stage, m - 1), []).append(i)
    out: list[tuple[str, int, int]] = []
    for op, mb, _ in one_f_one_b_order(stage, stages, m):
        out.append((op, mb, 0))
        if op == BACKWARD:
            out += [(WEIGHT, i, 0) for i in due.get(mb, [])]
    return out


def steady(p: int, m: int) -> tuple[tuple[float, ...], ...]:
    """1F1B's stash min(p - s, m), min(p, m) held on every stage (with the pending W's), and
    p - 1 idle units once m >= p, p - 1 + (p - m) below (the simulator's, for every m: the
    planner weighs pipelines of a hundred stages with fewer micro-batches without simulating
    them)."""
    held = float(min(p, m))
    return (tuple(float(min(p - s, m)) for s in range(p)), (held,) * p,
            (p - 1.0 + max(0, p - m),))


SPEC = ScheduleSpec("zb-h1", order, "1F1B with the backward split in B and W, W deferred: a third "
                    "of 1F1B's bubble for 1F1B's memory", split_backward=True, steady=steady)
