"""Links between ranks: the order of the messages on each (source, destination) pair.

NCCL matches point-to-point messages by order alone, so each link must receive in the order
it sends; `receives_in_send_order` reorders a program's receives to make it so, and
`check_link_order` proves it.
"""

from __future__ import annotations

from typing import Sequence

from pipeflow.schedules.ir import (RECV_ACT, RECV_GRAD, RECVS, SENDS, Action, Layout, Message,
                                   Programs, ScheduleError, route)

__all__ = ["link_orders", "receives_in_send_order", "check_link_order",
           "batched_rendezvous_stalls"]


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
