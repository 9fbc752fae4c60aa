"""V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", NeurIPS): a V of
two chunks a rank holding about half of 1F1B's activations, for a bubble of about p/2m.

Every rank holds virtual stages r and 2p - 1 - r (the V). The order comes from a list
scheduler that runs all ranks together in unit steps (F = B = W = one step of a chunk) under
a cap on the micro-batch chunks each rank holds (forwarded, W not done). On each rank, each
step: a ready B first (it unblocks the previous stage), else a forward if the cap allows
(the way back, chunk 1, before a new micro-batch on chunk 0), else a W (it frees memory). A
new micro-batch's chunk 0 starts only if one place stays free, so the next chunk-1 forward,
the oldest micro-batch's, always finds room and a V never deadlocks on memory. The cap sets
the memory, and the bubble follows:

    cap p + 2 chunks = (p + 2)/2 stages' worth     (1F1B: p; ZBV: p, with no bubble)

V-Min (`v_min.py`) runs the same scheduler at about a third.

V-Half, 4 ranks, 8 micro-batches (`pipeflow schedule -s v-half -p 4 -m 8` draws it)."""

from __future__ import annotations

import functools

from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, ScheduleError, v_layout
from pipeflow.schedules.spec import ScheduleSpec

__all__ = ["capped_v_order", "SPEC"]

Op = tuple[str, int, int]       # (op, micro-batch, chunk)


def capped_v_order(stages: int, microbatches: int, cap: int) -> list[list[Op]]:
    """Every rank's compute order for a V under a cap of `cap` (>= 2) held micro-batch
    chunks a rank; see the module's docstring. Of the admission rules (`_run`), the one whose
    order takes the fewest steps."""
    return [list(o) for o in _best(stages, microbatches, cap)]


@functools.lru_cache(maxsize=64)
def _best(stages: int, microbatches: int, cap: int) -> tuple[tuple[Op, ...], ...]:
    runs = [_run(stages, microbatches, cap, reserve, back, lead)
            for reserve in ("one", "each") for back in (1, 0) for lead in (BACKWARD, FORWARD)]
    steps = min(r[0] for r in runs)
    return tuple(tuple(o) for o in next(r[1] for r in runs if r[0] == steps))


def _run(stages: int, microbatches: int, cap: int, reserve: str, back: int,
         lead: str) -> tuple[int, list[list[Op]]]:
    """(steps, orders) of the list scheduler. `reserve`: a new micro-batch leaves "one"
    place free, or one for the chunk-1 forward of "each" micro-batch started here; `back`:
    the chunk whose B goes first when both are ready at the same micro-batch; `lead`: a ready
    B before a chunk-1 forward (BACKWARD) or after it (FORWARD)."""
    p, m = stages, microbatches
    if cap < 2:
        raise ScheduleError(f"a V needs room for both chunks of a micro-batch: cap >= 2, "
                            f"found {cap}")
    done: dict[tuple[str, int, int], int] = {}        # (op, virtual, mb) -> step finished
    nxt = {(op, r, c): 0 for op in (FORWARD, BACKWARD) for r in range(p) for c in (0, 1)}
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]   # (mb, chunk), B order
    held = [0] * p
    orders: list[list[Op]] = [[] for _ in range(p)]
    layout = v_layout(p)                              # layout[rank][chunk] -> virtual stage
    last, step = 2 * p - 1, 0

    def ready(op: str, r: int, c: int) -> int | None:
        mb = nxt[(op, r, c)]
        if mb >= m:
            return None
        v = layout[r][c]
        if op == FORWARD:
            need = [] if v == 0 else [(FORWARD, v - 1, mb)]
        else:
            need = [(FORWARD, v, mb)] + ([] if v == last else [(BACKWARD, v + 1, mb)])
        return mb if all(done.get(k, step) < step for k in need) else None

    while any(len(o) < 6 * m for o in orders):
        chosen: list[tuple[int, Op]] = []
        for r in range(p):
            pick = _pick(r, ready, pending_w[r], held[r], nxt, cap, reserve, back, lead)
            if pick is not None:
                chosen.append((r, pick))
        if not chosen:
            raise ScheduleError(f"capped V order: no rank can move at step {step} "
                                f"(p={p}, m={m}, cap={cap})")
        for r, (op, mb, c) in chosen:
            orders[r].append((op, mb, c))
            if op == WEIGHT:
                pending_w[r].pop(0)
                held[r] -= 1
                continue
            done[(op, layout[r][c], mb)] = step
            nxt[(op, r, c)] += 1
            if op == FORWARD:
                held[r] += 1
            else:
                pending_w[r].append((mb, c))
        step += 1
    return step, orders


def _pick(r: int, ready, pending_w: list[tuple[int, int]], held: int,
          nxt: dict[tuple[str, int, int], int], cap: int, reserve: str, back: int,
          lead: str) -> Op | None:
    """Rank r's next op: a ready B, else a forward the cap allows, else its oldest W."""
    if lead == FORWARD and held + 1 <= cap and ready(FORWARD, r, 1) is not None:
        return FORWARD, nxt[(FORWARD, r, 1)], 1
    backs = [(mb, c != back, c) for c in (0, 1) if (mb := ready(BACKWARD, r, c)) is not None]
    if backs:
        mb, _, c = min(backs)
        return BACKWARD, mb, c
    # A new micro-batch leaves a place free: the next chunk-1 forward (that of the oldest
    # micro-batch in flight, which then completes and frees its places) always finds room.
    owed = nxt[(FORWARD, r, 0)] - nxt[(FORWARD, r, 1)] if reserve == "each" else 0
    if held + 1 <= cap and ready(FORWARD, r, 1) is not None:
        return FORWARD, nxt[(FORWARD, r, 1)], 1
    if held + owed + 2 <= cap and ready(FORWARD, r, 0) is not None:
        return FORWARD, nxt[(FORWARD, r, 0)], 0
    if pending_w:
        mb, c = pending_w[0]
        return WEIGHT, mb, c
    return None


def half_cap(stages: int) -> int:
    """(p + 2)/2 stages' worth of activations, in chunks (half a stage each)."""
    return stages + 2


def order(stage: int, stages: int, microbatches: int, chunks: int = 2) -> list[Op]:
    return capped_v_order(stages, microbatches, half_cap(stages))[stage]


SPEC = ScheduleSpec("v-half", order, "a V at about half of 1F1B's activations ((p+2)/2 "
                    "stages' worth), bubble about p/2m", chunks=2, layout="v",
                    split_backward=True, planned=False)
