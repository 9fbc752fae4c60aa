"""Schedules as data: each stage's instruction list, and a simulator that replays them all."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

__all__ = [
    "Action", "FORWARD", "BACKWARD", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "SCHEDULES", "build_schedule",
    "ScheduleError", "SimResult",
    "simulate", "format_table",
]

FORWARD, BACKWARD = "F", "B"
SEND_ACT, RECV_ACT = "SA", "RA"      # activations travel forward: stage s -> s + 1
SEND_GRAD, RECV_GRAD = "SG", "RG"    # their gradients travel back: stage s + 1 -> s
COMPUTE = (FORWARD, BACKWARD)
SENDS = {SEND_ACT: (+1, "act"), SEND_GRAD: (-1, "grad")}
RECVS = {RECV_ACT: (-1, "act"), RECV_GRAD: (+1, "grad")}


class Action(NamedTuple):
    """One instruction for one stage: an op on a micro-batch, printed compactly as `F3`.

    `chunk` is the model chunk (virtual stage) of an interleaved schedule: rank `r` of `p`
    holds virtual stages `r, r + p, r + 2p, ...`; chunk 1's forward of micro-batch 3 prints
    as `F3.1`.
    """

    op: str
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(RuntimeError):
    """A schedule that cannot run: a deadlock, an unmatched message or a missing step."""


def _forward(stage: int, stages: int, mb: int, chunk: int = 0, chunks: int = 1) -> list[Action]:
    virtual, last = chunk * stages + stage, stages * chunks - 1
    acts = [Action(RECV_ACT, mb, chunk)] if virtual > 0 else []
    acts.append(Action(FORWARD, mb, chunk))
    if virtual < last:
        acts.append(Action(SEND_ACT, mb, chunk))
    return acts


def _backward(stage: int, stages: int, mb: int, chunk: int = 0, chunks: int = 1) -> list[Action]:
    virtual, last = chunk * stages + stage, stages * chunks - 1
    acts = [Action(RECV_GRAD, mb, chunk)] if virtual < last else []
    acts.append(Action(BACKWARD, mb, chunk))
    if virtual > 0:
        acts.append(Action(SEND_GRAD, mb, chunk))
    return acts


# GPipe, 3 stages, 4 micro-batches (time runs right; one column a unit of compute):
#
#   stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
#   stage 1 | .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .
#   stage 2 | .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .  .
#
# Every stage stashes all m micro-batches before its first backward.
def gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    """All forwards, then all backwards: stash `m` on every stage."""
    _check(stage, stages, microbatches)
    acts: list[Action] = []
    for mb in range(microbatches):
        acts += _forward(stage, stages, mb)
    for mb in range(microbatches):
        acts += _backward(stage, stages, mb)
    return acts


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
    _check(stage, stages, microbatches)
    warmup = min(stages - stage - 1, microbatches)
    acts: list[Action] = []
    for mb in range(warmup):
        acts += _forward(stage, stages, mb)
    for i in range(microbatches - warmup):
        acts += _forward(stage, stages, warmup + i)
        acts += _backward(stage, stages, i)
    for mb in range(microbatches - warmup, microbatches):
        acts += _backward(stage, stages, mb)
    return acts


# Interleaved 1F1B (Narayanan et al. 2021), 2 ranks, 2 chunks each, 4 micro-batches: the model
# is cut into 4 virtual stages, rank r holding virtual stages r and r + 2, so a micro-batch
# visits every rank twice. Each unit is a chunk (half a rank's layers): the ramps shrink to
# half, and the bubble to (p - 1) / (v·m + p - 1), for v times the point-to-point messages.
#
#   rank 0 | F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 .  B2.1 .  B3.1 B2 B3
#
# (`format_table(build_schedule("interleaved", 2, 4, chunks=2))` prints both ranks.)
def interleaved_1f1b(stage: int, stages: int, microbatches: int,
                     chunks: int = 2) -> list[Action]:
    """1F1B over `chunks` model chunks per rank, visiting them round-robin in groups of p
    micro-batches (Megatron-LM's order). Needs m to be a multiple of p."""
    _check(stage, stages, microbatches)
    if chunks < 1:
        raise ScheduleError(f"an interleaved schedule needs chunks >= 1, found {chunks}")
    if chunks > 1 and microbatches % stages:
        raise ScheduleError(
            f"interleaved 1F1B runs micro-batches in groups of the {stages} stages: "
            f"microbatches must be a multiple of {stages}, found {microbatches}; use "
            f"{stages * max(1, round(microbatches / stages))}")
    p, v, m = stages, chunks, microbatches
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group = (k // p) % v
        chunk = group if forward else v - 1 - group
        return (k // (p * v)) * p + k % p, chunk

    if m == p:
        warmup = total      # one group: every forward comes before the first backward
    else:
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    acts: list[Action] = []
    for k in range(warmup):
        acts += _forward(stage, p, *unit(k, True), chunks=v)
    for k in range(total - warmup):
        acts += _forward(stage, p, *unit(k + warmup, True), chunks=v)
        acts += _backward(stage, p, *unit(k, False), chunks=v)
    for k in range(total - warmup, total):
        acts += _backward(stage, p, *unit(k, False), chunks=v)
    return acts


SCHEDULES: dict[str, Callable[..., list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
}


def build_schedule(name: str, stages: int, microbatches: int,
                   chunks: int = 1) -> list[list[Action]]:
    """Every stage's instruction list for schedule `name` (`chunks` > 1: interleaved only)."""
    try:
        generator = SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; known: {sorted(SCHEDULES)}") from None
    if name == "interleaved":
        return [generator(s, stages, microbatches, chunks) for s in range(stages)]
    if chunks != 1:
        raise ScheduleError(f"schedule {name!r} runs one model chunk per rank, found "
                            f"chunks={chunks}; use schedule 'interleaved' for more")
    return [generator(s, stages, microbatches) for s in range(stages)]


def _check(stage: int, stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1 or not 0 <= stage < stages:
        raise ScheduleError(
            f"need stages >= 1, microbatches >= 1 and 0 <= stage < stages; found stage={stage}, "
            f"stages={stages}, microbatches={microbatches}")


@dataclasses.dataclass
class SimResult:
    """What a replay of all stages found."""

    makespan: float                  # time from the first instruction to the last
    busy: list[float]                # compute time per stage
    peak_stash: list[int]            # most micro-batches forwarded but not yet backwarded
    timeline: list[list[tuple[float, float, Action]]]  # per stage: (start, end, action)

    @property
    def bubble(self) -> float:
        """Idle fraction of all stages' time: (p - 1) / (m + p - 1) for GPipe and 1F1B."""
        total = self.makespan * len(self.busy)
        return 1.0 - sum(self.busy) / total if total else 0.0


def simulate(programs: Sequence[Sequence[Action]], forward_time: float = 1.0,
             backward_time: float = 1.0, comm_time: float = 0.0) -> SimResult:
    """Replay every stage's program together and check it can run.

    Sends never block (the engine posts them and moves on); a receive waits until the matching
    send has been issued. Raises `ScheduleError` on a deadlock (every unfinished stage waits
    for a message nobody will send), on a send no stage receives, and on a program that does
    not run each micro-batch's forward and backward exactly once, in that order. With model
    chunks (interleaved), a chunk's forward takes `forward_time / chunks`: a rank's whole
    forward of a micro-batch still takes `forward_time`.
    """
    stages = len(programs)
    chunks = 1 + max((a.chunk for prog in programs for a in prog), default=0)
    last = stages * chunks - 1
    _check_programs(programs, chunks)
    _check_link_order(programs)
    clock = [0.0] * stages
    busy = [0.0] * stages
    pc = [0] * stages
    stash = [0] * stages
    peak = [0] * stages
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(stages)]
    # (kind, micro-batch, destination virtual stage) -> arrival time
    in_flight: dict[tuple[str, int, int], float] = {}
    durations = {FORWARD: forward_time / chunks, BACKWARD: backward_time / chunks}

    while True:
        progressed = False
        for s in range(stages):
            prog = programs[s]
            while pc[s] < len(prog):
                act = prog[pc[s]]
                virtual = act.chunk * stages + s
                if act.op in RECVS:
                    _, kind = RECVS[act.op]
                    key = (kind, act.mb, virtual)
                    if key not in in_flight:
                        break                     # blocked until the sender gets there
                    clock[s] = max(clock[s], in_flight.pop(key))
                elif act.op in SENDS:
                    step, kind = SENDS[act.op]
                    dest = virtual + step
                    if not 0 <= dest <= last:
                        raise ScheduleError(f"stage {s} sends {act} to virtual stage {dest}, "
                                            f"which does not exist in a pipeline of "
                                            f"{last + 1}")
                    in_flight[(kind, act.mb, dest)] = clock[s] + comm_time
                else:
                    start = clock[s]
                    clock[s] += durations[act.op]
                    busy[s] += durations[act.op]
                    timeline[s].append((start, clock[s], act))
                    stash[s] += 1 if act.op == FORWARD else -1
                    peak[s] = max(peak[s], stash[s])
                pc[s] += 1
                progressed = True
        if all(pc[s] == len(programs[s]) for s in range(stages)):
            break
        if not progressed:
            waiting = ", ".join(f"stage {s} at {programs[s][pc[s]]} (instruction {pc[s]})"
                                for s in range(stages) if pc[s] < len(programs[s]))
            raise ScheduleError(f"deadlock: every unfinished stage waits on a receive: {waiting}")
    if in_flight:
        lost = ", ".join(f"{kind} of micro-batch {mb} to "
                         + (f"virtual stage {dest}" if chunks > 1 else f"stage {dest}")
                         for kind, mb, dest in sorted(in_flight))
        raise ScheduleError(f"send with no matching receive: {lost}")
    return SimResult(makespan=max(clock) if clock else 0.0, busy=busy, peak_stash=peak,
                     timeline=timeline)


def _check_programs(programs: Sequence[Sequence[Action]], chunks: int = 1) -> None:
    """Each stage runs F then B exactly once per micro-batch and chunk, with its messages
    around them."""
    stages = len(programs)
    last = stages * chunks - 1
    for s, prog in enumerate(programs):
        for c in range(chunks):
            forwards = [a.mb for a in prog if a.op == FORWARD and a.chunk == c]
            backwards = [a.mb for a in prog if a.op == BACKWARD and a.chunk == c]
            mbs = sorted(forwards)
            if mbs != list(range(len(mbs))) or sorted(backwards) != mbs or \
                    (c and len(mbs) != len([a for a in prog if a.op == FORWARD and not a.chunk])):
                where = f"stage {s}" + (f" chunk {c}" if chunks > 1 else "")
                raise ScheduleError(
                    f"{where}: expected one forward and one backward of each micro-batch "
                    f"0..m-1, found forwards {forwards} and backwards {backwards}")
        seen_f: set[tuple[int, int]] = set()
        have: set[tuple[str, int, int]] = set()
        for act in prog:
            virtual = act.chunk * stages + s
            if act.op in RECVS:
                have.add((act.op, act.mb, act.chunk))
            elif act.op == FORWARD:
                if virtual > 0 and (RECV_ACT, act.mb, act.chunk) not in have:
                    raise ScheduleError(f"stage {s} runs {act} before receiving its input")
                seen_f.add((act.mb, act.chunk))
            elif act.op == BACKWARD:
                if (act.mb, act.chunk) not in seen_f:
                    raise ScheduleError(f"stage {s} runs {act} before its forward")
                if virtual < last and (RECV_GRAD, act.mb, act.chunk) not in have:
                    raise ScheduleError(f"stage {s} runs {act} before receiving its gradient")


def _check_link_order(programs: Sequence[Sequence[Action]]) -> None:
    """On every link (sending rank -> receiving rank) the receives come in the order of the
    sends. NCCL matches messages by order alone, not by tag: a schedule that receives out of
    order would hand a tensor to the wrong micro-batch (or hang on a size mismatch)."""
    stages = len(programs)
    sent: dict[tuple[int, int], list] = {}
    taken: dict[tuple[int, int], list] = {}
    for s, prog in enumerate(programs):
        for act in prog:
            virtual = act.chunk * stages + s
            if act.op in SENDS:
                step, kind = SENDS[act.op]
                sent.setdefault((s, (virtual + step) % stages), []).append(
                    (kind, act.mb, virtual + step))
            elif act.op in RECVS:
                step, kind = RECVS[act.op]
                taken.setdefault(((virtual + step) % stages, s), []).append(
                    (kind, act.mb, virtual))
    for (src, dst), order in sorted(sent.items()):
        got = taken.get((src, dst), [])
        for k, (want, have) in enumerate(zip(order, got)):
            if want != have:
                raise ScheduleError(
                    f"link stage {src} -> stage {dst}: message {k} is sent as {want[0]} of "
                    f"micro-batch {want[1]} (virtual stage {want[2]}) but received as "
                    f"{have[0]} of micro-batch {have[1]} (virtual stage {have[2]}); NCCL "
                    f"matches by order, not tag: receive in the order of the sends")


def format_table(programs: Sequence[Sequence[Action]], **sim_kwargs: float) -> str:
    """The pipeline order as a table, one column a stage, one row a unit of simulated time."""
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
