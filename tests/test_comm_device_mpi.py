"""torch.distributed groups refuse tensors off their device, with gloo standing in for NCCL.

Run under `mpirun -n 2` (or 4) with `--with-mpi`.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from pipeflow.comm.base import CommDeviceError
from pipeflow.comm.torch_dist import TorchDistCommunicator, init_torch_distributed

WORLD = MPI.COMM_WORLD


def _world_group():
    import torch.distributed as dist
    init_torch_distributed("gloo", torch.device("cpu"))
    return dist.new_group(list(range(WORLD.size)))


@pytest.mark.mpi(min_size=2)
def test_collective_and_p2p_refuse_a_tensor_on_another_device():
    group = _world_group()
    # A group whose device is not the CPU (as an NCCL group's is CUDA): a CPU tensor, the
    # gradient norm's old `.cpu()` copy, must be refused before it reaches the backend.
    comm = TorchDistCommunicator(WORLD, group, {(0, 1): group, (1, 0): group}, device="meta")
    with pytest.raises(CommDeviceError, match=r"all_reduce got a tensor of shape \(1,\) on cpu, "
                                              r"but this group communicates on meta"):
        comm.allreduce_(torch.ones(1, dtype=torch.float64))
    if WORLD.rank in (0, 1):
        with pytest.raises(CommDeviceError, match="isend got a tensor"):
            comm.isend([torch.ones(2)], 1 - WORLD.rank, tag=0)
        with pytest.raises(CommDeviceError, match="irecv got a tensor"):
            comm.irecv([((2,), torch.float32)], 1 - WORLD.rank, tag=0, device=torch.device("cpu"))
    # On its device, the same collective sums.
    ok = TorchDistCommunicator(WORLD, group, device="cpu")
    t = torch.full((1,), float(WORLD.rank + 1), dtype=torch.float64)
    ok.allreduce_(t)
    assert t.item() == WORLD.size * (WORLD.size + 1) / 2
    comm.objects.free()
    ok.objects.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ring", [False, True])
def test_grid_groups_are_made_a_family_at_a_time_and_carry_both_directions(ring, monkeypatch):
    import pipeflow.comm.torch_dist as comm_mod
    from pipeflow.comm.topology import Topology

    calls = []
    real = comm_mod._split_family
    monkeypatch.setattr(comm_mod, "_split_family", lambda lists, backend, role="":
                        calls.append(lists) or real(lists, backend, role))
    p = WORLD.size
    topo = Topology(WORLD, p, 1)
    pipe, data = comm_mod.torch_grid_communicators(topo, "gloo", torch.device("cpu"), ring)
    assert data is None
    # One pipeline family, then (direction x parity) link families, plus the ring's: never
    # one call per group.
    families = 1 + 2 * min(2, p - 1) + (2 if ring and p > 2 else 0)
    assert len(calls) == families, calls
    s = topo.stage
    neighbours = {(s - 1) % p, (s + 1) % p} - {s} if ring and p > 2 else \
        {n for n in (s - 1, s + 1) if 0 <= n < p}
    assert set(pipe.links) == {(s, n) for n in neighbours} | {(n, s) for n in neighbours}
    # Every link moves a message, in both directions at once.
    sends = [pipe.isend([torch.full((2,), float(s))], n, tag=0) for n in sorted(neighbours)]
    recvs = {n: pipe.irecv([((2,), torch.float32)], n, 0, torch.device("cpu"))
             for n in sorted(neighbours)}
    for n, r in recvs.items():
        assert r.wait()[0].tolist() == [float(n)] * 2
    for sreq in sends:
        sreq.wait()
    pipe.free()
    topo.free()
