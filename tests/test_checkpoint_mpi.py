"""Checkpoints across ranks: every rank's files are checksummed, and a dropout run resumes
bit-identically on its grid (the random state of each rank restored), with a warning on
another grid. Run under `mpirun -n 2` (or 4: two pipelines side by side) with `--with-mpi`."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.runtime.rng import seed_everything

from toy import adamw, batches, dropout_layers, loss_fn, pair
from toy import allgather, barrier, bcast

pytestmark = pytest.mark.timeout(120)


def _engine(comm: MPI.Comm, pipeline: int, data: int, schedule: str = "1f1b",
            precision: str = "fp32") -> pf.Engine:
    return pf.Engine(dropout_layers(), loss_fn, adamw,
                     pf.Config(pipeline=pipeline, data=data, microbatches=2, schedule=schedule,
                               virtual_stages=2 if schedule == "zbv" else 1,
                               precision=precision, initial_loss_scale=2.0 ** 10), comm=comm)


def _masters(engine: pf.Engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.named_master_parameters()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("grid,schedule,precision", [
    ((2, 1), "1f1b", "fp32"), ((1, 2), "1f1b", "fp32"),
    # Split backward (W later than B) with mixed precision: the fp32 masters, the loss scale
    # and the random state resume as they were.
    ((2, 1), "zb-h1", "bf16"), ((2, 1), "zbv", "fp16")])
def test_a_dropout_run_resumes_bit_identically_on_every_rank(grid, schedule, precision,
                                                              tmp_path_factory):
    comm = pair()
    folder = bcast(comm, str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)
    data = batches(3, 8)
    seed_everything(0, comm.rank)        # each rank (each replica) draws its own masks
    engine = _engine(comm, *grid, schedule, precision)
    for x, y in data[:2]:
        engine.train_step(x, y)
    saved = engine.save(folder)
    engine.train_step(*data[2])
    expected = _masters(engine)
    if comm.rank == 0:
        meta = json.loads(open(os.path.join(saved, "engine.json")).read())
        assert sorted(meta["checksums"]) == sorted(set(os.listdir(saved)) - {"engine.json"})
        assert {"rng-rank00000.pt", "rng-rank00001.pt"} <= set(meta["checksums"])
    resumed = _engine(comm, *grid, schedule, precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # the same grid: no warning
        resumed.load(folder)
    resumed.train_step(*data[2])
    same = all(torch.equal(expected[n], p) for n, p in _masters(resumed).items())
    assert allgather(comm, same) == [True] * comm.size
    engine.close()
    resumed.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_another_grid_loads_the_weights_and_warns_about_the_random_state(tmp_path_factory):
    comm = pair()
    folder = bcast(comm, str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)
    engine = _engine(comm, 2, 1)
    engine.train_step(*batches(1, 8)[0])
    engine.save(folder)
    full = engine.gather_state_dict()
    other = _engine(comm, 1, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load(folder)
    messages = [str(w.message) for w in caught]
    if comm.rank == 0:
        assert any("the random state is not restored" in m and "'pipeline': 2" in m
                   for m in messages), messages
        loaded = other.gather_state_dict()
        assert all(torch.equal(full[k], loaded[k]) for k in full)
    else:
        other.gather_state_dict()
        assert not messages
    engine.close()
    other.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("grid", [(2, 1), (1, 2)])
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_last(grid):
    # One rank's write fails (ENOSPC): every rank raises, naming that rank and the OS error;
    # `latest` still names the previous checkpoint, which loads; nothing half-written stays.
    import errno

    import pipeflow.runtime.checkpoint as ckpt
    comm = pair()
    made = __import__("tempfile").mkdtemp(prefix="pipeflow-full-") if comm.rank == 0 else None
    folder = bcast(comm, made)
    engine = _engine(comm, *grid)
    data = batches(3, 8)
    engine.train_step(*data[0])
    engine.save(folder)
    saved = _masters(engine)
    engine.train_step(*data[1])
    real = ckpt.atomic_write_bytes

    def full(path, payload, **kwargs):
        if comm.rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(path, payload, **kwargs)

    ckpt.atomic_write_bytes = full
    try:
        with pytest.raises(pf.CheckpointError, match=r"step 2 was not saved: rank 1 \(stage "
                           r".*could not write .*No space left on device.*'step-00000001' is "
                           r"untouched"):
            engine.save(folder)
    finally:
        ckpt.atomic_write_bytes = real
    barrier(comm)
    assert sorted(os.listdir(folder)) == ["latest", "step-00000001"]
    other = _engine(comm, *grid)
    other.load(folder)
    assert other.stats.step == 1
    assert all(torch.equal(saved[k], v) for k, v in _masters(other).items())
    engine.train_step(*data[2])                 # the engine goes on, and saves again
    assert engine.save(folder).endswith("step-00000003")
    for e in (engine, other):
        e.close()
    comm.Free()
