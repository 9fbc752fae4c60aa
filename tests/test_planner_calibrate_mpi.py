"""Calibration under mpirun: the tensor group's all-reduce measured on the engine's MPI
communicator, and the plan for tensor = 2 built from it (run with `mpirun -n 2`, `--with-mpi`)."""

from __future__ import annotations

import dataclasses

import pytest
from mpi4py import MPI

from pipeflow.planner.calibrate import calibrate, measure_tensor_allreduce
from pipeflow.planner.cost import Grid, estimate, ring_allreduce_time
from pipeflow.planner.hardware import Cluster
from pipeflow.planner.search import SearchOptions, search
from pipeflow.planner.shapes import Shape

from toy import allgather

WORLD = MPI.COMM_WORLD
TINY = Shape(2, 64, 4, seq_len=16, vocab_size=64)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_calibration_measures_the_tensor_allreduce_and_plans_tensor_two():
    sizes = [b * TINY.seq_len * TINY.d_model * 4 for b in (1, 4, 16)]
    bandwidth, latency = measure_tensor_allreduce(WORLD, sizes, repeats=3)
    assert bandwidth > 0 and latency >= 0
    # Every rank has the answer rank 0 fitted.
    assert allgather(WORLD, (bandwidth, latency)) == [(bandwidth, latency)] * WORLD.size
    # The fit is a two-rank ring: n/bandwidth + 2·latency grows with the bytes.
    assert ring_allreduce_time(sizes[-1], 2, bandwidth, latency) > \
        ring_allreduce_time(sizes[0], 2, bandwidth, latency)
    hw = calibrate(TINY, comm=WORLD, ranks_per_node=WORLD.size, micro_batch_sizes=(1, 2),
                   repeats=1)
    assert allgather(WORLD, hw.to_dict()) == [hw.to_dict()] * WORLD.size
    assert hw.tensor_bandwidth > 0 and hw.tensor_latency is not None
    assert "block@2" in hw.layer_times.samples and "tensor" in hw.sources
    cluster = Cluster(hw, 2, 2)
    found = search(TINY, cluster, 4, SearchOptions("fp32", tensor=(2,), prune=False))
    assert {e.grid.tensor for e in found.ranked} == {2}
    plain = estimate(TINY, cluster, Grid(1, 1, 2, 2, tensor=2), "none", "fp32")
    slow = dataclasses.replace(hw, tensor_bandwidth=hw.tensor_bandwidth / 10)
    more = estimate(TINY, Cluster(slow, 2, 2), Grid(1, 1, 2, 2, tensor=2), "none", "fp32")
    assert more.step_time_s > plain.step_time_s       # the measured link is the one used
