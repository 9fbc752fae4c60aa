"""The example GPT: shapes, causality, parameter and FLOP formulas, and that it learns."""

import math

import pytest
import torch

from pipeflow import build_sequential
from pipeflow.models import (Block, Embedding, GPTConfig, Head, flops_per_token, gpt_layers,
                             gpt_loss, num_parameters)

TINY = dict(n_layers=2, d_model=32, n_heads=4, seq_len=16)


def tiny_model(seed: int = 0, **overrides) -> tuple[GPTConfig, torch.nn.Sequential]:
    cfg = GPTConfig(**{**TINY, **overrides})
    return cfg, build_sequential(gpt_layers(cfg), seed)


def random_tokens(cfg: GPTConfig, batch: int = 3, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)


def test_layer_list_is_embedding_blocks_head():
    cfg = GPTConfig(**TINY)
    layers = gpt_layers(cfg)
    assert [spec.cls for spec in layers] == [Embedding, Block, Block, Head]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [dict(TINY), dict(n_layers=3, d_model=48, n_heads=6,
                                                    seq_len=20, vocab_size=100)])
def test_parameter_count_formula_matches_the_model(shape, bias, tied):
    cfg = GPTConfig(**shape, bias=bias, tie_embeddings=tied)
    model = build_sequential(gpt_layers(cfg), 0)
    # The tied matrix is one parameter in the model, built once by each of its two layers.
    assert num_parameters(cfg) == sum(p.numel() for p in model.parameters())
    matrix = cfg.vocab_size * cfg.d_model
    assert num_parameters(cfg) + (matrix if tied else 0) == sum(
        spec.num_parameters() for spec in gpt_layers(cfg))
    tables = (0 if tied else matrix) + cfg.seq_len * cfg.d_model
    assert num_parameters(cfg, embeddings=False) == num_parameters(cfg) - tables
    if tied:
        assert model[0].tokens.weight is model[-1].lm_head.weight


def test_flops_per_token_is_six_n_plus_attention():
    cfg = GPTConfig(**TINY)
    n = num_parameters(cfg, embeddings=False)
    assert flops_per_token(cfg) == 6 * n + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def test_shapes_through_each_layer():
    cfg = GPTConfig(**TINY)
    layers = gpt_layers(cfg)
    embed, block, head = layers[0].build(), layers[1].build(), layers[-1].build()
    idx = random_tokens(cfg, batch=3)
    h = embed(idx)
    assert h.shape == (3, cfg.seq_len, cfg.d_model)
    assert block(h).shape == h.shape
    assert head(h).shape == (3, cfg.seq_len, cfg.vocab_size)
    # A shorter window than seq_len is fine: positions are taken from the front.
    assert embed(idx[:, :5]).shape == (3, 5, cfg.d_model)


def test_sequence_longer_than_seq_len_is_a_clear_error():
    cfg, model = tiny_model()
    with pytest.raises(ValueError, match="longer than GPTConfig.seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    cfg, model = tiny_model()
    idx = random_tokens(cfg, batch=2)
    t = cfg.seq_len // 2
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t:], after[:, t:])


@pytest.mark.parametrize("kwargs, match", [
    (dict(d_model=30, n_heads=4), "divisible by n_heads"),
    (dict(n_layers=0), "n_layers must be a positive integer"),
    (dict(seq_len=-1), "seq_len must be a positive integer"),
    (dict(vocab_size=2.5), "vocab_size must be a positive integer"),
    (dict(dropout=1.0), "dropout must be in"),
    (dict(bias="yes"), "bias must be true or false"),
])
def test_invalid_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **kwargs})


def test_untrained_loss_is_about_ln_vocab():
    cfg, model = tiny_model()
    idx = random_tokens(cfg, batch=8)
    with torch.no_grad():
        loss = gpt_loss(model(idx), random_tokens(cfg, batch=8, seed=1))
    assert loss.shape == ()
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_loss_is_mean_cross_entropy_over_all_tokens():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    per_token = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(gpt_loss(logits, targets), per_token.mean())


def test_a_few_optimizer_steps_lower_the_loss_on_a_fixed_batch():
    cfg, model = tiny_model()
    idx = random_tokens(cfg, batch=4)
    targets = torch.roll(idx, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = gpt_loss(model(idx), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_build_sequential_is_reproducible():
    _, a = tiny_model(seed=3)
    _, b = tiny_model(seed=3)
    _, c = tiny_model(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["1.qkv.weight"], sc["1.qkv.weight"])


def test_residual_projections_are_scaled_down_with_depth():
    cfg = GPTConfig(n_layers=8, d_model=64, n_heads=4, seq_len=8)
    block = gpt_layers(cfg)[1].build()
    expected = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert block.mlp_proj.weight.std().item() == pytest.approx(expected, rel=0.1)
    assert block.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
