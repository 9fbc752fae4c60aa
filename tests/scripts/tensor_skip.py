"""A 2-rank tensor-parallel job where tensor rank 1 skips a cut layer's collective:
`mpirun -n 2 python tensor_skip.py mpi|strict`.

mpi: the MPI backend; the waiting rank's watchdog must end the job naming the tensor group's
  collective (the layer and the instruction) it waits in;
strict: NCCL's rules on the CPU (PIPEFLOW_STRICT_COMM=1): the first collective that differs
  between the tensor ranks fails both, naming each side's layer.
"""

import os
import sys

if sys.argv[1] == "strict":
    os.environ["PIPEFLOW_STRICT_COMM"] = "1"

import torch                                  # noqa: E402
from mpi4py import MPI                        # noqa: E402
from torch import nn                          # noqa: E402

import pipeflow as pf                         # noqa: E402


class Skipping(nn.Module):
    """A user's layer whose forward, on tensor rank 1 only, bypasses its row layer."""

    tp_plan = {"up": "colwise", "down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.up(x))
        if MPI.COMM_WORLD.rank == 1:
            return x + h[..., :8]             # the bug: no reduction on this rank
        return x + self.down(h)


engine = pf.Engine([pf.LayerSpec(Skipping), pf.LayerSpec(Skipping)],
                   lambda y, t: ((y - t) ** 2).mean(), lambda p: torch.optim.SGD(p, lr=0.1),
                   pf.Config(tensor=2, watchdog_s=3.0))
x = torch.randn(4, 3, 8)
engine.train_step(x, x)
if MPI.COMM_WORLD.rank == 0:        # rank 1 (fewer collectives) may get through its step
    print("finished without failing")
