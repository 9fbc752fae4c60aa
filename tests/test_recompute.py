"""Recomputation: bit-for-bit gradients under every policy, the saved-tensor meter, auto."""

import pytest
import torch
from torch import nn

import pipeflow as pf
from pipeflow import build_sequential
from pipeflow.config import ConfigError
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss
from pipeflow.config import parse_policy
from pipeflow.runtime.recompute import (SavedTensorMeter, choose_auto, estimate_stash_bytes,
                                measure_layers, stage_forward)
from pipeflow.schedules import BACKWARD, FORWARD
from pipeflow.schedules.one_f_one_b import one_f_one_b

POLICIES = ["full", "every:1", "every:2", "every:3", "selective"]
CFG = GPTConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16, dropout=0.1)


@pytest.fixture(scope="module")
def layers() -> list[nn.Module]:
    """Embedding, 4 blocks, head: in training mode, with dropout everywhere."""
    return list(build_sequential(gpt_layers(CFG), seed=0).train())


def tokens(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len),
                         generator=torch.Generator().manual_seed(seed))


def hidden(batch: int = 2, seed: int = 0) -> torch.Tensor:
    """A received activation: a leaf that needs its gradient, as the engine makes it."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, CFG.seq_len, CFG.d_model, generator=gen).requires_grad_(True)


def grads(layers) -> list[torch.Tensor]:
    return [p.grad.clone() for layer in layers for p in layer.parameters()]


def zero(layers) -> None:
    for layer in layers:
        layer.zero_grad(set_to_none=True)


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# -- bit-for-bit against `none` ---------------------------------------------------------

def whole_model_step(layers, policy):
    zero(layers)
    torch.manual_seed(1234)
    ids = tokens()
    out = stage_forward(layers, ids, policy)
    gpt_loss(out, torch.roll(ids, -1, dims=1)).backward()
    return out.detach(), grads(layers), torch.get_rng_state()


@pytest.mark.parametrize("policy", POLICIES)
def test_whole_gpt_with_dropout_matches_none_bit_for_bit(layers, policy):
    out, g, rng = whole_model_step(layers, "none")
    out_p, g_p, rng_p = whole_model_step(layers, policy)
    assert torch.equal(out, out_p)
    assert_same(g, g_p)
    # The recomputation replays the random state and then restores it: the next micro-batch
    # draws the same dropout masks as without recomputation.
    assert torch.equal(rng, rng_p)


def middle_stage_step(blocks, policy):
    zero(blocks)
    x = hidden()
    torch.manual_seed(99)
    out = stage_forward(blocks, x, policy)
    out.backward(torch.ones_like(out))
    return out.detach(), grads(blocks), x.grad


@pytest.mark.parametrize("policy", POLICIES)
def test_leaf_stage_input_gets_the_same_gradient(layers, policy):
    blocks = layers[1:5]
    out, g, gx = middle_stage_step(blocks, "none")
    out_p, g_p, gx_p = middle_stage_step(blocks, policy)
    assert gx_p is not None and gx_p.abs().sum() > 0
    assert torch.equal(gx, gx_p)
    assert torch.equal(out, out_p)
    assert_same(g, g_p)


def one_f_one_b_stage(blocks, policy, stages=3, microbatches=5):
    """Stage 0's compute order under 1F1B: recomputations run after later forwards."""
    zero(blocks)
    torch.manual_seed(7)
    stash, input_grads = {}, {}
    meter = SavedTensorMeter()
    for act in one_f_one_b(0, stages, microbatches):
        if act.op == FORWARD:
            x = hidden(seed=act.mb)
            with meter:
                stash[act.mb] = (x, stage_forward(blocks, x, policy))
        elif act.op == BACKWARD:
            x, out = stash.pop(act.mb)
            out.backward(torch.full_like(out, 0.5))
            input_grads[act.mb] = x.grad
    return grads(blocks), [input_grads[i] for i in range(microbatches)], meter


@pytest.mark.parametrize("policy", POLICIES)
def test_interleaved_1f1b_micro_batches_match_none(layers, policy):
    g, gx, meter = one_f_one_b_stage(layers[1:5], "none")
    g_p, gx_p, meter_p = one_f_one_b_stage(layers[1:5], policy)
    assert_same(g, g_p)
    assert_same(gx, gx_p)
    assert meter.current == meter_p.current == 0
    assert meter_p.peak < meter.peak


class Mix(nn.Module):
    """A layer whose activation is a tuple (hidden states, token ids) with dropout."""

    def __init__(self, d: int = 8, vocab: int = 11) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.emb = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, ids = x
        return self.drop(torch.tanh(self.lin(h)) + self.emb(ids)), ids


def tuple_stage_step(mixes, policy):
    zero(mixes)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(4, 5, 8, generator=gen).requires_grad_(True)
    ids = torch.randint(0, 11, (4, 5), generator=gen)
    torch.manual_seed(5)
    out, ids_out = stage_forward(mixes, (h, ids), policy)
    assert torch.equal(ids_out, ids)
    out.pow(2).sum().backward()
    return out.detach(), grads(mixes), h.grad


@pytest.mark.parametrize("policy", POLICIES)
def test_tuple_activation_with_integer_tensor(policy):
    torch.manual_seed(0)
    mixes = [Mix() for _ in range(3)]
    out, g, gh = tuple_stage_step(mixes, "none")
    out_p, g_p, gh_p = tuple_stage_step(mixes, policy)
    assert torch.equal(out, out_p)
    assert_same(g, g_p)
    assert torch.equal(gh, gh_p)


def test_checkpointed_tuple_activation_is_counted_and_freed():
    torch.manual_seed(0)
    mixes = [Mix() for _ in range(2)]
    h = torch.randn(4, 5, 8, requires_grad=True)
    ids = torch.randint(0, 11, (4, 5))
    meter = SavedTensorMeter()
    with meter:
        out, _ = stage_forward(mixes, (h, ids), "full")
    # The checkpoint keeps both members of the tuple for its recomputation, nothing else.
    assert meter.current == h.numel() * 4 + ids.numel() * 8
    out.sum().backward()
    assert meter.current == 0


@pytest.mark.parametrize("policy", ["none", *POLICIES])
def test_no_grad_forward_is_plain(layers, policy):
    torch.manual_seed(0)
    with torch.no_grad():
        ref = stage_forward(layers, tokens(), "none")
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch.equal(stage_forward(layers, tokens(), policy), ref)


def test_selective_leaves_the_modules_as_they_were(layers):
    core = layers[1].core
    assert type(core).pipeflow_selective is True
    stage_forward(layers[1:3], hidden(), "selective")
    assert "forward" not in core.__dict__

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        stage_forward([layers[1], Boom()], hidden(), "selective")
    assert "forward" not in core.__dict__


def test_auto_must_be_resolved_before_running(layers):
    with pytest.raises(ConfigError, match="resolved"):
        stage_forward(layers[1:3], hidden(), "auto")


# -- the meter --------------------------------------------------------------------------

def test_meter_counts_views_of_one_storage_once_and_releases_after_backward():
    a = torch.randn(1000, requires_grad=True)
    meter = SavedTensorMeter()
    with meter:
        b = a * 2                               # saves nothing for a constant factor
        y = (b[:500] * b[500:]).sum()           # saves two views of b's storage
        z = (b.view(10, 100) * b.view(10, 100)).sum()
    assert meter.storages == 1
    assert meter.current == meter.peak == 1000 * 4
    (y + z).backward()
    assert meter.current == 0 and meter.storages == 0
    assert meter.peak == 4000
    meter.reset_peak()
    assert meter.peak == 0


def test_meter_counts_across_entries_and_leaves_out_parameters():
    lin = nn.Linear(64, 64)
    meter = SavedTensorMeter()
    outs = []
    for i in range(3):
        x = torch.randn(8, 64, requires_grad=True)
        with meter:                              # one entry per micro-batch forward
            outs.append(lin(x))
        assert meter.current == (i + 1) * 8 * 64 * 4    # the inputs; not the weight
    for out in outs:
        out.sum().backward()
    assert meter.current == 0 and meter.peak == 3 * 8 * 64 * 4
    # Outside the meter nothing is counted.
    lin(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert meter.peak == 3 * 8 * 64 * 4


def stash_bytes(blocks, policy, depth=2):
    meter = SavedTensorMeter()
    kept = []
    for mb in range(depth):
        with meter:
            kept.append(stage_forward(blocks, hidden(seed=mb), policy))
    peak = meter.peak
    for out in kept:
        out.sum().backward()
    assert meter.current == 0
    return peak


def test_meter_falls_with_recomputation_on_the_gpt(layers):
    blocks = layers[1:5]
    got = {p: stash_bytes(blocks, p) for p in ["none", *POLICIES]}
    assert got["full"] < got["every:2"] < got["none"]
    assert got["every:1"] > got["every:2"] >= got["every:3"] > got["full"]
    assert got["selective"] < got["none"]
    # The estimate's held part is what the meter sees over a stash of 2 micro-batches.
    b = measure_layers(blocks, hidden())
    for policy, measured in got.items():
        held = (estimate_stash_bytes(policy, b.saved, b.selective, b.boundary, 2)
                - estimate_stash_bytes(policy, b.saved, b.selective, b.boundary, 1))
        assert measured == 2 * held, policy


def test_the_loss_tail_is_kept_under_every_policy(layers):
    ids = [tokens(seed=i) for i in range(2)]
    b = measure_layers(layers, ids[0], tail=lambda out: gpt_loss(out, ids[0]))
    assert b.tail > 0
    for policy in ["none", *POLICIES]:
        meter = SavedTensorMeter()
        losses = []
        for x in ids:
            with meter:
                losses.append(gpt_loss(stage_forward(layers, x, policy), x))
        held = (estimate_stash_bytes(policy, b.saved, b.selective, b.boundary, 2,
                                     tail_bytes=b.tail)
                - estimate_stash_bytes(policy, b.saved, b.selective, b.boundary, 1,
                                       tail_bytes=b.tail))
        if policy in ("none", "selective"):
            assert meter.peak == 2 * held, policy
        else:
            # The first segment keeps token ids, smaller than the float boundary estimated.
            assert 2 * b.tail < meter.peak <= 2 * held, policy
        sum(losses).backward()
        assert meter.current == 0


def test_measure_layers_keeps_the_random_state_and_holds_nothing(layers):
    zero(layers)
    state = torch.get_rng_state()
    b = measure_layers(layers, tokens())
    assert torch.equal(torch.get_rng_state(), state)
    assert len(b.saved) == len(b.selective) == len(layers)
    assert b.boundary == 2 * CFG.seq_len * CFG.d_model * 4
    # Blocks mark their attention core; the embedding and head have nothing to recompute.
    assert all(s < n for s, n in zip(b.selective[1:5], b.saved[1:5]))
    assert b.selective[0] == b.saved[0] and b.selective[-1] == b.saved[-1]
    assert all(p.grad is None for layer in layers for p in layer.parameters())


# -- policies ---------------------------------------------------------------------------

def test_parse_policy_forms():
    assert parse_policy("none", 3) == ["none"] * 3
    assert parse_policy(" Every:02 ", 2) == ["every:2"] * 2
    assert parse_policy(["full", "selective", "every:1", "auto"], 4) == [
        "full", "selective", "every:1", "auto"]
    assert parse_policy(("auto",), 1) == ["auto"]


@pytest.mark.parametrize("spec, stages, match", [
    (["full", "none", "none"], 4, r"3 policies .* for 4 pipeline stages"),
    ("every:0", 2, r"k >= 1, found 'every:0'"),
    ("every:two", 2, r"whole number k >= 1, found 'every:two'"),
    ("partial", 2, r"must be a policy \(none, selective, every:k .*found 'partial'"),
    (["none", 3], 2, r"for stage 1 must be a policy .* found int: 3"),
    (7, 2, r"or a list of 2 of them .* found int"),
])
def test_parse_policy_errors_say_what_was_expected(spec, stages, match):
    with pytest.raises(ConfigError, match=match):
        parse_policy(spec, stages)


def test_choose_auto_from_a_measured_stage(layers):
    b = measure_layers(layers[1:5], hidden())
    need = {p: estimate_stash_bytes(p, b.saved, b.selective, b.boundary, 4)
            for p in ["none", "selective", "every:3", "every:2", "every:1", "full"]}
    assert need["every:2"] < need["selective"] < need["none"]
    assert need["full"] < need["none"]

    def auto(budget, depth=4):
        return choose_auto(b.saved, b.boundary, depth, budget,
                           selective_saved_bytes_per_layer=b.selective)

    assert auto(10 * need["none"]) == "none"
    assert auto(need["none"]) == "none"
    assert auto(need["none"] - 1) == "selective"
    tight = auto(need["every:2"])
    assert tight not in ("none", "selective")
    assert estimate_stash_bytes(tight, b.saved, b.selective, b.boundary, 4) <= need["every:2"]
    # Without a selective measurement, selective is not a candidate.
    assert choose_auto(b.saved, b.boundary, 4, need["none"] - 1) == "every:3"
    least = min(need.values())
    with pytest.raises(ConfigError, match=r"rank 0, stage 0: .*least any policy needs "
                                          r".*Raise the budget to at least"):
        choose_auto(b.saved, b.boundary, 4, least - 1, where="rank 0, stage 0",
                    selective_saved_bytes_per_layer=b.selective)


def test_auto_recomputes_most_where_the_1f1b_stash_is_deepest(layers):
    b = measure_layers(layers[1:5], hidden())
    budget = estimate_stash_bytes("none", b.saved, b.selective, b.boundary, 2)
    order = ["none", "selective", "every:3", "every:2", "every:1", "full"]
    chosen = [choose_auto(b.saved, b.boundary, min(4 - s, 8), budget,
                          selective_saved_bytes_per_layer=b.selective) for s in range(4)]
    assert chosen[2] == chosen[3] == "none"
    assert [order.index(c) for c in chosen] == sorted((order.index(c) for c in chosen),
                                                      reverse=True)
    assert chosen[0] != "none"
    for s, policy in enumerate(chosen):
        assert estimate_stash_bytes(policy, b.saved, b.selective, b.boundary,
                                    min(4 - s, 8)) <= budget


def test_full_recomputation_does_not_help_a_stash_of_one():
    # Recomputing one micro-batch brings its activations back during its own backward.
    saved, boundary = [100, 100], 10
    assert (estimate_stash_bytes("full", saved, None, boundary, 1)
            >= estimate_stash_bytes("none", saved, None, boundary, 1))
    assert choose_auto(saved, boundary, 1, 200) == "none"
    assert choose_auto(saved, boundary, 1, 190) == "every:1"


def test_selective_recomputes_the_module_classes_it_is_told():
    from toy import adamw, batches, loss_fn, toy_layers
    data = batches(2, 8)
    losses = {}
    for names in ([], ["Block"]):
        config = pf.Config(microbatches=2, recompute="selective", recompute_modules=names)
        if names:
            engine = pf.Engine(toy_layers(), loss_fn, adamw, config, measure_activations=True)
            assert engine.stage.module.get_submodule("1").pipeflow_selective is True
        else:
            with pytest.warns(UserWarning, match="finds no module to recompute"):
                engine = pf.Engine(toy_layers(), loss_fn, adamw, config,
                                   measure_activations=True)
        losses[tuple(names)] = [engine.train_step(x, y) for x, y in data]
        engine.close()
    assert losses[()] == losses[("Block",)]       # the same training, bit for bit


def test_the_meter_frees_a_graph_kept_for_a_later_backward():
    # Split backward keeps the graph from B to W; the meter must not keep it alive after.
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedTensorMeter()
    with meter:
        out = layer(x)
    torch.autograd.grad(out.sum(), x, retain_graph=True)
    assert meter.current > 0
    del out
    assert meter.current == 0, f"{meter.storages} storages still held"
