"""The rank grid `pipeline × data × tensor` (`pipeflow.grid`), its MPI sub-communicators, and
the backend it talks over."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow.grid import Grid
from pipeflow.config import ConfigError
from pipeflow.logs import get_logger

__all__ = ["Topology", "TopologyError", "bind_device",
           "choose_backend", "grid_communicators", "tensor_communicator"]

STRICT_ENV = "PIPEFLOW_STRICT_COMM"   # =1: the MPI backend runs under NCCL's rules (tests)

_log = get_logger(__name__)




class TopologyError(ConfigError):
    """The world does not hold the grid the configuration asks for."""


class Topology:
    """Where this rank sits in the grid, and the communicators it talks over.

    The layout is `pipeflow.grid.Grid`'s (tensor innermost, then data, pipeline outermost);
    each communicator here is one of its groups, asked for by axis name: `pipe` (this rank's
    pipeline: one stage of each, same replica and tensor rank; a rank's place in it is its
    stage), `data_group` (its stage's replicas) and `tensor_group` (its stage's tensor ranks).
    """

    def __init__(self, comm: MPI.Comm, pipeline: int, data: int = 1, tensor: int = 1) -> None:
        grid = Grid(pipeline, data, tensor)
        if grid.size != comm.size:
            raise TopologyError(
                f"rank {comm.rank}: the grid pipeline={pipeline} x data={data} x "
                f"tensor={tensor} needs {grid.size} ranks, but the job has {comm.size}; "
                f"launch with `mpirun -n {grid.size}` or choose degrees whose product is "
                f"{comm.size}{_fits(comm.size, pipeline, tensor)}")
        self.grid = grid
        self.world = comm
        self.rank = comm.rank
        self.pipeline, self.data, self.tensor = pipeline, data, tensor
        self.stage, self.replica, self.tensor_rank = grid.coords(comm.rank)
        self.pipe = self.split("pipeline")
        self.data_group = self.split("data")
        self.tensor_group = self.split("tensor")
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        self.local_rank, self.local_size = local.rank, local.size
        # Which of its node's GPUs this rank takes: its place among the job's ranks on the
        # node, not among this engine's (two engines on sub-communicators of one node would
        # both take GPU 0).
        self.gpu_slot = node_slot(comm, local.rank)
        self.local_cores = waiting.node_cores(local)    # cores this node's ranks may use
        local.Free()

    def split(self, axes: str | tuple[str, ...]) -> MPI.Comm:
        """This rank's group along `axes` as an MPI communicator (collective over the
        world), ranked by its coordinates on those axes."""
        return self.world.Split(color=self.grid.index(axes, self.rank),
                                key=self.grid.position(axes, self.rank))

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """World rank of `stage` in `replica`'s pipeline (this rank's by default) at this
        rank's tensor coordinate."""
        return self.grid.rank(stage, self.replica if replica is None else replica,
                              self.tensor_rank)

    def describe(self) -> str:
        text = (f"rank {self.rank} (stage {self.stage} of {self.pipeline}, "
                f"replica {self.replica} of {self.data}")
        if self.tensor > 1:
            text += f", tensor rank {self.tensor_rank} of {self.tensor}"
        return text + ")"

    def free(self) -> None:
        for comm in (self.pipe, self.data_group, self.tensor_group):
            if comm != MPI.COMM_NULL:
                comm.Free()


def _fits(world: int, pipeline: int, tensor: int) -> str:
    """Advice: the data degree that would fill `world` at these pipeline and tensor degrees."""
    if world % (pipeline * tensor) == 0:
        return f" (e.g. data = {world // (pipeline * tensor)})"
    return ""


def bind_device(device: torch.device) -> None:
    """Make `device` this process's current GPU, whatever the backend: CUDA's first use
    (layer building forks every GPU's random state), pinned buffers, synchronize() and user
    `device="cuda"` code must land on this rank's GPU, not GPU 0. A bare "cuda" (no index)
    means the current GPU: nothing to bind."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def choose_backend(name: str, topo: Topology, device: torch.device) -> str:
    """The backend this grid runs on, alike on every rank; binds the rank to its GPU.

    `auto`: NCCL where every rank has a GPU of its own (NCCL refuses two ranks on one GPU,
    "Duplicate GPU detected"; ranks are told apart by the GPU's UUID, so one GPU per rank
    through CUDA_VISIBLE_DEVICES counts as its own), MPI otherwise. With
    PIPEFLOW_STRICT_COMM=1, MPI becomes `strict` (NCCL's rules checked on CPUs).
    """
    bind_device(device)
    unfit = None
    if name == "nccl" and not (device.type == "cuda" and _nccl_available()):
        unfit = (f"{topo.describe()}: backend 'nccl' needs CUDA tensors and torch built with "
                 f"NCCL; this rank runs on {device}. Use backend = 'mpi' or 'auto'")
    if name == "gloo" and device.type == "cuda":
        raise ConfigError(
            f"{topo.describe()}: backend 'gloo' sends no CUDA tensors point to point, and "
            f"this rank runs on {device}; use backend = 'nccl' (one GPU per rank), 'mpi' or "
            f"'auto'")
    if name in ("auto", "nccl"):
        gpu = _gpu_identity(device) if device.type == "cuda" and _nccl_available() else None
        views = waiting.allgather(topo.world, (gpu, unfit))  # every rank decides alike
        unfit = next((u for _, u in views if u), None)
        if unfit:
            raise ConfigError(unfit)
        gpus = [g for g, _ in views]
        shared = _shared_gpus(gpus)
        if name == "nccl" and shared:
            raise ConfigError(
                f"{topo.describe()}: backend 'nccl' needs a GPU of its own for every rank, "
                f"and {shared}: NCCL refuses that ('Duplicate GPU detected'). Start one rank "
                f"per GPU (or set CUDA_VISIBLE_DEVICES per rank), or use backend = 'mpi'")
        if name == "auto" and None not in gpus and shared:
            if topo.world.rank == 0:     # GPUs everywhere, yet not NCCL: say why
                _log.warning("backend 'auto' chose MPI, not NCCL: %s (NCCL needs one GPU per "
                             "rank)", shared)
        if name == "auto":
            name = "nccl" if None not in gpus and not shared else "mpi"
    if name == "mpi" and os.environ.get(STRICT_ENV, "") not in ("", "0"):
        name = "strict"
    _log.debug("%s: backend %r on %s", topo.describe(), name, device)
    return name


def _shared_gpus(gpus: list[tuple[str, str] | None]) -> str:
    """Which ranks share a GPU, as a report says it ("" when none do)."""
    holders: dict[tuple[str, str], list[int]] = {}
    for rank, gpu in enumerate(gpus):
        if gpu is not None:
            holders.setdefault(gpu, []).append(rank)
    for (host, gpu), ranks in holders.items():
        if len(ranks) > 1:
            return f"ranks {ranks} share GPU {gpu} on {host}"
    return ""


def _gpu_identity(device: torch.device) -> tuple[str, str]:
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return (socket.gethostname(), str(uuid) if uuid is not None else
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}:{device.index}")


def _nccl_available() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_nccl_available()


def grid_communicators(topo: Topology, backend: str, device: torch.device, ring: bool,
                       timeout_s: float = 0.0) -> tuple[Any, Any]:
    """This rank's pipeline communicator and, with replicas, its stage's data group's;
    `timeout_s` (the watchdog's) bounds torch.distributed's own wait (see
    `init_torch_distributed`)."""
    from pipeflow.comm.mpi import MpiCommunicator
    from pipeflow.comm.torch_dist import torch_grid_communicators
    from pipeflow.comm.strict import StrictCommunicator

    if backend in ("mpi", "strict"):
        make = MpiCommunicator if backend == "mpi" else (
            lambda c: StrictCommunicator(c, device))
        return make(topo.pipe), (make(topo.data_group) if topo.data > 1 else None)
    if topo.world.size != MPI.COMM_WORLD.size:
        raise ConfigError(
            f"{topo.describe()}: backend {backend!r} (torch.distributed) spans "
            f"MPI.COMM_WORLD, but this engine runs on a communicator of {topo.world.size} "
            f"of its {MPI.COMM_WORLD.size} ranks; use backend 'mpi', or one engine over "
            f"the whole job")
    return torch_grid_communicators(topo, backend, device, ring=ring, timeout_s=timeout_s)


def tensor_communicator(topo: Topology, backend: str, device: torch.device) -> Any:
    """This rank's tensor group as a communicator on `backend` (tensor > 1): its layers'
    collectives run on it (`runtime.tensor_parallel`)."""
    if backend in ("mpi", "strict"):
        from pipeflow.comm.mpi import MpiCommunicator
        from pipeflow.comm.strict import StrictCommunicator
        return MpiCommunicator(topo.tensor_group) if backend == "mpi" else \
            StrictCommunicator(topo.tensor_group, device)
    from pipeflow.comm.torch_dist import torch_family_communicators
    return torch_family_communicators(topo.tensor_group, topo.grid.groups("tensor"), backend,
                                      device, "tensor")


# What launchers set for a rank's place among the job's ranks on its node: Open MPI, MPICH's
# hydra, PMI/PMIx, Cray PALS, Slurm's srun, torchrun.
LOCAL_RANK_ENV = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK",
                  "PMIX_LOCAL_RANK", "PALS_LOCAL_RANKID", "SLURM_LOCALID", "LOCAL_RANK")


def node_slot(comm: MPI.Comm, local_rank: int) -> int:
    """This rank's place among the job's ranks on its node. On the whole world that is its
    rank on the node's shared-memory group; on a sub-communicator the launcher's variable
    says (no collective over the world: other ranks may be building other engines), else
    the rank within this communicator's node group."""
    if comm.size == MPI.COMM_WORLD.size:
        return local_rank
    for name in LOCAL_RANK_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return local_rank
