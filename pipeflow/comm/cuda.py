"""GPU tensors over MPI: reductions through reused pinned host staging (point-to-point alone
hands device buffers to a CUDA-aware MPI, in `comm`); and NCCL's data-parallel all-reduce on a
stream of its own.

Only CUDA tensors come here; CPU tensors keep `comm.mpi_iallreduce_`'s host path. Nothing in
this module touches CUDA until a CUDA tensor is reduced, so it imports on any machine.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow.comm.base import Request, as_typed

__all__ = ["CUDA_AWARE_ENV", "cuda_aware_mpi", "PinnedBuffers", "side_stream", "receive_stream",
           "iallreduce_cuda_", "ireduce_scatter_cuda_", "iallgather_cuda_",
           "all_reduce_on_side_stream", "on_side_stream"]

CUDA_AWARE_ENV = "PIPEFLOW_CUDA_AWARE_MPI"


def cuda_aware_mpi(query: Callable[[], Any] | None = None) -> bool:
    """Whether MPI may be handed device memory.

    `PIPEFLOW_CUDA_AWARE_MPI=1` or `0` decides when set (an MPI that claims support it does
    not have, or one that cannot say, is common); otherwise MPI is asked
    (`MPI.Query_cuda_support`, mpi4py >= 4 on Open MPI and MPICH); otherwise it is off, and
    GPU tensors are staged through pinned host buffers.
    """
    value = os.environ.get(CUDA_AWARE_ENV, "").strip()
    if value:
        if value not in ("0", "1"):
            raise ValueError(f"{CUDA_AWARE_ENV}={value!r}: expected 1 (MPI takes device "
                             f"buffers) or 0 (stage through host memory); unset it to ask MPI")
        return value == "1"
    query = query if query is not None else getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except (NotImplementedError, MPI.Exception):   # an MPI without the MPIX extension
        return False


class PinnedBuffers:
    """Host staging buffers reused across steps, keyed by (numel, dtype).

    A buffer is taken for one operation and given back with the event after which it is
    free again (its copy back to the device); it is reused only once that event has passed,
    so buckets of one size in flight together each get their own.
    """

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self.allocated = 0
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((numel, dtype), [])
        for i, (buf, event) in enumerate(free):
            if event is None or event.query():
                del free[i]
                return buf
        self.allocated += 1
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)

    def give(self, buf: torch.Tensor, event: Any = None) -> None:
        self._free.setdefault((buf.numel(), buf.dtype), []).append((buf, event))


_PINNED = PinnedBuffers()
_SIDE: dict[torch.device, Any] = {}


def side_stream(device: torch.device) -> Any:
    """One communication stream per GPU, made on first use."""
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    return _SIDE[device]


_RECEIVE: dict[torch.device, Any] = {}


def receive_stream(device: torch.device) -> Any:
    """A stream per GPU that runs no kernel: CUDA-aware MPI's receive buffers are allocated
    on it, so the caching allocator never hands one a block that queued kernels still use
    (see `comm.mpi._incoming`)."""
    if device not in _RECEIVE:
        _RECEIVE[device] = torch.cuda.Stream(device=device)
    return _RECEIVE[device]


class _DeviceAllreduce(Request):
    """An MPI collective of device tensors through pinned host memory; `wait()` lands the
    result (`host`) in the target and gives the staging buffers (`also`: the send side of a
    reduce-scatter or all-gather) back."""

    def __init__(self, request: MPI.Request, host: torch.Tensor, target: torch.Tensor,
                 also: tuple[torch.Tensor, ...] = ()) -> None:
        self._request, self._host, self._target, self._also = request, host, target, also

    def test(self) -> bool:
        return self._request.Test()

    def wait(self) -> None:
        waiting.wait(self._request)
        # On the current (compute) stream: it waits for the sum only where it needs it.
        self._target.copy_(self._host.view(self._target.shape), non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._target.device))
        for buf in (self._host, *self._also):
            _PINNED.give(buf, done)


def _to_pinned(target: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor, made on the side stream after what the compute
    stream queued; this thread waits for the copy, the compute stream does not."""
    host = _PINNED.take(target.numel(), target.dtype)
    side = side_stream(target.device)
    side.wait_stream(torch.cuda.current_stream(target.device))
    with torch.cuda.stream(side):
        host.copy_(target.reshape(-1), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    target.record_stream(side)
    copied.synchronize()
    return host


def iallreduce_cuda_(comm: MPI.Comm, tensor: torch.Tensor) -> Request:
    """Start summing a CUDA tensor over `comm` in place, through a pinned host copy made on
    a side stream. Always through the host, even where MPI is CUDA-aware: CUDA-aware MPIs
    take device memory in point-to-point calls and blocking collectives, and Open MPI
    documents its nonblocking collectives (`Iallreduce`, what overlaps the backward here) as
    not CUDA-aware."""
    target = tensor.detach()
    _typed_check(target)
    host = _to_pinned(target)
    req = comm.Iallreduce(MPI.IN_PLACE, as_typed(host), op=MPI.SUM)
    return _DeviceAllreduce(req, host, target)


def ireduce_scatter_cuda_(comm: MPI.Comm, tensor: torch.Tensor, out: torch.Tensor) -> Request:
    """`Ireduce_scatter_block` of a CUDA tensor through pinned host buffers (as
    `iallreduce_cuda_`, for the same reason): block `comm.rank` of the sum into `out`."""
    _typed_check(tensor)
    send = _to_pinned(tensor.detach())
    host = _PINNED.take(out.numel(), out.dtype)
    req = comm.Ireduce_scatter_block(as_typed(send), as_typed(host), op=MPI.SUM)
    return _DeviceAllreduce(req, host, out.detach(), also=(send,))


def iallgather_cuda_(comm: MPI.Comm, shard: torch.Tensor, out: torch.Tensor) -> Request:
    """`Iallgather` of a CUDA shard through pinned host buffers, as bytes (bf16 included):
    every rank's shard into `out`."""
    send = _to_pinned(shard.detach())
    host = _PINNED.take(out.numel(), out.dtype)
    req = comm.Iallgather([send.view(torch.uint8).numpy(), MPI.BYTE],
                          [host.view(torch.uint8).numpy(), MPI.BYTE])
    return _DeviceAllreduce(req, host, out.detach(), also=(send,))


class _SideStreamWork(Request):
    """A torch.distributed all-reduce issued on the side stream; `wait()` orders the current
    stream after it, so what follows on the compute stream sees the sum."""

    def __init__(self, work: Any, side: Any, device: torch.device) -> None:
        self._work, self._side, self._device = work, side, device

    def test(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        self._work.wait()
        torch.cuda.current_stream(self._device).wait_stream(self._side)


def all_reduce_on_side_stream(dist: Any, tensor: torch.Tensor, group: Any) -> Request:
    """Start an NCCL all-reduce of a CUDA tensor on the GPU's communication stream, after
    what the compute stream has queued so far (the gradients it reduces); the compute stream
    goes on with the backward meanwhile."""
    return on_side_stream(lambda: dist.all_reduce(tensor, group=group, async_op=True),
                          [tensor])


def on_side_stream(issue: Callable[[], Any], tensors: list[torch.Tensor]) -> Request:
    """Issue an NCCL collective (`issue()`, async) over CUDA `tensors` on the GPU's
    communication stream, ordered after the compute stream's queued work; their memory is
    not reused before the side stream is done with it."""
    device = tensors[0].device
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        work = issue()
    for t in tensors:
        t.record_stream(side)
    return _SideStreamWork(work, side, device)


def _typed_check(t: torch.Tensor) -> None:
    if t.dtype == torch.bfloat16:
        raise TypeError(f"MPI has no bfloat16 sum (a tensor of shape {tuple(t.shape)} on "
                        f"{t.device}): reduce gradients in fp32 or fp16")
