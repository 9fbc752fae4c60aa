"""The mixture-of-experts families at tensor = 2: transformers' own model trained the same way.

Run under `mpirun -n 2` (t2) and `-n 4` (each pair t2; and p2×t2 for Mixtral and DeepSeek-V3)
with `--with-mpi`. Each family's attention is split by heads, each expert of its bank by its
inner width (fused 3-D parameters cut by `tensor_parallel.Shard`), a shared expert like a
dense MLP, the router whole; the load-balancing loss on (coefficient 0.1, as transformers
adds it to `.loss`), padded masks, the loss summed over valid tokens, SGD. PhiMoE samples its
experts in training: its logits against transformers, its training against one process of
pipeflow (whose equality to transformers tests/test_hf.py shows under a shared seed).
"""

from __future__ import annotations

import re

import pytest
import torch
from mpi4py import MPI
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="pipeflow.models.hf needs transformers: pip install -e '.[hf]'")

import pipeflow as pf                          # noqa: E402
from pipeflow.models import hf, hf_checkpoint  # noqa: E402
from pipeflow.runtime.tensor_parallel import Once, Shard, split_of   # noqa: E402
from test_hf import make_config                # noqa: E402
from test_hf_mpi import (LR, _train_transformers,                        # noqa: E402
                         assert_logits_as_transformers)
from toy import bcast, sgd                     # noqa: E402

WORLD = MPI.COMM_WORLD
N = WORLD.size
FOUR = N == 4
BATCH, SEQ, VOCAB, STEPS = 4, 8, 64, 3
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "gpt_oss", "deepseek_v3"]
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)


def moe_config(kind: str, **extra):
    """test_hf's tiny config of the family, narrower: hidden 32, heads of 8, 4 experts."""
    return make_config(kind, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       head_dim=8, max_position_embeddings=2 * SEQ, **AUX, **extra)


def batches(steps: int = STEPS):
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=gen)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        out.append((ids, ids.masked_fill(mask == 0, hf.IGNORE_INDEX), mask))
    return out


def pair() -> MPI.Comm:
    """Ranks in pairs: each pair a tensor group of 2 (the world under -n 2)."""
    return WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)


def engine_for(layers, comm, pipeline: int = 1, tensor: int = 2, sp: bool = False,
               **settings):
    # one micro-batch: transformers' load-balancing loss is one product of means over the
    # whole batch, which a mean over micro-batches is not
    return pf.Engine(layers, hf.causal_lm_loss_sum, sgd,
                     pf.Config(pipeline=pipeline, tensor=tensor, microbatches=1,
                               sequence_parallel=sp, **settings),
                     count_items=hf.num_valid_tokens, comm=comm)


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm().clamp(min=1e-12))


# What stays whole in a cut block: norms, routers, the a-projections of latent attention,
# the biases a row layer or an expert bank adds once; everything else is 1/t.
WHOLE = re.compile(r"norm\.weight$|\.gate\.weight$|router\.|shared_expert_gate|_a_proj|"
                   r"a_proj_with_mqa|o_proj\.bias$|down_proj_bias$|e_score_correction")


def assert_cut(engine, kind: str) -> None:
    """Each rank holds its slice of every expert bank, shared expert, head-cut projection and
    sink (and OLMoE's q and k norms, which span the heads); the rest whole."""
    last = engine.stage.n_layers - 1
    for name, p in engine.stage.module.named_parameters():
        if name.split(".")[0] in ("0", str(last)):      # embedding and head: replicated
            continue
        whole = bool(WHOLE.search(name)) and not (kind == "olmoe" and "_norm." in name)
        assert (split_of(p) is None) == whole, (name, tuple(p.shape))


def check_trained(full, expected: dict, cfg, start) -> None:
    trained, initial = hf.to_hf_state_dict(full, cfg), hf.to_hf_state_dict(start, cfg)
    assert set(trained) == set(expected)
    for key, value in expected.items():
        assert relative(trained[key], value) < 1e-5, (key, relative(trained[key], value))
    # as save_pretrained writes them (Mixtral's, Qwen2-MoE's, PhiMoE's experts one by one)
    files, theirs = hf_checkpoint.to_checkpoint(trained, cfg), \
        hf_checkpoint.to_checkpoint(expected, cfg)
    assert set(files) == set(theirs)
    assert all(relative(files[k], theirs[k]) < 1e-5 for k in theirs)
    routers = [k for k in expected if k.endswith(("gate.weight", "router.weight"))
               and "shared_expert_gate" not in k]
    assert routers and all(not torch.equal(expected[k], initial[k]) for k in routers)


def train_against_transformers(kind: str, comm, pipeline: int, sp: bool, recompute="none",
                               **extra) -> None:
    cfg = moe_config(kind, **extra)
    layers = hf.causal_lm_layers(cfg)
    engine = engine_for(layers, comm, pipeline, sp=sp, recompute=recompute)
    assert_cut(engine, kind)
    data = batches()
    start = pf.build_sequential(layers, 0).state_dict()
    assert_logits_as_transformers(engine, cfg, start, data[0], comm.rank)
    losses = [engine.train_step(ids, labels, attention_mask=mask) for ids, labels, mask in data]
    full = engine.gather_state_dict()
    if comm.rank == 0:
        assert sgd(list(torch.nn.Linear(1, 1).parameters())).defaults["lr"] == LR
        expected, ref = _train_transformers(cfg, start, data)
        assert losses == pytest.approx(ref, rel=1e-5)
        check_trained(full, expected, cfg, start)
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [k for k in FAMILIES if k != "phimoe"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_moe_family_at_t2_trains_like_transformers(kind, sp):
    """Logits before training, three SGD steps' losses and the gathered, trained weights (every
    expert whole again, keyed as transformers) against transformers' model."""
    comm = pair()
    train_against_transformers(kind, comm, 1, sp)
    comm.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_moe_family_at_p2xt2_trains_like_transformers(kind, sp):
    """Router sums cross the stage boundary; each stage's experts cut over its tensor pair;
    with sequence parallelism, every block recomputed (its collectives replayed)."""
    train_against_transformers(kind, WORLD, 2, sp, recompute="full" if sp else "none")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_phimoe_at_t2_gives_transformers_logits_and_trains_like_one_process():
    """PhiMoE draws its experts at random in training; both tensor ranks draw alike (they
    share a seed), and the same draws as one process of pipeflow from the same seed."""
    comm = pair()
    cfg = moe_config("phimoe")
    layers = hf.causal_lm_layers(cfg)
    data = batches()
    start = pf.build_sequential(layers, 0).state_dict()
    engine = engine_for(layers, comm)
    assert_logits_as_transformers(engine, cfg, start, data[0], comm.rank)
    losses = [engine.train_step(ids, labels, attention_mask=mask) for ids, labels, mask in data]
    full = engine.gather_state_dict()
    engine.close()
    one = engine_for(layers, MPI.COMM_SELF, tensor=1)
    one.eval_step(data[0][0], attention_mask=data[0][2])     # as the engine above did
    ref = [one.train_step(ids, labels, attention_mask=mask) for ids, labels, mask in data]
    expected = one.gather_state_dict()
    one.close()
    assert losses == pytest.approx(ref, rel=1e-5)
    if comm.rank == 0:
        check_trained(full, hf.to_hf_state_dict(expected, cfg), cfg, start)
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["gpt_oss", "deepseek_v3"])
@pytest.mark.filterwarnings("ignore:checkpoint .* was written on grid")
def test_a_t2_checkpoint_loads_whole_at_t1_and_cut_again_at_t2(kind, tmp_path):
    """A checkpoint holds whole tensors (the banks, the sinks, a bias added once): one saved
    at t2 with sequence parallelism loads into a data = 2 grid and into t2, each holding the
    trained weights; their greedy tokens (the key/value cache) agree."""
    comm = pair()
    cfg = moe_config(kind)
    layers = hf.causal_lm_layers(cfg)
    engine = engine_for(layers, comm, sp=True)
    for ids, labels, mask in batches(2):
        engine.train_step(ids, labels, attention_mask=mask)
    folder = bcast(comm, str(tmp_path))
    engine.save(folder)
    trained = engine.gather_state_dict()
    engine.close()
    prompts, tokens = [[3, 5, 7, 11], [2, 4, 6, 8]], []
    for config in (pf.Config(data=2), pf.Config(tensor=2)):
        other = pf.Engine(layers, hf.causal_lm_loss_sum, sgd, config,
                          count_items=hf.num_valid_tokens, comm=comm)
        other.load(folder)
        again = other.gather_state_dict()
        tokens.append(other.generate(prompts, max_new_tokens=4))
        other.close()
        if comm.rank == 0:
            assert set(again) == set(trained)
            assert all(torch.equal(again[k], trained[k]) for k in trained)
    assert tokens[0] == tokens[1]
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,extra,reason", [
    ("phimoe", {}, "samples experts at random"),
    ("mixtral", {"router_jitter_noise": 0.1}, r"random jitter \(router_jitter_noise")])
def test_random_routing_under_sequence_parallelism_is_refused_with_the_reason(kind, extra,
                                                                               reason):
    comm = pair()
    cfg = moe_config(kind)
    for key, value in extra.items():
        setattr(cfg, key, value)
    with pytest.raises(pf.ConfigError, match=f"layer 1 .*{reason}.*set sequence_parallel"):
        engine_for(hf.causal_lm_layers(cfg), comm, sp=True)
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_qwen2_moe_with_a_dense_block_trains_like_transformers():
    """One plan for both kinds of block: the dense one's MLP cut as Llama's, the MoE one's
    bank and shared expert as above (`Split(..., if_present=True)`)."""
    comm = pair()
    train_against_transformers("qwen2_moe", comm, 1, True, mlp_only_layers=[0])
    comm.Free()


# -- the cuts on a user's own model: parameters, a per-token module, a bias added once ------

class Bank(nn.Module):
    """A user's per-token module with plain parameters (no nn.Linear), scaled per token by a
    second input (as an expert bank by its routing weights), a bias inside."""

    def __init__(self, width: int = 24, inner: int = 16) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(inner, width) / width ** 0.5)
        self.down = nn.Parameter(torch.randn(width, inner) / inner ** 0.5)
        self.bias = nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ self.up.t()) @ self.down.t() + self.bias) * scale


class BankBlock(nn.Module):
    tp_plan = {"bank": "tokenwise", "bank.up": Shard(0), "bank.down": Shard(1),
               "bank.bias": Once()}

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(24, 1)         # whole: a router of one expert
        self.bank = Bank()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bank(x, torch.sigmoid(self.gate(x)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_users_own_per_token_module_with_parameter_cuts_trains_like_one_process():
    from test_tensor_mpi import UserEmbed, UserHead, check
    layers = [pf.LayerSpec(UserEmbed), pf.LayerSpec(BankBlock), pf.LayerSpec(BankBlock),
              pf.LayerSpec(UserHead)]
    engine = check(layers, (1, 1, N), sgd, 1e-5)
    held = dict(engine.stage.module.named_parameters())
    assert held["1.bank.up"].shape == (16 // N, 24) and held["1.bank.down"].shape == (24, 16 // N)
    assert split_of(held["1.bank.bias"]) is None and split_of(held["1.gate.weight"]) is None


class HalfCut(BankBlock):
    tp_plan = {"bank": "tokenwise", "bank.up": Shard(0), "bank.down": Shard(1)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("plan,message", [
    (HalfCut.tp_plan, r"bank: a tokenwise module .* parameters \['bias'\] are neither cut"),
    ({**HalfCut.tp_plan, "bank.bias": Once(), "bank.scale": Shard(0)},
     r"'bank.scale' \(Shard.*names no parameter"),
    ({**HalfCut.tp_plan, "bank.bias": Shard(1)}, r"Shard cuts dimension 1 of a parameter of "
                                                  r"shape \(24,\)")], ids=["whole", "typo", "dim"])
def test_a_parameter_plan_that_does_not_fit_is_refused_naming_it(plan, message):
    from test_tensor_mpi import UserEmbed, UserHead
    layers = [pf.LayerSpec(UserEmbed), pf.LayerSpec(HalfCut), pf.LayerSpec(UserHead)]
    HalfCut.tp_plan = plan
    try:
        with pytest.raises(pf.ConfigError, match=message):
            pf.Engine(layers, hf.causal_lm_loss_sum, sgd, pf.Config(tensor=N))
    finally:
        HalfCut.tp_plan = {"bank": "tokenwise", "bank.up": Shard(0), "bank.down": Shard(1)}


if not FOUR:       # not collected at all (a skip under mpirun is an error)
    del test_moe_family_at_p2xt2_trains_like_transformers
