"""Mismatched calls, mismatched batches, non-finite steps and shapes that change under the
engine: a clear error on every rank, or the right result; never a hang, never garbage."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from torch import nn

import pipeflow as pf
from pipeflow.runtime.optim_step import NonFiniteError

from toy import adamw, batches, loss_fn, pair, toy_layers
from toy import barrier, bcast



def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_eval_on_one_rank_while_another_trains_fails_on_both():
    comm = pair()
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(pipeline=2, microbatches=2),
                       comm=comm)
    x, y = batches(1, 8)[0]
    before = {k: v.clone() for k, v in engine.stage.module.state_dict().items()}
    with pytest.raises(pf.BatchError, match="ranks disagree on the call: rank . is in "
                                            "(train_step|eval_step) of step 0"):
        if comm.rank == 0:
            engine.train_step(x, y)
        else:
            engine.eval_step(x, y)
    # Nobody stepped.
    assert all(torch.equal(before[k], v) for k, v in engine.stage.module.state_dict().items())
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("grid", [(2, 1), (1, 2)], ids=["pipeline", "replicas"])
def test_ranks_a_step_apart_fail_on_both(grid):
    # One rank a step ahead (a train_step of its own earlier, a step count set on one rank):
    # the same call with the same batch shapes, so only the step number tells them apart.
    # Let through, the ranks would pair the wrong steps' micro-batches and data positions.
    comm = pair()
    pipeline, data = grid
    engine = pf.Engine(toy_layers(), loss_fn, adamw,
                       pf.Config(pipeline=pipeline, data=data, microbatches=2), comm=comm)
    x, y = batches(1, 8)[0]
    engine.train_step(x, y)
    if comm.rank == 1:
        engine.stats.step += 1
    before = {k: v.clone() for k, v in engine.stage.module.state_dict().items()}
    with pytest.raises(pf.BatchError, match="ranks disagree on the step number: rank . is in "
                                            "train_step of step [12], rank . in train_step "
                                            "of step [12]"):
        engine.train_step(x, y)
    assert all(torch.equal(before[k], v) for k, v in engine.stage.module.state_dict().items())
    engine.stats.step = 1                  # agreed again: the engine trains on
    assert math.isfinite(engine.train_step(x, y))
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_replicas_given_different_batches_fail_at_once():
    comm = pair()
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(data=2, microbatches=2),
                       comm=comm)
    x, y = batches(1, 8 if comm.rank == 0 else 12)[0]
    with pytest.raises(pf.BatchError, match="ranks were given different inputs"):
        engine.train_step(x, y)
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_local_batches_of_different_sizes_name_the_local_fix():
    """Issue 46 item 14: under batch = "local", replicas giving 2 and 3 rows were told to
    pass the same global batch on every rank (the advice for "global")."""
    comm = pair()
    engine = pf.Engine(toy_layers(), loss_fn, adamw,
                       pf.Config(data=2, microbatches=1, batch="local"), comm=comm)
    x, y = batches(1, 2 if comm.rank == 0 else 3)[0]
    with pytest.raises(pf.BatchError) as info:
        engine.train_step(x, y)
    said = str(info.value)
    assert "replicas were given inputs of different shapes under Config.batch = \"local\"" \
        in said and "(replica 0)" in said and "(replica 1)" in said
    assert "same local batch size" in said and "global batch" not in said
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_an_optimizer_factory_returning_none_is_refused():
    comm = pair()
    with pytest.raises(pf.ConfigError, match="optimizer factory returned NoneType"):
        pf.Engine(toy_layers(), loss_fn, lambda params: None, pf.Config(pipeline=2),
                  comm=comm)
    comm.Free()


class Poison(nn.Module):
    """Passes its input through; turns it into NaN while `Poison.on` is set."""

    on = False

    def forward(self, x):
        h, tokens = x
        return (h * float("nan") if Poison.on else h), tokens


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_non_finite_step_is_skipped_everywhere_then_the_run_stops(precision):
    comm = pair()
    layers = toy_layers()
    layers.insert(1, pf.LayerSpec(Poison))
    config = pf.Config(pipeline=2, microbatches=2, precision=precision, max_nonfinite_steps=2)
    engine = pf.Engine(layers, loss_fn, sgd, config, comm=comm)
    data = batches(5, 8)
    engine.train_step(*data[0])
    before = {k: v.clone() for k, v in engine.stage.module.state_dict().items()}
    Poison.on = True
    try:
        for x, y in data[1:3]:            # two non-finite steps: skipped, weights intact
            assert math.isnan(engine.train_step(x, y))
            assert engine.stats.skipped
        assert all(torch.equal(before[k], v) for k, v in engine.stage.module.state_dict().items())
        assert engine.stats.skipped_steps == 2
        with pytest.raises(NonFiniteError, match="3 steps in a row had a non-finite"):
            engine.train_step(*data[3])
    finally:
        Poison.on = False
    assert math.isfinite(engine.train_step(*data[4]))     # and it recovers
    engine.close()
    comm.Free()


class Switch(nn.Module):
    """Changes its output's dtype (and length) between calls, the batch shape unchanged."""

    mode = "float"

    def forward(self, x):
        h, tokens = x
        if Switch.mode == "double":
            return h.double(), tokens
        if Switch.mode == "trim":
            return h[:, :3], tokens[:, :3]
        return h, tokens


class Back(nn.Module):
    def forward(self, x):
        h, tokens = x
        return h.float(), tokens


def _trimmed_loss(logits, targets):
    return loss_fn(logits, targets[:, :logits.shape[1]])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_outputs_that_change_dtype_or_shape_are_renegotiated_not_misread():
    comm = pair()
    layers = toy_layers(blocks=2)
    layers[2:2] = [pf.LayerSpec(Switch), pf.LayerSpec(Back)]    # Switch ends stage 0
    engine = pf.Engine(layers, _trimmed_loss, adamw,
                       pf.Config(pipeline=2, microbatches=2, partition=[0, 3, 6]), comm=comm)
    reference = pf.build_sequential(layers, 0)
    x, y = batches(1, 8)[0]
    try:
        for mode in ("float", "double", "trim", "float"):
            Switch.mode = mode
            expected = _trimmed_loss(reference(x), y).item()
            assert engine.eval_step(x, y) == pytest.approx(expected, rel=1e-6), mode
    finally:
        Switch.mode = "float"
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_save_on_rank_0_only_fails_on_both_ranks():
    # The DDP habit `if rank == 0: engine.save(d)`: rank 1 goes on to the next step, whose
    # agreement meets rank 0's save; both ranks learn it at once, nothing is written.
    import tempfile
    comm = pair()
    folder = bcast(comm, tempfile.mkdtemp(prefix="pipeflow-rank0-") if comm.rank == 0 else None)
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(pipeline=2, microbatches=2),
                       comm=comm)
    x, y = batches(1, 8)[0]
    engine.train_step(x, y)
    with pytest.raises(pf.BatchError, match="ranks disagree on the call: rank 0 is in save of "
                                            "step 1, rank 1 in train_step of step 1"):
        if comm.rank == 0:
            engine.save(folder)
        else:
            engine.train_step(x, y)
    assert os.listdir(folder) == []
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_call_some_rank_never_makes_names_it_within_agree_s():
    # Rank 1 never calls gather_state_dict: rank 0 gives up after agree_s, naming rank 1
    # (library use without aborts: a CollectiveError, and the engine is spent).
    comm = pair()
    engine = pf.Engine(toy_layers(), loss_fn, adamw,
                       pf.Config(pipeline=2, microbatches=2, agree_s=1.0), comm=comm,
                       abort_on_error=False)
    start = time.monotonic()
    if comm.rank == 0:
        with pytest.raises(pf.CollectiveError, match=r"called gather_state_dict\(\) at step 0; "
                                                     r"rank\(s\) 1 did not within 1 s"):
            engine.gather_state_dict()
        assert time.monotonic() - start < 10
        with pytest.raises(pf.ConfigError, match="on a closed engine"):
            engine.train_step(*batches(1, 8)[0])
    barrier(comm)
