"""The engine's single-rank path, config and checkpoints: plain pytest, no mpirun."""

import os
import re

import pytest
import torch

import pipeflow as pf
from pipeflow.runtime.checkpoint import CheckpointError
from pipeflow.schedules import names

from toy import (adamw, assert_same_parameters, batches, loss_fn, sgd, toy_layers,
                 train_reference)


@pytest.mark.parametrize("optimizer", [adamw, sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_one_stage_trains_like_build_sequential(microbatches, schedule, optimizer):
    # Plain SGD's update is the gradient: a micro-batch loss scaled wrong shows there.
    layers = toy_layers()
    engine = pf.Engine(layers, loss_fn, optimizer,
                       pf.Config(microbatches=microbatches, schedule=schedule))
    data = batches(3, 8)
    losses = [engine.train_step(x, y) for x, y in data]
    reference, ref_losses = train_reference(layers, data, optimizer=optimizer)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_parameters(engine.gather_state_dict(), reference.state_dict())
    # One stage: 1F1B runs each backward right after its forward; GPipe holds them all.
    assert engine.stats.peak_stash == (1 if schedule == "1f1b" else microbatches)
    engine.close()


def test_build_sequential_is_seeded_per_layer():
    layers = toy_layers()
    a, b = pf.build_sequential(layers, 0), pf.build_sequential(layers, 0)
    c = pf.build_sequential(layers, 1)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["1.up.weight"], c.state_dict()["1.up.weight"])
    # Layer i's weights do not depend on the layers before it.
    shorter = pf.build_sequential(layers[:3], 0)
    assert torch.equal(shorter.state_dict()["2.up.weight"], a.state_dict()["2.up.weight"])
    with pytest.raises(TypeError, match="layer 1 is a Linear, expected a pipeflow.LayerSpec"):
        pf.build_sequential([layers[0], torch.nn.Linear(2, 2)])


def test_config_round_trips_through_toml(tmp_path):
    config = pf.Config(pipeline=2, microbatches=8, schedule="gpipe", partition=[0, 2, 7],
                       clip=1.0, seed=3, shard_optimizer=True)
    config.save(tmp_path / "c.toml")
    assert pf.Config.load(tmp_path / "c.toml") == config
    assert "[engine]" in (tmp_path / "c.toml").read_text()
    assert "shard_optimizer = true" in (tmp_path / "c.toml").read_text()
    assert pf.Config().shard_optimizer is False


def test_shard_optimizer_on_one_replica_trains_as_unsharded():
    # d = 1: nothing to shard; the flag changes nothing, and the memory report says so.
    layers = toy_layers()
    engine = pf.Engine(layers, loss_fn, sgd, pf.Config(shard_optimizer=True))
    assert engine.stage.shards is None
    for x, y in batches(2, 6):
        engine.train_step(x, y)
    reference, _ = train_reference(layers, batches(2, 6), optimizer=sgd)
    assert_same_parameters(engine.gather_state_dict(), reference.state_dict())
    report = engine.memory_report()
    assert report["sharded"] is False and report["masters"] == 0
    assert report["bytes_per_parameter"]["gradients"] == pytest.approx(4.0)
    engine.close()


@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline=0), "Config.pipeline must be a positive integer, found 0"),
    (dict(shard_optimizer="yes"), "Config.shard_optimizer must be true or false, found 'yes'"),
    (dict(schedule="zigzag"), re.escape(f"Config.schedule must be one of "
                                        f"{[*names(), 'auto']}, found 'zigzag'")),
    (dict(schedule="interleaved"), "set virtual_stages >= 2"),
    (dict(schedule="interleaved", virtual_stages=2, pipeline=2, microbatches=3),
     "microbatches must be a multiple of 2, found 3"),
    (dict(virtual_stages=2),
     "'1f1b' runs exactly 1 model chunk per rank, found virtual_stages = 2"),
    (dict(precision="fp8"), "Config.precision must be one of \\['fp32', 'bf16', 'fp16'\\], "
                            "found 'fp8'"),
    (dict(loss_scale_backoff=2.0), "0 < loss_scale_backoff < 1"),
    (dict(partition="magic"), "Config.partition must be one of"),
    (dict(clip=-1.0), "Config.clip must be a norm >= 0"),
    # CUDA graphs replay into static buffers: stashed and in-flight outputs would be overwritten
    (dict(compile="cudagraphs"), "'cudagraphs' replays CUDA graphs.*stashed"),
    (dict(compile="reduce-overhead"), "'reduce-overhead' replays CUDA graphs"),
])
def test_bad_config_values_are_clear_errors(kwargs, message):
    with pytest.raises(pf.ConfigError, match=message):
        pf.Config(**kwargs)
    with pytest.raises(pf.ConfigError, match="unknown engine setting\\(s\\) \\['stages'\\]"):
        pf.Config.from_dict({"stages": 2})


@pytest.mark.parametrize("optimizer", [adamw, sgd], ids=["adamw", "sgd"])
def test_save_and_load_resume_training_exactly(tmp_path, optimizer):
    layers = toy_layers()
    data = batches(4, 8)
    engine = pf.Engine(layers, loss_fn, optimizer, pf.Config(microbatches=2))
    for x, y in data[:2]:
        engine.train_step(x, y)
    folder = engine.save(tmp_path)
    assert os.path.basename(folder) == "step-00000002"
    assert (tmp_path / "latest").read_text() == "step-00000002"
    # Resumed with another micro-batch count: the gradient's scale changes with it.
    resumed = pf.Engine(layers, loss_fn, optimizer, pf.Config(microbatches=4))
    resumed.load(tmp_path)
    for x, y in data[2:]:
        resumed.train_step(x, y)
    reference, _ = train_reference(layers, data, optimizer=optimizer)
    assert_same_parameters(resumed.gather_state_dict(), reference.state_dict())
    engine.close()
    resumed.close()


def _adamw_groups(params):
    # Two groups, as users build them: no weight decay on biases and norms.
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                              {"params": [p for p in params if p.dim() <= 1],
                               "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)


def _sgd_groups(params):
    return torch.optim.SGD([{"params": [p for p in params if p.dim() > 1]},
                            {"params": [p for p in params if p.dim() <= 1], "lr": 0.1}],
                           lr=0.3, momentum=0.9)


# Settings changed after the optimizer was built (by a scheduler, or by hand), per group.
_CHANGED = {
    "adamw": (_adamw_groups, [dict(lr=3e-3, weight_decay=0.05, betas=(0.8, 0.95), eps=1e-6),
                              dict(lr=2e-2, betas=(0.5, 0.9), weight_decay=0.01)]),
    "sgd": (_sgd_groups, [dict(lr=0.05, momentum=0.5, weight_decay=1e-3),
                          dict(lr=0.2, momentum=0.7, dampening=0.1)]),
}


@pytest.mark.parametrize("name", list(_CHANGED))
def test_resume_keeps_changed_param_group_settings(tmp_path, name):
    factory, changes = _CHANGED[name]
    layers = toy_layers()
    data = batches(4, 8)
    engine = pf.Engine(layers, loss_fn, factory, pf.Config(microbatches=2))
    engine.train_step(*data[0])
    for group, change in zip(engine.stage.optimizer.param_groups, changes):
        group.update(change)
    engine.train_step(*data[1])
    engine.save(tmp_path)
    resumed = pf.Engine(layers, loss_fn, factory, pf.Config(microbatches=2))
    resumed.load(tmp_path)
    for i, (a, b) in enumerate(zip(engine.stage.optimizer.param_groups,
                                   resumed.stage.optimizer.param_groups)):
        saved = {k: v for k, v in a.items() if k != "params"}
        loaded = {k: v for k, v in b.items() if k != "params"}
        assert loaded == saved, f"param group {i}: saved {saved}, loaded {loaded}"
    # And the steps after the resume are those of the run that never stopped.
    for x, y in data[2:]:
        assert resumed.train_step(x, y) == engine.train_step(x, y)
    for (n, a), (_, b) in zip(engine.named_master_parameters(),
                              resumed.named_master_parameters()):
        assert torch.equal(a, b), n
    engine.close()
    resumed.close()


def test_an_interrupted_save_leaves_the_last_whole_checkpoint(tmp_path):
    layers = toy_layers()
    engine = pf.Engine(layers, loss_fn, adamw, pf.Config())
    engine.train_step(*batches(1, 4)[0])
    engine.save(tmp_path)
    saved = {k: v.clone() for k, v in engine.stage.module.state_dict().items()}
    # A later save that died before its engine.json: shards only, `latest` not moved.
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / "layer-00000.pt").write_bytes(b"half")
    engine.train_step(*batches(1, 4, seed=2)[0])
    engine.load(tmp_path)
    assert engine.stats.step == 1
    assert all(torch.equal(saved[k], v) for k, v in engine.stage.module.state_dict().items())
    with pytest.raises(CheckpointError, match="no checkpoint in .*expected a 'latest' file"):
        engine.load(tmp_path / "step-00000009")
    assert not list(tmp_path.rglob("*.tmp"))
    engine.close()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config())
    engine.save(tmp_path)
    other = pf.Engine(toy_layers(blocks=2), loss_fn, adamw, pf.Config())
    with pytest.raises(CheckpointError, match="holds 7 layers, the model has 4"):
        other.load(tmp_path)
    engine.close()
    other.close()


def test_single_rank_failure_raises_with_the_instruction():
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("broken layer")

    engine = pf.Engine(toy_layers() + [pf.LayerSpec(Broken)], loss_fn, adamw, pf.Config())
    with pytest.raises(RuntimeError, match="rank 0 \\(stage 0 of 1.*instruction F0 of step 0: "
                                           "broken layer"):
        engine.train_step(*batches(1, 4)[0])
    engine.close()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_the_summed_loss_check_looks_at_one_row_and_still_tells_a_mean(reduction):
    # The first step checks that a loss under count_items is a sum. It evaluated the loss on
    # the whole micro-batch concatenated with itself: logits of twice the micro-batch, so
    # step 1's peak memory (an LM's logits are the largest activation) exceeded every other's.
    rows_seen = []

    def loss(logits, targets):
        rows_seen.append(logits.shape[0])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 reduction=reduction)

    engine = pf.Engine(toy_layers(), loss, sgd, pf.Config(microbatches=2),
                       count_items=lambda t: t.numel())
    x, y = batches(1, 8)[0]
    if reduction == "mean":
        with pytest.raises(pf.ConfigError, match="does not grow with the items"):
            engine.train_step(x, y)
    else:
        engine.train_step(x, y)
        engine.train_step(x, y)                          # checked once: the first step
        assert sorted(rows_seen) == [1, 2] + [4] * 4, rows_seen
    assert max(rows_seen) == 4                           # never more than a micro-batch
    engine.close()


def test_deterministic_kernels_can_be_asked_for_a_whole_job(monkeypatch):
    # The GPU scripts' bit-for-bit claims (resume, recompute) need deterministic kernels in
    # every engine the tests build, without editing each test's Config.
    monkeypatch.setenv("PIPEFLOW_DETERMINISTIC", "1")
    assert pf.Config().deterministic is True
    monkeypatch.setenv("PIPEFLOW_DETERMINISTIC", "0")
    assert pf.Config().deterministic is False
    monkeypatch.setenv("PIPEFLOW_DETERMINISTIC", "maybe")
    with pytest.raises(pf.ConfigError, match="PIPEFLOW_DETERMINISTIC must be 1 or 0"):
        pf.Config()


@pytest.mark.parametrize("call", ["train_step", "eval_step"])
def test_a_batch_of_sequence_length_0_is_refused_not_nan(call):
    """Issue 46 item 4: `train_step` on a batch of sequence length 0 returned nan and raised
    nothing (a mean over no positions)."""
    engine = pf.Engine(toy_layers(), loss_fn, sgd, pf.Config(microbatches=2))
    x, y = torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, 0, dtype=torch.long)
    before = {k: v.clone() for k, v in engine.stage.module.state_dict().items()}
    with pytest.raises(pf.BatchError, match=r"inputs has a tensor of shape \(4, 0\): an empty "
                                            r"dimension after the batch's .*pass at least one "
                                            r"position"):
        getattr(engine, call)(x, y)
    assert all(torch.equal(before[k], v) for k, v in engine.stage.module.state_dict().items())
    x, y = batches(1, 4)[0]
    assert torch.isfinite(torch.tensor(engine.train_step(x, y)))      # and trains on after it
    engine.close()
