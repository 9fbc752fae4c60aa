"""Auxiliary losses (`pf.add_aux_loss`) from layers on every stage: the pipeline trains and
reports exactly what one process does with the same losses added."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf

from toy import (VOCAB, WIDTH, Block, Embed, Head, assert_same_parameters, batches, loss_fn,
                 sgd, sub_world)

COEF = 0.3
BATCH, STEPS = 16, 3


class AuxBlock(Block):
    """The toy block, adding `COEF x` the mean square of its output (a regulariser)."""

    def forward(self, x):
        h, tokens = super().forward(x)
        pf.add_aux_loss(COEF * (h ** 2).mean())
        return h, tokens


def aux_layers(blocks: int = 6) -> list[pf.LayerSpec]:
    return [pf.LayerSpec(Embed, VOCAB, WIDTH),
            *[pf.LayerSpec(AuxBlock, WIDTH, 16) for _ in range(blocks)],
            pf.LayerSpec(Head, WIDTH, VOCAB)]


def reference(layers, data, optimizer):
    """One process, each whole batch: the main loss plus every layer's auxiliary loss (with
    equal micro-batches, the mean of their means is the whole batch's mean)."""
    model = pf.build_sequential(layers, 0)
    opt = optimizer(list(model.parameters()))
    losses = []
    for x, y in data:
        with pf.collect_aux_losses() as aux:
            out = model(x)
        loss = loss_fn(out, y) + sum(aux)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _cases():
    for pipeline, data in [(2, 1), (2, 2)]:
        if pipeline * data > MPI.COMM_WORLD.size:
            continue
        for schedule, recompute in [("1f1b", "none"), ("zbv", "none"), ("gpipe", "full"),
                                    ("zb-h1", "full")]:
            yield pipeline, data, schedule, recompute


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data,schedule,recompute", list(_cases()))
def test_aux_losses_train_and_report_like_one_process(pipeline, data, schedule, recompute):
    comm = sub_world(pipeline * data)
    layers = aux_layers()
    config = pf.Config(pipeline=pipeline, data=data, microbatches=4, schedule=schedule,
                       recompute=recompute)
    engine = pf.Engine(layers, loss_fn, sgd, config, comm=comm)
    steps = batches(STEPS, BATCH)
    losses = [engine.train_step(x, y) for x, y in steps]
    ref, ref_losses = reference(layers, steps, sgd)
    assert comm.allgather(losses) == [losses] * comm.size
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    full = engine.gather_state_dict()
    if comm.rank == 0:
        assert_same_parameters(full, ref.state_dict(), rtol=1e-5)
    # Without the auxiliary losses the update differs: the test sees them.
    plain = [loss_fn(pf.build_sequential(layers, 0)(x), y).item() for x, y in steps[:1]]
    assert abs(plain[0] - ref_losses[0]) > 1e-3
    engine.close()
    comm.Free()


def test_add_aux_loss_outside_an_engine_is_ignored_and_checks_its_value():
    pf.add_aux_loss(torch.tensor(1.0))          # no sink: ignored
    with pf.collect_aux_losses() as got:
        pf.add_aux_loss(torch.tensor([2.0]))
    assert [float(g) for g in got] == [2.0]
    with pytest.raises(ValueError, match="expects a scalar tensor"):
        pf.add_aux_loss(torch.ones(3))
