"""`pipeflow train` on 2 ranks: SIGTERM on one rank stops every rank at a step boundary with a
checkpoint, and `--resume` continues as if never stopped; replicas reading their own shards
of a token file train as one process on the whole batch.

Run under `mpirun -n 2` (or 4: two independent pairs) with `--with-mpi`.
"""

from __future__ import annotations

import os
import signal
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from pipeflow._io import atomic_write_bytes
from pipeflow.train.run_config import load_run_config
from pipeflow.train.loop import train

from factory_models import RUN_TOML
from toy import pair
from toy import barrier, bcast



def _shared_folder(comm: MPI.Comm) -> str:
    return bcast(comm, tempfile.mkdtemp(prefix="pipeflow-train-") if comm.rank == 0 else None)


def _run(folder: str, pipeline: int = 2, data: int = 1, *overrides: str):
    path = os.path.join(folder, f"run-{pipeline}x{data}.toml")
    if not os.path.exists(path):
        # Both ranks of a pair may write it: atomically, so neither reads half a file.
        atomic_write_bytes(path, RUN_TOML.format(pipeline=pipeline, data=data, steps=6,
                                                 batch_size=8, log_every=2).encode())
    return load_run_config(path, overrides)


def _quiet(*args, **kwargs):
    pass


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_sigterm_on_one_rank_saves_on_every_rank_and_resume_continues():
    comm = pair()
    folder = _shared_folder(comm)
    barrier(comm)
    whole = train(_run(folder), comm=comm, log=_quiet)
    save = f'train.save_dir="{folder}/ck"'

    def on_step(step: int) -> None:
        if comm.rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)     # only this rank is told

    first = train(_run(folder, 2, 1, save), comm=comm, log=_quiet, on_step=on_step)
    assert len(first) == 3                           # stopped after step 2 on both ranks
    with open(os.path.join(folder, "ck", "latest")) as f:
        assert f.read() == "step-00000003"
    rest = train(_run(folder, 2, 1, save, "train.resume=true"), comm=comm, log=_quiet)
    assert first + rest == whole
    # The handler is gone after train: the default disposition is back.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_replicas_reading_their_shards_train_as_one_process():
    comm = pair()
    folder = _shared_folder(comm)
    if comm.rank == 0:
        (np.arange(30_000) * 7 % 256).astype(np.uint16).tofile(os.path.join(folder, "t.bin"))
    barrier(comm)
    data = f'data.train="{folder}/t.bin"'
    replicated = train(_run(folder, 1, 2, data), comm=comm, log=_quiet)
    alone = train(_run(folder, 1, 1, data), comm=MPI.COMM_SELF, log=_quiet)
    assert replicated == pytest.approx(alone, rel=1e-5)
    assert replicated[-1] < replicated[0]
