"""Interleaved 1F1B (Narayanan et al. 2021): several model chunks a rank, looped."""

from __future__ import annotations

from pipeflow.schedules.ir import BACKWARD, FORWARD
from pipeflow.schedules.spec import ScheduleSpec

# Interleaved 1F1B (Narayanan et al. 2021), 2 ranks, 2 chunks each, 4 micro-batches: the model
# is cut into 4 virtual stages, rank r holding virtual stages r and r + 2, so a micro-batch
# visits every rank twice. Each unit is a chunk (half a rank's layers): the ramps shrink to
# half, and the bubble to (p - 1) / (v·m + p - 1), for v times the point-to-point messages.
#
#   rank 0 | F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 .  B2.1 .  B3.1 B2 B3
#
# (`format_table(build_schedule("interleaved", 2, 4, chunks=2))` prints both ranks.)
def order(stage: int, stages: int, microbatches: int,
          chunks: int = 2) -> list[tuple[str, int, int]]:
    """1F1B over `chunks` model chunks per rank, visiting them round-robin in groups of p
    micro-batches (Megatron-LM's order). Needs m to be a multiple of p."""
    p, v, m = stages, chunks, microbatches
    total = m * v

    def unit(k: int, op: str) -> tuple[str, int, int]:
        group = (k // p) % v
        chunk = group if op == FORWARD else v - 1 - group
        return op, (k // (p * v)) * p + k % p, chunk

    if m == p:
        warmup = total      # one group: every forward comes before the first backward
    else:
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    out = [unit(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        out += [unit(k + warmup, FORWARD), unit(k, BACKWARD)]
    return out + [unit(k, BACKWARD) for k in range(total - warmup, total)]


def _groups_of_p(p: int) -> int:
    return p


SPEC = ScheduleSpec("interleaved", order, "1F1B over v model chunks a rank (looped): bubble "
                    "(p-1)/(vm+p-1), v times the messages", chunks=None, default_chunks=2,
                    min_chunks=2, microbatch_multiple=_groups_of_p, min_stages=2,
                    planned=False)
