"""`pipeflow train` itself, on every schedule: stopped by SIGUSR1 on one rank and resumed, it
gives the uninterrupted run's losses bit for bit, and those are the losses of the library loop
over the same batches. With dropout (the random stream must survive the checkpoint), tied
embeddings across stages, clipping, fp16 loss scaling or bf16, and a validation pass mid-run.

At tensor 2 (sequence parallel on alternate schedules), for the GPT and for transformers'
Llama blocks: resumed bit for bit, and equal to one process at tensor 1.

On 2 ranks the grid is pipeline 2 (tensor 2 for the tensor tests); on 4, pipeline 2 x
data 2 (replicas read their own rows), or pipeline 2 x tensor 2.
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


# -- the tensor axis through `pipeflow train` ------------------------------------------------

TENSOR_GRID = {"engine.tensor": 2, "engine.pipeline": WORLD.size // 2, "engine.data": 1}
# interleaved passes chunks between stages: pipeline 2 (4 ranks) only
TENSOR_SCHEDULES = [s for s in SCHEDULES if WORLD.size >= 4 or s != "interleaved"]


def _tensor_run(folder: str, schedule: str, *overrides: str):
    """The run above at tensor 2 (pipeline 1 on 2 ranks, pipeline 2 on 4), fp32 and without
    dropout so that it can equal one process; sequence parallelism on alternate schedules."""
    sp = SCHEDULES.index(schedule) % 2 == 1
    grid = [f"{k}={v}" for k, v in TENSOR_GRID.items()]
    return _run(folder, schedule, "fp32", 1, *grid, "model.dropout=0.0", "engine.clip=0.0",
                f"engine.sequence_parallel={'true' if sp else 'false'}", *overrides)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", TENSOR_SCHEDULES)
def test_a_tensor_parallel_run_resumes_bit_for_bit_and_equals_one_process(schedule):
    """`[engine] tensor = 2` (with `sequence_parallel` on every other schedule): stopped by
    SIGUSR1 and resumed it gives the uninterrupted losses bit for bit, those are the library
    loop's, and they equal one process's (tensor 1, pipeline 1) to fp32 rounding."""
    folder = bcast(WORLD, tempfile.mkdtemp(prefix="pipeflow-trainer-") if WORLD.rank == 0
                   else None)
    whole = train(_tensor_run(folder, schedule, f'train.save_dir="{folder}/all"'), comm=WORLD,
                  log=_quiet)
    library = _library_loop(_tensor_run(folder, schedule), WORLD, saved_plan(f"{folder}/all"))
    assert library == whole, (library, whole)
    save = f'train.save_dir="{folder}/ck"'

    def on_step(step: int) -> None:        # Slurm's warning, to the last rank only
        if WORLD.rank == WORLD.size - 1 and step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    first = train(_tensor_run(folder, schedule, save), comm=WORLD, log=_quiet, on_step=on_step)
    rest = train(_tensor_run(folder, schedule, save, "train.resume=true"), comm=WORLD,
                 log=_quiet)
    assert len(first) == 3 and first + rest == whole, (first, rest, whole)
    alone = train(_tensor_run(folder, "1f1b", "engine.tensor=1", "engine.pipeline=1",
                              "engine.sequence_parallel=false", "engine.virtual_stages=1"),
                  comm=MPI.COMM_SELF, log=_quiet)
    assert whole == pytest.approx(alone, rel=1e-5), (whole, alone)


HF_RUN = """
[engine]
pipeline = {pipeline}
tensor = {tensor}
sequence_parallel = {sp}
microbatches = 2
[model]
kind = "hf"
seq_len = 16
[model.config]
model_type = "llama"
vocab_size = 256
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 16
[train]
steps = 5
batch_size = 4
lr = 1e-2
warmup = 1
log_every = 100
progress = false
"""


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sp", ["false", "true"], ids=["tp", "sp"])
def test_a_transformers_model_at_tensor_2_resumes_and_equals_one_process(sp):
    """`[model] kind = "hf"` (transformers' own Llama blocks) at tensor 2, sequence parallel
    or not: a stopped and resumed run is the uninterrupted one, equal to one process."""
    pytest.importorskip("transformers")
    folder = bcast(WORLD, tempfile.mkdtemp(prefix="pipeflow-trainer-") if WORLD.rank == 0
                   else None)

    def run(pipeline: int, tensor: int, comm: MPI.Comm, *overrides: str, **kw) -> list[float]:
        path = os.path.join(folder, f"hf-{pipeline}x{tensor}.toml")
        if comm.rank == 0:
            atomic_write_bytes(path, HF_RUN.format(pipeline=pipeline, tensor=tensor,
                                                   sp=sp if tensor > 1 else "false").encode())
        barrier(comm)
        return train(load_run_config(path, overrides), comm=comm, log=_quiet, **kw)

    p = WORLD.size // 2
    whole = run(p, 2, WORLD)
    save = f'train.save_dir="{folder}/ck"'

    def on_step(step: int) -> None:
        if WORLD.rank == 0 and step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    first = run(p, 2, WORLD, save, on_step=on_step)
    rest = run(p, 2, WORLD, save, "train.resume=true")
    assert len(first) == 3 and first + rest == whole, (first, rest, whole)
    alone = run(1, 1, MPI.COMM_SELF)
    assert whole == pytest.approx(alone, rel=1e-5), (whole, alone)
