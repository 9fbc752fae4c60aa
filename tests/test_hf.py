"""pipeflow.models.hf against transformers itself: logits, state dicts, training, initialisation.

One process, tiny configs, random weights (no download). The pipeflow model is
`build_sequential(causal_lm_layers(cfg))` run layer by layer, each layer given the side inputs
its forward names, as the engine gives them.
"""

import inspect
import math
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="pipeflow.models.hf needs transformers: pip install -e '.[hf]'")

import pipeflow as pf                      # noqa: E402
from pipeflow.models import hf             # noqa: E402

VOCAB, SEQ, BATCH = 128, 16, 3
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
TOKENS = dict(bos_token_id=0, eos_token_id=0)

# Families whose config keys differ from Llama's: their whole tiny config.
OWN_KEYS = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **TOKENS),
    "gptj": dict(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=VOCAB, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **TOKENS),
    # word_embed_proj_dim < hidden: project_in and project_out; pad 1 as in OPT's checkpoints
    "opt": dict(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32,
                dropout=0.0, pad_token_id=1, **TOKENS),
    "falcon": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                   **TOKENS),
    "bloom": dict(n_layer=2, hidden_size=64, n_head=4, vocab_size=VOCAB, **TOKENS),
}
# Llama-keyed families: what differs from SMALL (the family's own steps made to show).
EXTRA = {
    "phi3": dict(pad_token_id=0),
    "starcoder2": dict(TOKENS),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0,
                    attention_multiplier=0.2),
    "cohere": dict(logit_scale=0.5),
    # soft-caps low enough that tanh bends the scores; a window shorter than the sequence
    "gemma2": dict(sliding_window=4, final_logit_softcapping=0.5, attn_logit_softcapping=2.0),
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    # Gemma3: local (sliding) and global layers with their own rotary bases; soft-caps (eager)
    "gemma3_text": dict(sliding_window=4, sliding_window_pattern=2, final_logit_softcapping=0.5,
                        attn_logit_softcapping=2.0),
    "smollm3": dict(no_rope_layer_interval=2, pad_token_id=0, **TOKENS),   # layer 1: no rope
    "glm4": dict(pad_token_id=0, **TOKENS),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, **TOKENS),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    # attention sinks, sliding and full layers alternating, experts with biases (eager)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4),
    # multi-head latent attention (low-rank q and kv, a shared rope key), a dense first block,
    # then routed experts with a shared one and grouped top-k
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                        num_key_value_heads=4, n_group=2, topk_group=1, rope_scaling=None),
}


def make_config(kind: str, **overrides):
    config_class = transformers.CONFIG_MAPPING[kind]
    if kind in OWN_KEYS:
        return config_class(**{**OWN_KEYS[kind], **overrides})
    return config_class(**{**SMALL, "num_hidden_layers": 2, "head_dim": 16,
                           **EXTRA.get(kind, {}), **overrides})


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=hf.attention_implementation(cfg))


def pipeflow_copy(cfg, model):
    """build_sequential of the layers, holding `model`'s weights, in its train/eval mode."""
    seq = pf.build_sequential(hf.causal_lm_layers(cfg), seed=1)
    seq.load_state_dict(hf.from_hf_state_dict(model.state_dict(), cfg), strict=True)
    return seq.train(model.training)


def run_layers(seq, ids, **side):
    """What each stage does: every layer gets the side inputs its forward names."""
    x = ids
    for layer in seq:
        accepted = inspect.signature(layer.forward).parameters
        x = layer(x, **{k: v for k, v in side.items() if k in accepted})
    return x


def padding_mask(where: str) -> torch.Tensor | None:
    if where == "none":
        return None
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    lengths = [SEQ, SEQ - 5, SEQ - 9]
    for row, n in enumerate(lengths):
        if where == "left":
            mask[row, :SEQ - n] = 0
        else:
            mask[row, n:] = 0
    return mask


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def labels_for(ids, mask):
    return ids if mask is None else ids.masked_fill(mask == 0, hf.IGNORE_INDEX)


# Every family hf builds (hf.supported_model_types()). Gemma scales its embedding, OLMo2
# normalises after attention and MLP, GPT-NeoX runs attention and MLP in parallel with partial
# rotary, Mixtral and Qwen2-MoE route experts, Cohere scales and Granite divides its logits,
# Granite multiplies its embedding and residuals, Gemma2 soft-caps attention and logits (eager),
# GPT-J rotates inside attention and has a head bias, OPT counts positions from the mask with
# an offset of 2 and projects in and out, Bloom adds ALiBi and normalises its embedding,
# Falcon runs attention and MLP in parallel, StableLM has partial rotary and LayerNorm.
# Gemma3 keeps a rotary table per layer type, SmolLM3 skips rotary in some layers, GLM4 rotates
# part of each head and norms after attention and MLP; Qwen3-MoE, OLMoE, PhiMoE (sparsemixer
# routing, random in training), GPT-OSS and DeepSeek-V3 route experts.
MODELS = ["gpt2", "llama", "qwen2", "mistral", "qwen3", "gemma", "olmo2", "gpt_neox", "mixtral",
          "phi3", "qwen2_moe", "cohere", "granite", "starcoder2", "gptj", "gemma2", "stablelm",
          "opt", "falcon", "bloom", "gemma3_text", "smollm3", "glm4", "qwen3_moe", "olmoe",
          "phimoe", "gpt_oss", "deepseek_v3"]


def test_every_supported_family_is_checked_here():
    assert sorted(hf.supported_model_types()) == sorted(MODELS)


@pytest.mark.parametrize("where", ["none", "left", "right"])
@pytest.mark.parametrize("kind", MODELS)
def test_logits_match_transformers(kind, where):
    cfg = make_config(kind)
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids, mask = batch(), padding_mask(where)
    with torch.no_grad():
        ours = run_layers(seq, ids, attention_mask=mask)
        theirs = model(ids, attention_mask=mask).logits
    assert ours.shape == (BATCH, SEQ, VOCAB)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


# Config switches inside a family that change its blocks or its base model's steps.
VARIANTS = [
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    ("falcon", dict(parallel_attn=False, multi_query=False, bias=True)),
    ("stablelm", dict(qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True)),
    ("opt", dict(word_embed_proj_dim=64, do_layer_norm_before=False)),   # no projections
    ("gemma2", dict(final_logit_softcapping=None)),
    ("bloom", dict(apply_residual_connection_post_layernorm=True)),
    ("gemma3_text", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),   # SDPA
    ("smollm3", dict(use_sliding_window=True, sliding_window=4, no_rope_layer_interval=4)),
]


@pytest.mark.parametrize("where", ["none", "left", "right"])
@pytest.mark.parametrize("kind,overrides", VARIANTS)
def test_family_variants_match_transformers(kind, overrides, where):
    cfg = make_config(kind, **overrides)
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids, mask = batch(), padding_mask(where)
    with torch.no_grad():
        ours = run_layers(seq, ids, attention_mask=mask)
        theirs = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_micro_batches_alone_give_the_batch_logits(kind):
    # The engine splits the batch and its side inputs by rows: a micro-batch without padding
    # takes SDPA's causal path, one with padding an explicit mask; both must agree.
    cfg = make_config(kind)
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids, mask = batch(), padding_mask("left")
    with torch.no_grad():
        whole = run_layers(seq, ids, attention_mask=mask)
        parts = [run_layers(seq, ids[i:i + 1], attention_mask=mask[i:i + 1])
                 for i in range(BATCH)]
        theirs = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(parts), theirs, atol=1e-5, rtol=1e-5)


# GPT-J: its sin/cos table indexed by position; OPT: given positions replace the mask's count.
@pytest.mark.parametrize("kind", ["gpt2", "llama", "gptj", "opt"])
def test_position_ids_side_input_matches_transformers(kind):
    # Positions restarting mid-row, as for packed documents (a uniform shift would not
    # show: rotary attention sees only relative positions).
    cfg = make_config(kind)
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids, mask = batch(), padding_mask("left")
    positions = (torch.arange(SEQ) % 7).expand(BATCH, SEQ)
    with torch.no_grad():
        ours = run_layers(seq, ids, attention_mask=mask, position_ids=positions)
        theirs = model(ids, attention_mask=mask, position_ids=positions).logits
        default = run_layers(seq, ids, attention_mask=mask)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, default, atol=1e-3)   # the positions reached the model


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_layers_match_transformers(kind):
    # A window shorter than the sequence: the mask each block builds must be the sliding one.
    extra = {"sliding_window": 4}
    if kind == "qwen2":
        extra.update(use_sliding_window=True, max_window_layers=1)
    cfg = make_config(kind, **extra)
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids, mask = batch(), padding_mask("right")
    with torch.no_grad():
        ours = run_layers(seq, ids, attention_mask=mask)
        theirs = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    kinds = [layer.kind for layer in seq if isinstance(layer, hf.DecoderLayer)]
    assert "sliding_attention" in kinds, kinds


# Keys one family reads and another ignores (configs copied between families carry them): the
# mask, soft-caps, multipliers, expert counts, the aux loss, rotary switches. Each family must
# do with them what transformers' own model of that family does: move or stay alike.
FOREIGN = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
               use_sliding_window=True, max_window_layers=1, final_logit_softcapping=0.5,
               attn_logit_softcapping=2.0, logit_scale=0.5, embedding_multiplier=2.0,
               logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
               num_local_experts=6, num_experts=8, n_routed_experts=8, no_rope_layer_interval=2,
               partial_rotary_factor=0.5, alibi=True, layerdrop=0.1,
               use_bidirectional_attention=True, output_router_logits=True,
               router_aux_loss_coef=0.1)
# Left out where pipeflow refuses the key (test_unsupported_config_of_a_family_is_refused) or
# transformers' own model breaks on it (GPT-OSS's rotary with a partial factor).
LEFT_OUT = {"falcon": "alibi", "opt": "layerdrop", "gemma3_text": "use_bidirectional_attention",
            "gpt_oss": "partial_rotary_factor"}


@pytest.mark.parametrize("kind", MODELS)
def test_keys_of_other_families_do_what_transformers_does_with_them(kind):
    keys = {k: v for k, v in FOREIGN.items() if k != LEFT_OUT.get(kind)}
    cfg = make_config(kind, **keys)
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids, mask = batch(), padding_mask("right")
    labels = labels_for(ids, mask)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
        with pf.collect_aux_losses() as aux:
            ours = run_layers(seq, ids, attention_mask=mask)
    torch.testing.assert_close(ours, out.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hf.causal_lm_loss(ours, labels) + sum(aux), out.loss,
                               atol=1e-6, rtol=1e-6)
    if kind == "llama":     # Llama's forward reads none of them: the same model as without
        plain = hf_model(make_config(kind)).eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(ids, attention_mask=mask).logits, out.logits)


# GPT-J: a head bias; OPT: the base model's parts under `decoder.`; Bloom: an embedding norm.
@pytest.mark.parametrize("kind,tied", [("gpt2", True), ("llama", False), ("llama", True),
                                       ("gptj", False), ("gptj", True), ("opt", True),
                                       ("bloom", True)])
def test_state_dict_round_trip_and_ties(kind, tied):
    cfg = make_config(kind, tie_word_embeddings=tied)
    model = hf_model(cfg)
    theirs = model.state_dict()
    ours = hf.from_hf_state_dict(theirs, cfg)
    assert set(ours) == set(pf.build_sequential(hf.causal_lm_layers(cfg)).state_dict())
    back = hf.to_hf_state_dict(ours, cfg)
    assert list(back) == list(theirs)
    for key, value in theirs.items():
        assert torch.equal(back[key], value), key
    seq = pipeflow_copy(cfg, model)
    head = seq[len(seq) - 1].lm_head.weight
    embed = seq[0].get_parameter(hf.arch(cfg).embed[0].split(".")[-1] + ".weight")
    assert (head is embed) == tied
    assert sum(1 for _ in seq.parameters()) == sum(1 for _ in model.parameters())


def test_tied_head_missing_from_checkpoint_is_filled():
    cfg = make_config("gpt2")
    state = hf_model(cfg).state_dict()
    del state["lm_head.weight"]
    ours = hf.from_hf_state_dict(state, cfg)
    head_key = f"{cfg.n_layer + 1}.lm_head.weight"
    assert torch.equal(ours[head_key], state["transformer.wte.weight"])


def test_unknown_key_is_named():
    cfg = make_config("llama")
    state = dict(hf_model(cfg).state_dict())
    state["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="model.extra.weight"):
        hf.from_hf_state_dict(state, cfg)


@pytest.mark.parametrize("where", ["none", "right"])
def test_loss_matches_transformers(where):
    cfg = make_config("llama")
    model = hf_model(cfg).eval()
    ids, mask = batch(), padding_mask(where)
    labels = labels_for(ids, mask)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(hf.causal_lm_loss(out.logits, labels), out.loss,
                               atol=1e-6, rtol=1e-6)
    total, count = hf.causal_lm_loss_sum(out.logits, labels), hf.num_valid_tokens(labels)
    expected = BATCH * (SEQ - 1) if mask is None else int(mask[:, 1:].sum())
    assert count == expected
    torch.testing.assert_close(total / count, out.loss, atol=1e-6, rtol=1e-6)
    # Per micro-batch sums over the global count: the whole batch's token mean, however the
    # padding falls (the engine's global normalisation).
    sums = [hf.causal_lm_loss_sum(out.logits[i:i + 1], labels[i:i + 1]) for i in range(BATCH)]
    assert sum(hf.num_valid_tokens(labels[i:i + 1]) for i in range(BATCH)) == count
    torch.testing.assert_close(sum(sums) / count, out.loss, atol=1e-6, rtol=1e-6)


# A case: a family, "+aux" for its MoE load-balancing loss on (coefficient 0.1), "+tied" for
# the embedding tied to the head.
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)
MOE_AUX = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "gpt_oss"]
TRAIN_CASES = MODELS + ["gpt2+tied", "llama+tied"] + [f"{k}+aux" for k in MOE_AUX]


def case_config(case: str):
    kind, *flags = case.split("+")
    return make_config(kind, **(AUX if "aux" in flags else {}),
                       **({"tie_word_embeddings": True} if "tied" in flags else {}))


def pipeflow_loss(seq, ids, mask, labels):
    """HF's loss of the layers: the shifted token mean plus every auxiliary loss they add."""
    with pf.collect_aux_losses() as aux:
        logits = run_layers(seq, ids, attention_mask=mask)
    return hf.causal_lm_loss(logits, labels) + sum(aux)


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm().clamp(min=1e-12))


def train_both(cfg, optimizer, steps: int):
    """transformers' model and its pipeflow copy after `steps` steps on the same batches
    (right, left, no padding); each step's gradients compared before the update."""
    model = hf_model(cfg).train()
    seq = pipeflow_copy(cfg, model).train()
    opt_hf, opt_pf = optimizer(model.parameters()), optimizer(seq.parameters())
    for step in range(steps):
        ids, mask = batch(seed=step), padding_mask(["right", "left", "none"][step % 3])
        labels = labels_for(ids, mask)
        opt_hf.zero_grad(), opt_pf.zero_grad()
        torch.manual_seed(100 + step)     # one random stream each (PhiMoE samples its experts)
        expected = model(ids, attention_mask=mask, labels=labels).loss
        expected.backward()
        torch.manual_seed(100 + step)
        loss = pipeflow_loss(seq, ids, mask, labels)
        loss.backward()
        torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
        grads = hf.to_hf_state_dict({n: p.grad for n, p in seq.named_parameters()}, cfg)
        for key, p in model.named_parameters():
            assert relative(grads[key], p.grad) < 1e-5, (step, key, relative(grads[key], p.grad))
        opt_hf.step(), opt_pf.step()
    return model, seq


def assert_trained_alike(cfg, model, seq):
    start = hf_model(cfg).state_dict()
    trained = hf.to_hf_state_dict(seq.state_dict(), cfg)
    still, params = [], dict(model.named_parameters())
    for key, value in model.state_dict().items():
        assert relative(trained[key], value) < 1e-5, (key, relative(trained[key], value))
        if torch.equal(value, start[key]) and key in params:   # buffers do not train
            still.append(key)
    # Every parameter trained, on both sides; but PhiMoE's sparsemixer gives a router no
    # gradient while one expert alone clears its jitter threshold for every token
    # (transformers' own gradient is 0 there too).
    assert still == [k for k in still
                     if cfg.model_type == "phimoe" and k.endswith("router.weight")], still


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_three_sgd_steps_match_transformers(case):
    cfg = case_config(case)
    model, seq = train_both(cfg, lambda ps: torch.optim.SGD(ps, lr=0.5), steps=3)
    assert_trained_alike(cfg, model, seq)


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_one_adamw_step_matches_transformers(case):
    # AdamW moves every weight by about lr whatever its gradient's size: a gradient that is
    # noise on one side would show here.
    cfg = case_config(case)
    model, seq = train_both(cfg, lambda ps: torch.optim.AdamW(ps, lr=1e-3), steps=1)
    assert_trained_alike(cfg, model, seq)


@pytest.mark.parametrize("where", ["none", "left", "right"])
@pytest.mark.parametrize("kind,extra", [
    ("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}), ("olmoe", {}), ("phimoe", {}),
    ("gpt_oss", {}),
    # a dense first block (no router): it passes the sums on unchanged
    ("qwen2_moe", {"mlp_only_layers": [0], "num_hidden_layers": 3})])
def test_router_aux_loss_matches_transformers(kind, extra, where):
    cfg = make_config(kind, **AUX, **extra)
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids, mask = batch(), padding_mask(where)
    labels = labels_for(ids, mask)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
        with pf.collect_aux_losses() as aux:
            logits = run_layers(seq, ids, attention_mask=mask)
    assert len(aux) == 1                        # the head adds it once, for all layers
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[0], 0.1 * out.aux_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hf.causal_lm_loss(logits, labels) + sum(aux), out.loss,
                               atol=1e-6, rtol=1e-6)


def test_deepseek_v3_adds_no_load_balancing_loss_as_transformers_adds_none():
    # DeepSeek-V3 balances its experts by a bias outside the loss: its causal LM adds no aux
    # loss even with output_router_logits, and neither may pipeflow.
    cfg = make_config("deepseek_v3", **AUX)
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids = batch()
    with torch.no_grad():
        out = model(ids, labels=ids)
        with pf.collect_aux_losses() as aux:
            logits = run_layers(seq, ids)
    assert aux == []
    torch.testing.assert_close(hf.causal_lm_loss(logits, ids), out.loss, atol=1e-6, rtol=1e-6)


def test_each_mask_rule_is_the_one_its_modeling_file_uses():
    # A family whose base forward never builds a sliding mask must attend fully, whatever its
    # config carries; one that does must take the rule (window or layer types) it uses.
    from pipeflow.models import hf_families
    for kind in MODELS:
        parts = hf.arch(make_config(kind))
        source = inspect.getsource(sys.modules[parts.base.__module__])
        name = "create_sliding_window_causal_mask"
        uses = [line for line in source.splitlines() if name in line and line.strip() != name
                + "," and not line.lstrip().startswith(("from ", "import "))]
        sliding = bool(uses)
        assert (parts.family.kind is not hf_families.full_attention) == sliding, kind


def test_router_sums_cross_the_layers():
    # What crosses a stage boundary with the aux loss on: (hidden, the three running sums).
    cfg = make_config("mixtral", **AUX)
    seq = pf.build_sequential(hf.causal_lm_layers(cfg))
    ids, mask = batch(), padding_mask("right")
    hidden, sums = seq[0](ids)
    assert hidden.shape == (BATCH, SEQ, 64)
    assert sorted(sums) == ["assigned_sum", "prob_sum", "tokens"]
    assert not any(t.any() for t in sums.values())
    for i in (1, 2):
        hidden, sums = seq[i]((hidden, sums), attention_mask=mask)
        valid = int(mask.sum())
        assert float(sums["tokens"]) == i * valid
        assert float(sums["assigned_sum"].sum()) == i * valid * cfg.num_experts_per_tok
        torch.testing.assert_close(float(sums["prob_sum"].detach().sum()), float(i * valid))
    assert sums["prob_sum"].requires_grad and sums["prob_sum"].dtype == torch.float32
    # Counts are integers: a mixed-precision cast of the activations leaves them exact.
    assert sums["assigned_sum"].dtype == sums["tokens"].dtype == torch.int64
    with pf.collect_aux_losses() as aux:
        logits = seq[3]((hidden, sums))
    assert logits.shape == (BATCH, SEQ, VOCAB) and len(aux) == 1


def test_starcoder2_embedding_and_residual_dropout_match_transformers():
    # StarCoder2 drops out its embedding in the base model's forward (a function, no module):
    # the same random stream must give the same masks in the embedding layer.
    cfg = make_config("starcoder2", embedding_dropout=0.3, residual_dropout=0.3)
    model = hf_model(cfg).train()
    seq = pipeflow_copy(cfg, model).train()
    ids, mask = batch(), padding_mask("right")
    torch.manual_seed(5)
    theirs = model(ids, attention_mask=mask).logits
    torch.manual_seed(5)
    ours = run_layers(seq, ids, attention_mask=mask)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    dropped = float((seq[0](ids) == 0).float().mean())
    assert 0.2 < dropped < 0.4, dropped


def _spread(t: torch.Tensor) -> tuple[float, float]:
    return float(t.float().std()), float(t.float().mean())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_initialisation_matches_transformers_statistics(kind):
    cfg = make_config(kind, **({"n_layer": 4} if kind == "gpt2" else {"pad_token_id": 0}))
    ours = hf.to_hf_state_dict(pf.build_sequential(hf.causal_lm_layers(cfg)).state_dict(), cfg)
    theirs = hf_model(cfg).state_dict()
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        std, mean = _spread(value)
        if std == 0:                                  # norms' ones, biases' zeros
            assert torch.equal(ours[key], value), key
            continue
        our_std, our_mean = _spread(ours[key])
        assert abs(our_std / std - 1) < 0.1, (key, our_std, std)
        assert abs(our_mean) < 0.2 * std, (key, our_mean)
    r = cfg.initializer_range
    if kind == "gpt2":        # residual projections scaled by 1/sqrt(2 n_layer), the rest r
        assert abs(_spread(ours["transformer.h.1.attn.c_proj.weight"])[0]
                   / (r / math.sqrt(2 * cfg.n_layer)) - 1) < 0.1
        assert abs(_spread(ours["transformer.h.1.attn.c_attn.weight"])[0] / r - 1) < 0.1
    else:                     # the padding token's embedding row is zero
        assert abs(_spread(ours["model.layers.0.mlp.up_proj.weight"])[0] / r - 1) < 0.1
        assert not ours["model.embed_tokens.weight"][cfg.pad_token_id].any()


def test_layers_build_alike_alone_and_in_sequence():
    # Any partition builds layer i alone; it must hold build_sequential's weights.
    cfg = make_config("llama")
    layers = hf.causal_lm_layers(cfg)
    seq = pf.build_sequential(layers, seed=3)
    alone = pf.layers.build_layer(layers[2], 3, 2)
    for (name, a), b in zip(seq[2].state_dict().items(), alone.state_dict().values()):
        assert torch.equal(a, b), name
    assert layers[1].num_parameters() == sum(p.numel() for p in seq[1].parameters())


def test_rotary_frequencies_stay_fp32_under_bf16():
    cfg = make_config("llama")
    model = hf_model(cfg).eval()
    seq = pipeflow_copy(cfg, model)
    ids = batch()
    with torch.no_grad():
        full = run_layers(seq, ids)
        seq.to(torch.bfloat16)
        half = run_layers(seq, ids)
    block = seq[1]
    assert block._rotary[0].inv_freq.dtype == torch.float32
    assert half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max() < 0.05 * full.abs().max()


@pytest.mark.parametrize("config,why", [
    # BERT has a causal LM head in transformers (BertLMHeadModel) but is an encoder.
    (transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1,
                             num_attention_heads=4, intermediate_size=128), "'bert'"),
    (transformers.T5Config(vocab_size=VOCAB, d_model=64, num_layers=1), "'t5'"),
    # A decoder-only causal LM not checked here (partial rotary, parallel blocks, own dense).
    (transformers.PhiConfig(**{**SMALL, "num_hidden_layers": 1}), "'phi'"),
])
def test_unsupported_model_type_is_refused_naming_the_supported(config, why):
    with pytest.raises(ValueError) as error:
        hf.causal_lm_layers(config)
    text = str(error.value)
    assert why in text and "not supported" in text
    assert "llama" in text and "mixtral" in text and "hf_families.py" in text
    with pytest.raises(ValueError, match=why):
        hf.from_hf_state_dict({}, config)


@pytest.mark.parametrize("kind,overrides,why", [
    ("falcon", {"alibi": True}, "alibi=False"),
    ("opt", {"layerdrop": 0.1}, "layerdrop=0.0"),
])
def test_unsupported_config_of_a_family_is_refused(kind, overrides, why):
    with pytest.raises(ValueError, match=why) as error:
        hf.causal_lm_layers(make_config(kind, **overrides))
    assert repr(kind) in str(error.value)
