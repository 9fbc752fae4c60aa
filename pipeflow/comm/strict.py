"""`StrictCommunicator`: NCCL's rules enforced on CPUs, so a test run breaks where NCCL would.

MPI forgives what NCCL does not: it matches messages by tag, takes tensors anywhere and lets
any thread call it. Under `Config(backend="strict")` (or `PIPEFLOW_STRICT_COMM=1` with the
MPI backend) every point-to-point message and collective goes through this wrapper, which
refuses

- a receive that is not the next message sent on its link (NCCL matches by order only, the
  tag is ignored): each message carries a header (its index on the link, its tag, its
  shapes), and the receiver compares it with what it asked for;
- a collective that the ranks of the group do not all issue as their next one (same op, same
  shape and dtype): NCCL would hang or sum unrelated buffers;
- a send that completes before the peer has posted its receive: NCCL's sends do not finish
  until the peer receives (no buffering to hide an order that only works with it), so every
  tensor here is sent synchronously (`MPI_Issend`);
- a device synchronize inside a step (`torch.cuda.synchronize`, see `no_device_sync`): after
  a send it waits for the peer's receive, and two stages doing so wait for each other;
- a tensor off the group's device;
- any call from another thread than the one that built the communicator (on CUDA, autograd
  runs gradient hooks on its device thread).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow.comm.base import Communicator, Request, TensorMeta, check_on_device, meta_of
from pipeflow.comm.mpi import HeadersFirst, MpiCommunicator

__all__ = ["StrictCommunicator", "StrictCommError", "no_device_sync"]


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


class _StrictRecv(Request):
    def __init__(self, header: MPI.Request, data: Request, expected: tuple, where: str) -> None:
        self._header = header
        self._data = data
        self._expected = expected
        self._where = where
        self._got: tuple | None = None

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


class StrictCommunicator(HeadersFirst, Communicator):
    """Host-staged MPI with NCCL's rules checked on every call (see the module's docstring)."""

    def __init__(self, comm: MPI.Comm, device: torch.device | str = "cpu") -> None:
        self.inner = MpiCommunicator(comm, synchronous=True)
        self.headers = comm.Dup()       # one header per message, matched by order
        self.checks = comm.Dup()        # each collective's signature, compared across ranks
        self.rank, self.size = comm.rank, comm.size
        self.device = torch.device(device)
        self.thread = threading.get_ident()
        self._sent: dict[int, int] = {}
        self._posted: dict[int, int] = {}
        self.collectives = 0

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

    def _agree(self, op: str, tensor: torch.Tensor | None = None) -> None:
        """Every rank of the group issues this same collective as its next one."""
        sig = (op, None if tensor is None else (tuple(tensor.shape), str(tensor.dtype)))
        views = waiting.allgather(self.checks, sig)
        index = self.collectives
        self.collectives += 1
        if any(v != sig for v in views):
            ranks = "; ".join(f"rank {r}: {v[0]}{'' if v[1] is None else v[1]}"
                              for r, v in enumerate(views))
            raise StrictCommError(
                f"rank {self.rank}: collective {index} of this group differs between ranks "
                f"({ranks}); every rank of an NCCL group must issue the same collectives in "
                f"the same order")

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
        return _StrictRecv(header, self.inner.irecv(metas, source, 0, device),
                           (index, tag, tuple(metas)), where)

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

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        self._guard("all_reduce", [tensor])
        self._agree("all_reduce", tensor)
        return self.inner.iallreduce_(tensor)

    def ireduce_scatter_(self, tensor: torch.Tensor, out: torch.Tensor) -> Request:
        self._guard("reduce_scatter", [tensor, out])
        self._agree("reduce_scatter", tensor)
        return self.inner.ireduce_scatter_(tensor, out)

    def iallgather_(self, shard: torch.Tensor, out: torch.Tensor) -> Request:
        self._guard("all_gather", [shard, out])
        self._agree("all_gather", out)
        return self.inner.iallgather_(shard, out)

    def barrier(self) -> None:
        self._guard("barrier")
        self._agree("barrier")
        self.inner.barrier()

    def free(self) -> None:
        self.inner.free()
        self.headers.Free()
        self.checks.Free()
