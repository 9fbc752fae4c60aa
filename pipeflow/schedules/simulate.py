"""The simulator: replay every rank's program together, in simulated time.

It proves a schedule runs (no deadlock, every message received, each micro-batch's F, B and W
once and in order, each link received in send order) and measures it: makespan, bubble, and
per rank the peak stash (forwarded, B not done), pending W's and all held micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pipeflow.schedules.ir import (BACKWARD, COMPUTE, FORWARD, RECV_ACT, RECV_GRAD, RECVS, SENDS,
                                   WEIGHT, Action, Layout, Message, ScheduleError, looped_layout,
                                   route)
from pipeflow.schedules.links import check_link_order

__all__ = ["SimResult", "simulate", "format_table"]


@dataclasses.dataclass
class SimResult:
    """What a replay of all stages found."""

    makespan: float                  # time from the first instruction to the last
    busy: list[float]                # compute time per stage
    peak_stash: list[int]            # most micro-batches forwarded but not yet backwarded (B)
    timeline: list[list[tuple[float, float, Action]]]  # per stage: (start, end, action)
    # Most micro-batches whose B is done but W is not (0 without split backward): their
    # autograd graph is still held for W.
    peak_pending_w: list[int] = dataclasses.field(default_factory=list)
    # Most micro-batches forwarded whose backward is not complete (B, and W when split).
    peak_held: list[int] = dataclasses.field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Idle fraction of all stages' time: (p - 1) / (m + p - 1) for GPipe and 1F1B."""
        total = self.makespan * len(self.busy)
        return 1.0 - sum(self.busy) / total if total else 0.0


def simulate(programs: Sequence[Sequence[Action]], forward_time: float = 1.0,
             backward_time: float | None = None, comm_time: float = 0.0, *,
             backward_input_time: float = 1.0, weight_time: float = 1.0,
             layout: Sequence[Sequence[int]] | None = None,
             stage_times: Sequence[tuple[float, float, float]] | None = None) -> SimResult:
    """Replay every stage's program together and check it can run.

    Sends never block (the engine posts them and moves on); a receive waits until the matching
    send has been issued. Raises `ScheduleError` on a deadlock (every unfinished stage waits
    for a message nobody will send), on a send no stage receives, on a link whose receives
    come in another order than its sends, and on a program that does not run each
    micro-batch's forward and backward (and W, if any) exactly once, in that order.

    Times: F takes `forward_time`; in a schedule with W, B takes `backward_input_time` and W
    `weight_time`; in one without, B is the whole backward, `backward_time` (default
    `backward_input_time + weight_time`). With model chunks, a chunk's op takes 1/chunks of
    that: a rank's whole forward of a micro-batch still takes `forward_time`. `layout` (which
    virtual stage each rank's chunk runs) defaults to the programs' own (`Programs`), else
    the interleaved one.

    `stage_times[v] = (F, B, W)`, one entry a virtual stage, replaces the scalar times with
    each virtual stage's own (an uneven partition, a heavy last stage): its ops take them
    as given, not divided by the chunks; without W in the schedule B takes B + W.
    """
    stages = len(programs)
    chunks = 1 + max((a.chunk for prog in programs for a in prog), default=0)
    layout = layout or getattr(programs, "layout", None) or looped_layout(stages, chunks)
    layout = layout if isinstance(layout, Layout) else Layout(layout)
    split = any(a.op == WEIGHT for prog in programs for a in prog)
    _check_programs(programs, layout, split)
    if stage_times is None:
        full = backward_input_time + weight_time if backward_time is None else backward_time
        b, w = (backward_input_time, weight_time) if split else (full, 0.0)
        times = [(forward_time / chunks, b / chunks, w / chunks)] * (stages * chunks)
    else:
        times = _check_stage_times(stage_times, stages * chunks)
    durations = {v: {FORWARD: f, BACKWARD: b if split else b + w, WEIGHT: w}
                 for v, (f, b, w) in enumerate(times)}
    result = _replay(programs, layout, durations, comm_time, split)
    check_link_order(programs, layout)
    return result


def _check_stage_times(stage_times: Sequence[tuple[float, float, float]],
                       virtual: int) -> list[tuple[float, float, float]]:
    times = [tuple(float(t) for t in entry) for entry in stage_times]
    if len(times) != virtual or any(len(t) != 3 or min(t) < 0 for t in times):
        raise ScheduleError(
            f"stage_times needs one (F, B, W) triple of times >= 0 per virtual stage, "
            f"{virtual} in all, found {list(stage_times)!r}")
    return times


def _replay(programs: Sequence[Sequence[Action]], layout: Layout,
            durations: dict[int, dict[str, float]], comm_time: float,
            split: bool) -> SimResult:
    """`durations[virtual stage][op]`: how long each compute op takes there."""
    stages = len(programs)
    clock, busy, pc = [0.0] * stages, [0.0] * stages, [0] * stages
    held = {kind: [0] * stages for kind in ("stash", "pending_w", "held")}
    peaks = {kind: [0] * stages for kind in held}
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(stages)]
    in_flight: dict[Message, float] = {}            # message -> arrival time
    while not all(pc[s] == len(programs[s]) for s in range(stages)):
        progressed = False
        for s, prog in enumerate(programs):
            while pc[s] < len(prog):
                act = prog[pc[s]]
                if act.op in RECVS:
                    msg = route(act, s, layout, 1).message
                    if msg not in in_flight:
                        break                     # blocked until the sender gets there
                    clock[s] = max(clock[s], in_flight.pop(msg))
                elif act.op in SENDS:
                    in_flight[route(act, s, layout, 1).message] = clock[s] + comm_time
                else:
                    took = durations[layout[s][act.chunk]][act.op]
                    timeline[s].append((clock[s], clock[s] + took, act))
                    clock[s] += took
                    busy[s] += took
                    _count(held, peaks, s, act.op, split)
                pc[s] += 1
                progressed = True
        if not progressed:
            waiting = ", ".join(f"stage {s} at {programs[s][pc[s]]} (instruction {pc[s]})"
                                for s in range(stages) if pc[s] < len(programs[s]))
            raise ScheduleError(f"deadlock: every unfinished stage waits on a receive: {waiting}")
    if in_flight:
        lost = ", ".join(f"{kind} of micro-batch {mb} to "
                         + (f"virtual stage {dest}" if layout.stages > stages else f"stage {dest}")
                         for kind, mb, dest in sorted(in_flight))
        raise ScheduleError(f"send with no matching receive: {lost}")
    return SimResult(makespan=max(clock) if clock else 0.0, busy=busy,
                     peak_stash=peaks["stash"], timeline=timeline,
                     peak_pending_w=peaks["pending_w"], peak_held=peaks["held"])


def _count(held: dict[str, list[int]], peaks: dict[str, list[int]], s: int, op: str,
           split: bool) -> None:
    """Per stage: the stash (F done, B not), the pending W's (B done, W not) and all held
    (F done, backward not complete), and their peaks."""
    if op == FORWARD:
        held["stash"][s] += 1
        held["held"][s] += 1
    elif op == BACKWARD:
        held["stash"][s] -= 1
        if split:
            held["pending_w"][s] += 1
        else:
            held["held"][s] -= 1
    else:
        held["pending_w"][s] -= 1
        held["held"][s] -= 1
    for kind, counts in held.items():
        peaks[kind][s] = max(peaks[kind][s], counts[s])


def _check_programs(programs: Sequence[Sequence[Action]], layout: Sequence[Sequence[int]],
                    split: bool) -> None:
    """Each stage runs F, then B, then (split) W exactly once per micro-batch and chunk, with
    its messages before them."""
    last = max(v for chunks in layout for v in chunks)
    ops = COMPUTE if split else (FORWARD, BACKWARD)
    m = len([a for a in programs[0] if a.op == FORWARD and a.chunk == 0]) if programs else 0
    for s, prog in enumerate(programs):
        for c in range(len(layout[s])):
            runs = {op: [a.mb for a in prog if a.op == op and a.chunk == c] for op in COMPUTE}
            if any(sorted(runs[op]) != list(range(m)) for op in ops) or \
                    (not split and runs[WEIGHT]):
                where = f"stage {s}" + (f" chunk {c}" if len(layout[s]) > 1 else "")
                names = {FORWARD: "forwards", BACKWARD: "backwards", WEIGHT: "W's"}
                raise ScheduleError(
                    f"{where}: expected one forward and one backward{' and one W' * split} "
                    f"of each micro-batch 0..{m - 1}, found "
                    + " and ".join(f"{names[op]} {runs[op]}" for op in ops))
        _check_order(s, prog, layout[s], last)


def _check_order(s: int, prog: Sequence[Action], virtuals: Sequence[int], last: int) -> None:
    done: set[tuple[str, int, int]] = set()
    for act in prog:
        virtual = virtuals[act.chunk]
        need = {FORWARD: (RECV_ACT, "receiving its input", virtual > 0),
                BACKWARD: (FORWARD, "its forward", True),
                WEIGHT: (BACKWARD, "its B", True)}.get(act.op)
        if need and need[2] and (need[0], act.mb, act.chunk) not in done:
            raise ScheduleError(f"stage {s} runs {act} before {need[1]}")
        if act.op == BACKWARD and virtual < last and (RECV_GRAD, act.mb, act.chunk) not in done:
            raise ScheduleError(f"stage {s} runs {act} before receiving its gradient")
        done.add((act.op, act.mb, act.chunk))


def format_table(programs: Sequence[Sequence[Action]], **sim_kwargs: float) -> str:
    """The pipeline order as a table, one column a stage, one row a unit of simulated time
    (every op one unit unless times are given: a whole backward too)."""
    sim_kwargs.setdefault("backward_time", 1.0)
    result = simulate(programs, **sim_kwargs)
    slots: dict[float, list[str]] = {}
    for s, events in enumerate(result.timeline):
        for start, _end, act in events:
            slots.setdefault(start, [""] * len(programs))[s] = repr(act)
    width = max([4] + [len(c) for row in slots.values() for c in row])
    header = "time | " + " ".join(f"{f's{s}':>{width}}" for s in range(len(programs)))
    lines = [header, "-" * len(header)]
    for t in sorted(slots):
        lines.append(f"{t:4g} | " + " ".join(f"{c or '.':>{width}}" for c in slots[t]))
    return "\n".join(lines)
