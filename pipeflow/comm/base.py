"""The communicator interface every backend implements: point-to-point tensors, collectives,
requests; and the helpers every backend shares (byte and typed views of a tensor)."""

from __future__ import annotations

import abc
from typing import Any, Sequence

import torch
from mpi4py import MPI

from pipeflow.tree import Header

__all__ = ["TensorMeta", "Communicator", "Request", "Requests", "CommDeviceError",
           "check_on_device", "meta_of", "ProtocolError", "as_bytes", "as_typed", "completed",
           "check_blocks"]
# What a receiver must know to allocate a buffer: shape and dtype. Exchanged once per
# distinct batch shape and cached by the engine, never sent with every message.
TensorMeta = tuple[tuple[int, ...], torch.dtype]

def meta_of(tensors: Sequence[torch.Tensor]) -> tuple[TensorMeta, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


class ProtocolError(RuntimeError):
    """A message that does not match what its receiver expects: never read as garbage."""


class CommDeviceError(RuntimeError):
    """A tensor handed to a group's operation lives on another device than the group's."""


def check_on_device(op: str, tensors: Sequence[torch.Tensor], device: torch.device,
                    where: str = "") -> None:
    """Refuse tensors not on `device`, the group's device.

    NCCL groups take CUDA tensors only ("No backend type associated with device type cpu"),
    and a gloo group CPU tensors only: say so here, naming the operation, instead of failing
    deep inside torch.distributed (or, on CPU tests, not failing at all).
    """
    for t in tensors:
        if t.device.type != device.type or (
                device.index is not None and t.device.index not in (None, device.index)):
            raise CommDeviceError(
                f"{where + ': ' if where else ''}{op} got a tensor of shape {tuple(t.shape)} "
                f"on {t.device}, but this group communicates on {device}; move it there "
                f"first (`tensor.to({str(device)!r})`)")


class Request(abc.ABC):
    """An operation in flight; `wait()` completes it."""

    @abc.abstractmethod
    def test(self) -> bool: ...

    @abc.abstractmethod
    def wait(self) -> Any: ...


class Communicator(abc.ABC):
    """The few operations the engine needs from a group of ranks."""

    rank: int
    size: int
    device: torch.device     # where this group's tensors live for its collectives and p2p
    # Whether an all-reduce may be issued from a thread other than the engine's: autograd's
    # CUDA device thread, where gradient hooks run (NCCL, ordered by streams, as DDP does);
    # not MPI, whose calls stay on the engine's thread.
    launch_from_any_thread: bool = False

    @abc.abstractmethod
    def isend(self, tensors: Sequence[torch.Tensor], dest: int, tag: int) -> Request:
        """Start sending `tensors`; they must not change until the request completes."""

    @abc.abstractmethod
    def irecv(self, metas: Sequence[TensorMeta], source: int, tag: int,
              device: torch.device) -> Request:
        """Start receiving tensors of `metas`; `wait()` returns them on `device`."""

    # Messages: a pytree's tensor leaves, with its `Header` announced when it changes.
    always_header = False    # True where the receiver cannot probe (torch.distributed)

    @abc.abstractmethod
    def send_message(self, header: Header | None, tensors: Sequence[torch.Tensor], dest: int,
                     tag: int) -> Request:
        """Start sending one message: `header` (when it changed since the last message on
        this link, else None) then `tensors`, which must not change until the request is done."""

    @abc.abstractmethod
    def recv_message(self, source: int, tag: int, header: Header | None,
                     device: torch.device) -> tuple[Header, list[torch.Tensor]]:
        """Receive the message `tag` from `source`: a new header when one was announced, else
        `header` (what the last message on this link announced); every tensor is checked
        against it, and a message that does not fit raises `ProtocolError`."""

    def irecv_message(self, metas: Sequence[TensorMeta], source: int, tag: int,
                      device: torch.device) -> Request:
        """Post the receive of message `tag`'s tensors, whose sizes the receiver knows (an
        agreed link, the gradients of an activation this rank sent, or over MPI the last
        header of the link): posted ahead of the instruction that consumes it, so the
        transfer overlaps the compute before that instruction."""
        return self.irecv(metas, source, tag, device)

    def recv_posted(self, request: Request, source: int, tag: int, header: Header,
                    device: torch.device) -> tuple[Header, list[torch.Tensor]]:
        """Complete a receive posted by `irecv_message` for `header`'s sizes: `(header, its
        tensors)`. A receiver that probes (MPI) posts for the link's last header, and where
        the sender announced a new one instead, takes the announced message (see
        `MpiCommunicator`); elsewhere the header was agreed and the message is the posted
        one."""
        return header, request.wait()

    @abc.abstractmethod
    def send_object(self, obj: Any, dest: int) -> None: ...

    @abc.abstractmethod
    def recv_object(self, source: int) -> Any: ...

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]: ...

    @abc.abstractmethod
    def bcast_object(self, obj: Any, root: int) -> Any: ...

    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place."""
        self.iallreduce_(tensor).wait()
        return tensor

    # Every collective takes an optional `key`: what the caller calls this operation (e.g.
    # "gradient bucket 3"). The backends ignore it; the strict one compares it across ranks
    # with the shape and dtype, so two operations of one size issued in different orders on
    # different ranks (which MPI and NCCL would silently pair) are an error there.
    @abc.abstractmethod
    def iallreduce_(self, tensor: torch.Tensor, key: str | None = None) -> Request:
        """Start summing `tensor` over the group, in place; done when the request is."""

    @abc.abstractmethod
    def ireduce_scatter_(self, tensor: torch.Tensor, out: torch.Tensor,
                         key: str | None = None) -> Request:
        """Start summing `tensor` (contiguous, `size` blocks of `out.numel()` elements) over
        the group; block `rank` of the sum lands in `out` when the request is done. `tensor`
        must not change until then (sharded optimizer: the gradient buckets)."""

    @abc.abstractmethod
    def iallgather_(self, shard: torch.Tensor, out: torch.Tensor,
                    key: str | None = None) -> Request:
        """Start gathering every rank's `shard` into `out` (contiguous, `size` blocks of
        `shard.numel()` elements, in rank order); done when the request is (sharded
        optimizer: the updated working weights)."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def arrived_from(self, source: int) -> str | None:
        """For a hang report, from any thread: what has arrived from `source` and not been
        received yet, or None where the transport cannot tell (torch.distributed)."""
        return None

    def in_flight(self) -> list[str]:
        """For a hang report, from any thread: the operations issued to the device that have
        not completed (NCCL's waits never block the host, so a stuck link shows only here;
        the host blocks later, at the loss or the optimizer step). Empty where every wait
        blocks the host (MPI)."""
        return []


def as_bytes(t: torch.Tensor) -> Any:
    """A zero-copy byte view of a contiguous CPU tensor (or GPU tensor, for a CUDA-aware MPI)
    that MPI can read and write.

    Bytes, not typed elements, so every torch dtype (bf16 included, which MPI lacks) travels.
    A host tensor is handed over by address (0.5 us a call against 5 us for a NumPy view, and
    a message takes one on each side): the buffer holds no reference, so the caller keeps `t`
    alive until MPI is done with it, as the requests here do (`_MpiSend`, `_MpiRecv`).
    """
    if t.device.type == "cuda":                 # CUDA-aware MPI reads the tensor itself
        return [t.view(-1).view(torch.uint8), MPI.BYTE]
    if not t.is_contiguous():
        raise ValueError(f"MPI sends a contiguous tensor's bytes; found a tensor of shape "
                         f"{tuple(t.shape)} with strides {t.stride()}: call .contiguous()")
    return [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()), MPI.BYTE]


def as_typed(t: torch.Tensor) -> Any:
    """A zero-copy typed view for reductions (MPI must know the element type to sum)."""
    if t.dtype == torch.bfloat16:
        raise TypeError("MPI has no bfloat16 sum: reduce gradients in fp32 or fp16")
    return t.view(-1).numpy()


def check_blocks(op: str, whole: torch.Tensor, block: torch.Tensor, size: int,
                 where: str = "") -> None:
    """Refuse a reduce-scatter or all-gather whose buffers do not fit: `whole` must be
    contiguous and hold `size` blocks of `block.numel()` elements of `block`'s dtype."""
    if whole.numel() != size * block.numel() or whole.dtype != block.dtype \
            or not whole.is_contiguous() or not block.is_contiguous():
        raise ValueError(
            f"{where + ': ' if where else ''}{op} expected a contiguous buffer of {size} x "
            f"{block.numel()} {block.dtype} elements and a contiguous block of "
            f"{block.numel()}; found {whole.numel()} {whole.dtype} elements (contiguous: "
            f"{whole.is_contiguous()}) and a block of {block.numel()} (contiguous: "
            f"{block.is_contiguous()}); pad the buffer to a multiple of the group's size")


def completed(works: list) -> bool:
    return all(w.is_completed() for w in works)


class Requests(Request):
    """Several requests as one."""

    def __init__(self, parts: list[Request]) -> None:
        self._parts = parts

    def test(self) -> bool:
        return all(p.test() for p in self._parts)

    def wait(self) -> None:
        for p in self._parts:
            p.wait()
