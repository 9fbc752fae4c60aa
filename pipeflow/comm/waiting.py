"""How a rank waits on MPI: spinning inside MPI, or testing and yielding its core.

MPI implementations (MPICH, Open MPI by default) busy-poll inside a blocking call: the lowest
latency when every rank has a core of its own, as on a GPU node. Where ranks outnumber cores
(tests and laptops: 4 ranks on 2 cores), a spinning rank takes the core that the rank it waits
for needs. `benchmarks/bench_waiting.py`, 4 ranks on 2 cores: over MPI one step took 65 s
(median 206 ms, yielding 161 ms, worst 0.2 s); over gloo (torch.distributed on CPUs: headers
over MPI, tensors over loopback TCP) spinning ranks also starved gloo's threads and the
kernel's TCP, and steps stalled for 15 to 35 s now and then, which the watchdog reported as a
hang. At 2 ranks on 2 cores spinning is the faster (1.23x over MPI), so "auto" spins there.

`Config.wait`: "spin" (MPI's own blocking waits), "yield" (test, then sleep with a growing
nap: 20 us doubling to 200 us), or "auto": yield where this node runs more of the job's ranks
than the cores they may run on, else spin. The longest nap bounds what a wait adds once the
message is there; 4 ranks on 2 cores, 1F1B, 8 layers, m = 32, alternated rounds: a step of
width 16 took 226 ms with naps up to 1 ms, 200 with 200 us, 167 with 100 us, 218 with a
constant 20 us (a waiting rank that wakes that often takes the core from the working ones);
width 128, sequence 64, m = 8: 176, 143, 150 and 168 ms. The choice is process-wide
(communicators are shared by engines); `PIPEFLOW_WAIT` sets the default for a whole job.

The policy changes how a rank waits, never which operation it issues: collectives are always
the nonblocking ones (MPI matches a blocking collective with a blocking one only), so ranks
whose policies differ (nodes with and without spare cores under "auto", a setting on one
rank only) still meet in every collective.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

__all__ = ["use", "policy", "choose", "node_cores", "until", "wait", "waitall", "wait_object",
           "mprobe", "recv_object", "allgather", "gather", "bcast", "barrier", "sleeping_barrier",
           "agree", "NotJoined"]

_FIRST_NAP, _LONGEST_NAP = 2e-5, 2e-4
_policy = ["spin"]


def choose(wait: str, ranks_on_node: int, cores: int) -> str:
    """"spin" or "yield" for `Config.wait` on a node running `ranks_on_node` of the job's
    ranks on `cores` cores."""
    if wait != "auto":
        return wait
    return "yield" if ranks_on_node > cores else "spin"


def use(wait: str) -> None:
    """Set this process's policy: "spin" or "yield" (resolve "auto" with `choose`)."""
    if wait not in ("spin", "yield"):
        raise ValueError(f"a wait policy is 'spin' or 'yield', found {wait!r}")
    _policy[0] = wait


def policy() -> str:
    return _policy[0]


def node_cores(local: MPI.Comm) -> int:
    """The cores this node's ranks of the job may run on: the union of their affinities
    (all of the node's cores unless the launcher binds ranks). Collective over `local`."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    return len(set().union(*local.allgather(mine)))


def _until(done: Callable[[], Any], deadline: float | None = None,
           nap: bool = True) -> Any:
    """Call `done` until it returns something other than None/False, napping in between
    (unless `nap` is False: spinning). Past `deadline` (a `time.monotonic()` value), None."""
    pause = _FIRST_NAP
    while True:
        result = done()
        if result is not None and result is not False:
            return result
        if deadline is not None and time.monotonic() > deadline:
            return None
        if nap:
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_NAP)


def until(done: Callable[[], Any]) -> Any:
    """Call `done` until it returns something other than None/False, waiting by the policy
    between calls (for a wait on either of two things, which no single MPI call does)."""
    return _until(done, nap=_policy[0] != "spin")


def wait(request: MPI.Request) -> None:
    if _policy[0] == "spin":
        request.Wait()
    else:
        _until(request.Test)


def waitall(requests: Sequence[MPI.Request]) -> None:
    requests = list(requests)
    if _policy[0] == "spin" or not requests:
        MPI.Request.Waitall(requests)
    else:
        _until(lambda: MPI.Request.Testall(requests))


def wait_object(request: MPI.Request) -> Any:
    """`request.wait()` of a pickled-object request (`comm.irecv`), by the policy."""
    if _policy[0] == "spin":
        return request.wait()
    got: list[Any] = []

    def done() -> bool:
        flag, obj = request.test()
        if flag:
            got.append(obj)
        return flag

    _until(done)
    return got[0]


def mprobe(comm: MPI.Comm, source: int, tag: int, status: MPI.Status) -> MPI.Message:
    """A matched probe (`Comm.Mprobe`), waiting by the policy."""
    if _policy[0] == "spin":
        return comm.Mprobe(source=source, tag=tag, status=status)
    return _until(lambda: comm.Improbe(source=source, tag=tag, status=status))


def recv_object(comm: MPI.Comm, source: int, tag: int = 0) -> Any:
    """`comm.recv(source=, tag=)` of a pickled object, waiting by the policy."""
    if _policy[0] == "spin":
        return comm.recv(source=source, tag=tag)
    return _until(lambda: comm.improbe(source=source, tag=tag)).recv()


def allgather(comm: MPI.Comm, obj: Any) -> list[Any]:
    """`comm.allgather(obj)`, waiting by the policy: the sizes, then the pickled bytes."""
    data = MPI.pickle.dumps(obj)
    sizes = np.zeros(comm.size, dtype=np.int64)
    wait(comm.Iallgather(np.array([len(data)], dtype=np.int64), sizes))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    buf = bytearray(int(sizes.sum()))
    wait(comm.Iallgatherv([data, MPI.BYTE], [buf, (sizes, starts), MPI.BYTE]))
    return _unpickled(buf, sizes, starts)


def gather(comm: MPI.Comm, obj: Any, root: int) -> list[Any] | None:
    """`comm.gather(obj, root=root)`, waiting by the policy."""
    data = MPI.pickle.dumps(obj)
    mine = comm.rank == root
    sizes = np.zeros(comm.size if mine else 0, dtype=np.int64)
    wait(comm.Igather(np.array([len(data)], dtype=np.int64), sizes if mine else None, root))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])) if mine else None
    buf = bytearray(int(sizes.sum())) if mine else None
    wait(comm.Igatherv([data, MPI.BYTE], [buf, (sizes, starts), MPI.BYTE] if mine else None,
                       root))
    return _unpickled(buf, sizes, starts) if mine else None


def _unpickled(buf: bytearray, sizes: np.ndarray, starts: np.ndarray) -> list[Any]:
    """The objects that (all)gatherv put side by side in `buf`, one per rank."""
    return [MPI.pickle.loads(bytes(buf[s:s + n])) for s, n in zip(starts, sizes)]


def bcast(comm: MPI.Comm, obj: Any, root: int) -> Any:
    """`comm.bcast(obj, root=root)`, waiting by the policy."""
    data = MPI.pickle.dumps(obj) if comm.rank == root else b""
    size = np.array([len(data)], dtype=np.int64)
    wait(comm.Ibcast(size, root=root))
    buf = bytearray(data) if comm.rank == root else bytearray(int(size[0]))
    wait(comm.Ibcast([buf, MPI.BYTE], root=root))
    return MPI.pickle.loads(bytes(buf))     # a copy on the root too, as comm.bcast gives


def sleeping_barrier(comm: MPI.Comm) -> None:
    """A barrier that always yields its core while it waits, whatever the policy: for ranks
    that wait while others are being timed (the planner's calibration, benchmarks)."""
    _until(comm.Ibarrier().Test)


def barrier(comm: MPI.Comm) -> None:
    wait(comm.Ibarrier())


class NotJoined(Exception):
    """Not every rank joined an agreement within its deadline. `missing` lists the ranks that
    never arrived where this rank could know them (the collecting rank), else None. The
    communicator still holds this agreement's messages: the caller must not use it again."""

    def __init__(self, missing: list[int] | None, waited: float) -> None:
        super().__init__(f"missing {missing}" if missing else "no verdict")
        self.missing, self.waited = missing, waited


_AGREE_TAG = 0x5A6E


def agree(comm: MPI.Comm, view: Any, decide: Callable[[list[Any]], Any],
          deadline_s: float = 0.0) -> Any:
    """Every rank's `view` to rank 0, which returns `decide(views)` to every rank.

    Point to point through rank 0 (two latencies, small messages: the views go up, only the
    verdict comes down), so that, unlike a collective, an agreement that not every rank
    joins can be given up: after `deadline_s` seconds (0: no limit) it raises `NotJoined`,
    on rank 0 naming the ranks that never arrived. A rank makes its next agreement only
    after the verdict of this one, so on rank 0 every message of this tag belongs to it.
    """
    if comm.size == 1:
        return decide([view])
    deadline = time.monotonic() + deadline_s if deadline_s > 0 else None
    nap, start = _policy[0] != "spin", time.monotonic()
    if comm.rank == 0:
        views: list[Any] = [view] + [None] * (comm.size - 1)
        pending = set(range(1, comm.size))
        status = MPI.Status()

        def arrived() -> bool:
            while pending:
                msg = comm.improbe(source=MPI.ANY_SOURCE, tag=_AGREE_TAG, status=status)
                if msg is None:
                    return False
                views[status.Get_source()] = msg.recv()
                pending.discard(status.Get_source())
            return True

        if not _until(arrived, deadline, nap):
            raise NotJoined(sorted(pending), time.monotonic() - start)
        verdict = decide(views)
        waitall_objects([comm.isend(verdict, dest=r, tag=_AGREE_TAG)
                         for r in range(1, comm.size)])
        return verdict
    sent = comm.isend(view, dest=0, tag=_AGREE_TAG)
    msg = _until(lambda: comm.improbe(source=0, tag=_AGREE_TAG), deadline, nap)
    if msg is None:
        raise NotJoined(None, time.monotonic() - start)
    verdict = msg.recv()
    sent.wait()
    return verdict


def waitall_objects(requests: Sequence[MPI.Request]) -> None:
    """Wait for pickled-object requests (`comm.isend`), by the policy."""
    for request in requests:
        if _policy[0] == "spin":
            request.wait()
        else:
            _until(lambda: request.test()[0])
