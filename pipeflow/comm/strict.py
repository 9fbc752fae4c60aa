"""`StrictCommunicator`: NCCL's rules enforced on CPUs, so a test run breaks where NCCL would.

MPI forgives what NCCL does not: it matches messages by tag, takes tensors anywhere and lets
any thread call it. Under `Config(backend="strict")` (or `PIPEFLOW_STRICT_COMM=1` with the
MPI backend) every point-to-point message and collective goes through this wrapper, which
refuses

- a receive that is not the next message sent on its link (NCCL matches by order only, the
  tag is ignored): each message carries a header (its index on the link, its tag, its
  shapes), and the receiver compares it with what it asked for;
- a collective that the ranks of the group do not all issue as their next one (same op, same
  shape and dtype, and the same name where the caller gives one: two gradient buckets of one
  size issued in different orders): NCCL would hang or sum unrelated buffers. Tensor
  collectives and object collectives (which travel over MPI under every backend) are two
  sequences, each checked in its own order; a tensor collective is checked without blocking
  the host, as NCCL's are issued, and started once every rank's signature agrees;
- a send that completes before the peer has posted its receive: NCCL's sends do not finish
  until the peer receives (no buffering to hide an order that only works with it), so every
  tensor here is sent synchronously (`MPI_Issend`);
- a device synchronize inside a step (`torch.cuda.synchronize`, see `no_device_sync`): after
  a send it waits for the peer's receive, and two stages doing so wait for each other;
- a receive posted and never matched (an engine's step failed after posting it ahead):
  NCCL cannot withdraw a posted receive, and the next engine on the same ranks reuses the
  link's group, so its first message on that link would land in the old receive. MPI
  withdraws it (`MPI_Cancel`); here it is withdrawn but remembered (`_POSTED`), and a strict
  communicator built over ranks with such a link refuses, on every rank;
- a tensor off the group's device;
- any call from another thread than the one that built the communicator (on CUDA, autograd
  runs gradient hooks on its device thread).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow.comm.base import Communicator, Request, TensorMeta, check_on_device, meta_of
from pipeflow.comm.mpi import HeadersFirst, MpiCommunicator

__all__ = ["StrictCommunicator", "StrictCommError", "no_device_sync", "forget_posted"]


class StrictCommError(RuntimeError):
    """A use of a communicator that MPI tolerates but NCCL would not."""


@contextlib.contextmanager
def no_device_sync(where: Callable[[], str]) -> Iterator[None]:
    """Within a step under the strict backend, `torch.cuda.synchronize` is an error (on a CPU
    nothing else would show that the engine calls it, as the tracer once did)."""
    real = torch.cuda.synchronize

    def refuse(device: Any = None) -> None:
        raise StrictCommError(
            f"{where()}: torch.cuda.synchronize() inside a step: after a send it waits for "
            f"the peer's receive, and two stages doing so wait for each other under NCCL. "
            f"Record a CUDA event and read it after the step instead")

    torch.cuda.synchronize = refuse
    try:
        yield
    finally:
        torch.cuda.synchronize = real


class _StrictSend(Request):
    def __init__(self, header: MPI.Request, data: Request) -> None:
        self._header = header
        self._data = data

    def test(self) -> bool:
        return self._header.Test() and self._data.test()

    def wait(self) -> None:
        waiting.wait(self._header)
        self._data.wait()


# (world rank of the source, of the destination) -> the receives posted on that link by strict
# communicators of this process, until matched: NCCL's link groups are cached per process,
# so a receive posted and never matched stays posted for the next engine.
_POSTED: dict[tuple[int, int], list["_StrictRecv"]] = {}


def forget_posted() -> None:
    """Forget every receive posted and never matched (tests that make one on purpose)."""
    _POSTED.clear()


class _StrictRecv(Request):
    def __init__(self, header: MPI.Request, data: Request, expected: tuple, where: str) -> None:
        self._header = header
        self._data = data
        self._expected = expected
        self._where = where
        self._got: tuple | None = None
        self.withdrawn = False

    def pending(self) -> bool:
        """Posted and not matched by a message (withdrawn ones stay pending: NCCL's would)."""
        if self.withdrawn:
            return True
        parts = [self._header, *getattr(self._data, "_requests", [])]
        return not all(r.Get_status() for r in parts)

    def withdraw(self) -> None:
        """Cancel the MPI receives (NCCL could not) and remember the link as unmatched."""
        for r in [self._header, *getattr(self._data, "_requests", [])]:
            if not r.Get_status():
                r.Cancel()
            MPI.Request.Wait(r)
        self.withdrawn = True

    def _check(self, got: tuple) -> None:
        self._got = got
        index, tag, metas = self._expected
        _, sent_tag, sent_metas = got
        if (sent_tag, sent_metas) != (tag, metas):
            raise StrictCommError(
                f"{self._where}: receive {index} on this link expected tag {tag} with tensors "
                f"{list(metas)}, but message {index} sent on the link has tag "
                f"{sent_tag} with tensors {list(sent_metas)}; NCCL matches point-to-point "
                f"messages by order only: receive in the order the peer sends")

    def test(self) -> bool:
        if self._got is None:
            done, got = self._header.test()
            if not done:
                return False
            self._check(got)
        return self._data.test()

    def wait(self) -> list[torch.Tensor]:
        if self._got is None:
            self._check(waiting.wait_object(self._header))
        return self._data.wait()


def _unmatched(links: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Of `links`, those with posted receives no message matched, and how many."""
    out = {}
    for link in links:
        live = [r for r in _POSTED.get(link, []) if r.pending()]
        _POSTED[link] = live
        if live:
            out[link] = len(live)
    return out


class _PendingCollective(Request):
    """A tensor collective under the strict backend: its signature's digest all-gathered
    without blocking; the collective itself started once every rank's digest is in and equal
    (`StrictCommunicator._advance`, in order of issue)."""

    def __init__(self, owner: "StrictCommunicator", sig: tuple, index: int,
                 issue: Callable[[], Request]) -> None:
        self.owner, self.sig, self.index, self.issue = owner, sig, index, issue
        digest = hashlib.blake2b(repr(sig).encode(), digest_size=8).digest()
        self.mine = np.frombuffer(digest, dtype=np.int64).copy()
        self.views = np.empty(owner.size, dtype=np.int64)
        self.check = owner.tensor_checks.Iallgather(self.mine, self.views)
        self.inner: Request | None = None

    def check_done(self, block: bool) -> bool:
        """Whether every rank's digest is in (waiting for it with `block`)."""
        if block:
            waiting.wait(self.check)
            return True
        return self.check.Test()

    def verify(self) -> None:
        """A mismatch raises on every rank, each naming what every rank issued."""
        if (self.views != self.mine[0]).any():
            views = waiting.allgather(self.owner.texts, self.sig)
            ranks = "; ".join(f"rank {r}: {v[0]}{v[1]}" for r, v in enumerate(views))
            raise StrictCommError(
                f"rank {self.owner.rank}: collective {self.index} of this group differs "
                f"between ranks ({ranks}); every rank of an NCCL group must issue the same "
                f"collectives in the same order")
        return True

    def start(self) -> None:
        self.inner = self.issue()

    def test(self) -> bool:
        if self.inner is None:
            self.owner._advance()
        return self.inner is not None and self.inner.test()

    def wait(self) -> Any:
        if self.inner is None:
            self.owner._advance(until=self)
        return self.inner.wait()


class StrictCommunicator(HeadersFirst, Communicator):
    """Host-staged MPI with NCCL's rules checked on every call (see the module's docstring)."""

    def __init__(self, comm: MPI.Comm, device: torch.device | str = "cpu") -> None:
        self.inner = MpiCommunicator(comm, synchronous=True)
        self.headers = comm.Dup()       # one header per message, matched by order
        self.checks = comm.Dup()        # each object collective's signature, compared at once
        self.tensor_checks = comm.Dup()  # each tensor collective's signature (digest), async
        self.texts = comm.Dup()         # the signatures in full, where the digests differ
        self.rank, self.size = comm.rank, comm.size
        self.device = torch.device(device)
        self.thread = threading.get_ident()
        self._sent: dict[int, int] = {}
        self._posted: dict[int, int] = {}
        self._live: list[_StrictRecv] = []      # posted by this communicator
        self.collectives = 0             # tensor collectives issued
        self.object_collectives = 0
        self._queue: list[_PendingCollective] = []   # issued, their check not yet complete
        self.world_ranks = MPI.Group.Translate_ranks(
            comm.Get_group(), list(range(comm.size)), MPI.COMM_WORLD.Get_group())
        self._refuse_unmatched()

    def _refuse_unmatched(self) -> None:
        """On every rank alike: refuse these ranks where a receive an earlier communicator
        posted on one of their links was never matched (see the module's docstring)."""
        me = self.world_ranks[self.rank]
        mine = _unmatched([(src, me) for src in self.world_ranks if src != me])
        views = waiting.allgather(self.checks, mine)
        found = {link: n for view in views for link, n in view.items()}
        if found:
            links = ", ".join(f"{n} on the link from rank {a} to rank {b}"
                              for (a, b), n in sorted(found.items()))
            raise StrictCommError(
                f"rank {self.rank}: receives posted by an earlier engine and never matched "
                f"({links}), its step having failed after posting them ahead. NCCL cannot "
                f"withdraw a posted receive and the next engine on these ranks reuses the "
                f"link's group, so the first message on that link would land in the old "
                f"receive (read one message late) or hang where sizes differ. On NCCL a "
                f"multi-rank engine therefore ends the job on a failure (abort_on_error=False "
                f"is refused); start a new job after a failed step")

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    def _guard(self, op: str, tensors: Sequence[torch.Tensor] = ()) -> None:
        here = threading.get_ident()
        if here != self.thread:
            raise StrictCommError(
                f"rank {self.rank}: {op} called from thread {here}, not from the thread that "
                f"owns this communicator ({self.thread}); on CUDA, autograd runs gradient "
                f"hooks on its own device thread: mark the work ready in the hook and issue "
                f"it from the engine's thread")
        check_on_device(op, tensors, self.device, f"rank {self.rank} (strict communicator)")

    def _agree(self, op: str) -> None:
        """Every rank of the group issues this same object collective as its next one (these
        travel over MPI under every backend: a sequence of their own, checked at once)."""
        views = waiting.allgather(self.checks, op)
        index = self.object_collectives
        self.object_collectives += 1
        if any(v != op for v in views):
            raise StrictCommError(
                f"rank {self.rank}: object collective {index} of this group differs between "
                f"ranks ({'; '.join(f'rank {r}: {v}' for r, v in enumerate(views))}); every "
                f"rank must issue the same collectives in the same order")

    def _collective(self, op: str, tensor: torch.Tensor, key: str | None,
                    issue: Callable[[], Request]) -> Request:
        """A tensor collective (NCCL's, on a GPU) checked as NCCL would need it: the same
        operation, shape, dtype and caller's `key` as every other rank's collective of the
        same index. Issued as NCCL issues it, without waiting for the others: its signature
        travels in a nonblocking all-gather, and the collective itself starts, in order of
        issue, once every rank's signature is in and equal (so a mismatch is named before
        MPI could pair unrelated buffers)."""
        name = op if key is None else f"{op}[{key}]"
        sig = (name, (tuple(tensor.shape), str(tensor.dtype)))
        pending = _PendingCollective(self, sig, self.collectives, issue)
        self.collectives += 1
        self._queue.append(pending)
        self._advance()
        return pending

    def _advance(self, until: "_PendingCollective | None" = None) -> None:
        """Start the queued collectives whose check is complete, in order of issue; with
        `until`, wait for the checks up to and including that one."""
        while self._queue:
            head = self._queue[0]
            if not head.check_done(block=until is not None):
                return
            self._queue.pop(0)
            head.verify()
            head.start()
            if head is until:
                return

    # -- point to point ---------------------------------------------------------------
    def isend(self, tensors: Sequence[torch.Tensor], dest: int, tag: int) -> Request:
        self._guard("isend", tensors)
        index = self._sent.get(dest, 0)
        self._sent[dest] = index + 1
        header = self.headers.isend((index, tag, meta_of(tensors)), dest=dest, tag=0)
        return _StrictSend(header, self.inner.isend(tensors, dest, tag=0))   # the tag ignored

    def irecv(self, metas: Sequence[TensorMeta], source: int, tag: int,
              device: torch.device) -> Request:
        self._guard("irecv", [torch.empty(0, device=device)])
        index = self._posted.get(source, 0)
        self._posted[source] = index + 1
        header = self.headers.irecv(source=source, tag=0)
        where = f"rank {self.rank}, link from rank {source}"
        recv = _StrictRecv(header, self.inner.irecv(metas, source, 0, device),
                           (index, tag, tuple(metas)), where)
        link = (self.world_ranks[source], self.world_ranks[self.rank])
        for posted in (_POSTED.setdefault(link, []), self._live):
            if len(posted) >= 16:       # matched ones go, a few at a time
                posted[:] = [r for r in posted if r.pending()]
            posted.append(recv)
        return recv

    def _header_link(self, tag: int) -> tuple[MPI.Comm, int]:
        return self.headers, 1          # tag 0 carries the per-message order checks

    # -- objects and collectives ------------------------------------------------------
    def send_object(self, obj: Any, dest: int) -> None:
        self._guard("send_object")
        self.inner.send_object(obj, dest)

    def recv_object(self, source: int) -> Any:
        self._guard("recv_object")
        return self.inner.recv_object(source)

    def allgather_object(self, obj: Any) -> list[Any]:
        self._guard("allgather_object")
        self._agree("allgather_object")
        return self.inner.allgather_object(obj)

    def bcast_object(self, obj: Any, root: int) -> Any:
        self._guard("bcast_object")
        self._agree(f"bcast_object(root={root})")
        return self.inner.bcast_object(obj, root)

    def iallreduce_(self, tensor: torch.Tensor, key: str | None = None) -> Request:
        self._guard("all_reduce", [tensor])
        return self._collective("all_reduce", tensor, key, lambda: self.inner.iallreduce_(tensor))

    def ireduce_scatter_(self, tensor: torch.Tensor, out: torch.Tensor,
                         key: str | None = None) -> Request:
        self._guard("reduce_scatter", [tensor, out])
        return self._collective("reduce_scatter", tensor, key,
                                lambda: self.inner.ireduce_scatter_(tensor, out))

    def iallgather_(self, shard: torch.Tensor, out: torch.Tensor,
                    key: str | None = None) -> Request:
        self._guard("all_gather", [shard, out])
        return self._collective("all_gather", out, key,
                                lambda: self.inner.iallgather_(shard, out))

    def barrier(self) -> None:
        self._guard("barrier")
        self._agree("barrier")
        self.inner.barrier()

    def free(self) -> None:
        for recv in self._live:
            if recv.pending():
                recv.withdraw()         # remembered in `_POSTED`: NCCL's would stay posted
        self._live = []
        self.inner.free()
        self.headers.Free()
        for comm in (self.checks, self.tensor_checks, self.texts):
            comm.Free()
