"""Mixed precision across ranks: agreed overflow skips, loss curves, bytes on the wire."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import pipeflow as pf
from pipeflow.train.data import Batches, load_corpus
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss

from toy import (adamw, assert_same_update, batches, loss_fn, sgd, toy_layers, train_reference,
                 update_of)
from toy import allgather

WORLD = MPI.COMM_WORLD
ARMED = {"on": False}


class _Poison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf") if ARMED["on"] else grad


class Injector(nn.Module):
    """Identity forward; an infinite gradient in backward while armed on this rank."""

    def forward(self, x):
        h, tokens = x
        return _Poison.apply(h), tokens


@pytest.mark.mpi(min_size=2)
def test_overflow_on_one_stage_of_one_replica_skips_the_step_everywhere():
    data = 2 if WORLD.size == 4 else 1
    pipeline = WORLD.size // data
    layers = toy_layers()
    layers.insert(1, pf.LayerSpec(Injector))           # on stage 0
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=pipeline, data=data, microbatches=2, precision="fp16",
                                 initial_loss_scale=1024.0, loss_scale_interval=2))
    target = engine.stage.topo.rank_of(stage=0, replica=data - 1)
    steps = batches(4, 8)
    engine.train_step(*steps[0])                        # a good step
    assert engine.loss_scale == 1024.0
    before = [m.detach().clone() for m in engine.stage.precision.masters]
    ARMED["on"] = WORLD.rank == target
    engine.train_step(*steps[1])                        # overflow on one rank only
    ARMED["on"] = False
    # Skipped everywhere: no parameter moved on any rank, the scale halved on every rank.
    assert all(torch.equal(b, m) for b, m in zip(before, engine.stage.precision.masters))
    assert allgather(WORLD, (engine.loss_scale, engine.stats.skipped_steps)) == \
        [(512.0, 1)] * WORLD.size
    # Training continues, and after `loss_scale_interval` good steps the scale grows back.
    engine.train_step(*steps[2])
    assert not all(torch.equal(b, m) for b, m in zip(before, engine.stage.precision.masters))
    assert engine.loss_scale == 512.0
    engine.train_step(*steps[3])
    assert allgather(WORLD, engine.loss_scale) == [1024.0] * WORLD.size
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_fp16_sgd_update_on_the_grid_at_a_large_loss_scale_is_the_fp32_update(schedule):
    # Plain SGD's update is the gradient itself: a loss scale not applied, or not undone,
    # before the tied-weight sum or the replicas' all-reduce changes its size 1024-fold.
    # Under split backward the weight gradients (and the fp32 masters' accumulation) come
    # later, in W.
    data = 2 if WORLD.size == 4 else 1
    layers = toy_layers(tied=True)
    engine = pf.Engine(layers, loss_fn, sgd,
                       pf.Config(pipeline=WORLD.size // data, data=data, microbatches=2,
                                 schedule=schedule, virtual_stages=2 if schedule == "zbv" else 1,
                                 precision="fp16", initial_loss_scale=1024.0))
    x, y = batches(1, 16)[0]
    update = update_of(engine, x, y)
    assert engine.stats.skipped_steps == 0
    before = pf.build_sequential(layers, 0).state_dict()
    after = train_reference(layers, [(x, y)], optimizer=sgd)[0].state_dict()
    assert_same_update(update, {k: after[k] - before[k] for k in before}, rtol=0.02)
    engine.close()


def _sub_world(stages: int) -> MPI.Comm:
    return WORLD.Split(color=WORLD.rank // stages, key=WORLD.rank)


def _gpt_run(precision: str, comm: MPI.Comm, steps: int):
    cfg = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
    engine = pf.Engine(gpt_layers(cfg), gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                       pf.Config(pipeline=2, microbatches=4, precision=precision,
                                 initial_loss_scale=2.0 ** 12), comm=comm)
    data = Batches(load_corpus(), 8, cfg.seq_len, seed=0)
    losses = [engine.train_step(*data.batch(i)) for i in range(steps)]
    sent = sum(allgather(comm, engine.stage.pipe_comm.bytes_sent))
    engine.close()
    return losses, sent


@pytest.mark.mpi(min_size=2)
def test_bf16_and_fp16_follow_the_fp32_loss_curve_with_half_the_bytes():
    comm = _sub_world(2)
    steps = 20
    fp32, sent32 = _gpt_run("fp32", comm, steps)
    for precision in ("bf16", "fp16"):
        low, sent = _gpt_run(precision, comm, steps)
        # Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2% per
        # operation), fp16 11; summed over a few layers and steps the loss may drift by a few
        # tenths of a percent per step, never by the 40% the loss falls over the run. 3% of the
        # loss at every step is tight enough to catch a wrong scale, a missed unscale or
        # stale working weights (each of which moves the curve by far more).
        for a, b in zip(fp32, low):
            assert abs(a - b) <= 0.03 * a, (precision, fp32, low)
        assert low[-1] < 0.8 * low[0]
        # Activations and their gradients cross stages in the working dtype: half the bytes.
        assert sent * 2 == sent32, (precision, sent, sent32)
    comm.Free()
