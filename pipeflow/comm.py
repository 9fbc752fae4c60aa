"""`Communicator`: point-to-point tensors and collectives; an mpi4py backend."""

from __future__ import annotations

import abc
import pickle
import time
from typing import Any, Sequence

import torch
from mpi4py import MPI

from pipeflow import waiting
from pipeflow.tree import Header, describe

__all__ = ["TensorMeta", "Communicator", "MpiCommunicator", "TorchDistCommunicator",
           "CommDeviceError", "check_on_device", "init_torch_distributed", "rendezvous_address",
           "torch_grid_communicators", "torch_family_communicators", "meta_of",
           "mpi_iallreduce_", "ProtocolError", "HeadersFirst"]

# What a receiver must know to allocate a buffer: shape and dtype. Exchanged once per
# distinct batch shape and cached by the engine, never sent with every message.
TensorMeta = tuple[tuple[int, ...], torch.dtype]

# Stage every all-reduce through a host copy, as GPU tensors are: lets a CPU test run the
# staging path (a copy out, the sum, the copy back) that only GPUs would take otherwise.
FORCE_HOST_STAGING = False


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

    @abc.abstractmethod
    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        """Start summing `tensor` over the group, in place; done when the request is."""

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


def _bytes(t: torch.Tensor) -> Any:
    """A zero-copy byte view of a contiguous CPU tensor (or GPU tensor, for a CUDA-aware MPI)
    that MPI can read and write.

    Bytes, not typed elements, so every torch dtype (bf16 included, which MPI lacks) travels.
    """
    raw = t.view(-1).view(torch.uint8)
    return [raw if t.device.type == "cuda" else raw.numpy(), MPI.BYTE]   # CUDA: CUDA-aware MPI


def _device_aware(device: torch.device) -> bool:
    """Whether MPI takes this device's memory itself (a CUDA-aware MPI and a GPU tensor)."""
    if device.type != "cuda":
        return False
    from pipeflow.cuda_mpi import cuda_aware_mpi
    return cuda_aware_mpi()


def _outgoing(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The buffers a send hands MPI: contiguous host copies, or with a CUDA-aware MPI the GPU
    tensors themselves, once the compute stream has written them."""
    ts = [t.detach() for t in tensors]
    if ts and _device_aware(ts[0].device):
        out = [t.contiguous() for t in ts]
        torch.cuda.current_stream(ts[0].device).synchronize()
        return out
    return [t.to("cpu").contiguous() for t in ts]


def _incoming(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive's buffer: on the GPU for a CUDA-aware MPI, else pinned host memory for GPU
    tensors (copied up by the caller) and plain host memory for CPU ones.

    The caching allocator hands out a block as soon as its last owner's kernels are queued,
    which is safe for kernels on the same stream but not for MPI, which writes at once: the
    stream is drained first, so no queued kernel still reads the block's old contents."""
    if _device_aware(device):
        buf = torch.empty(shape, dtype=dtype, device=device)
        torch.cuda.current_stream(device).synchronize()
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


class _MpiAllreduce(Request):
    def __init__(self, request: MPI.Request, host: torch.Tensor, target: torch.Tensor) -> None:
        self._request = request
        self._host = host
        self._target = target

    def test(self) -> bool:
        return self._request.Test()

    def wait(self) -> None:
        waiting.wait(self._request)
        if self._host is not self._target:
            self._target.copy_(self._host)


def _typed(t: torch.Tensor) -> Any:
    """A zero-copy typed view for reductions (MPI must know the element type to sum)."""
    if t.dtype == torch.bfloat16:
        raise TypeError("MPI has no bfloat16 sum: reduce gradients in fp32 or fp16")
    return t.view(-1).numpy()


def mpi_iallreduce_(comm: MPI.Comm, tensor: torch.Tensor) -> Request:
    """Start summing `tensor` over `comm` in place.

    CUDA tensors go to `cuda_mpi` (device buffers for a CUDA-aware MPI, else reused pinned
    staging on a side stream). A contiguous CPU tensor is reduced where it lies; a
    non-contiguous one (or any, with `FORCE_HOST_STAGING`) through a contiguous copy, summed
    back into `tensor` by `wait()`.
    """
    if tensor.device.type == "cuda" and not FORCE_HOST_STAGING:
        from pipeflow.cuda_mpi import iallreduce_cuda_
        return iallreduce_cuda_(comm, tensor)
    host = tensor.detach()
    if FORCE_HOST_STAGING or host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu", memory_format=torch.contiguous_format, copy=True)
    req = comm.Iallreduce(MPI.IN_PLACE, _typed(host), op=MPI.SUM)
    return _MpiAllreduce(req, host, tensor.detach())


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
        reqs = [self._isend(_bytes(t), dest=dest, tag=tag) for t in host]
        return _MpiSend(reqs, host)

    def irecv(self, metas: Sequence[TensorMeta], source: int, tag: int,
              device: torch.device) -> Request:
        host = [_incoming(shape, dtype, device) for shape, dtype in metas]
        reqs = [self.comm.Irecv(_bytes(t), source=source, tag=tag) for t in host]
        return _MpiRecv(reqs, host, device)

    def send_message(self, header: Header | None, tensors: Sequence[torch.Tensor], dest: int,
                     tag: int) -> Request:
        # The header and the tensors go on one communicator from one sender, so the receiver
        # meets them in order (MPI's non-overtaking rule under an ANY_TAG probe): it learns a
        # new shape before the tensors of that shape, and nothing when no shape changed.
        reqs, keep = [], []
        if header is not None:
            raw = bytearray(pickle.dumps(header))
            reqs.append(self.comm.Isend([raw, MPI.BYTE], dest=dest, tag=2 * tag + 1))
            keep.append(raw)
        host = _outgoing(tensors)
        self.bytes_sent += sum(t.numel() * t.element_size() for t in host)
        reqs += [self._isend(_bytes(t), dest=dest, tag=2 * tag) for t in host]
        return _MpiSend(reqs, host + keep)

    def recv_message(self, source: int, tag: int, header: Header | None,
                     device: torch.device) -> tuple[Header, list[torch.Tensor]]:
        status = MPI.Status()
        msg = waiting.mprobe(self.comm, source, MPI.ANY_TAG, status)
        if status.tag == 2 * tag + 1:
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
            if status.tag != 2 * tag or found != meta.nbytes:
                raise ProtocolError(
                    f"expected message {tag} from rank {source} of the pipeline, tensor {i} "
                    f"of {describe(header.metas)} ({meta.nbytes} bytes); found "
                    f"{_on_wire(status)}: the two ranks disagree on the order or shape of "
                    f"their messages")
            host = _incoming(meta.shape, meta.dtype, device)
            waiting.wait(msg.Irecv(_bytes(host)))
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

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        return mpi_iallreduce_(self.comm, tensor)

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


# -- torch.distributed (NCCL on GPUs; gloo runs the same code on CPUs) ----------------------

def init_torch_distributed(backend: str, device: torch.device) -> None:
    """Start torch.distributed over all MPI ranks with nothing set by hand.

    Rank and world size come from MPI.COMM_WORLD; rank 0 opens the rendezvous store (on the
    address other nodes reach it by, on a port the system picks) and broadcasts where it
    is. MASTER_ADDR / MASTER_PORT, when set, override the address and the port.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    world = MPI.COMM_WORLD
    store = _rendezvous_store(world)
    kwargs = {}
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if backend == "nccl":
        kwargs["device_id"] = device       # NCCL binds each rank's communicators to its GPU
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                            **kwargs)


def rendezvous_address(hosts: Sequence[str]) -> str:
    """The address rank 0 (on `hosts[0]`) is reached by from every rank's host.

    Not `gethostbyname(gethostname())`: on Debian and Ubuntu that is 127.0.1.1, which no other
    node reaches. With other hosts in the job, the address of the interface that routes to
    one of them (a UDP `connect` sends nothing; the kernel just picks the route).
    """
    import os
    import socket

    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    others = [h for h in hosts if h != hosts[0]]
    if not others:
        return "127.0.0.1"
    try:
        peer = socket.gethostbyname(others[0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError as exc:
        raise RuntimeError(
            f"rank 0 on {hosts[0]} cannot find its address as seen from {others[0]} ({exc}); "
            f"set MASTER_ADDR to an address of {hosts[0]} that every node reaches") from exc


def _rendezvous_store(world: MPI.Comm) -> Any:
    """A TCPStore on rank 0 at a port bound once (no probe-then-close race); every rank
    connects to it. An error on rank 0 is raised on every rank."""
    import datetime
    import os

    import torch.distributed as dist

    hosts = world.allgather(_hostname())
    where, store = None, None
    if world.rank == 0:
        try:
            ip = rendezvous_address(hosts)
            port = int(os.environ.get("MASTER_PORT", 0))
            store = dist.TCPStore(ip, port, world.size, is_master=True,
                                  wait_for_workers=False, timeout=datetime.timedelta(minutes=5))
            where = (ip, store.port, None)
        except (OSError, RuntimeError, ValueError) as exc:
            where = (None, None, f"rank 0 could not open the rendezvous store: {exc}")
    ip, port, error = world.bcast(where, root=0)
    if error:
        raise RuntimeError(error)
    if world.rank != 0:
        store = dist.TCPStore(ip, port, world.size, is_master=False,
                              timeout=datetime.timedelta(minutes=5))
    return store


def _hostname() -> str:
    import socket
    return socket.gethostname()


def _completed(works: list) -> bool:
    return all(w.is_completed() for w in works)


class _DistWork(Request):
    def __init__(self, works: list, result: Any = None) -> None:
        self._works = works
        self._result = result

    def test(self) -> bool:
        return _completed(self._works)

    def wait(self) -> Any:
        for w in self._works:
            w.wait()
        return self._result


class _Requests(Request):
    """Several requests as one."""

    def __init__(self, parts: list[Request]) -> None:
        self._parts = parts

    def test(self) -> bool:
        return all(p.test() for p in self._parts)

    def wait(self) -> None:
        for p in self._parts:
            p.wait()


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
        return _Requests(parts)

    def recv_message(self, source: int, tag: int, header: Header | None,
                     device: torch.device) -> tuple[Header, list[torch.Tensor]]:
        if header is None:
            comm, htag = self._header_link(tag)
            header = waiting.recv_object(comm, source, htag)
        if not header.metas:
            return header, []
        metas = [(m.shape, m.dtype) for m in header.metas]
        return header, self.irecv(metas, source, tag, device).wait()


class TorchDistCommunicator(HeadersFirst, Communicator):
    """Tensors over torch.distributed (NCCL or gloo); objects over MPI."""

    def __init__(self, comm: MPI.Comm, group: Any,
                 links: dict[tuple[int, int], Any] | None = None,
                 device: torch.device | str = "cpu") -> None:
        """`comm`: this group's MPI communicator (objects travel over it); `group`: the same
        ranks as a torch.distributed group; `links`: (source, destination) ranks of `comm` ->
        a two-rank group per direction (see `torch_grid_communicators`); `device`: where
        the group's tensors must be (the rank's GPU for NCCL, the CPU for gloo)."""
        import torch.distributed as dist

        self._dist = dist
        self.objects = MpiCommunicator(comm)
        self.rank, self.size = comm.rank, comm.size
        self.device = torch.device(device)
        self.bytes_sent = 0
        # This communicator's ranks as torch.distributed (= MPI.COMM_WORLD) ranks.
        self.global_ranks = MPI.Group.Translate_ranks(
            comm.Get_group(), list(range(comm.size)), MPI.COMM_WORLD.Get_group())
        self.group = group
        self.links = links or {}
        # NCCL on a GPU: buckets launch from autograd's hooks, on the side stream.
        self.launch_from_any_thread = self.device.type == "cuda"
        self._flight: list[tuple[str, list, float]] = []    # (what, works, issued at)

    def isend(self, tensors: Sequence[torch.Tensor], dest: int, tag: int) -> Request:
        group = self.links[(self.rank, dest)]
        self._check("isend", tensors)
        ts = [t.detach().contiguous() for t in tensors]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in ts)
        # One batch for the message's tensors: NCCL runs them as one grouped operation.
        ops = [self._dist.P2POp(self._dist.isend, t, self.global_ranks[dest], group, tag)
               for t in ts]
        return self._issued(f"send of message {tag} to rank {self.global_ranks[dest]}",
                            _DistWork(self._dist.batch_isend_irecv(ops), ts))

    def irecv(self, metas: Sequence[TensorMeta], source: int, tag: int,
              device: torch.device) -> Request:
        group = self.links[(source, self.rank)]
        ts = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas]
        self._check("irecv", ts)
        ops = [self._dist.P2POp(self._dist.irecv, t, self.global_ranks[source], group, tag)
               for t in ts]
        return self._issued(f"receive of message {tag} from rank {self.global_ranks[source]}",
                            _DistWork(self._dist.batch_isend_irecv(ops), ts))

    def _issued(self, what: str, work: "_DistWork") -> "_DistWork":
        """Track a device operation for `in_flight` (completed ones are dropped as new ones
        come, so the list stays as short as what is really outstanding)."""
        if self.device.type == "cuda":
            self._flight = [f for f in self._flight if not _completed(f[1])]
            self._flight.append((what, work._works, time.monotonic()))
        return work

    def in_flight(self) -> list[str]:
        now = time.monotonic()
        return [f"{what} (issued {now - t0:.0f} s ago, not completed on the device)"
                for what, works, t0 in list(self._flight) if not _completed(works)]

    def _header_link(self, tag: int) -> tuple[MPI.Comm, int]:
        return self.objects.comm, tag

    def send_object(self, obj: Any, dest: int) -> None:
        self.objects.send_object(obj, dest)

    def recv_object(self, source: int) -> Any:
        return self.objects.recv_object(source)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.objects.allgather_object(obj)

    def bcast_object(self, obj: Any, root: int) -> Any:
        return self.objects.bcast_object(obj, root)

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        self._check("all_reduce", [tensor])
        if tensor.device.type == "cuda":
            from pipeflow.cuda_mpi import all_reduce_on_side_stream
            return all_reduce_on_side_stream(self._dist, tensor, self.group)
        return _DistWork([self._dist.all_reduce(tensor, group=self.group, async_op=True)])

    def _check(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        check_on_device(op, tensors, self.device,
                        f"rank {self.rank} of a {self.size}-rank torch.distributed group")

    def barrier(self) -> None:
        self.objects.barrier()

    def free(self) -> None:
        """Free the MPI side. The torch.distributed groups stay alive for the process (see
        `_split_family`): the next engine on the same ranks reuses them."""
        self.objects.free()


def torch_grid_communicators(topo: Any, backend: str, device: torch.device, ring: bool
                             ) -> tuple[TorchDistCommunicator, TorchDistCommunicator | None]:
    """This rank's pipeline and data-group communicators over torch.distributed.

    Groups are made a family at a time (every pipeline in one call, every data group in
    another, the links of one direction and parity in a third...), in the same order on
    every rank: with NCCL by `split_group` (one ncclCommSplit per family instead of one
    `new_group` per group on every rank: about 1,000 at p=8, d=64), elsewhere by
    `new_subgroups_by_enumeration`. Point-to-point runs on one two-rank group per direction
    between neighbouring stages (with `ring`, for model chunks, the last stage also feeds the
    first), 2 to 6 link families whatever p. Each link's stream carries one direction only, in the
    order the schedule sends (`schedule._check_link_order`: NCCL ignores tags), and a rank's
    host waits only on receives (sends are asynchronous), so every schedule the simulator
    runs without deadlock under asynchronous sends runs without one on NCCL.

    Megatron-Core's design, one group per pipeline, makes both directions share one stream,
    where a send waits for its receive to be posted: the sends and receives must then be
    batched where both sides meet. Batching each run of consecutive sends and receives of
    our programs, the rendezvous simulation `schedule.batched_rendezvous_stalls` stalls 46 of
    53 interleaved and 217 of 224 ZBV programs (p = 2..8, m = 1..32), none of GPipe, 1F1B
    or ZB-H1; Megatron pairs them by hand for each schedule. Hence the links split by
    direction.
    """
    init_torch_distributed(backend, device)
    p, d = topo.pipeline, topo.data
    pipelines = [[topo.rank_of(s, r) for s in range(p)] for r in range(d)]
    pipe_group = _split_family(pipelines, backend, "pipeline")
    links: dict[tuple[int, int], Any] = {}
    pairs = [(b, b + 1) for b in range(p - 1)]
    families = [[ab for ab in pairs if ab[0] % 2 == parity] for parity in (0, 1)]
    if ring and p > 2:
        families.append([(p - 1, 0)])
    for family in (f for f in families if f):
        for forward in (True, False):
            group = _split_family([[pl[a], pl[b]] for pl in pipelines for a, b in family],
                                  backend, "forward" if forward else "backward")
            for a, b in family:
                if topo.stage in (a, b):
                    links[(a, b) if forward else (b, a)] = group
    data_group = None
    if d > 1:
        data_group = _split_family([[topo.rank_of(s, r) for r in range(d)] for s in range(p)],
                                   backend, "data")
    pipe = TorchDistCommunicator(topo.pipe, pipe_group, links, device)
    data = TorchDistCommunicator(topo.data_group, data_group, device=device) if d > 1 else None
    return pipe, data


def torch_family_communicators(comm: MPI.Comm | None, rank_lists: list[list[int]],
                                backend: str, device: torch.device, role: str
                                ) -> TorchDistCommunicator | None:
    """One torch.distributed group per list of world ranks (disjoint lists), made in one call
    on every rank; this rank's as a communicator whose objects travel over `comm` (the same
    ranks over MPI), or None where this rank is in none of the lists."""
    group = _split_family(rank_lists, backend, role)
    if comm is None:
        return None
    return TorchDistCommunicator(comm, group, device=device)


# (backend, role, rank lists) -> this rank's group: every family is made once per process, or
# once per default group where the user tears torch.distributed down and starts it again.
_FAMILIES: dict[tuple[str, str, tuple[tuple[int, ...], ...]], Any] = {}
_FAMILIES_OF: list[Any] = [None]        # the default group the families above belong to


def _split_family(rank_lists: list[list[int]], backend: str, role: str = "") -> Any:
    """Disjoint groups (world ranks), made in one call on every rank the first time these
    lists are asked for, then reused; this rank's group, or None when it is in none of them.

    Groups live as long as the process, as in Megatron-Core, and are never destroyed by an
    engine's `close()`: a gloo or NCCL group's teardown waits for its queued work and joins
    its threads, and where that teardown runs (garbage collection, at any later point) while
    the peer ranks still hold their side, the rank blocks there and every other rank waits
    on it in its next collective. Making a group is also costly (NCCL communicators), so
    the next engine on the same ranks reuses it. The key is the same on every rank, so every
    rank makes or reuses a family alike.

    `role` (pipeline, forward, backward, data, tie) keeps NCCL families of the same ranks
    apart: NCCL matches by order on one stream per communicator, so a link's two directions
    need a communicator each. gloo matches point-to-point messages by tag, so one gloo group
    serves every role of the same ranks: a group per role multiplies the gloo groups, each
    with its threads and sockets (at 4 ranks on 2 cores, the first gloo test, which makes
    them, took 3-34 s against 2-6 s shared), and more threads for spinning MPI ranks to
    starve (`pipeflow.waiting`).
    """
    import torch.distributed as dist

    if _FAMILIES_OF[0] is not dist.group.WORLD:      # destroyed and initialised again
        _FAMILIES.clear()
        _FAMILIES_OF[0] = dist.group.WORLD
    key = (backend, role if backend == "nccl" else "", tuple(tuple(r) for r in rank_lists))
    if key not in _FAMILIES:
        _FAMILIES[key] = _new_family(rank_lists, backend)
    return _FAMILIES[key]


def _new_family(rank_lists: list[list[int]], backend: str) -> Any:
    import torch.distributed as dist

    if backend == "nccl" and hasattr(dist, "split_group"):
        return dist.split_group(split_ranks=rank_lists)
    if hasattr(dist, "new_subgroups_by_enumeration"):
        return dist.new_subgroups_by_enumeration(rank_lists)[0]
    mine = None
    for ranks in rank_lists:                # torch < 2.1: one group at a time, all ranks
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine
