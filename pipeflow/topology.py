"""The rank grid `pipeline × data` and its MPI sub-communicators."""

from __future__ import annotations

import time
from typing import Any

from mpi4py import MPI

from pipeflow.config import ConfigError

__all__ = ["Topology", "TopologyError", "rank_of", "sleeping_barrier"]


def rank_of(stage: int, replica: int, data: int) -> int:
    """World rank of `(stage, replica)` in a grid of `data` replicas: pipeline-outermost, so
    a stage's replicas are neighbouring ranks (see `Topology`)."""
    return stage * data + replica


def sleeping_barrier(comm: Any) -> None:
    """A barrier that sleeps while it waits.

    MPICH's blocking barrier spins, and on a machine with one core per rank a spinning idle
    rank would steal time from the ranks being measured.
    """
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-4)


class TopologyError(ConfigError):
    """The world does not hold the grid the configuration asks for."""


class Topology:
    """Where this rank sits in the grid, and the communicators it talks over.

    Ranks are laid out pipeline-outermost: world rank = stage · data + replica. The replicas of
    one stage are neighbours (on one node, when `data` divides the GPUs per node), so the
    heavy gradient all-reduce stays on the fast intra-node links and only the light
    point-to-point activations cross nodes.
    """

    def __init__(self, comm: MPI.Comm, pipeline: int, data: int = 1) -> None:
        if pipeline * data != comm.size:
            raise TopologyError(
                f"rank {comm.rank}: the grid pipeline={pipeline} x data={data} needs "
                f"{pipeline * data} ranks, but the job has {comm.size}; launch with "
                f"`mpirun -n {pipeline * data}` or set pipeline x data = {comm.size}")
        self.world = comm
        self.rank = comm.rank
        self.pipeline = pipeline
        self.data = data
        self.stage, self.replica = divmod(comm.rank, data)     # the inverse of rank_of
        # Each replica's pipeline: ranks of all stages of one replica, ordered by stage, so
        # a stage's rank in `pipe` is its stage index.
        self.pipe = comm.Split(color=self.replica, key=self.stage)
        # Each stage's data group: its replicas, ordered by replica.
        self.data_group = comm.Split(color=self.stage, key=self.replica)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        self.local_rank, self.local_size = local.rank, local.size
        local.Free()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pipeline - 1

    def rank_of(self, stage: int, replica: int) -> int:
        """World rank of `(stage, replica)`."""
        return rank_of(stage, replica, self.data)

    def describe(self) -> str:
        return (f"rank {self.rank} (stage {self.stage} of {self.pipeline}, "
                f"replica {self.replica} of {self.data})")

    def free(self) -> None:
        for comm in (self.pipe, self.data_group):
            if comm != MPI.COMM_NULL:
                comm.Free()
