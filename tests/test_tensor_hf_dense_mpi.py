"""The dense transformers families at tensor = 2: transformers' logits, and SGD steps equal to
transformers' own model trained in one process (`pipeflow.models.hf_tensor_dense`).

Run under `mpirun -n 2` (t2) and `mpirun -n 4` (d2×t2) with `--with-mpi`. Each family's
tiny config is tests/test_hf.py's, narrowed (hidden 32, 4 heads of 8, 2 key/value heads, 2
blocks), with the switches that change how its block splits turned on (StableLM's and
Cohere's norms per head, StableLM's parallel residual); every family with and without
sequence parallelism; greedy generation through the key/value cache as transformers'
`generate`. The families pipeflow builds but cannot split are refused at construction with
the reason.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

transformers = pytest.importorskip(
    "transformers", reason="pipeflow.models.hf needs transformers: pip install -e '.[hf]'")

import pipeflow as pf                                   # noqa: E402
from pipeflow.models import hf, hf_tensor               # noqa: E402
from pipeflow.models.hf_tensor_base import head_dim     # noqa: E402
from test_hf import make_config                         # noqa: E402
from test_hf_mpi import (LR, _hf_model, _train_transformers,             # noqa: E402
                         assert_logits_as_transformers, assert_trained_as_transformers)
from toy import sgd                                     # noqa: E402

WORLD = MPI.COMM_WORLD
T, D = 2, WORLD.size // 2          # tensor 2; at 4 ranks two replicas of it
BATCH, SEQ, VOCAB = 8, 8, 64
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=VOCAB, max_position_embeddings=4 * SEQ)

# case -> (model_type, what differs from test_hf's config of it)
CASES = {
    "gemma": ("gemma", {}),                 # embedding x sqrt(hidden)
    "gemma2": ("gemma2", {}),               # soft-caps, sliding window 4 < SEQ (eager)
    "gemma3_text": ("gemma3_text", {}),     # q/k norms per head, local and global blocks
    "starcoder2": ("starcoder2", {}),       # c_fc / c_proj with biases, attention biases
    "stablelm": ("stablelm", {}),           # partial rotary, views by self.num_heads
    "stablelm+qk_norm": ("stablelm", dict(qk_layernorm=True, use_parallel_residual=True,
                                          use_qkv_bias=True)),   # a LayerNorm per head
    # one key/value head for every query head: replicated, each rank computing it
    "stablelm+mqa": ("stablelm", dict(num_key_value_heads=1)),
    "gemma+mqa": ("gemma", dict(num_key_value_heads=1)),
    "gemma3_text+mqa": ("gemma3_text", dict(num_key_value_heads=1)),    # norms per head
    "cohere": ("cohere", {}),               # attention and MLP in parallel, logit scale
    "cohere+qk_norm": ("cohere", dict(use_qk_norm=True)),        # a weight row per head
    "granite": ("granite", {}),             # multipliers
    "olmo2": ("olmo2", {}),                 # q/k RMSNorm over the whole width
    "glm4": ("glm4", {}),                   # fused gate_up_proj, partial rotary
    "smollm3": ("smollm3", {}),             # a block without rotary
}


def _config(case: str):
    kind, switches = CASES[case]
    return make_config(kind, **{**TINY, **switches})


def _steps(n: int = 3):
    """(ids, labels, mask) per step: rows right-padded, their padding ignored (-100)."""
    gen = torch.Generator().manual_seed(5)
    steps = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=gen)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        steps.append((ids, ids.masked_fill(mask == 0, -100), mask))
    return steps


def _engine(cfg, **config) -> pf.Engine:
    return pf.Engine(hf.causal_lm_layers(cfg), hf.causal_lm_loss_sum, sgd,
                     pf.Config(tensor=T, microbatches=2, **config),
                     count_items=hf.num_valid_tokens)


def _assert_cut(engine: pf.Engine, cfg) -> None:
    """Each rank holds half of every block's projections (the split is real, not the whole
    model replicated): q by heads, and the MLP's row layer by its inner width."""
    held = dict(engine.stage.module.named_parameters())
    q = [p for n, p in held.items() if n.endswith("self_attn.q_proj.weight")]
    down = [p for n, p in held.items() if n.endswith(("mlp.down_proj.weight",
                                                      "mlp.c_proj.weight"))]
    assert len(q) == len(down) >= 1         # this stage's blocks
    for w in q:
        assert tuple(w.shape) == (cfg.num_attention_heads * head_dim(cfg) // T, cfg.hidden_size)
    for w in down:
        assert tuple(w.shape) == (cfg.hidden_size, cfg.intermediate_size // T)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_dense_family_at_tensor_2_gives_transformers_logits_and_steps(case, sp):
    _check(case, data=D, sequence_parallel=sp)


def _check(case: str, **config) -> None:
    """Before training the logits of transformers holding the same weights; 3 SGD steps
    equal to transformers' own model trained on the whole batches (losses and weights)."""
    cfg = _config(case)
    engine = _engine(cfg, **config)
    _assert_cut(engine, cfg)
    steps = _steps()
    start = pf.build_sequential(hf.causal_lm_layers(cfg), seed=0).state_dict()
    assert_logits_as_transformers(engine, cfg, start, steps[0], WORLD.rank)
    losses = [engine.train_step(ids, labels, attention_mask=mask) for ids, labels, mask in steps]
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert sgd(list(torch.nn.Linear(1, 1).parameters())).defaults["lr"] == LR
        expected, ref_losses = _train_transformers(cfg, start, steps)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        # it trained: the whole norms a rank uses a slice of included
        assert_trained_as_transformers(full, expected, cfg, start)
    engine.close()


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["olmo2", "stablelm+qk_norm", "cohere+qk_norm"])
def test_own_collectives_and_fix_ups_hold_at_p2xt2_with_recomputation(case):
    """The blocks with their own sum over the group (OLMo2) or fix-ups after the cut
    (StableLM, Cohere), on 2 stages, recomputed in the backward, sequence-parallel."""
    _check(case, pipeline=2, recompute="full", sequence_parallel=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_dense_family_at_tensor_2_generates_what_transformers_generates(case):
    """Greedy generation through the key/value cache (`DecoderLayer.decode`: the localized
    head counts and norms, OLMo2's sum over the group, per position): transformers' tokens."""
    from test_generate import PROMPTS, _transformers_greedy
    cfg = _config(case)
    cfg.initializer_range = 0.3             # wide weights: varied greedy text
    engine = _engine(cfg, data=D)
    model = _hf_model(cfg, pf.build_sequential(hf.causal_lm_layers(cfg), seed=0).state_dict())
    prompts = [[p % VOCAB for p in prompt] for prompt in PROMPTS[:2]]
    expected = _transformers_greedy(model.eval(), prompts, 8)
    assert len({t for e in expected for t in e}) > 1
    assert engine.generate(prompts, 8, use_cache=True) == expected
    engine.close()


def _unsplit_families() -> list[str]:
    return sorted(set(hf.supported_model_types()) - set(hf_tensor.FAMILIES))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_every_family_without_a_tensor_plan_is_refused_naming_the_reason(monkeypatch):
    """Every family of docs/models.md splits (none halfway); one without a row is refused on
    every rank at construction, naming it and the families that do (granite's row taken
    away to see it)."""
    assert _unsplit_families() == []
    monkeypatch.delitem(hf_tensor.FAMILIES, "granite")
    for kind in _unsplit_families():
        cfg = make_config(kind)
        with pytest.raises(pf.ConfigError, match=rf"model_type '{kind}' has no tensor-parallel "
                                                  rf"plan .*gemma.*set tensor = 1"):
            _engine(cfg, data=D)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,switch,why", [
    ("stablelm", "qk_layernorm", "qk_layernorm keeps a LayerNorm per head"),
    ("cohere", "use_qk_norm", "use_qk_norm keeps a weight row per head"),
    ("olmo2", None, "k_norm spans the key heads' whole width")])
def test_a_norm_over_key_heads_with_fewer_heads_than_ranks_is_refused(kind, switch, why):
    """A norm cut with the key heads cannot be cut where one key/value head is computed whole
    on every rank: refused on every rank with the reason, not a crash in the forward."""
    extra = {switch: True} if switch else {}
    cfg = make_config(kind, **{**TINY, "num_key_value_heads": 1, **extra})
    with pytest.raises(pf.ConfigError, match=rf"{kind}'s {why}, and its 1 key/value heads do "
                                             rf"not cut over tensor = 2"):
        _engine(cfg, data=D)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(60)
def test_sharded_optimizer_with_norms_per_head_is_refused_at_d2xt2():
    """A whole weight a rank uses a slice of (`partial_gradient`: OLMo2's q/k norms) has its
    gradient summed over the tensor group at the step, after the sharded optimizer's
    reduce-scatters: refused on every rank, naming the weights, not trained wrong."""
    with pytest.raises(pf.ConfigError, match=r"shard_optimizer with data > 1 .*partial_gradient"
                                             r".*layer 1: layer\.self_attn\.q_norm\.weight"):
        pf.Engine(hf.causal_lm_layers(_config("olmo2")), hf.causal_lm_loss_sum, sgd,
                  pf.Config(data=2, tensor=2, shard_optimizer=True),
                  count_items=hf.num_valid_tokens)


if WORLD.size != 4:       # not collected at all (a skip under mpirun is an error)
    del (test_sharded_optimizer_with_norms_per_head_is_refused_at_d2xt2,
         test_own_collectives_and_fix_ups_hold_at_p2xt2_with_recomputation)
