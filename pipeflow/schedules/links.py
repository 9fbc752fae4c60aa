"""Links between ranks: the order of the messages on each (source, destination) pair.

NCCL matches point-to-point messages by order alone, so each link must receive in the order
it sends; `receives_in_send_order` reorders a program's receives to make it so, and
`check_link_order` proves it.
"""

from __future__ import annotations

from typing import Any, Sequence

from pipeflow.schedules.ir import (BACKWARD, COMPUTE, RECV_ACT, RECV_GRAD, RECVS, SENDS,
                                   WEIGHT, Action, Layout, Message, Programs, ScheduleError,
                                   route)

__all__ = ["link_orders", "receives_in_send_order", "check_link_order",
           "batched_rendezvous_stalls", "ordered_launch_stalls", "posting_order",
           "issue_order", "device_stalls"]


def link_orders(programs: Sequence[Sequence[Action]], layout: Layout
                 ) -> tuple[dict[tuple[int, int], list[Message]],
                            dict[tuple[int, int], list[Message]]]:
    """Per directed link (source rank, destination rank): its sends and its receives, each
    in program order."""
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    for rank, prog in enumerate(programs):
        for act in prog:
            if act.op in SENDS or act.op in RECVS:
                msg, src, dst = route(act, rank, layout, 1)[:3]
                (sent if act.op in SENDS else received).setdefault((src, dst), []).append(msg)
    return sent, received


def receives_in_send_order(programs: Sequence[Sequence[Action]],
                            layout: Layout) -> list[list[Action]]:
    """Move receives earlier so that each link receives in the order it sends (NCCL matches
    point-to-point messages by order alone). A receive moves just ahead of the one that
    needs a later message: it waits no longer than that one would, so nothing new blocks."""
    sent, received = link_orders(programs, layout)
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
            msg, src, _ = route(act, dst, layout, 1)[:3]
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


def check_link_order(programs: Sequence[Sequence[Action]],
                      layout: Layout) -> None:
    sent, received = link_orders(programs, layout)
    for (src, dst), sends in sorted(sent.items()):
        recvs = received.get((src, dst), [])
        for i, (s, r) in enumerate(zip(sends, recvs)):
            if s != r:
                raise ScheduleError(
                    f"link rank {src} -> rank {dst}: message {i} is sent as {s[0]} of "
                    f"micro-batch {s[1]} to virtual stage {s[2]} but received as {r[0]} of "
                    f"micro-batch {r[1]} to virtual stage {r[2]}; NCCL matches messages by "
                    f"order alone: receive them in the order they are sent")


def ordered_launch_stalls(programs: Programs) -> list[int]:
    """The ranks left stuck if every send and receive ran in the host's order of issue on
    one queue per GPU, each completing only once its peer is at the matching operation:
    NCCL's communicators on one GPU with `NCCL_LAUNCH_ORDER_IMPLICIT=1`. Empty: safe."""
    return batched_rendezvous_stalls(programs, batched=False)


def batched_rendezvous_stalls(programs: Programs, batched: bool = True) -> list[int]:
    """The ranks left stuck if each run of consecutive sends and receives were one batch on
    one shared stream per pipeline (Megatron-Core's single P2P group), where a send completes
    only once its receiver has posted the matching receive, i.e. sits in the batch that
    receiver is at (messages to this rank's own other chunk complete at once). Empty: that
    batching never deadlocks. The engine's direction-split links need no such batching; this
    says which schedules a one-group design could batch naively (see
    `comm.torch_dist.torch_grid_communicators`)."""
    layout = programs.layout
    items = [_comm_runs(prog, batched) for prog in programs]
    at = [0] * len(programs)
    done: list[set[tuple[Message, bool]]] = [set() for _ in programs]

    def batch(r: int) -> dict[tuple[Message, bool], int]:
        """The batch rank r is at: (message, is a send) -> the peer; {} at a computation."""
        run = items[r][at[r]] if at[r] < len(items[r]) else []
        found = {}
        for act in run:
            msg, src, dst = route(act, r, layout, 1)[:3]
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


def _comm_runs(prog: Sequence[Action], batched: bool = True) -> list[list[Action]]:
    """The program as items: each run of consecutive sends and receives one batch (or, not
    `batched`, each its own), each computation an empty item."""
    out: list[list[Action]] = []
    for act in prog:
        if act.op in SENDS or act.op in RECVS:
            if batched and out and out[-1]:
                out[-1].append(act)
                continue
            out.append([act])
        else:
            out.append([])
    return out


def posting_order(prog: Sequence[Action], rank: int, layout: Layout,
                  ahead: int = 1) -> list[tuple[int, list[Action]]]:
    """For each compute instruction of `prog` (by position): the receives from other ranks
    posted just before it when receives are posted `ahead` compute instructions early (the
    runner's posting; 0: none, each receive at its own place). With `ahead = 1` a compute
    posts the receives between it and the next compute."""
    computes = [i for i, a in enumerate(prog) if a.op in COMPUTE]
    windows: list[list[Action]] = [[] for _ in computes]
    seen = -1
    for act in prog:
        if act.op in COMPUTE:
            seen += 1
        elif ahead and act.op in RECVS and seen >= 0 and \
                route(act, rank, layout, 1).peer != rank:
            windows[max(0, seen - ahead + 1)].append(act)
    return [(computes[j], w) for j, w in enumerate(windows) if w]


def device_stalls(programs: Programs, kernels: int, ahead: int = 1,
                  reductions: bool = False) -> list[int]:
    """The ranks left stuck if each GPU ran at most `kernels` blocking NCCL kernels at once
    (NCCL's concurrency, conservatively: operations of different communicators are not
    guaranteed to progress together; `CUDA_DEVICE_MAX_CONNECTIONS=1` is 1). Empty: safe.

    Each rank launches its device work in the host's order of issue (`issue_order`): a
    compute kernel at once, an NCCL kernel (send, receive, with `reductions` the data group's
    reduction after each chunk's last gradient action) once fewer than `kernels` of them are
    resident, which it stays until it completes; a later launch never passes an earlier one.
    A kernel waits for the compute issued before it (a receive posted ahead holds its slot
    from its post), and for the operation before it on its link's stream; a send and its
    receive complete together once both are resident and ready; a reduction (replicas run
    the same program) once it is ready; a compute once the receives before it in the
    program are complete."""
    items = [issue_order(prog, r, programs.layout, ahead, reductions)
             for r, prog in enumerate(programs)]
    sim = _DeviceSim(items, kernels)
    while sim.advance():
        pass
    return [r for r in range(len(items)) if sim.done[r] < len(items[r])]


# A device operation of `device_stalls`: kind ("C" compute, "S" send, "R" receive, "A" a
# reduction), what it is (the compute's index, the message), the computes issued before it
# (a kernel waits for them), its stream ((source, dest) of a link, "data"), and for a
# compute the receives it waits for.
_Item = tuple[str, Any, int, Any, tuple]


def issue_order(prog: Sequence[Action], rank: int, layout: Layout, ahead: int = 1,
                reductions: bool = False) -> list[_Item]:
    """`prog` as the device work its rank issues, in the host's order (see `device_stalls`)."""
    posted = dict(posting_order(prog, rank, layout, ahead))
    early = {a for w in posted.values() for a in w}
    last_grad = {a.chunk: i for i, a in enumerate(prog) if a.op in (BACKWARD, WEIGHT)}
    out: list[_Item] = []
    computes, waits = 0, []

    def message(act: Action) -> _Item:
        msg, src, dst = route(act, rank, layout, 1)[:3]
        kind = "S" if act.op in SENDS else "R"
        return (kind, (msg, src, dst), computes, (src, dst), ())

    for i, act in enumerate(prog):
        for recv in posted.get(i, ()):
            out.append(message(recv))
        if act.op in COMPUTE:
            out.append(("C", computes, computes, "compute", tuple(waits)))
            computes, waits = computes + 1, []
            if reductions and last_grad.get(act.chunk) == i:
                out.append(("A", act.chunk, computes, "data", ()))
            continue
        r = route(act, rank, layout, 1)
        if r.peer == rank:
            continue                # to this rank's other chunk: no NCCL operation
        if act.op in RECVS:
            waits.append(r.message)
        if act not in early:
            out.append(message(act))
    return out


class _DeviceSim:
    """The state of `device_stalls`' simulation: launches, resident kernels, completions."""

    def __init__(self, items: list[list[_Item]], kernels: int) -> None:
        self.items, self.kernels = items, kernels
        n = len(items)
        self.launched, self.done = [0] * n, [0] * n
        self.computes = [0] * n                         # computes complete, in order
        self.complete: list[set[int]] = [set() for _ in items]
        self.resident: list[list[int]] = [[] for _ in items]
        self.received: list[set] = [set() for _ in items]   # messages complete on arrival
        self.before: dict[tuple[int, int], int | None] = {}  # op -> previous on its stream
        self.where: dict[tuple[str, Any], tuple[int, int]] = {}
        self.compute_at: list[list[int]] = [[] for _ in items]
        for r, seq in enumerate(items):
            last: dict[Any, int] = {}
            for i, (kind, what, _, stream, _) in enumerate(seq):
                if kind == "C":
                    self.compute_at[r].append(i)
                    continue
                self.before[(r, i)] = last.get(stream)
                last[stream] = i
                if kind in "SR":
                    self.where[(kind, what)] = (r, i)

    def ready(self, r: int, i: int) -> bool:
        kind, what, need, _, _ = self.items[r][i]
        prev = self.before[(r, i)]
        return self.computes[r] >= need and (prev is None or prev in self.complete[r])

    def finish(self, r: int, i: int) -> None:
        self.complete[r].add(i)
        self.done[r] += 1
        if i in self.resident[r]:
            self.resident[r].remove(i)
        kind, what = self.items[r][i][:2]
        if kind == "R":
            self.received[r].add(what[0])

    def advance(self) -> bool:
        """One pass over the ranks; whether anything moved."""
        moved = False
        for r in range(len(self.items)):
            while self._step(r):
                moved = True
        return moved

    def _step(self, r: int) -> bool:
        seq, moved = self.items[r], False
        while self.launched[r] < len(seq) and (
                seq[self.launched[r]][0] == "C" or len(self.resident[r]) < self.kernels):
            if seq[self.launched[r]][0] != "C":
                self.resident[r].append(self.launched[r])
            self.launched[r] += 1
            moved = True
        c = self.computes[r]
        while c < len(self.compute_at[r]) and self.compute_at[r][c] < self.launched[r] and \
                self.received[r].issuperset(seq[self.compute_at[r][c]][4]):
            self.finish(r, self.compute_at[r][c])
            c = self.computes[r] = c + 1
            moved = True
        for i in list(self.resident[r]):
            if i in self.complete[r] or not self.ready(r, i):
                continue
            kind, what = seq[i][:2]
            if kind == "A":
                self.finish(r, i)
                moved = True
                continue
            peer, j = self.where[("R" if kind == "S" else "S", what)]
            if j in self.resident[peer] and self.ready(peer, j):
                self.finish(r, i)
                self.finish(peer, j)
                moved = True
        return moved
