"""`Communicator`: point-to-point tensors and collectives; an mpi4py backend."""

from __future__ import annotations

import abc
from typing import Any, Sequence

import torch
from mpi4py import MPI

__all__ = ["TensorMeta", "Communicator", "MpiCommunicator", "meta_of"]

# What a receiver must know to allocate a buffer: shape and dtype. Exchanged once per
# distinct batch shape and cached by the engine, never sent with every message.
TensorMeta = tuple[tuple[int, ...], torch.dtype]


def meta_of(tensors: Sequence[torch.Tensor]) -> tuple[TensorMeta, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


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

    @abc.abstractmethod
    def isend(self, tensors: Sequence[torch.Tensor], dest: int, tag: int) -> Request:
        """Start sending `tensors`; they must not change until the request completes."""

    @abc.abstractmethod
    def irecv(self, metas: Sequence[TensorMeta], source: int, tag: int,
              device: torch.device) -> Request:
        """Start receiving tensors of `metas`; `wait()` returns them on `device`."""

    @abc.abstractmethod
    def send_object(self, obj: Any, dest: int) -> None: ...

    @abc.abstractmethod
    def recv_object(self, source: int) -> Any: ...

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]: ...

    @abc.abstractmethod
    def bcast_object(self, obj: Any, root: int) -> Any: ...

    @abc.abstractmethod
    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place."""

    @abc.abstractmethod
    def barrier(self) -> None: ...


def _bytes(t: torch.Tensor) -> Any:
    """A zero-copy byte view of a contiguous CPU tensor that MPI can read and write.

    Bytes, not typed elements, so every torch dtype (bf16 included, which MPI lacks) travels.
    """
    return [t.view(-1).view(torch.uint8).numpy(), MPI.BYTE]


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
        MPI.Request.Waitall(self._requests)
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
        MPI.Request.Waitall(self._requests)
        if self._device.type == "cpu":
            return self._host
        return [t.to(self._device, non_blocking=True) for t in self._host]


class MpiCommunicator(Communicator):
    """mpi4py over host memory; runs anywhere. GPU tensors are staged through the host."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        # Objects travel on their own context, so they can never match a tensor receive.
        self.control = comm.Dup()
        self.rank = comm.rank
        self.size = comm.size

    def isend(self, tensors: Sequence[torch.Tensor], dest: int, tag: int) -> Request:
        # One message per tensor, all with the same tag: MPI's non-overtaking rule delivers
        # them in order into the receiver's receives, posted in the same order.
        host = [t.detach().to("cpu").contiguous() for t in tensors]
        reqs = [self.comm.Isend(_bytes(t), dest=dest, tag=tag) for t in host]
        return _MpiSend(reqs, host)

    def irecv(self, metas: Sequence[TensorMeta], source: int, tag: int,
              device: torch.device) -> Request:
        host = [torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
                for shape, dtype in metas]
        reqs = [self.comm.Irecv(_bytes(t), source=source, tag=tag) for t in host]
        return _MpiRecv(reqs, host, device)

    def send_object(self, obj: Any, dest: int) -> None:
        self.control.send(obj, dest=dest)

    def recv_object(self, source: int) -> Any:
        return self.control.recv(source=source)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.control.allgather(obj)

    def bcast_object(self, obj: Any, root: int) -> Any:
        return self.control.bcast(obj, root=root)

    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.detach().to("cpu").contiguous()
        buf = host.numpy() if host.dtype != torch.bfloat16 else None
        if buf is None:
            raise TypeError("MPI all-reduce of bfloat16 is not supported: reduce in fp32")
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        if host.data_ptr() != tensor.data_ptr():
            tensor.copy_(host)
        return tensor

    def barrier(self) -> None:
        self.comm.Barrier()

    def free(self) -> None:
        self.control.Free()
