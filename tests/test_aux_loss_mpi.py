"""Auxiliary losses (`pf.add_aux_loss`) from layers on every stage: the pipeline trains and
reports exactly what one process does with the same losses added."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf

from toy import (VOCAB, WIDTH, Block, Embed, Head, assert_same_parameters, assert_same_update,
                 batches, loss_fn, sgd, sub_world, update_of)
from toy import allgather

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
    assert allgather(comm, losses) == [losses] * comm.size
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


def _summed(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             reduction="sum")


# Tolerance on the update against one process in fp32: fp32's arithmetic differs only in
# order; bf16 and fp16 weights and activations round at 2^-8 and 2^-11.
_RTOL = {"fp32": 1e-5, "bf16": 0.05, "fp16": 0.02}


@pytest.mark.parametrize("counted", [False, True], ids=["mean", "count_items"])
@pytest.mark.parametrize("precision", list(_RTOL))
def test_aux_losses_weigh_alike_under_every_precision_and_loss_normalisation(precision,
                                                                             counted):
    # The auxiliary loss is a per-micro-batch mean weighted 1/(m x d), whatever the main
    # loss's normalisation (count_items divides the summed main loss by the items, not the
    # auxiliary loss), and under fp16 it is multiplied by the loss scale with the main loss
    # (then unscaled with every gradient). Plain SGD: the update is the gradient, so an
    # auxiliary gradient weighted 1/items (here 1/80 for 1/2) or left unscaled (1/1024 after
    # the unscale) shows as a smaller update of every block.
    layers = aux_layers(blocks=2)
    x, y = batches(1, BATCH)[0]
    start = pf.build_sequential(layers, 0).state_dict()
    ref, _ = reference(layers, [(x, y)], sgd)
    expected = {k: v - start[k] for k, v in ref.state_dict().items()}
    plain = pf.build_sequential(layers, 0)
    loss_fn(plain(x), y).backward()
    without = {k: -0.5 * p.grad for k, p in plain.named_parameters()}
    engine = pf.Engine(layers, _summed if counted else loss_fn, sgd,
                       pf.Config(microbatches=2, precision=precision, initial_loss_scale=1024.0),
                       count_items=(lambda t: t.numel()) if counted else None)
    update = update_of(engine, x, y)
    assert engine.stats.skipped_steps == 0
    engine.close()
    aux_part = max(((expected[k] - without[k]).norm() / expected[k].norm()).item()
                   for k in update)
    assert aux_part > 5 * _RTOL[precision], "the auxiliary gradient is too small to see"
    assert_same_update(update, expected, rtol=_RTOL[precision])
