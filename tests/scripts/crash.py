"""A 2-rank job where rank 1 fails at step 2:
`mpirun -n 2 python crash.py in-layer|outside|sigint-in-layer`.

The whole job must end within seconds, naming the rank (and stage, when inside the engine).
"""

import os
import signal
import sys

from torch import nn

import pipeflow as pf

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from toy import adamw, batches, loss_fn, toy_layers  # noqa: E402


class Bomb(nn.Module):
    """Passes its input through, and raises on its fifth call (the third step's forward)."""

    calls = 0

    def forward(self, x):
        Bomb.calls += 1
        if Bomb.calls == 5 and MODE == "in-layer":
            raise RuntimeError("boom: a layer failed")
        if Bomb.calls == 5 and MODE == "sigint-in-layer":     # Ctrl-C to this rank alone
            os.kill(os.getpid(), signal.SIGINT)
        return x


MODE = sys.argv[1]
layers = toy_layers()
layers.insert(-1, pf.LayerSpec(Bomb))
engine = pf.Engine(layers, loss_fn, adamw, pf.Config(pipeline=2, microbatches=2))
for step, (x, y) in enumerate(batches(4, 8)):
    if MODE == "outside" and step == 2 and engine.stage.index == 1:
        raise ValueError("user code failed between steps")
    engine.train_step(x, y)
print("finished without failing", flush=True)
