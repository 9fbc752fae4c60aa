"""Recomputation in the engine: bit-identical training with dropout, and the memory it saves."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.train.data import Batches, load_corpus
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss
from toy import allgather

WORLD = MPI.COMM_WORLD
CFG = GPTConfig(n_layers=7, d_model=32, n_heads=2, seq_len=16, dropout=0.1)
# Two blocks a stage (the last has one and the head), so the stash depth decides who holds most.
BOUNDS = {1: [0, 9], 2: [0, 5, 9], 4: [0, 3, 5, 7, 9]}


def _train(comm, stages, schedule, recompute, budget_mb=0.0, steps=3):
    torch.manual_seed(1000 + WORLD.rank)     # dropout masks: the same stream for every policy
    engine = pf.Engine(gpt_layers(CFG), gpt_loss,
                       lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
                       pf.Config(pipeline=stages, microbatches=4, schedule=schedule,
                                 partition=BOUNDS[stages * (2 if schedule == "zbv" else 1)],
                                 recompute=recompute, activation_budget_mb=budget_mb),
                       comm=comm, measure_activations=True)
    data = Batches(load_corpus(), 8, CFG.seq_len, seed=0)
    losses = [engine.train_step(*data.batch(i)) for i in range(steps)]
    return engine, losses


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "zbv"])
@pytest.mark.parametrize("recompute", ["full", "every:1", "every:2", "selective",
                                       ["full", "selective"], "auto"],
                         ids=["full", "every1", "every2", "selective", "per-stage", "auto"])
def test_every_policy_trains_bit_for_bit_like_none(schedule, recompute):
    comm = WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)
    base, base_losses = _train(comm, 2, schedule, "none")
    # A budget below what "none" stashes on stage 0, so "auto" must recompute there.
    budget = 0.6 * max(allgather(comm, base.stats.peak_activation_bytes)) / 2**20
    other, losses = _train(comm, 2, schedule, recompute, budget_mb=budget)
    assert losses == base_losses
    for (name, a), (_, b) in zip(base.stage.module.state_dict().items(),
                                 other.stage.module.state_dict().items()):
        assert torch.equal(a, b), name
    if recompute != "none":
        assert other.stats.peak_activation_bytes < base.stats.peak_activation_bytes or \
            other.stage.recompute == "none"
    base.close()
    other.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_auto_fits_a_budget_that_none_exceeds_and_recomputes_most_on_stage_0():
    stages = min(4, WORLD.size)
    comm = WORLD.Split(color=WORLD.rank // stages, key=WORLD.rank)
    none, _ = _train(comm, stages, "1f1b", "none", steps=2)
    held = allgather(comm, none.stats.peak_activation_bytes)
    # 1F1B stashes min(p - s, m) micro-batches: stage 0 holds the most.
    assert held[0] == max(held) and held[0] > held[-1]
    budget = 0.7 * held[0]
    assert held[0] > budget
    auto, _ = _train(comm, stages, "1f1b", "auto", budget_mb=budget / 2**20, steps=2)
    after = allgather(comm, auto.stats.peak_activation_bytes)
    policies = allgather(comm, auto.stage.recompute)
    assert all(a <= budget for a in after), (after, budget, policies)
    saved = [h - a for h, a in zip(held, after)]
    assert saved[0] == max(saved) and saved[0] > 0, (saved, policies)
    assert policies[-1] == "none" or stages == 1
    none.close()
    auto.close()
    comm.Free()
