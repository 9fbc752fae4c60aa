"""One order of collectives on every replica, whatever gradients arrived.

A bucket's gradients are final on one replica and not on another when a parameter gets no
gradient in the step's last backward there: here an expert no sample of that replica was
routed to (a mixture of experts in miniature), on every micro-batch. Launched in the order
gradients arrive, the same collective index would name different buckets on the two replicas;
two experts of one shape make buckets of one size, so MPI would sum expert 0 of one replica
with expert 1 of the other without an error. Buckets launch in index order instead: the grid
trains like one process, plain and sharded, and a real MoE family too.

Run under `mpirun -n 2` (1x2) and `-n 4` (1x4, 2x2).
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import pipeflow as pf

from toy import (SEQ, VOCAB, WIDTH, Block, Embed, Head, assert_same_parameters, loss_fn,
                 sgd_momentum, train_reference)
from toy import allgather

WORLD = MPI.COMM_WORLD
BATCH, M = 16, 2
GRIDS = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}.get(WORLD.size, [])


class TwoExperts(nn.Module):
    """Each sample goes to one of two experts of equal shape, by its first token; an expert
    no sample of a micro-batch was routed to takes no part in it (no gradient at all)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])

    def forward(self, x):
        h, tokens = x
        route = (tokens[:, 0] >= VOCAB // 2).long()
        out = h
        for e, expert in enumerate(self.experts):
            rows = route == e
            if bool(rows.any()):
                out = out.index_add(0, rows.nonzero().flatten(),
                                    torch.tanh(expert(h[rows])))
        return out, tokens


def expert_layers() -> list[pf.LayerSpec]:
    return [pf.LayerSpec(Embed, VOCAB, WIDTH), pf.LayerSpec(TwoExperts, WIDTH),
            pf.LayerSpec(TwoExperts, WIDTH), pf.LayerSpec(Block, WIDTH, 8),
            pf.LayerSpec(TwoExperts, WIDTH), pf.LayerSpec(TwoExperts, WIDTH),
            pf.LayerSpec(Head, WIDTH, VOCAB)]


def routed_batches(steps: int, data: int):
    """Replica r's rows all go to expert r % 2, on every micro-batch of every step."""
    gen = torch.Generator().manual_seed(3)
    out = []
    shard = BATCH // data
    for _ in range(steps):
        x = torch.randint(0, VOCAB // 2, (BATCH, SEQ), generator=gen)
        for r in range(data):
            x[r * shard:(r + 1) * shard, 0] += (r % 2) * (VOCAB // 2)
        out.append((x, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)))
    return out


def _cases():
    for pipeline, data in GRIDS:
        for schedule in ("1f1b", "zb-h1") + (("zbv",) if pipeline > 1 else ()):
            for shard in (False, True):
                yield pipeline, data, schedule, shard


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline,data,schedule,shard", list(_cases()))
def test_replicas_with_different_unrouted_experts_train_like_one_process(pipeline, data,
                                                                          schedule, shard):
    layers = expert_layers()
    config = pf.Config(pipeline=pipeline, data=data, microbatches=M, schedule=schedule,
                       bucket_mb=1e-4, shard_optimizer=shard)   # about a bucket a tensor
    engine = pf.Engine(layers, loss_fn, sgd_momentum, config)
    reducer = engine.stage.shards if shard else engine.stage.reducer
    sizes = [b.flat.numel() for b in reducer.buckets]
    assert any(allgather(WORLD, len(sizes) > len(set(sizes)))), \
        "no rank has two buckets of one size: nothing to confuse"
    steps = routed_batches(2, data)
    losses = [engine.train_step(x, y) for x, y in steps]
    reference, ref_losses = train_reference(layers, steps, optimizer=sgd_momentum)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # The launches happened in index order on every replica.
    assert [i for _, i in reducer.events] == sorted(i for _, i in reducer.events)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    engine.close()


def _sgd_decay(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9, weight_decay=0.1)


def _adamw_decay(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _one_expert_first(data: int):
    """Step 1: every sample of every replica to expert 0 (expert 1 has no gradient anywhere,
    so torch.optim skips it: no weight decay, no momentum); step 2: replica r to r % 2; step
    3: every sample to expert 0 again. A parameter is skipped in a step where it got no
    gradient, whatever it got in the steps before: expert 1, used in step 2, keeps its
    weights through step 3 (its momentum and weight decay wait for its next gradient)."""
    first, second, third = routed_batches(3, data)
    for x, _ in (first, third):
        x[:, 0] %= VOCAB // 2
    return [first, second, third]


def _optimizer_cases():
    for pipeline, data in GRIDS:
        for shard in (False, True):
            for name in ("sgd-decay",) + (() if shard else ("adamw",)):
                yield pipeline, data, shard, name


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline,data,shard,optimizer", list(_optimizer_cases()))
@pytest.mark.parametrize("user_zero_grad", [False, True], ids=["", "user-zero-grad"])
def test_a_parameter_without_gradient_is_skipped_as_torch_optim_skips_it(
        pipeline, data, shard, optimizer, user_zero_grad):
    # And the plain loop's habit, `optimizer.zero_grad()` on the optimizer the engine built,
    # changes nothing (it dropped the buckets' views: replicas drifted apart, or, sharded, an
    # AttributeError inside backward). Sharded AdamW is left out: its step count is the
    # block's (see ShardedOptimizer._untouched_elements).
    make = _sgd_decay if optimizer == "sgd-decay" else _adamw_decay
    layers = expert_layers()
    config = pf.Config(pipeline=pipeline, data=data, microbatches=M, bucket_mb=1e-4,
                       shard_optimizer=shard)
    engine = pf.Engine(layers, loss_fn, make, config)
    steps = _one_expert_first(data)
    losses = []
    for x, y in steps:
        losses.append(engine.train_step(x, y))
        if user_zero_grad:
            engine.stage.optimizer.zero_grad()
    reference, ref_losses = train_reference(layers, steps, optimizer=make)
    full = engine.gather_state_dict()
    local = engine.stage.module.state_dict()
    everyone = allgather(WORLD, local)
    engine.close()
    for other in everyone:                        # the replicas agree
        for k, v in other.items():
            if k in local:
                assert torch.equal(v, local[k]), k
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    if WORLD.rank == 0:
        assert_same_parameters(full, reference.state_dict())


transformers = pytest.importorskip(
    "transformers", reason="pipeflow.models.hf needs transformers: pip install -e '.[hf]'")
from pipeflow.models import hf  # noqa: E402

MOE_SCHEDULES = [s for s in ("1f1b", "zbv") if WORLD.size >= 4 or s == "1f1b"]


def _train_mixtral(cfg, start, data, lr):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.load_state_dict(hf.to_hf_state_dict(start, cfg))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for ids in data:
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    return model.state_dict()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", MOE_SCHEDULES)
@pytest.mark.parametrize("shard", [False, True], ids=["plain", "sharded"])
def test_mixtral_with_two_replicas_and_small_buckets_trains_like_transformers(schedule, shard):
    # Two replicas (and two stages on four ranks, where ZBV runs), a bucket about every
    # tensor: each replica's tokens reach its own experts.
    pipeline = WORLD.size // 2
    cfg = transformers.MixtralConfig(num_hidden_layers=2 * pipeline, hidden_size=16,
                                     intermediate_size=32, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=64,
                                     max_position_embeddings=8, num_local_experts=4,
                                     num_experts_per_tok=1)
    layers = hf.causal_lm_layers(cfg)
    config = pf.Config(pipeline=pipeline, data=2, microbatches=2, schedule=schedule,
                       bucket_mb=1e-4, shard_optimizer=shard)
    engine = pf.Engine(layers, hf.causal_lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.5),
                       config)
    gen = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 64, (8, 8), generator=gen) for _ in range(2)]
    start = pf.build_sequential(layers, seed=config.seed).state_dict()
    for ids in data:
        engine.train_step(ids, ids)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        expected = _train_mixtral(cfg, start, data, 0.5)
        trained = hf.to_hf_state_dict(full, cfg)
        for key, value in expected.items():
            diff = (trained[key] - value).norm() / value.norm().clamp(min=1e-12)
            assert diff < 1e-5, (key, float(diff))
    engine.close()
