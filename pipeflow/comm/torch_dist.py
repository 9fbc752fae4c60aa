"""The torch.distributed backend (NCCL on GPUs; gloo runs the same code on CPUs), bootstrapped
from MPI, and the cache of its process groups."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow.comm.base import (Communicator, Request, TensorMeta, check_blocks, check_on_device,
                                completed)
from pipeflow.comm.mpi import HeadersFirst, MpiCommunicator

__all__ = ["TorchDistCommunicator", "init_torch_distributed", "check_nccl_launch_order",
           "nccl_post_ahead",
           "rendezvous_address",
           "torch_grid_communicators", "torch_family_communicators"]


# How much longer than pipeflow's watchdog torch.distributed waits before it ends a stuck
# collective itself: the watchdog's report (rank, instruction, peer) comes first.
NCCL_TIMEOUT_MARGIN_S = 60.0


def check_nccl_launch_order(programs: Any, where: str) -> None:
    """Refuse `NCCL_LAUNCH_ORDER_IMPLICIT=1` where this schedule's sends and receives, run in
    the host's order with each waiting for its peer, would deadlock (see
    `init_torch_distributed`)."""
    import os

    from pipeflow.config import ConfigError
    from pipeflow.schedules.links import ordered_launch_stalls

    if os.environ.get("NCCL_LAUNCH_ORDER_IMPLICIT", "").strip() != "1":
        return
    stuck = ordered_launch_stalls(programs)
    if stuck:
        raise ConfigError(
            f"{where}: NCCL_LAUNCH_ORDER_IMPLICIT=1 makes NCCL run every operation of this GPU "
            f"in the host's order, each waiting for its peer; this schedule's programs would "
            f"then deadlock (ranks {stuck} stuck in the simulation), as its sends and receives "
            f"to the two neighbours interleave. Unset it (or set 0) for pipeflow's jobs; "
            f"pipeflow runs its links on independent streams, proven free of stalls with two "
            f"NCCL kernels resident (`schedules.links.device_stalls`)")


def nccl_post_ahead(programs: Any, where: str, reductions: bool) -> int:
    """How many compute instructions early a stage posts its receives on NCCL, proven free
    of stalls by `schedules.links.device_stalls` (at most K blocking NCCL kernels resident
    on a GPU, a posted receive counted from its post).

    By default 1: every registered schedule (p <= 8, m <= 16, data-parallel reductions in
    the last backward) runs without a stall with two kernels resident (`test_schedule`), and
    a GPU runs more. `CUDA_DEVICE_MAX_CONNECTIONS=1` (Megatron's recipes set it) puts every
    stream on one hardware queue: one kernel at a time. A receive posted ahead would then
    hold the queue while the send the peer waits for sits behind it, so nothing is posted
    ahead (0), and a schedule that stalls even so (1F1B, ZB-H1, ZBV, the V's for most
    sizes; GPipe never) is refused, saying why."""
    import os

    from pipeflow.config import ConfigError
    from pipeflow.schedules.links import device_stalls

    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() != "1":
        return 1
    stuck = device_stalls(programs, 1, ahead=0, reductions=reductions)
    if stuck:
        raise ConfigError(
            f"{where}: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every CUDA stream of this GPU on one "
            f"hardware queue, so one NCCL kernel runs at a time and one waiting for its peer "
            f"blocks the rest; this schedule's programs would deadlock that way (ranks "
            f"{stuck} stuck in `schedules.links.device_stalls` with one kernel). Unset it "
            f"(pipeflow overlaps communication by streams, not by launch order), or use "
            f"schedule 'gpipe'")
    return 0


def init_torch_distributed(backend: str, device: torch.device, timeout_s: float = 0.0) -> None:
    """Start torch.distributed over all MPI ranks with nothing set by hand.

    Rank and world size come from MPI.COMM_WORLD; rank 0 opens the rendezvous store (on the
    address other nodes reach it by, on a port the system picks) and broadcasts where it
    is. MASTER_ADDR / MASTER_PORT, when set, override the address and the port.

    `timeout_s` (the engine's `watchdog_s`; 0: torch's default) ties NCCL's own timeout to
    the watchdog: NCCL's watchdog ends a stuck collective `NCCL_TIMEOUT_MARGIN_S` after
    pipeflow's has had the chance to name the rank and the operation, never 10 minutes later.

    Operations of several NCCL communicators are in flight on one GPU at once (a link per
    direction, the data group, the tie groups, each on its own stream). NCCL does not promise
    that they progress together: its guide asks for operations on different communicators to
    be serialised, and its maintainers say two streams may not progress at once
    (NVIDIA/nccl#783, #522). So the engine's programs are proven against a model of that,
    `schedules.links.device_stalls`: at most K blocking NCCL kernels resident on a GPU, a
    posted receive counted from its post. With receives posted a compute early, every
    registered schedule (p <= 8, m <= 16, with reductions) runs with K = 2; with
    `CUDA_DEVICE_MAX_CONNECTIONS=1` (K = 1) nothing is posted ahead and a schedule that stalls
    even so is refused (`nccl_post_ahead`). Ordering every operation instead,
    `NCCL_LAUNCH_ORDER_IMPLICIT=1`, would deadlock: each then waits for its peer in the
    host's order, and `ordered_launch_stalls` finds 1F1B stuck that way in 75 of 80
    programs (p = 2..6, m = 1..16), GPipe in none; the stage refuses that setting where its
    program would stall (`check_nccl_launch_order`).
    """
    import datetime

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
    if timeout_s > 0:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s + NCCL_TIMEOUT_MARGIN_S)
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

    hosts = waiting.allgather(world, _hostname())
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
    ip, port, error = waiting.bcast(world, where, 0)
    if error:
        raise RuntimeError(error)
    if world.rank != 0:
        store = dist.TCPStore(ip, port, world.size, is_master=False,
                              timeout=datetime.timedelta(minutes=5))
    return store


def _hostname() -> str:
    import socket
    return socket.gethostname()


class _DistWork(Request):
    def __init__(self, works: list, result: Any = None) -> None:
        self._works = works
        self._result = result

    def test(self) -> bool:
        return completed(self._works)

    def wait(self) -> Any:
        for w in self._works:
            w.wait()
        return self._result


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
        # NCCL: every message one batch on its link's group (see `_p2p`).
        self.batch_p2p = self.device.type == "cuda"
        self._flight: list[tuple[str, list, float]] = []    # (what, works, issued at)

    def isend(self, tensors: Sequence[torch.Tensor], dest: int, tag: int) -> Request:
        group = self.links[(self.rank, dest)]
        self._check("isend", tensors)
        ts = [t.detach().contiguous() for t in tensors]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in ts)
        return self._issued(f"send of message {tag} to rank {self.global_ranks[dest]}",
                            _DistWork(self._p2p(self._dist.isend, ts, dest, group, tag), ts))

    def irecv(self, metas: Sequence[TensorMeta], source: int, tag: int,
              device: torch.device) -> Request:
        group = self.links[(source, self.rank)]
        ts = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas]
        self._check("irecv", ts)
        return self._issued(f"receive of message {tag} from rank {self.global_ranks[source]}",
                            _DistWork(self._p2p(self._dist.irecv, ts, source, group, tag), ts))

    def _p2p(self, op: Any, ts: list[torch.Tensor], peer: int, group: Any, tag: int) -> list:
        """A message's tensors to or from `peer` as one batch on the link's group
        (`batch_isend_irecv`), which NCCL runs as one grouped operation on the group's own
        communicator. Never a plain `isend`/`irecv` on NCCL: ProcessGroupNCCL gives a plain
        point-to-point operation a two-rank communicator of its own per pair, made lazily (a
        second communicator per link, its buffers, a first send that blocks the host until
        the peer arrives, and one- and several-tensor messages of a link on two streams).
        gloo has no such communicators, and a lone tensor by itself takes half the host
        time of a batch of one there. A batch holds one group's operations only, so a send
        and a receive of two links (a group per direction) are never batched."""
        rank = self.global_ranks[peer]
        if len(ts) == 1 and not self.batch_p2p:
            return [op(ts[0], rank, group=group, tag=tag)]
        return self._dist.batch_isend_irecv(
            [self._dist.P2POp(op, t, rank, group, tag) for t in ts])

    def _issued(self, what: str, work: "_DistWork") -> "_DistWork":
        """Track a device operation for `in_flight` (completed ones are dropped as new ones
        come, so the list stays as short as what is really outstanding)."""
        if self.device.type == "cuda":
            self._flight = [f for f in self._flight if not completed(f[1])]
            self._flight.append((what, work._works, time.monotonic()))
        return work

    def in_flight(self) -> list[str]:
        now = time.monotonic()
        return [f"{what} (issued {now - t0:.0f} s ago, not completed on the device)"
                for what, works, t0 in list(self._flight) if not completed(works)]

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

    def iallreduce_(self, tensor: torch.Tensor, key: str | None = None) -> Request:
        self._check("all_reduce", [tensor])
        if tensor.device.type == "cuda":
            from pipeflow.comm.cuda import all_reduce_on_side_stream
            return all_reduce_on_side_stream(self._dist, tensor, self.group)
        return _DistWork([self._dist.all_reduce(tensor, group=self.group, async_op=True)])

    def ireduce_scatter_(self, tensor: torch.Tensor, out: torch.Tensor,
                         key: str | None = None) -> Request:
        self._check("reduce_scatter", [tensor, out])
        check_blocks("reduce_scatter", tensor, out, self.size, f"rank {self.rank}")
        # torch >= 2.13 names them `*_single`; the older names warn there, and are all
        # that older versions have.
        scatter = getattr(self._dist, "reduce_scatter_single", None) or \
            self._dist.reduce_scatter_tensor
        return self._collective(lambda: scatter(out, tensor, group=self.group, async_op=True),
                                [tensor, out])

    def iallgather_(self, shard: torch.Tensor, out: torch.Tensor,
                    key: str | None = None) -> Request:
        self._check("all_gather", [shard, out])
        check_blocks("all_gather", out, shard, self.size, f"rank {self.rank}")
        gather = getattr(self._dist, "all_gather_single", None) or \
            self._dist.all_gather_into_tensor
        return self._collective(lambda: gather(out, shard, group=self.group, async_op=True),
                                [shard, out])

    def _collective(self, issue: Any, tensors: list[torch.Tensor]) -> Request:
        """An async collective: on a GPU on the communication stream (as the buckets'
        all-reduce), on a CPU (gloo) directly."""
        if tensors[0].device.type == "cuda":
            from pipeflow.comm.cuda import on_side_stream
            return on_side_stream(issue, tensors)
        return _DistWork([issue()])

    def _check(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        check_on_device(op, tensors, self.device,
                        f"rank {self.rank} of a {self.size}-rank torch.distributed group")

    def barrier(self) -> None:
        self.objects.barrier()

    def free(self) -> None:
        """Free the MPI side. The torch.distributed groups stay alive for the process (see
        `_split_family`): the next engine on the same ranks reuses them."""
        self.objects.free()


def torch_grid_communicators(topo: Any, backend: str, device: torch.device, ring: bool,
                             timeout_s: float = 0.0
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
    init_torch_distributed(backend, device, timeout_s)
    p, d = topo.pipeline, topo.data
    pipelines = topo.grid.groups("pipeline")
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
        data_group = _split_family(topo.grid.groups("data"), backend, "data")
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
