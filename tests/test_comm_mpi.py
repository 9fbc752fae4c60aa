"""torch.distributed groups refuse tensors off their device, with gloo standing in for NCCL.

Run under `mpirun -n 2` (or 4) with `--with-mpi`.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from pipeflow.comm import CommDeviceError, TorchDistCommunicator, init_torch_distributed

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
