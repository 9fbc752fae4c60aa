"""ZBV (Qi et al. 2024, section 6): the V-shaped zero-bubble schedule."""

from __future__ import annotations

from pipeflow.schedules.ir import BACKWARD, COMPUTE, FORWARD, WEIGHT
from pipeflow.schedules.spec import ScheduleSpec

# ZBV (Qi et al. 2024, section 6), 2 ranks, 4 micro-batches: 2p virtual stages in a V, rank r
# holding virtual stages r (chunk 0, on the way down) and 2p - 1 - r (chunk 1, on the way
# back), so rank 0 holds the first and the last, and the turn at rank p - 1 is local (its
# message to itself is a hand-over, no link). One unit is a chunk's F, B or W; rank 0 never
# waits:
#
#   rank 0 | F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3 B0 W0 F2.1 B2.1 W2.1 B1 W1 F3.1 ...
#
# (`format_table(build_schedule("zbv", 2, 4))` prints both ranks.) Rank r warms up with
# 2(p - r) - 1 chunk-0 forwards, interleaves chunk 1's first forwards, then runs F B W on each
# chunk in turn; the drain runs the W's it deferred where the last gradients are awaited.
# With F = B = W and m >= 2p - 1 the step takes 3m + (p - 1)/2 units of a whole stage's op:
# the bubble is p - 1 chunk units, half ZB-H1's, for the same peak memory (2p chunks, p
# stages' worth, on every rank). Counts below run as if m >= 2p - 1 (the least that fills the
# V); the micro-batches beyond m are then dropped (torch.distributed.pipelining's order).
def order(stage: int, stages: int, microbatches: int,
          chunks: int = 2) -> list[tuple[str, int, int]]:
    """The V-shaped zero-bubble schedule: two chunks a rank, rank 0 holds both ends."""
    p, r, n = stages, stage, max(2 * stages - 1, microbatches)
    count = {(op, c): 0 for op in COMPUTE for c in (0, 1)}
    out: list[tuple[str, int, int]] = []

    def run(op: str, chunk: int) -> None:
        out.append((op, count[(op, chunk)], chunk))
        count[(op, chunk)] += 1

    for op, chunk in [(FORWARD, 0)] * (2 * (p - r) - 1) + [(FORWARD, 1), (FORWARD, 0)] * r \
            + [(FORWARD, 1), (BACKWARD, 1), (WEIGHT, 1)] * (p - r):
        run(op, chunk)
    while count[(FORWARD, 1)] < count[(FORWARD, 0)] or count[(FORWARD, 0)] < n:
        if count[(FORWARD, 0)] < n:
            run(FORWARD, 0)
        for op, chunk in [(BACKWARD, 0), (WEIGHT, 0), (FORWARD, 1), (BACKWARD, 1), (WEIGHT, 1)]:
            run(op, chunk)
    for op, chunk in [(BACKWARD, 0), (BACKWARD, 1)] * r + [(BACKWARD, 0), (WEIGHT, 0)] * (p - r):
        run(op, chunk)
    for chunk in (1, 0):
        while count[(WEIGHT, chunk)] < count[(BACKWARD, chunk)]:
            run(WEIGHT, chunk)
    return [a for a in out if a[1] < microbatches]


def _v_full(p: int) -> int:
    """The least micro-batches that fill the V; below, ZB-H1 is as near at less memory."""
    return 2 * p - 1


def steady(p: int, m: int) -> tuple[tuple[float, ...], ...] | None:
    """2p chunks stashed and held on every rank, (p - 1)/2 idle units, once the V is full."""
    if m < _v_full(p):
        return None
    return (2.0 * p,) * p, (2.0 * p,) * p, ((p - 1) / 2,)


SPEC = ScheduleSpec("zbv", order, "zero bubble in a V, two chunks a rank: half ZB-H1's bubble "
                    "for 1F1B's memory", chunks=2, layout="v", split_backward=True,
                    planner_min_microbatches=_v_full, steady=steady)
