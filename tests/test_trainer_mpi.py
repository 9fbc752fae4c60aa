"""`pipeflow train` itself, on every schedule: stopped by SIGUSR1 on one rank and resumed, it
gives the uninterrupted run's losses bit for bit, and those are the losses of the library loop
over the same batches. With dropout (the random stream must survive the checkpoint), tied
embeddings across stages, clipping, fp16 loss scaling or bf16, and a validation pass mid-run.

On 2 ranks the grid is pipeline 2; on 4, pipeline 2 x data 2 (replicas read their own rows).
Run under `mpirun -n 2` or `-n 4` with `--with-mpi`.
"""

from __future__ import annotations

import dataclasses

import os
import signal
import tempfile

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow._io import atomic_write_bytes
from pipeflow.runtime.checkpoint import saved_plan
from pipeflow.train.data import Batches, load_corpus
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss
from pipeflow.train.run_config import load_run_config
from pipeflow.train.loop import lr_at, train, weight_decay_groups
from toy import barrier, bcast

WORLD = MPI.COMM_WORLD
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "auto"]

RUN = """
[engine]
pipeline = 2
data = {data}
microbatches = 4
schedule = "{schedule}"
virtual_stages = {virtual}
partition = "{partition}"
precision = "{precision}"
initial_loss_scale = 1024.0
loss_scale_interval = 2
clip = 0.5
[model]
n_layers = 4
d_model = 16
n_heads = 2
seq_len = 16
dropout = 0.2
[train]
steps = 6
batch_size = 8
lr = 1e-2
warmup = 2
log_every = 100
eval_every = 2
eval_batches = 1
progress = false
"""


def _grid() -> tuple[MPI.Comm, int]:
    """The whole world: pipeline 2 on 2 ranks, pipeline 2 x data 2 on 4."""
    return WORLD, WORLD.size // 2


def _quiet(*args, **kwargs):
    pass


def _run(folder: str, schedule: str, precision: str, data: int, *overrides: str):
    path = os.path.join(folder, "run.toml")
    if WORLD.rank == 0:
        # "auto" measures (and partition "time" too): a resumed run must keep what the
        # first one measured, or it would not continue bit for bit.
        text = RUN.format(data=data, schedule=schedule, precision=precision,
                          virtual=2 if schedule in ("interleaved", "zbv") else 1,
                          partition="time" if schedule == "auto" else "uniform")
        atomic_write_bytes(path, text.encode())
    barrier(WORLD)
    return load_run_config(path, overrides)


def _library_loop(run, comm: MPI.Comm, plan: dict) -> list[float]:
    """What a user writes with the library: the same model, optimizer, learning-rate schedule
    and batches (each replica its rows), one `train_step` a batch; on the schedule and stages
    that `plan` (a checkpoint's) records, which is what "auto" and "time" chose."""
    t = run.train
    run.engine.schedule, run.engine.virtual_stages = plan["schedule"], plan["virtual_stages"]
    run.engine.partition = plan["boundaries"]
    cfg = GPTConfig(**run.model)
    engine = pf.Engine(gpt_layers(cfg), gpt_loss,
                       lambda ps: torch.optim.AdamW(weight_decay_groups(ps, t.weight_decay),
                                                    lr=t.lr, betas=(t.beta1, t.beta2)),
                       dataclasses.replace(run.engine, batch="local"), comm=comm)
    batches = Batches(load_corpus(), t.batch_size, cfg.seq_len, run.engine.seed)
    losses = []
    for step in range(t.steps):
        if engine.stage.optimizer is not None:
            for group in engine.stage.optimizer.param_groups:
                group["lr"] = lr_at(step, t)
        x, y = batches.local_batch(step, engine.stage.topo.replica, run.engine.data)
        losses.append(engine.train_step(x if engine.plan.holds_first(engine.stage.index) else None,
                                        y if engine.plan.holds_last(engine.stage.index) else None))
    engine.close()
    return losses


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stopped_and_resumed_run_is_the_uninterrupted_run_and_the_library_loop(schedule,
                                                                                precision):
    comm, data = _grid()
    folder = bcast(comm, tempfile.mkdtemp(prefix="pipeflow-trainer-") if comm.rank == 0 else None)
    whole = train(_run(folder, schedule, precision, data, f'train.save_dir="{folder}/all"'),
                  comm=comm, log=_quiet)
    assert len(whole) == 6 and all(map(torch.isfinite, torch.tensor(whole)))
    plan = saved_plan(f"{folder}/all")
    library = _library_loop(_run(folder, schedule, precision, data), comm, plan)
    assert library == whole, (library, whole)

    save = f'train.save_dir="{folder}/ck"'

    def on_step(step: int) -> None:        # Slurm's warning, to the last rank only
        if comm.rank == comm.size - 1 and step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    first = train(_run(folder, schedule, precision, data, save), comm=comm, log=_quiet,
                  on_step=on_step)
    assert len(first) == 3
    rest = train(_run(folder, schedule, precision, data, save, "train.resume=true"),
                 comm=comm, log=_quiet)
    # The resumed run kept the stopped one's plan; "auto" may have chosen another than the
    # uninterrupted run did (it measures), and then the library loop on that plan decides.
    resumed = saved_plan(f"{folder}/ck")
    expected = whole if resumed == plan else \
        _library_loop(_run(folder, schedule, precision, data), comm, resumed)
    assert first + rest == expected, (first, rest, expected)      # bit for bit


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_resume_from_a_periodic_checkpoint_trains_each_batch_once():
    # A periodic checkpoint (save_every) must record the batch after the one just trained:
    # resumed from it, a run that failed later sees every batch exactly once.
    comm, data = _grid()
    folder = bcast(comm, tempfile.mkdtemp(prefix="pipeflow-trainer-") if comm.rank == 0 else None)
    base = ("1f1b", "bf16", data, f'train.save_dir="{folder}/ck"', "train.save_every=2")
    whole = train(_run(folder, "1f1b", "bf16", data), comm=comm, log=_quiet)

    class Failure(Exception):
        pass

    def on_step(step: int) -> None:        # every rank alike: a failure after step 2
        if step == 2:
            raise Failure

    with pytest.raises(Failure):
        train(_run(folder, *base), comm=comm, log=_quiet, on_step=on_step)
    with open(os.path.join(folder, "ck", "latest")) as f:
        assert f.read() == "step-00000002"    # the periodic one, not a save at the stop
    rest = train(_run(folder, *base, "train.resume=true"), comm=comm, log=_quiet)
    assert rest == whole[2:], (rest, whole)
