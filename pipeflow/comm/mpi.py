"""The MPI backend: mpi4py over host memory (or device memory, with a CUDA-aware MPI); runs
anywhere. Also `HeadersFirst`, the message protocol of backends that cannot probe a size."""

from __future__ import annotations

import pickle
from typing import Any, Sequence

import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow.comm.base import (Communicator, ProtocolError, Request, Requests, TensorMeta,
                                as_bytes, as_typed, check_blocks)
from pipeflow.comm import cuda
from pipeflow.tree import Header, describe

__all__ = ["MpiCommunicator", "HeadersFirst", "mpi_iallreduce_", "mpi_ireduce_scatter_",
           "mpi_iallgather_", "FORCE_HOST_STAGING"]

# Stage every all-reduce through a host copy, as GPU tensors are: lets a CPU test run the
# staging path (a copy out, the sum, the copy back) that only GPUs would take otherwise.
FORCE_HOST_STAGING = False


def _device_aware(device: torch.device) -> bool:
    """Whether MPI takes this device's memory itself (a CUDA-aware MPI and a GPU tensor)."""
    if device.type != "cuda":
        return False
    return cuda.cuda_aware_mpi()


def _outgoing(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The buffers a send hands MPI: contiguous host copies, or with a CUDA-aware MPI the GPU
    tensors themselves, once the compute stream has written them."""
    ts = [t.detach() for t in tensors]
    if all(t.device.type == "cpu" and t.is_contiguous() for t in ts):
        return ts                             # already what MPI reads: no call per tensor
    if ts and _device_aware(ts[0].device):
        out = [t.contiguous() for t in ts]
        torch.cuda.current_stream(ts[0].device).synchronize()
        return out
    return [t.to("cpu").contiguous() for t in ts]


def _incoming(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive's buffer: on the GPU for a CUDA-aware MPI, else pinned host memory for GPU
    tensors (copied up by the caller) and plain host memory for CPU ones.

    MPI writes a device buffer at once, outside stream order, so the buffer must be a block
    no queued kernel still reads. The caching allocator hands out a block freed on the
    compute stream as soon as its kernels are queued; but a block is only reused for the
    stream it was allocated on, once every stream recorded on it has passed its free. So the
    buffer comes from a stream no kernel runs on (`cuda.receive_stream`) and is recorded on
    the compute stream that reads it: no stream-wide synchronize before each receive."""
    if _device_aware(device):
        with torch.cuda.stream(cuda.receive_stream(device)):
            buf = torch.empty(shape, dtype=dtype, device=device)
        buf.record_stream(torch.cuda.current_stream(device))
        return buf
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


class _MpiSend(Request):
    def __init__(self, requests: list[MPI.Request], keep: list[torch.Tensor]) -> None:
        self._requests = requests
        self._keep = keep             # the buffers must outlive the send

    def test(self) -> bool:
        done = MPI.Request.Testall(self._requests)
        if done:
            self._keep = []
        return done

    def wait(self) -> None:
        waiting.waitall(self._requests)
        self._keep = []


class _MpiRecv(Request):
    def __init__(self, requests: list[MPI.Request], host: list[torch.Tensor],
                 device: torch.device) -> None:
        self._requests = requests
        self._host = host
        self._device = device

    def test(self) -> bool:
        return MPI.Request.Testall(self._requests)

    def wait(self) -> list[torch.Tensor]:
        waiting.waitall(self._requests)
        if self._device.type == "cpu":
            return self._host
        return [t.to(self._device, non_blocking=True) for t in self._host]

    def cancel(self) -> None:
        """Withdraw receives that no message will match (MPI cancels a posted receive
        reliably); one that matched in the meantime completes instead, and is an error."""
        for r in self._requests:
            r.Cancel()
        statuses = [MPI.Status() for _ in self._requests]
        MPI.Request.Waitall(self._requests, statuses)
        if not all(st.Is_cancelled() for st in statuses):
            raise ProtocolError("a receive posted for a link's last shapes matched a message "
                                "although its sender announced new shapes: the two ranks "
                                "disagree on the order of their messages")
        self._host = []


class _MpiAllreduce(Request):
    """A collective whose result MPI writes into `host`: `wait()` copies it into `target`
    where the two differ (a staged copy); `keep`, the send buffers, live until then."""

    def __init__(self, request: MPI.Request, host: torch.Tensor, target: torch.Tensor,
                 keep: Sequence[torch.Tensor] = ()) -> None:
        self._request = request
        self._host = host
        self._target = target
        self._keep = list(keep)

    def test(self) -> bool:
        return self._request.Test()

    def wait(self) -> None:
        waiting.wait(self._request)
        self._keep = []
        if self._host is not self._target:
            self._target.copy_(self._host.view(self._target.shape))


def mpi_iallreduce_(comm: MPI.Comm, tensor: torch.Tensor) -> Request:
    """Start summing `tensor` over `comm` in place.

    CUDA tensors go to `cuda_mpi` (device buffers for a CUDA-aware MPI, else reused pinned
    staging on a side stream). A contiguous CPU tensor is reduced where it lies; a
    non-contiguous one (or any, with `FORCE_HOST_STAGING`) through a contiguous copy, summed
    back into `tensor` by `wait()`.
    """
    if tensor.device.type == "cuda" and not FORCE_HOST_STAGING:
        return cuda.iallreduce_cuda_(comm, tensor)
    host = tensor.detach()
    if FORCE_HOST_STAGING or host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu", memory_format=torch.contiguous_format, copy=True)
    req = comm.Iallreduce(MPI.IN_PLACE, as_typed(host), op=MPI.SUM)
    return _MpiAllreduce(req, host, tensor.detach())


def _staged(tensor: torch.Tensor) -> bool:
    """Whether a CPU collective goes through a host copy of `tensor` (forced, in tests)."""
    return FORCE_HOST_STAGING or tensor.device.type != "cpu" or not tensor.is_contiguous()


def _host_pair(source: torch.Tensor, out: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(what MPI reads, what it writes, where the result belongs) of a collective from
    `source` into `out`: each used where it lies unless it needs host staging (`_staged`)."""
    send, target = source.detach(), out.detach()
    if _staged(send):
        send = send.to("cpu", copy=True)
    host = torch.empty_like(target, device="cpu") if _staged(target) else target
    return send, host, target


def mpi_ireduce_scatter_(comm: MPI.Comm, tensor: torch.Tensor, out: torch.Tensor) -> Request:
    """Start `Ireduce_scatter_block`: the sum of `tensor` over `comm`, block `comm.rank` of
    it into `out`. CUDA tensors go through pinned host staging (`cuda`); CPU ones are read
    and written where they lie (with `FORCE_HOST_STAGING`, through copies)."""
    check_blocks("reduce_scatter", tensor, out, comm.size, f"rank {comm.rank}")
    if tensor.device.type == "cuda" and not FORCE_HOST_STAGING:
        return cuda.ireduce_scatter_cuda_(comm, tensor, out)
    send, host, target = _host_pair(tensor, out)
    req = comm.Ireduce_scatter_block(as_typed(send), as_typed(host), op=MPI.SUM)
    return _MpiAllreduce(req, host, target, keep=[send])


def mpi_iallgather_(comm: MPI.Comm, shard: torch.Tensor, out: torch.Tensor) -> Request:
    """Start `Iallgather`: every rank's `shard` into `out`, in rank order, as bytes (so
    bf16 travels too). CUDA tensors go through pinned host staging (`cuda`)."""
    check_blocks("all_gather", out, shard, comm.size, f"rank {comm.rank}")
    if shard.device.type == "cuda" and not FORCE_HOST_STAGING:
        return cuda.iallgather_cuda_(comm, shard, out)
    send, host, target = _host_pair(shard, out)
    req = comm.Iallgather(as_bytes(send), as_bytes(host))
    return _MpiAllreduce(req, host, target, keep=[send])


def _on_wire(status: MPI.Status) -> str:
    """A probed message as reports name it: its tag (header or tensor, see `send_message`)
    and size."""
    kind = " (a header)" if status.tag % 2 else ""
    return f"message {status.tag // 2}{kind} of {status.Get_count(MPI.BYTE)} bytes"


class MpiCommunicator(Communicator):
    """mpi4py over host memory; runs anywhere. GPU tensors are staged through the host, or
    handed to MPI as they are where MPI is CUDA-aware (`cuda_mpi.cuda_aware_mpi`)."""

    def __init__(self, comm: MPI.Comm, synchronous: bool = False) -> None:
        """`synchronous`: a tensor send completes only once the peer has matched it with a
        receive (`MPI_Issend`), as NCCL's do, instead of when MPI has buffered it."""
        self.comm = comm
        self._isend = comm.Issend if synchronous else comm.Isend
        # Objects travel on their own context, so they can never match a tensor receive.
        self.control = comm.Dup()
        self.rank = comm.rank
        self.size = comm.size
        self.device = torch.device("cpu")   # host buffers; GPU tensors are staged through it
        self.bytes_sent = 0       # point-to-point payload, for measurements

    def isend(self, tensors: Sequence[torch.Tensor], dest: int, tag: int) -> Request:
        # One message per tensor, all with the same tag: MPI's non-overtaking rule delivers
        # them in order into the receiver's receives, posted in the same order.
        host = _outgoing(tensors)
        self.bytes_sent += sum(t.numel() * t.element_size() for t in host)
        reqs = [self._isend(as_bytes(t), dest=dest, tag=tag) for t in host]
        return _MpiSend(reqs, host)

    def irecv(self, metas: Sequence[TensorMeta], source: int, tag: int,
              device: torch.device) -> Request:
        host = [_incoming(shape, dtype, device) for shape, dtype in metas]
        reqs = [self.comm.Irecv(as_bytes(t), source=source, tag=tag) for t in host]
        return _MpiRecv(reqs, host, device)

    def send_message(self, header: Header | None, tensors: Sequence[torch.Tensor], dest: int,
                     tag: int) -> Request:
        # A message the receiver knows the shapes of travels as its tensors alone, on tag
        # 2·tag; one with a new header travels whole on 2·tag + 1, the header first. The two
        # go on one communicator from one sender, so the receiver meets them in order (MPI's
        # non-overtaking rule under an ANY_TAG probe) and learns a new shape before its
        # tensors; and a receive posted ahead for the link's last shapes (2·tag) never meets
        # tensors of a new shape, which follow their header on the other tag.
        reqs, keep = [], []
        data_tag = 2 * tag
        if header is not None:
            data_tag = 2 * tag + 1
            raw = bytearray(pickle.dumps(header))
            reqs.append(self.comm.Isend([raw, MPI.BYTE], dest=dest, tag=data_tag))
            keep.append(raw)
        host = _outgoing(tensors)
        self.bytes_sent += sum(t.numel() * t.element_size() for t in host)
        reqs += [self._isend(as_bytes(t), dest=dest, tag=data_tag) for t in host]
        return _MpiSend(reqs, host + keep)

    def irecv_message(self, metas: Sequence[TensorMeta], source: int, tag: int,
                      device: torch.device) -> Request:
        # The tensors of a message whose shapes the receiver knows travel on 2·tag. A posted
        # receive claims its message by tag, so a later probe (ANY_TAG) never sees it.
        return self.irecv(metas, source, 2 * tag, device)

    def recv_posted(self, request: Request, source: int, tag: int, header: Header,
                    device: torch.device) -> tuple[Header, list[torch.Tensor]]:
        # Posted for the link's last header; the sender either sent tensors of those shapes
        # (they land in the posted buffers) or announced new ones on 2·tag + 1, whose
        # message no posted receive matches: then the posted receives are withdrawn and
        # the announced message is probed as any other.
        announced = MPI.Status()

        def done() -> str | None:
            if request.test():
                return "posted"
            if self.comm.Iprobe(source=source, tag=2 * tag + 1, status=announced):
                return "announced"
            return None
        try:
            if waiting.until(done) == "posted":
                return header, request.wait()
        except MPI.Exception as exc:        # a message longer than the sizes posted
            raise ProtocolError(
                f"expected message {tag} from rank {source} of the pipeline as "
                f"{describe(header.metas)}, the shapes its link last announced; found a "
                f"message that does not fit ({exc.Get_error_string()}): the sender changed "
                f"shapes without announcing them") from None
        request.cancel()
        return self.recv_message(source, tag, None, device)

    def recv_message(self, source: int, tag: int, header: Header | None,
                     device: torch.device) -> tuple[Header, list[torch.Tensor]]:
        status = MPI.Status()
        msg = waiting.mprobe(self.comm, source, MPI.ANY_TAG, status)
        data_tag = 2 * tag
        if status.tag == 2 * tag + 1:
            data_tag = 2 * tag + 1
            raw = bytearray(status.Get_count(MPI.BYTE))
            waiting.wait(msg.Irecv([raw, MPI.BYTE]))
            header = pickle.loads(raw)
            msg = waiting.mprobe(self.comm, source, MPI.ANY_TAG, status) \
                if header.metas else None
        if header is None:
            raise ProtocolError(f"message {tag} from rank {source} of the pipeline arrived "
                                f"before any announcement of its shapes")
        out = []
        for i, meta in enumerate(header.metas):
            if i:
                msg = waiting.mprobe(self.comm, source, MPI.ANY_TAG, status)
            found = status.Get_count(MPI.BYTE)
            if status.tag != data_tag or found != meta.nbytes:
                raise ProtocolError(
                    f"expected message {tag} from rank {source} of the pipeline, tensor {i} "
                    f"of {describe(header.metas)} ({meta.nbytes} bytes); found "
                    f"{_on_wire(status)}: the two ranks disagree on the order or shape of "
                    f"their messages")
            host = _incoming(meta.shape, meta.dtype, device)
            waiting.wait(msg.Irecv(as_bytes(host)))
            out.append(host if device.type == "cpu" else host.to(device, non_blocking=True))
        return header, out

    def send_object(self, obj: Any, dest: int) -> None:
        waiting.wait(self.control.isend(obj, dest=dest))

    def recv_object(self, source: int) -> Any:
        return waiting.recv_object(self.control, source)

    def allgather_object(self, obj: Any) -> list[Any]:
        return waiting.allgather(self.control, obj)

    def bcast_object(self, obj: Any, root: int) -> Any:
        return waiting.bcast(self.control, obj, root)

    def iallreduce_(self, tensor: torch.Tensor, key: str | None = None) -> Request:
        return mpi_iallreduce_(self.comm, tensor)

    def ireduce_scatter_(self, tensor: torch.Tensor, out: torch.Tensor,
                         key: str | None = None) -> Request:
        return mpi_ireduce_scatter_(self.comm, tensor, out)

    def iallgather_(self, shard: torch.Tensor, out: torch.Tensor,
                    key: str | None = None) -> Request:
        return mpi_iallgather_(self.comm, shard, out)

    def barrier(self) -> None:
        waiting.barrier(self.comm)

    def arrived_from(self, source: int) -> str | None:
        status = MPI.Status()
        if not self.comm.Iprobe(source=source, tag=MPI.ANY_TAG, status=status):
            return f"nothing from rank {source} of the pipeline has arrived"
        return (f"{_on_wire(status)} from rank {source} of the pipeline has arrived and "
                f"waits to be received")

    def free(self) -> None:
        self.control.Free()


class HeadersFirst:
    """Messages for backends that cannot probe a message's size (torch.distributed; MPI
    under NCCL's rules): every message's header travels first over MPI (a pickled tuple of
    shapes), then the tensors, which NCCL matches by order."""

    always_header = True

    def _header_link(self, tag: int) -> tuple[MPI.Comm, int]:
        """The MPI communicator and tag a message's header travels on."""
        raise NotImplementedError

    def send_message(self, header: Header | None, tensors: Sequence[torch.Tensor], dest: int,
                     tag: int) -> Request:
        parts: list[Request] = []
        if header is not None:
            comm, htag = self._header_link(tag)
            parts.append(_MpiSend([comm.isend(header, dest=dest, tag=htag)], []))
        if tensors:
            parts.append(self.isend(tensors, dest, tag))
        return Requests(parts)

    def recv_message(self, source: int, tag: int, header: Header | None,
                     device: torch.device) -> tuple[Header, list[torch.Tensor]]:
        if header is None:
            comm, htag = self._header_link(tag)
            header = waiting.recv_object(comm, source, htag)
        if not header.metas:
            return header, []
        metas = [(m.shape, m.dtype) for m in header.metas]
        return header, self.irecv(metas, source, tag, device).wait()
