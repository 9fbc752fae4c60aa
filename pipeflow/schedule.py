"""Schedules as data: each stage's instruction list, and a simulator that replays them all."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, NamedTuple, Sequence

__all__ = [
    "Action", "FORWARD", "BACKWARD", "WEIGHT", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zbv", "SCHEDULES", "build_schedule",
    "Programs", "stage_layout", "ScheduleError", "SimResult", "simulate", "format_table",
    "batched_rendezvous_stalls",
]

# B is a stage's whole backward in a schedule without W; in one with W (zero bubble), B is the
# input gradient alone (what the previous stage waits for) and W the weight gradient (what
# only the optimizer waits for).
FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
SEND_ACT, RECV_ACT = "SA", "RA"      # activations travel forward: stage s -> s + 1
SEND_GRAD, RECV_GRAD = "SG", "RG"    # their gradients travel back: stage s + 1 -> s
COMPUTE = (FORWARD, BACKWARD, WEIGHT)
SENDS = {SEND_ACT: (+1, "act"), SEND_GRAD: (-1, "grad")}
RECVS = {RECV_ACT: (-1, "act"), RECV_GRAD: (+1, "grad")}
_ACTION = re.compile(r"([A-Z]+)(\d+)(?:\.(\d+))?")


class ScheduleError(RuntimeError):
    """A schedule that cannot run: a deadlock, an unmatched message or a missing step."""


class Action(NamedTuple):
    """One instruction for one stage: an op on a micro-batch, printed compactly as `F3`.

    `chunk` is the model chunk of a schedule with several per rank (interleaved, ZBV); which
    virtual stage a chunk is depends on the schedule's layout (`stage_layout`). Chunk 1's
    forward of micro-batch 3 prints as `F3.1`; `Action.from_str` reads that back.
    """

    op: str
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")

    @staticmethod
    def from_str(text: str) -> "Action":
        """The reverse of `repr`: `"W3.1"` -> `Action("W", 3, 1)`."""
        found = _ACTION.fullmatch(text.strip())
        if not found or found.group(1) not in (*COMPUTE, *SENDS, *RECVS):
            raise ScheduleError(
                f"cannot read {text!r} as an action: expected an op of "
                f"{[*COMPUTE, *SENDS, *RECVS]}, a micro-batch and an optional .chunk, "
                f"like 'F3', 'W3.1' or 'RG0'")
        op, mb, chunk = found.groups()
        return Action(op, int(mb), int(chunk or 0))


class Programs(list):
    """Every rank's instruction list, one list a rank, and the schedule's `layout`:
    `layout[rank][chunk]` is the virtual stage (slice of the model) that chunk runs."""

    def __init__(self, programs: Iterable[list[Action]], layout: list[list[int]]) -> None:
        super().__init__(programs)
        self.layout = layout


def stage_layout(name: str, stages: int, chunks: int = 1) -> list[list[int]]:
    """`layout[rank][chunk]` -> virtual stage. Interleaved: rank r holds r, r + p, r + 2p...;
    ZBV's V: rank r holds r and 2p - 1 - r, so rank 0 holds the first and the last."""
    if name == "zbv":
        return [[r, 2 * stages - 1 - r] for r in range(stages)]
    return [[c * stages + r for c in range(chunks)] for r in range(stages)]


def _messages(compute: Iterable[tuple[str, int, int]], virtuals: Sequence[int],
              last: int) -> list[Action]:
    """A compute-only order with its messages added: a receive right before the forward
    (backward) that needs it, a send right after the one that produces it. W sends nothing."""
    acts: list[Action] = []
    for op, mb, chunk in compute:
        virtual = virtuals[chunk]
        if op == FORWARD:
            acts += [Action(RECV_ACT, mb, chunk)] if virtual > 0 else []
            acts.append(Action(FORWARD, mb, chunk))
            acts += [Action(SEND_ACT, mb, chunk)] if virtual < last else []
        elif op == BACKWARD:
            acts += [Action(RECV_GRAD, mb, chunk)] if virtual < last else []
            acts.append(Action(BACKWARD, mb, chunk))
            acts += [Action(SEND_GRAD, mb, chunk)] if virtual > 0 else []
        else:
            acts.append(Action(op, mb, chunk))
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
    compute = [(op, mb, 0) for op in (FORWARD, BACKWARD) for mb in range(microbatches)]
    return _messages(compute, [stage], stages - 1)


def _one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    warmup = min(stages - stage - 1, microbatches)
    order = [(FORWARD, mb, 0) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(FORWARD, warmup + i, 0), (BACKWARD, i, 0)]
    return order + [(BACKWARD, mb, 0) for mb in range(microbatches - warmup, microbatches)]


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
    return _messages(_one_f_one_b_order(stage, stages, microbatches), [stage], stages - 1)


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
def zb_h1(stage: int, stages: int, microbatches: int) -> list[Action]:
    """1F1B with split backward; stage s runs W(i) right after B(i + s) (or after its last B)."""
    _check(stage, stages, microbatches)
    m = microbatches
    due: dict[int, list[int]] = {}
    for i in range(m):
        due.setdefault(min(i + stage, m - 1), []).append(i)
    order: list[tuple[str, int, int]] = []
    for op, mb, _ in _one_f_one_b_order(stage, stages, m):
        order.append((op, mb, 0))
        if op == BACKWARD:
            order += [(WEIGHT, i, 0) for i in due.get(mb, [])]
    return _messages(order, [stage], stages - 1)


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

    def unit(k: int, op: str) -> tuple[str, int, int]:
        group = (k // p) % v
        chunk = group if op == FORWARD else v - 1 - group
        return op, (k // (p * v)) * p + k % p, chunk

    if m == p:
        warmup = total      # one group: every forward comes before the first backward
    else:
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    order = [unit(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        order += [unit(k + warmup, FORWARD), unit(k, BACKWARD)]
    order += [unit(k, BACKWARD) for k in range(total - warmup, total)]
    return _messages(order, stage_layout("interleaved", p, v)[stage], p * v - 1)


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
def zbv(stage: int, stages: int, microbatches: int) -> list[Action]:
    """The V-shaped zero-bubble schedule: two chunks a rank, rank 0 holds both ends."""
    _check(stage, stages, microbatches)
    p, r, n = stages, stage, max(2 * stages - 1, microbatches)
    count = {(op, c): 0 for op in COMPUTE for c in (0, 1)}
    order: list[tuple[str, int, int]] = []

    def run(op: str, chunk: int) -> None:
        order.append((op, count[(op, chunk)], chunk))
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
    order = [a for a in order if a[1] < microbatches]
    return _messages(order, stage_layout("zbv", p)[stage], 2 * p - 1)


SCHEDULES: dict[str, Callable[..., list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zbv": zbv,
}
# Model chunks per rank of the schedules that fix them (the others run one, interleaved v).
_CHUNKS = {"zbv": 2}


def build_schedule(name: str, stages: int, microbatches: int,
                   chunks: int | None = None) -> Programs:
    """Every stage's instruction list for schedule `name`, with the receives on each link put
    in the order of its sends. `chunks`: model chunks per rank; more than 1 for
    'interleaved' (default 1), and 2 (implied) for 'zbv'."""
    try:
        generator = SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; known: {sorted(SCHEDULES)}") from None
    fixed = _CHUNKS.get(name, 1)
    chunks = fixed if chunks is None else chunks
    if name == "interleaved":
        programs = [generator(s, stages, microbatches, chunks) for s in range(stages)]
    elif chunks != fixed:
        raise ScheduleError(f"schedule {name!r} runs {fixed} model chunk(s) per rank, found "
                            f"chunks={chunks}; use schedule 'interleaved' for another count")
    else:
        programs = [generator(s, stages, microbatches) for s in range(stages)]
    layout = stage_layout(name, stages, chunks)
    return Programs(_receives_in_send_order(programs, layout), layout)


def _check(stage: int, stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1 or not 0 <= stage < stages:
        raise ScheduleError(
            f"need stages >= 1, microbatches >= 1 and 0 <= stage < stages; found stage={stage}, "
            f"stages={stages}, microbatches={microbatches}")


# A message is (kind, micro-batch, destination virtual stage): unique in a step.
Message = tuple[str, int, int]


def _owners(layout: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    """virtual stage -> (rank, chunk)."""
    return {v: (r, c) for r, chunks in enumerate(layout) for c, v in enumerate(chunks)}


def _route(act: Action, rank: int, layout: Sequence[Sequence[int]],
           owners: dict[int, tuple[int, int]]) -> tuple[Message, int, int]:
    """A send's or a receive's message, source rank and destination rank."""
    virtual = layout[rank][act.chunk]
    if act.op in SENDS:
        step, kind = SENDS[act.op]
        dest = virtual + step
        if dest not in owners:
            raise ScheduleError(f"stage {rank} sends {act} to virtual stage {dest}, which does "
                                f"not exist in a pipeline of {len(owners)}")
        return (kind, act.mb, dest), rank, owners[dest][0]
    step, kind = RECVS[act.op]
    source = virtual + step
    if source not in owners:
        raise ScheduleError(f"stage {rank} receives {act} from virtual stage {source}, which "
                            f"does not exist in a pipeline of {len(owners)}")
    return (kind, act.mb, virtual), owners[source][0], rank


def _link_orders(programs: Sequence[Sequence[Action]], layout: Sequence[Sequence[int]]
                 ) -> tuple[dict[tuple[int, int], list[Message]],
                            dict[tuple[int, int], list[Message]]]:
    """Per directed link (source rank, destination rank): its sends and its receives, each
    in program order."""
    owners = _owners(layout)
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    for rank, prog in enumerate(programs):
        for act in prog:
            if act.op in SENDS or act.op in RECVS:
                msg, src, dst = _route(act, rank, layout, owners)
                (sent if act.op in SENDS else received).setdefault((src, dst), []).append(msg)
    return sent, received


def _receives_in_send_order(programs: Sequence[Sequence[Action]],
                            layout: Sequence[Sequence[int]]) -> list[list[Action]]:
    """Move receives earlier so that each link receives in the order it sends (NCCL matches
    point-to-point messages by order alone). A receive moves just ahead of the one that
    needs a later message: it waits no longer than that one would, so nothing new blocks."""
    owners = _owners(layout)
    sent, received = _link_orders(programs, layout)
    positions = {link: {msg: i for i, msg in enumerate(msgs)} for link, msgs in sent.items()}
    out = []
    for dst, prog in enumerate(programs):
        wanted = {msg for (_, d), msgs in received.items() if d == dst for msg in msgs}
        done: set[Message] = set()
        at: dict[int, int] = {}
        new: list[Action] = []
        for act in prog:
            if act.op not in RECVS:
                new.append(act)
                continue
            msg, src, _ = _route(act, dst, layout, owners)
            if msg in done:
                continue
            queue, i = sent.get((src, dst), []), at.get(src, 0)
            j = positions[(src, dst)].get(msg, -1) if (src, dst) in positions else -1
            if j >= i and wanted.issuperset(queue[i:j]):
                for kind, mb, virtual in queue[i:j]:
                    new.append(Action(RECV_ACT if kind == "act" else RECV_GRAD, mb,
                                      layout[dst].index(virtual)))
                    done.add((kind, mb, virtual))
                at[src] = j + 1
            new.append(act)
            done.add(msg)
        out.append(new)
    return out


def _check_link_order(programs: Sequence[Sequence[Action]],
                      layout: Sequence[Sequence[int]]) -> None:
    sent, received = _link_orders(programs, layout)
    for (src, dst), sends in sorted(sent.items()):
        recvs = received.get((src, dst), [])
        for i, (s, r) in enumerate(zip(sends, recvs)):
            if s != r:
                raise ScheduleError(
                    f"link rank {src} -> rank {dst}: message {i} is sent as {s[0]} of "
                    f"micro-batch {s[1]} to virtual stage {s[2]} but received as {r[0]} of "
                    f"micro-batch {r[1]} to virtual stage {r[2]}; NCCL matches messages by "
                    f"order alone: receive them in the order they are sent")


def batched_rendezvous_stalls(programs: Programs) -> list[int]:
    """The ranks left stuck if each run of consecutive sends and receives were one batch on
    one shared stream per pipeline (Megatron-Core's single P2P group), where a send completes
    only once its receiver has posted the matching receive, i.e. sits in the batch that
    receiver is at (messages to this rank's own other chunk complete at once). Empty: that
    batching never deadlocks. The engine's direction-split links need no such batching; this
    says which schedules a one-group design could batch naively (see
    `comm.torch_grid_communicators`)."""
    layout, owners = programs.layout, _owners(programs.layout)
    items = [_comm_runs(prog) for prog in programs]
    at = [0] * len(programs)
    done: list[set[tuple[Message, bool]]] = [set() for _ in programs]

    def batch(r: int) -> dict[tuple[Message, bool], int]:
        """The batch rank r is at: (message, is a send) -> the peer; {} at a computation."""
        run = items[r][at[r]] if at[r] < len(items[r]) else []
        found = {}
        for act in run:
            msg, src, dst = _route(act, r, layout, owners)
            found[(msg, act.op in SENDS)] = dst if act.op in SENDS else src
        return found

    local: set[Message] = set()
    moved = True
    while moved:
        moved = False
        for r in range(len(programs)):
            mine = batch(r)
            for (msg, send), peer in mine.items():
                if (msg, send) in done[r]:
                    continue
                if peer == r and (send or msg in local):
                    local.add(msg)
                    done[r].add((msg, send))
                elif peer != r and (msg, not send) in batch(peer):
                    done[r].add((msg, send))
                    done[peer].add((msg, not send))
            if at[r] < len(items[r]) and done[r].issuperset(mine):
                at[r], done[r], moved = at[r] + 1, set(), True
    return [r for r in range(len(programs)) if at[r] < len(items[r])]


def _comm_runs(prog: Sequence[Action]) -> list[list[Action]]:
    """The program as items: each run of consecutive sends and receives one batch, each
    computation an empty item."""
    out: list[list[Action]] = []
    for act in prog:
        if act.op in SENDS or act.op in RECVS:
            if out and out[-1]:
                out[-1].append(act)
                continue
            out.append([act])
        else:
            out.append([])
    return out


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
    layout = layout or getattr(programs, "layout", None) or \
        stage_layout("interleaved", stages, chunks)
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
    _check_link_order(programs, layout)
    return result


def _check_stage_times(stage_times: Sequence[tuple[float, float, float]],
                       virtual: int) -> list[tuple[float, float, float]]:
    times = [tuple(float(t) for t in entry) for entry in stage_times]
    if len(times) != virtual or any(len(t) != 3 or min(t) < 0 for t in times):
        raise ScheduleError(
            f"stage_times needs one (F, B, W) triple of times >= 0 per virtual stage, "
            f"{virtual} in all, found {list(stage_times)!r}")
    return times


def _replay(programs: Sequence[Sequence[Action]], layout: Sequence[Sequence[int]],
            durations: dict[int, dict[str, float]], comm_time: float,
            split: bool) -> SimResult:
    """`durations[virtual stage][op]`: how long each compute op takes there."""
    stages = len(programs)
    owners = _owners(layout)
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
                    msg = _route(act, s, layout, owners)[0]
                    if msg not in in_flight:
                        break                     # blocked until the sender gets there
                    clock[s] = max(clock[s], in_flight.pop(msg))
                elif act.op in SENDS:
                    in_flight[_route(act, s, layout, owners)[0]] = clock[s] + comm_time
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
                         + (f"virtual stage {dest}" if len(owners) > stages else f"stage {dest}")
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
