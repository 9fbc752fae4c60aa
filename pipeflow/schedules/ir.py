"""The schedule IR: instructions (`Action`), every rank's program (`Programs`), the layout of
virtual stages over ranks (`Layout`) and where each message goes (`route`).

Everything here is pure Python: the simulator, the planner, `auto` and the engine share it.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple, Sequence

__all__ = [
    "Action", "FORWARD", "BACKWARD", "WEIGHT", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD",
    "COMPUTE", "SENDS", "RECVS", "ScheduleError", "Programs", "Layout", "Route", "Message",
    "route", "with_messages", "looped_layout", "v_layout",
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
_KIND = {"act": 0, "grad": 1}
_ACTION = re.compile(r"([A-Z]+)(\d+)(?:\.(\d+))?")


class ScheduleError(RuntimeError):
    """A schedule that cannot run: a deadlock, an unmatched message or a missing step."""


class Action(NamedTuple):
    """One instruction for one stage: an op on a micro-batch, printed compactly as `F3`.

    `chunk` is the model chunk of a schedule with several per rank (interleaved, the V
    schedules); which virtual stage a chunk runs is the schedule's `Layout`. Chunk 1's
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


class Layout(list):
    """`layout[rank][chunk]` -> the virtual stage (slice of the model) that chunk runs, and
    the reverse, `owner[virtual] = (rank, chunk)`."""

    def __init__(self, rows: Iterable[Sequence[int]]) -> None:
        super().__init__([list(r) for r in rows])
        self.owner = {v: (r, c) for r, row in enumerate(self) for c, v in enumerate(row)}

    @property
    def stages(self) -> int:
        """Virtual stages in all."""
        return len(self.owner)


def looped_layout(stages: int, chunks: int = 1) -> Layout:
    """Rank r holds virtual stages r, r + p, r + 2p... (1F1B, interleaved)."""
    return Layout([[c * stages + r for c in range(chunks)] for r in range(stages)])


def v_layout(stages: int, chunks: int = 2) -> Layout:
    """The V: rank r holds r (on the way down) and 2p - 1 - r (on the way back), so rank 0
    holds the first and the last virtual stage and the turn at rank p - 1 is local."""
    if chunks != 2:
        raise ScheduleError(f"a V layout runs 2 model chunks per rank, found {chunks}")
    return Layout([[r, 2 * stages - 1 - r] for r in range(stages)])


class Programs(list):
    """Every rank's instruction list, one list a rank, and the schedule's `layout`."""

    def __init__(self, programs: Iterable[list[Action]], layout: Sequence[Sequence[int]]) -> None:
        super().__init__(programs)
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)


# A message is (kind, micro-batch, destination virtual stage): unique in a step.
Message = tuple[str, int, int]


class Route(NamedTuple):
    """Where the message of a send or receive goes: its identity, the ranks at both ends,
    the other end (`peer`), the chunk that receives it, and its tag (unique per micro-batch,
    receiving chunk and kind, so that messages of one link never mix)."""

    message: Message
    source: int
    dest: int
    peer: int
    chunk: int
    tag: int


def route(act: Action, rank: int, layout: Layout, microbatches: int) -> Route:
    """The route of send or receive `act` on `rank`: activations go to virtual stage v + 1,
    gradients to v - 1, wherever the layout put it (the next rank; the first rank's next
    chunk when interleaved; this very rank at the bottom of a V)."""
    virtual = layout[rank][act.chunk]
    sending = act.op in SENDS
    step, kind = SENDS[act.op] if sending else RECVS[act.op]
    other = virtual + step
    if other not in layout.owner:
        verb = "sends" if sending else "receives"
        raise ScheduleError(f"stage {rank} {verb} {act} {'to' if sending else 'from'} virtual "
                            f"stage {other}, which does not exist in a pipeline of "
                            f"{layout.stages}")
    peer, peer_chunk = layout.owner[other]
    dest_virtual, chunk = (other, peer_chunk) if sending else (virtual, act.chunk)
    source, dest = (rank, peer) if sending else (peer, rank)
    tag = 2 * (chunk * microbatches + act.mb) + _KIND[kind]
    return Route((kind, act.mb, dest_virtual), source, dest, peer, chunk, tag)


def with_messages(compute: Iterable[tuple[str, int, int]], virtuals: Sequence[int],
                  last: int) -> list[Action]:
    """A compute-only order `(op, micro-batch, chunk)` with its messages added: a receive
    right before the forward (backward) that needs it, a send right after the one that
    produces it. W sends nothing. `virtuals[chunk]`: this rank's virtual stages; `last`: the
    last virtual stage of the pipeline."""
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
