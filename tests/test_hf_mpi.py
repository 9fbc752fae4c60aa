"""transformers models pipelined: 3 SGD steps equal transformers' own in one process.

GPT-2 and Llama under every schedule; Granite (its embedding multiplier on stage 0, its logits
divisor on the last), Mixtral (experts routed on both stages) and the families added since
(Gemma3, SmolLM3, GLM4, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3; PhiMoE's logits) under 1F1B;
Mixtral, Qwen3-MoE, OLMoE and GPT-OSS with their load-balancing loss.

Run under `mpirun -n 2` and `mpirun -n 4` with `--with-mpi`. The engine starts from
`build_sequential`'s weights; the transformers model is given the same weights through
`to_hf_state_dict`, trains on the whole batch, and the gathered pipeline must match it.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

transformers = pytest.importorskip(
    "transformers", reason="pipeflow.models.hf needs transformers: pip install -e '.[hf]'")

import pipeflow as pf                      # noqa: E402
from pipeflow.models import hf             # noqa: E402
from toy import allgather                  # noqa: E402

WORLD = MPI.COMM_WORLD
VOCAB, SEQ, BATCH, STEPS, LR = 128, 16, 8, 3, 0.5


def make_config(kind: str):
    if kind == "gpt2":       # tied embedding: stage 0 and the last stage share the weight
        return transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    shape = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 max_position_embeddings=SEQ)
    if kind == "granite":
        return transformers.GraniteConfig(**shape, embedding_multiplier=2.0,
                                          residual_multiplier=0.5, logits_scaling=4.0,
                                          attention_multiplier=0.2)
    if kind == "mixtral":
        return transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
    if kind in NEW:          # test_hf.py's tiny config of the family, 4 blocks
        from test_hf import make_config as tiny
        return tiny(kind, num_hidden_layers=4)
    return transformers.LlamaConfig(**shape)


# The families added in transformers 5's time, each pipelined on 2 ranks under 1F1B. PhiMoE's
# router samples its experts at random in training (sparsemixer): pipelined, its logits.
NEW = ["gemma3_text", "smollm3", "glm4", "qwen3_moe", "olmoe", "phimoe", "gpt_oss",
       "deepseek_v3"]
RANDOM_IN_TRAINING = {"phimoe"}


def _cases():
    for stages in (s for s in (2, 4) if s <= WORLD.size):
        for schedule in ("1f1b", "interleaved", "zbv") if stages == 2 else ("1f1b",):
            for kind in ("gpt2", "llama"):
                for padded in (False, True):
                    yield kind, stages, schedule, padded
        for kind in ("granite", "mixtral"):
            for padded in (False, True):
                yield kind, stages, "1f1b", padded
        if stages == 2:
            for kind in NEW:
                yield kind, stages, "1f1b", True


def _data(padded: bool):
    """(ids, labels, mask) per step; padded rows end early (right padding), their padding
    ignored by the loss (-100) and masked in attention."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=gen) if padded else \
            torch.full((BATCH,), SEQ)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        out.append((ids, ids.masked_fill(mask == 0, -100), mask))
    return out


def _hf_model(cfg, start: dict[str, torch.Tensor]):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=hf.attention_implementation(cfg))
    model.load_state_dict(hf.to_hf_state_dict(start, cfg))
    return model


def _train_transformers(cfg, start: dict[str, torch.Tensor], data) -> tuple[dict, list]:
    model = _hf_model(cfg, start)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids, labels, mask in data:
        opt.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def assert_logits_as_transformers(engine, cfg, start: dict, batch, rank: int) -> None:
    """The engine's logits of `batch` (ids, labels, mask) are transformers' for the weights
    `start`, at every valid position (checked on `rank` 0)."""
    ids, _, mask = batch
    logits = engine.eval_step(ids, attention_mask=mask)
    if rank == 0:
        with torch.no_grad():
            expected = _hf_model(cfg, start).eval()(ids, attention_mask=mask).logits
        valid = mask.bool()
        torch.testing.assert_close(logits[valid], expected[valid], atol=1e-5, rtol=1e-5)


def assert_trained_as_transformers(full: dict, expected: dict, cfg, start: dict,
                                   floor: float = 1e-12) -> None:
    """The engine's trained state (`gather_state_dict`) in transformers' names equals
    transformers' own trained `expected` (relative 1e-5, the norm floored at `floor`), and
    every parameter moved (buffers need not: DeepSeek-V3's expert bias is set outside the
    loss)."""
    trained, initial = hf.to_hf_state_dict(full, cfg), hf.to_hf_state_dict(start, cfg)
    assert set(trained) == set(expected)
    params = {n for n, _ in _hf_model(cfg, start).named_parameters()}
    for key, value in expected.items():
        diff = (trained[key] - value).norm() / value.norm().clamp(min=floor)
        assert diff < 1e-5, (key, float(diff))
        assert key not in params or not torch.equal(value, initial[key]), key


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,stages,schedule,padded", list(_cases()))
def test_pipelined_transformers_model_trains_like_it(kind, stages, schedule, padded):
    # The padding mask is a side input (every stage builds its attention mask from it); the
    # loss is summed per micro-batch and divided by the valid tokens of the whole batch, so
    # it is transformers' token mean even where micro-batches hold different token counts.
    comm = WORLD.Split(color=WORLD.rank // stages, key=WORLD.rank)
    cfg = make_config(kind)
    layers = hf.causal_lm_layers(cfg)
    config = pf.Config(pipeline=stages, microbatches=4, schedule=schedule,
                       virtual_stages=2 if schedule == "interleaved" else 1)
    engine = pf.Engine(layers, hf.causal_lm_loss_sum,
                       lambda ps: torch.optim.SGD(ps, lr=LR), config, comm=comm,
                       count_items=hf.num_valid_tokens)
    data = _data(padded)
    start = pf.build_sequential(layers, seed=config.seed).state_dict()
    # Before training: the same logits as transformers holding the same weights.
    assert_logits_as_transformers(engine, cfg, start, data[0], comm.rank)
    if kind in RANDOM_IN_TRAINING:
        engine.close()
        comm.Free()
        return
    losses = [engine.train_step(ids, labels, attention_mask=mask) for ids, labels, mask in data]
    full = engine.gather_state_dict()
    if comm.rank == 0:
        expected, ref_losses = _train_transformers(cfg, start, data)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert_trained_as_transformers(full, expected, cfg, start)
    engine.close()
    comm.Free()


def _pair() -> MPI.Comm:
    return WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss", ["causal_lm_loss_sum", "causal_lm_loss"])
def test_a_mean_loss_with_count_items_stops_every_rank_at_the_first_step(loss):
    # count_items divides the summed loss by the batch's valid tokens: HF's mean loss given
    # instead would train with a loss (and gradients) a micro-batch's token count too small.
    # The first step finds it on the last stage and every rank stops with the same error.
    comm = _pair()
    cfg = make_config("llama")
    engine = pf.Engine(hf.causal_lm_layers(cfg), getattr(hf, loss),
                       lambda ps: torch.optim.SGD(ps, lr=LR),
                       pf.Config(pipeline=2, microbatches=4), comm=comm,
                       count_items=hf.num_valid_tokens)
    ids, labels, mask = _data(padded=True)[0]
    before = {k: v.clone() for k, v in engine.stage.module.state_dict().items()}
    try:
        engine.train_step(ids, labels, attention_mask=mask)
        error = None
    except pf.ConfigError as exc:
        error = str(exc)
    errors = allgather(comm, error)
    if loss == "causal_lm_loss_sum":
        assert errors == [None, None]
        engine.train_step(ids, labels, attention_mask=mask)   # checked once, then trains
    else:
        assert all(e is not None for e in errors), errors
        assert "causal_lm_loss" in errors[0] and "x too small" in errors[0]
        assert "causal_lm_loss_sum" in errors[0] and errors[0].split("stopped")[1] == \
            errors[1].split("stopped")[1]
        # Found before the update: the wrong loss never moved a weight.
        after = engine.stage.module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    engine.close()
    comm.Free()


AUX_M = 4


def _train_mixtral_with_aux_in_one_process(cfg, start, batches, optimizer):
    """transformers' Mixtral with gradient accumulation over the micro-batches: each
    micro-batch's loss is its CE mean + 0.1 x its load-balancing loss (transformers adds it
    to `.loss`), averaged over the micro-batches."""
    model = _hf_model(cfg, start)
    model.train()
    opt = optimizer(model.parameters())
    for ids in batches:
        opt.zero_grad()
        for part in ids.chunk(AUX_M):
            out = model(part, labels=part)
            (out.loss / AUX_M).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind,optimizer", [("mixtral", "sgd"), ("mixtral", "adamw"),
                                            ("qwen3_moe", "sgd"), ("olmoe", "sgd"),
                                            ("gpt_oss", "sgd")])
def test_pipelined_moe_with_its_load_balancing_loss_trains_like_transformers(kind, optimizer):
    # The aux loss of each micro-batch is made on the head's stage from router sums that
    # crossed the stage boundary: the engine weights it by 1/(m·d), as the mean CE.
    comm = _pair()
    cfg = make_config(kind)
    cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.1
    make = (lambda ps: torch.optim.SGD(ps, lr=LR)) if optimizer == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    layers = hf.causal_lm_layers(cfg)
    config = pf.Config(pipeline=2, microbatches=AUX_M)
    engine = pf.Engine(layers, hf.causal_lm_loss, make, config, comm=comm)
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]
    start = pf.build_sequential(layers, seed=config.seed).state_dict()
    for ids in batches:
        engine.train_step(ids, ids)
    full = engine.gather_state_dict()
    if comm.rank == 0:
        expected = _train_mixtral_with_aux_in_one_process(cfg, start, batches, make)
        trained, initial = hf.to_hf_state_dict(full, cfg), hf.to_hf_state_dict(start, cfg)
        assert set(trained) == set(expected)
        for key, value in expected.items():
            diff = (trained[key] - value).norm() / value.norm().clamp(min=1e-12)
            assert diff < 1e-5, (key, float(diff))
        gate = next(k for k in expected if k.endswith(("gate.weight", "router.weight")))
        assert not torch.equal(expected[gate], initial[gate])          # the router trained
    engine.close()
    comm.Free()
