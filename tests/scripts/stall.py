"""A 2-rank job that stops making progress: `mpirun -n 2 python stall.py sleep|extra-step|build`.

sleep: rank 1 sleeps inside a layer (the watchdog must report and end the job);
outside: rank 1 sleeps in its own code between two steps (rank 0's watchdog, waiting for it
  in the next step's agreement, must report and end the job);
extra-step: rank 1 calls train_step once more than rank 0, which exits (the close check);
build: rank 1's layer constructor raises while rank 0 builds on (abort from the first line);
save-rank0: rank 0 alone calls save (the DDP habit) while rank 1 waits in a barrier of its own
  (the save's agreement gives up after agree_s, naming rank 1);
close-skipped: rank 1 ends without close (rank 0's close names it after agree_s).
"""

import sys
import tempfile
import time

from mpi4py import MPI
from torch import nn

import pipeflow as pf

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from toy import adamw, batches, loss_fn, toy_layers  # noqa: E402

MODE = sys.argv[1]
RANK = MPI.COMM_WORLD.rank


class Sleepy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        if MODE == "build" and RANK == 1:
            raise RuntimeError("boom: a layer constructor failed on one rank")
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if MODE == "sleep" and self.calls == 3:
            time.sleep(120)
        return x


layers = toy_layers()
layers.insert(-1, pf.LayerSpec(Sleepy))
deadline = 2.0 if MODE in ("save-rank0", "close-skipped") else 30.0
engine = pf.Engine(layers, loss_fn, adamw,
                   pf.Config(pipeline=2, microbatches=2, watchdog_s=20.0 if deadline < 30
                             else 2.0, agree_s=deadline))
steps = 3 + (MODE == "extra-step" and engine.stage.index == 1)
for k, (x, y) in enumerate(batches(steps, 8)):
    if MODE == "outside" and RANK == 1 and k == 2:
        time.sleep(120)
    engine.train_step(x, y)
if MODE == "save-rank0":
    if RANK == 0:
        engine.save(tempfile.mkdtemp(prefix="pipeflow-stall-"))
    MPI.COMM_WORLD.Barrier()
if MODE == "close-skipped" and RANK == 1:
    sys.exit(0)                  # forgets engine.close()
engine.close()
print("finished without failing", flush=True)
