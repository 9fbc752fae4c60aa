"""The tensor axis: tensor-parallel training equals `build_sequential` trained in one process.

Run under `mpirun -n 2` (grid t2) and `-n 4` (t4, p2×t2, d2×t2) with `--with-mpi`. The GPT's
blocks are cut by their `tp_plan` (attention by heads, the MLP by its inner width); a model of
the user's own needs only that dictionary; a plan the degree does not fit is refused on every
rank; checkpoints hold whole tensors, so they move between tensor degrees.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import pipeflow as pf
from pipeflow.runtime import tensor_parallel
from pipeflow.models.gpt import GPTConfig, gpt_layers, gpt_loss
from pipeflow.schedules.registry import names as schedule_names

from toy import allgather, assert_same_parameters, bcast, sgd, train_reference

WORLD = MPI.COMM_WORLD
N = WORLD.size
# (pipeline, data, tensor) grids of this world with tensor > 1
GRIDS = {2: [(1, 1, 2)], 4: [(1, 1, 4), (2, 1, 2), (1, 2, 2)]}.get(N, [])
BATCH, SEQ, VOCAB = 8, 8, 64


def gpt(tied: bool = False, n_layers: int = 4, dropout: float = 0.0):
    return gpt_layers(GPTConfig(n_layers=n_layers, d_model=32, n_heads=4, seq_len=SEQ,
                                vocab_size=VOCAB, tie_embeddings=tied, dropout=dropout))


def data(steps: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(steps)]


def adamw(params):
    # Adam divides by the gradient's own size: where that is near eps (the key projection's
    # bias has a gradient of exactly zero in exact arithmetic: softmax ignores a shift of
    # every score), fp32 rounding noise, which differs with any reordering of sums, is
    # amplified by about lr / (4 eps). eps 1e-6 and lr 1e-3 keep that under the tolerance;
    # SGD (no such division) checks the gradients at 1e-5.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def reference(layers, steps, optimizer, loss_fn=gpt_loss, clip=0.0):
    return train_reference(layers, steps, clip=clip, optimizer=optimizer, criterion=loss_fn)


def check(layers, grid, optimizer, rtol, loss_fn=gpt_loss, steps=3, **config):
    p, d, t = grid
    engine = pf.Engine(layers, loss_fn, optimizer,
                       pf.Config(pipeline=p, data=d, tensor=t, **config))
    batches = data(steps)
    losses = [engine.train_step(x, y) for x, y in batches]
    model, ref_losses = reference(layers, batches, optimizer, loss_fn, config.get("clip", 0.0))
    assert losses == pytest.approx(ref_losses, rel=rtol)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, model.state_dict(), rtol=rtol)
    return engine


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "p%dxd%dxt%d" % g)
@pytest.mark.parametrize("optimizer,rtol", [(sgd, 1e-5), (adamw, 1e-4)], ids=["sgd", "adamw"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_tensor_grid_trains_like_one_process(grid, optimizer, rtol, tied, sp):
    engine = check(gpt(tied), grid, optimizer, rtol, microbatches=2, sequence_parallel=sp)
    # Each rank holds its slices only: a block's qkv weight is 1/t of the whole.
    t = grid[2]
    held = {n: p.shape for n, p in engine.stage.module.named_parameters()}
    for name, shape in held.items():
        if name.endswith("qkv.weight"):
            assert shape == (3 * 32 // t, 32), (name, shape)
        if name.endswith("mlp_proj.weight"):
            assert shape == (32, 4 * 32 // t), (name, shape)
        if name.endswith("ln_1.weight"):
            assert shape == (32,), (name, shape)
        if name.endswith(("tokens.weight", "lm_head.weight")):   # the vocabulary cut
            assert shape == (VOCAB // t, 32), (name, shape)
    # Whole logits are never built: the head gives this rank's slice of the vocabulary, the
    # loss takes it as it is (the vocabulary-parallel cross-entropy).
    seen, hook = [], None
    if engine.stage.vocab_logits:
        head = engine.stage.module.get_submodule(str(engine.stage.n_layers - 1))
        hook = head.register_forward_hook(lambda _m, _a, out: seen.append(out.shape[-1]))
    engine.train_step(*data(1)[0])            # every rank: a step is collective
    if hook is not None:
        hook.remove()
        assert seen and set(seen) == {VOCAB // t}, seen
    assert engine.stage.vocab_logits == engine.stage.plan.holds_last(engine.stage.index)


# Grids of 4 ranks only: collected under `mpirun -n 4` alone (see the end of the file).
FOUR = N == 4


# Every registered schedule, each with a recompute policy (all five over the seven), and
# 1F1B with full recomputation besides.
POLICIES = ["none", "full", "every:2", "selective", "auto"]
SCHEDULE_CASES = [(name, POLICIES[i % len(POLICIES)])
                  for i, name in enumerate(schedule_names())] + [("1f1b", "full")]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule,recompute", SCHEDULE_CASES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_pipeline_by_tensor_every_schedule(schedule, recompute, sp):
    v = 2 if schedule == "interleaved" else 1
    check(gpt(tied=True, n_layers=6), (2, 1, 2), sgd, 1e-5, microbatches=4,
          schedule=schedule, virtual_stages=v, recompute=recompute, clip=0.05,
          sequence_parallel=sp, activation_budget_mb=0.05)


@pytest.mark.mpi(min_size=2)
def test_clip_bites_and_counts_each_slice_once():
    """The gradient norm spans the tensor group: each slice once, each whole weight once. A
    clip below the norm then scales every rank alike; a norm that counted a replicated
    weight t times (or a slice once only) would clip by another factor."""
    grid = GRIDS[0]
    engine = check(gpt(), grid, sgd, 1e-5, clip=0.05)
    assert engine.stats.grad_norm > 0.05, "the clip never bit: the test would prove nothing"
    model = pf.build_sequential(gpt(), 0)
    x, y = data(3)[0]
    gpt_loss(model(x), y).backward()
    norms = allgather(WORLD, engine.stats.grad_norm)
    assert len(set(norms)) == 1



@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_torch_distributed_backend_trains_like_one_process(sp):
    """The tensor group's collectives over torch.distributed (gloo here, NCCL on GPUs): the
    all-gathers and reduce-scatters of sequence parallelism and the vocabulary included."""
    check(gpt(tied=True), GRIDS[0], sgd, 1e-5, microbatches=2, sequence_parallel=sp,
          backend="gloo")

class UserMLP(nn.Module):
    """A model of the user's own: only the tp_plan says how it splits."""

    tp_plan = {"up": "colwise", "down": "rowwise"}

    def __init__(self, width: int = 24, inner: int = 48) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class UserEmbed(nn.Module):
    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)

    def forward(self, ids):
        return self.emb(ids)


class UserHead(nn.Module):
    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.out = nn.Linear(width, VOCAB)

    def forward(self, x):
        return self.out(x)


def user_layers(inner: int = 48):
    return [pf.LayerSpec(UserEmbed), pf.LayerSpec(UserMLP, 24, inner),
            pf.LayerSpec(UserMLP, 24, inner), pf.LayerSpec(UserHead)]


@pytest.mark.mpi(min_size=2)
def test_users_own_model_with_a_tp_plan_trains_like_one_process():
    check(user_layers(), GRIDS[0], adamw, 1e-4)


@pytest.mark.mpi(min_size=2)
def test_a_width_the_degree_does_not_divide_is_refused_on_every_rank():
    t = N
    inner = 6 * t + 1 if t > 1 else 7          # not divisible by t
    with pytest.raises(pf.ConfigError) as err:
        pf.Engine(user_layers(inner), gpt_loss, adamw, pf.Config(tensor=t))
    text = str(err.value)
    assert "UserMLP" in text and "out_features" in text and str(inner) in text, text
    assert "tensor degrees that would" in text, text



@pytest.mark.mpi(min_size=2)
def test_a_sequence_the_degree_does_not_divide_is_refused_under_sequence_parallelism():
    engine = pf.Engine(gpt(), gpt_loss, sgd, pf.Config(tensor=N, sequence_parallel=True))
    x = torch.randint(0, VOCAB, (4, N + 1))
    with pytest.raises(pf.ConfigError, match=rf"cuts the sequence \({N + 1} positions.* over "
                                             rf"tensor = {N}, which does not divide it"):
        engine.train_step(x, x)

@pytest.mark.mpi(min_size=2)
def test_a_model_without_any_tp_plan_is_refused():
    from toy import loss_fn, toy_layers
    with pytest.raises(pf.ConfigError, match="no layer of the model declares a tp_plan"):
        pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(tensor=N))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("resume", [(1, 1, 4), (4, 1, 1), (1, 4, 1)], ids=str)
def test_checkpoint_of_p2xt2_resumes_on_other_tensor_degrees(resume, tmp_path):
    """Saved at p2 x t2 after two steps, loaded on t4, on p4 (t1) and on d4 (t1): the third
    step lands where one process's third step does."""
    folder = bcast(WORLD, str(tmp_path))
    layers, batches = gpt(tied=True), data(3)
    first = pf.Engine(layers, gpt_loss, adamw, pf.Config(pipeline=2, tensor=2))
    for x, y in batches[:2]:
        first.train_step(x, y)
    first.save(folder)
    first.close()
    p, d, t = resume
    second = pf.Engine(layers, gpt_loss, adamw, pf.Config(pipeline=p, data=d, tensor=t))
    second.load(folder)
    second.train_step(*batches[2])
    model, _ = reference(layers, batches, adamw)
    full = second.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, model.state_dict(), rtol=1e-4)




@pytest.mark.mpi(min_size=2)
def test_memory_falls_by_the_tensor_degree():
    """Each rank's model states are at most 1/t of one rank's at t = 1 plus the replicated
    share; with sequence parallelism its activations per micro-batch at most 0.55x at t = 2
    (each rank keeps its slice of the sequence outside attention)."""
    t = N
    layers = gpt(n_layers=6)      # blocks dominate, as in any model worth cutting
    x, y = data(1)[0]
    reports = {}
    for name, world, config in [
            ("t1", MPI.COMM_SELF, pf.Config()),
            ("tp", WORLD, pf.Config(tensor=t)),
            ("sp", WORLD, pf.Config(tensor=t, sequence_parallel=True))]:
        engine = pf.Engine(layers, gpt_loss, adamw, config, comm=world,
                           measure_activations=True)
        engine.train_step(x, y)
        reports[name] = engine.memory_report()
        engine.close()
    one, tp, sp = reports["t1"], reports["tp"], reports["sp"]
    replicated = tp["replicated_working"]
    assert 0 < replicated < one["working"] / 4
    for kind in ("working", "gradients", "optimizer_state"):
        share = replicated * (2 if kind == "optimizer_state" else 1)   # AdamW: two moments
        assert tp[kind] <= one[kind] / t + share + 64, (kind, tp[kind], one[kind], share)
    assert sp["activations_peak"] <= (0.55 if t == 2 else 0.35) * one["activations_peak"], \
        (sp["activations_peak"], one["activations_peak"])
    assert tp["activations_peak"] > sp["activations_peak"]


POISON = {"on": False}


class _Poison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf") if POISON["on"] else grad


class Injector(nn.Module):
    """Identity; an infinite gradient backward while armed on this rank."""

    def forward(self, x):
        return _Poison.apply(x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_fp16_overflow_on_one_tensor_rank_skips_the_step_on_every_rank(sp):
    """The overflow verdict spans the tensor group: an infinite gradient on the last tensor
    rank only skips the step and halves the scale on every rank, as one process would;
    good steps then take one process's fp16 decisions."""
    layers = gpt()
    layers.insert(1, pf.LayerSpec(Injector))
    engine = pf.Engine(layers, gpt_loss, sgd,
                       pf.Config(tensor=N, precision="fp16", initial_loss_scale=1024.0,
                                 loss_scale_interval=2, sequence_parallel=sp))
    steps = data(4)
    engine.train_step(*steps[0])
    before = [m.detach().clone() for m in engine.stage.precision.masters]
    POISON["on"] = engine.stage.topo.tensor_rank == N - 1
    engine.train_step(*steps[1])
    POISON["on"] = False
    assert all(torch.equal(b, m) for b, m in zip(before, engine.stage.precision.masters))
    assert allgather(WORLD, (engine.loss_scale, engine.stats.skipped_steps)) == \
        [(512.0, 1)] * N
    for x, y in steps[2:]:
        engine.train_step(x, y)
    assert allgather(WORLD, engine.loss_scale) == [1024.0] * N
    engine.close()


# -- transformers models: the Llama-shaped families split, a config that cannot is refused --

def _hf_config(kind: str):
    """A family's small config, "NAME-kvK" with K key/value heads (N by default)."""
    transformers = pytest.importorskip("transformers")
    kind, _, kv = kind.partition("-kv")
    shape = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=int(kv or N), vocab_size=VOCAB,
                 max_position_embeddings=SEQ * 2)
    if kind == "falcon":     # multi_query: one key/value head for every query head
        return transformers.FalconConfig(num_hidden_layers=2, hidden_size=32,
                                         num_attention_heads=4, vocab_size=VOCAB,
                                         multi_query=True, new_decoder_architecture=False)
    return {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[kind](
                **shape, **({"head_dim": 8} if kind == "qwen3" else {}))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
# -kvK: fewer key/value heads than ranks, each rank computing the one its query heads read
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "llama-kv1",
                                  *(["qwen3-kv2"] if N == 4 else [])])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_llama_shaped_transformers_families_split_like_one_process(kind, sp):
    """Grouped-query attention (as many key/value heads as tensor ranks), padding masks as
    side inputs, the summed loss over valid tokens: equal to one process at t = world."""
    from pipeflow.models import hf
    cfg = _hf_config(kind)
    layers = hf.causal_lm_layers(cfg)
    engine = pf.Engine(layers, hf.causal_lm_loss_sum, sgd,
                       pf.Config(tensor=N, microbatches=2, sequence_parallel=sp),
                       count_items=hf.num_valid_tokens)
    replicated = [m for m in engine.stage.module.modules()
                  if isinstance(m, tensor_parallel.ReplicatedHeads)]
    assert len(replicated) == (4 if cfg.num_key_value_heads < N else 0)   # k and v, 2 blocks
    gen = torch.Generator().manual_seed(5)
    steps = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=gen)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        steps.append((ids, ids.masked_fill(mask == 0, -100), mask))
    losses = [engine.train_step(ids, labels, attention_mask=mask)
              for ids, labels, mask in steps]
    # The reference: transformers' own model from the same start, trained on whole batches
    # with SGD at test_hf_mpi's rate (its LR is toy.sgd's).
    from test_hf_mpi import LR, _train_transformers
    assert sgd(list(nn.Linear(1, 1).parameters())).defaults["lr"] == LR
    expected, ref = _train_transformers(cfg, pf.build_sequential(layers, 0).state_dict(), steps)
    assert losses == pytest.approx(ref, rel=1e-5)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        trained = hf.to_hf_state_dict(full, cfg)
        for key, value in expected.items():
            diff = (trained[key] - value).norm() / value.norm().clamp(min=1e-12)
            assert diff < 1e-5, (key, float(diff))


@pytest.mark.mpi(min_size=2)
def test_a_config_without_a_tensor_plan_is_refused_with_the_reason():
    from pipeflow.models import hf
    cfg = _hf_config("falcon")
    with pytest.raises(pf.ConfigError, match="'falcon' splits over a tensor group, but not "
                                             "this config: multi_query=True keeps one"):
        pf.Engine(hf.causal_lm_layers(cfg), hf.causal_lm_loss_sum, sgd, pf.Config(tensor=N),
                  count_items=hf.num_valid_tokens)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("optimizer,rtol", [(sgd, 1e-5), (adamw, 1e-4)], ids=["sgd", "adamw"])
def test_sharded_optimizer_at_d2xt2_trains_like_one_process(optimizer, rtol, tmp_path):
    """Each tensor rank's replicas shard its slices' masters and optimizer state; the norm
    counts whole weights once (a clip that bites); a checkpoint of it resumes unsharded at t4."""
    engine = check(gpt(tied=True), (1, 2, 2), optimizer, rtol, microbatches=2,
                   shard_optimizer=True, clip=0.05)
    assert engine.stats.grad_norm > 0.05
    folder = bcast(WORLD, str(tmp_path))
    engine.save(folder)
    engine.close()
    other = pf.Engine(gpt(tied=True), gpt_loss, optimizer, pf.Config(tensor=4, clip=0.05))
    other.load(folder)
    batches = data(4)
    other.train_step(*batches[3])
    model, _ = reference(gpt(tied=True), batches, optimizer, clip=0.05)
    full = other.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, model.state_dict(), rtol=rtol)



@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_eval_and_generation_at_tensor_degree_match_one_process(sp):
    """Logits of eval_step and greedy generation (the key/value cache's decode path, the
    sequence whole while decoding) equal one rank's after the same training."""
    layers = gpt(n_layers=2)
    fast = lambda ps: torch.optim.AdamW(ps, lr=3e-2)       # noqa: E731
    engines = {t: pf.Engine(layers, gpt_loss, fast, pf.Config(tensor=t, sequence_parallel=sp
                                                               and t > 1), comm=comm)
               for t, comm in ((1, MPI.COMM_SELF), (N, WORLD))}
    for x, _ in data(12):          # learn "the next token is this one plus 1": varied output
        for e in engines.values():
            e.train_step(x, (x + 1) % VOCAB)
    # The same weights on both (training's equivalence is the other tests' business).
    engines[1].load_state_dict(bcast(WORLD, engines[N].gather_state_dict()))
    x, _ = data(1, seed=9)[0]
    logits = {t: e.eval_step(x) for t, e in engines.items()}
    prompt = x[:2, :3].tolist()
    group = engines[N].stage.tensor
    gathers = []
    real = group.comm.iallgather_
    group.comm.iallgather_ = lambda *a, **k: gathers.append(k.get("key")) or real(*a, **k)
    tokens = {t: e.generate(prompt, max_new_tokens=4) for t, e in engines.items()}
    del group.comm.iallgather_
    # Decoding cuts no sequence: a few new positions a call, each rank's cache whole (with
    # sequence parallelism left on, the column layers gathered duplicates of every position).
    assert [k for k in gathers if "logits" not in k] == [], gathers[:3]
    if WORLD.rank == 0:
        assert torch.allclose(logits[N], logits[1], rtol=1e-4, atol=1e-5)
        assert tokens[N] == tokens[1], tokens
        assert len({tok for row in tokens[1] for tok in row}) > 1, "degenerate: proves little"
    for e in engines.values():
        e.close()


class FrozenUp(UserMLP):
    """A cut layer whose column weight is frozen: its slices stay put on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.up.requires_grad_(False)


@pytest.mark.mpi(min_size=2)
def test_a_frozen_cut_weight_stays_put_and_the_rest_trains_like_one_process():
    layers = [pf.LayerSpec(UserEmbed), pf.LayerSpec(FrozenUp), pf.LayerSpec(UserMLP),
              pf.LayerSpec(UserHead)]
    engine = check(layers, GRIDS[0], adamw, 1e-4)
    start = pf.build_sequential(layers, 0).state_dict()
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert torch.equal(full["1.up.weight"], start["1.up.weight"])

if not FOUR:       # not collected at all (a skip under mpirun is an error)
    del (test_pipeline_by_tensor_every_schedule,
         test_checkpoint_of_p2xt2_resumes_on_other_tensor_degrees,
         test_sharded_optimizer_at_d2xt2_trains_like_one_process)


# -- dropout: one mask where the activation is whole, each rank its own on slices ----------

MASKS: dict[str, list] = {}


class DropMLP(UserMLP):
    """Dropout on the inner slice (between the column and the row layer) and on the whole
    output; each records which of its outputs it dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.inner_drop, self.outer_drop = nn.Dropout(0.5), nn.Dropout(0.5)
        for name in ("inner_drop", "outer_drop"):
            getattr(self, name).register_forward_hook(
                lambda _m, _args, out, name=name: MASKS.setdefault(name, []).append(
                    (out == 0).tolist()))

    def forward(self, x):
        # + 1: no input entry is 0, so an output 0 is a dropped entry
        inner = torch.relu(self.up(self.norm(x))) + 1.0
        return x + self.outer_drop(self.down(self.inner_drop(inner)) + 1.0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_dropout_draws_one_mask_on_whole_activations_and_its_own_on_slices(sp):
    """On a whole activation every tensor rank must drop the same entries (or their copies
    of it part); on a slice (this rank's inner features; under sequence parallelism, its
    positions) the ranks' masks must differ, as one process's masks differ between heads or
    positions. With one shared stream, slices would all be dropped alike. The masks come back
    when the layer is recomputed, and the tensor ranks' whole weights stay equal."""
    layers = [pf.LayerSpec(UserEmbed), pf.LayerSpec(DropMLP), pf.LayerSpec(UserHead)]
    runs = {}
    for recompute in ("none", "full"):
        MASKS.clear()
        engine = pf.Engine(layers, gpt_loss, sgd,
                           pf.Config(tensor=N, sequence_parallel=sp, recompute=recompute,
                                     microbatches=2))
        losses = [engine.train_step(x, y) for x, y in data(2)]
        runs[recompute] = (losses, engine.gather_state_dict(), dict(MASKS))
        whole = {k: v for k, v in engine.stage.module.state_dict().items()
                 if "norm" in k or "down.bias" in k}
        views = allgather(WORLD, whole)
        for k in whole:
            assert all(torch.equal(v[k], views[0][k]) for v in views), k
        engine.close()
    (losses, state, masks), (re_losses, re_state, re_masks) = runs["none"], runs["full"]
    assert losses == re_losses
    # full recomputation runs each forward twice: the replay drew the same masks
    for name in masks:
        assert sorted(map(str, re_masks[name])) == sorted(map(str, masks[name] * 2)), name
    if WORLD.rank == 0:
        for k in state:
            assert torch.equal(state[k], re_state[k]), k
    inner = allgather(WORLD, masks["inner_drop"])
    outer = allgather(WORLD, masks["outer_drop"])
    assert all(m != inner[0] for m in inner[1:]), "slices dropped alike on every rank"
    if sp:
        assert all(m != outer[0] for m in outer[1:]), "positions dropped alike on every rank"
    else:
        assert all(m == outer[0] for m in outer[1:]), "a whole activation dropped apart"


class RoutedBiases(UserMLP):
    """A whole weight that only some positions reach: each position adds the bias of its
    expert, expert 0 for the first half of the sequence, 1 for the second, 2 for position 0
    alone, 3 never. Under sequence parallelism a rank's slice reaches only some experts."""

    def __init__(self) -> None:
        super().__init__()
        self.biases = nn.ParameterList(nn.Parameter(torch.randn(24) * 0.1) for _ in range(4))

    def forward(self, x):
        h = super().forward(x)
        group = getattr(self, "pf_sequence_group", None)     # this rank's place in it
        size, rank = (group.size, group.rank) if group is not None else (1, 0)
        length = h.shape[1] * size
        where = torch.arange(h.shape[1]) + rank * h.shape[1]    # whole-sequence positions
        choice = torch.where(where < length // 2, 0, 1).masked_fill(where == 0, 2)
        for e, bias in enumerate(self.biases):
            picked = (choice == e)[None, :, None]
            if picked.any():
                h = h + picked * bias
        return h


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_whole_weight_only_some_slices_reach_trains_like_one_process():
    """The tensor group sums every whole weight's gradient, zeros where a rank had none,
    and a weight no rank reached (expert 3) keeps no gradient: weight decay skips it as
    torch.optim does in one process."""
    layers = [pf.LayerSpec(UserEmbed), pf.LayerSpec(RoutedBiases), pf.LayerSpec(UserHead)]
    decayed = lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.5)     # noqa: E731
    engine = check(layers, (1, 1, N), decayed, 1e-5, sequence_parallel=True, microbatches=2)
    state = engine.stage.module.state_dict()
    start = pf.build_sequential(layers, 0).state_dict()
    assert torch.equal(state["1.biases.3"], start["1.biases.3"])       # never reached


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["llama", "llama-kv1"])
def test_a_transformers_model_built_sequence_parallel_generates_as_one_process(kind):
    """Generation turns sequence parallelism off for the call: the attention's
    `gather_sequence` must gather nothing then (it gathered, and rotary failed on the
    doubled length). With one key/value head, each rank's cache holds it."""
    from pipeflow.models import hf
    layers = hf.causal_lm_layers(_hf_config(kind))
    tokens = {}
    for t, comm in ((1, MPI.COMM_SELF), (N, WORLD)):
        engine = pf.Engine(layers, hf.causal_lm_loss_sum, sgd,
                           pf.Config(tensor=t, sequence_parallel=t > 1), comm=comm,
                           count_items=hf.num_valid_tokens)
        tokens[t] = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)
        engine.close()
    assert tokens[N] == tokens[1]
