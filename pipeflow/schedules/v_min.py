"""V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", NeurIPS): a V of
two chunks a rank holding about a third of 1F1B's activations, (p + 4)/3 stages' worth, for a
bubble of about 2p/3m. The same capped list scheduler as V-Half (`v_half.py`), with the cap
at 2(p + 4)/3 chunks (half a stage each)."""

from __future__ import annotations

from pipeflow.schedules.spec import ScheduleSpec
from pipeflow.schedules.v_half import Op, capped_v_order

__all__ = ["SPEC"]


def min_cap(stages: int) -> int:
    """(p + 4)/3 stages' worth of activations, in chunks, rounded down (at least 2)."""
    return max(2, 2 * (stages + 4) // 3)


def order(stage: int, stages: int, microbatches: int, chunks: int = 2) -> list[Op]:
    return capped_v_order(stages, microbatches, min_cap(stages))[stage]


SPEC = ScheduleSpec("v-min", order, "a V at about a third of 1F1B's activations ((p+4)/3 "
                    "stages' worth), bubble about 2p/3m", chunks=2, layout="v",
                    split_backward=True, planned=False)
