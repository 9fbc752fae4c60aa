"""`pipeflow train`'s loop with one rank failing between steps:
`mpirun -n 2 python trainer_fault.py raise|interrupt`.

raise: rank 1's own code raises after step 1 (its exception is printed, its close gives up
  after engine.FAILING_CLOSE_S while rank 0 waits at the stop-signal agreement, and the job
  ends); raise-patient: the same with agree_s = 600, which the close does not wait for;
interrupt: rank 1 gets SIGINT (Ctrl-C) after step 1: named, and the job ends at once.
"""

import os
import signal
import sys
import tempfile

from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from factory_models import RUN_TOML  # noqa: E402

from pipeflow.train.run_config import load_run_config  # noqa: E402
from pipeflow.train.loop import train  # noqa: E402

MODE = sys.argv[1]
RANK = MPI.COMM_WORLD.rank
folder = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="pipeflow-fault-") if RANK == 0 else None)
path = os.path.join(folder, "run.toml")
if RANK == 0:
    with open(path, "w") as f:
        f.write(RUN_TOML.format(pipeline=2, data=1, steps=50, batch_size=8, log_every=100))
MPI.COMM_WORLD.Barrier()
AGREE_S = 600 if MODE == "raise-patient" else 3
run = load_run_config(path, [f"engine.agree_s={AGREE_S}", "engine.watchdog_s=900"
                             if MODE == "raise-patient" else "engine.watchdog_s=30"])


def on_step(step: int) -> None:
    if RANK == 1 and step == 1:
        if MODE.startswith("raise"):
            raise ValueError("user code failed between steps")
        os.kill(os.getpid(), signal.SIGINT)


train(run, log=lambda *a, **k: None, on_step=on_step)
print("finished without failing", flush=True)
