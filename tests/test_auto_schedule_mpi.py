"""`schedule = "auto"` on a pipeline: every rank runs the same choice, and it trains like one
process. Run with `mpirun -n 2` (or 4) `python -m pytest --with-mpi -m mpi`."""

import logging

import pytest
from mpi4py import MPI

import pipeflow as pf
from pipeflow.schedules import build_schedule, simulate

from toy import (adamw, assert_same_parameters, batches, loss_fn, sub_world, toy_layers,
                 train_reference)
from toy import allgather

WORLD = MPI.COMM_WORLD
BATCH = 24


def _cases():
    for p in (p for p in (2, 4) if p <= WORLD.size):
        for m, partition, budget_mb in [(4, "uniform", 0.0), (3, "time", 0.0),
                                        (8, "uniform", 0.0095)]:
            yield p, m, partition, budget_mb


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages,microbatches,partition,budget_mb", list(_cases()))
def test_auto_trains_like_one_process_and_reports_its_choice(stages, microbatches, partition,
                                                             budget_mb, caplog):
    caplog.set_level(logging.INFO, logger="pipeflow")
    comm = sub_world(stages)
    layers = toy_layers(blocks=7)                  # 9 layers: room for two chunks a rank
    data = batches(3, BATCH)
    config = pf.Config(pipeline=stages, microbatches=microbatches, schedule="auto",
                       partition=partition, activation_budget_mb=budget_mb)
    sample = data[0][0][:BATCH // microbatches] if comm.rank == 0 else None   # rank 0's
    engine = pf.Engine(layers, loss_fn, adamw, config, comm=comm, sample=sample)
    choice = engine.schedule_choice
    # One choice, the same on every rank, from numbers rank 0 measured; rank 0 logs it.
    assert allgather(comm, (engine.schedule, choice, list(engine.plan.boundaries))) == \
        [(engine.schedule, choice, list(engine.plan.boundaries))] * comm.size
    assert choice.startswith(f"pipeflow: schedule 'auto' chose {engine.schedule!r}")
    said = [(r.getMessage(), r.rank) for r in caplog.records
            if r.name == "pipeflow.runtime.arrange"]
    assert said == ([(choice.removeprefix("pipeflow: "), WORLD.rank)] if comm.rank == 0 else [])
    assert config.schedule == "auto" and config.virtual_stages == 1
    if budget_mb:
        # 9.7 KiB: only 1F1B's stash of this model fits (bytes are exact, not timed); the
        # faster interleaved schedule is refused, and the log says so.
        assert engine.schedule == "1f1b" and "none fits" not in choice
        assert "> budget 9.7 KiB; interleaved" in choice and "KiB > budget 9.7 KiB; zb-h1" \
            in choice
    losses = [engine.train_step(x, y) for x, y in data]
    reference, ref_losses = train_reference(layers, data)
    assert allgather(comm, losses) == [losses] * comm.size
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    full = engine.gather_state_dict()
    if comm.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    # It runs the schedule it chose: the stash is that schedule's simulated one.
    chunks = 2 if engine.schedule in ("interleaved", "zbv") else 1
    expected = simulate(build_schedule(engine.schedule, stages, microbatches, chunks))
    assert engine.stats.peak_stash == expected.peak_stash[engine.stage.index]
    assert len(engine.plan.boundaries) == stages * chunks + 1
    engine.close()
    comm.Free()
