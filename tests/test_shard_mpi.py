"""The distributed optimizer (`Config(shard_optimizer=True)`): the same training as unsharded
and as one process, with 1/d of the masters and optimizer state on each replica.

Run under `mpirun -n 2` (grid 1x2) and `-n 4` (grids 2x2 and 1x4) with `--with-mpi`. The toy
model's tiny buckets (`bucket_mb`) are padded to a multiple of d, so replicas hold blocks of
unequal real content: a block summed or gathered into the wrong place shows.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import pipeflow as pf
from pipeflow.config import ConfigError
from pipeflow.runtime.precision import (bytes_per_parameter, itemsize,
                                        sharded_bytes_per_parameter)

from toy import (VOCAB, Block, Embed, Head, adamw, assert_same_parameters, batches, loss_fn,
                 pair, sgd, sgd_momentum, toy_layers, train_reference)
from toy import allgather, bcast

WORLD = MPI.COMM_WORLD
GRIDS = {2: [(1, 2)], 4: [(2, 2), (1, 4)]}.get(WORLD.size, [])
BATCH = 24
TINY = 0.0005      # MiB: several buckets a stage


class FrozenBlock(Block):
    """A block whose first projection is frozen (requires_grad False)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__(width, hidden)
        self.up.requires_grad_(False)


def _run(layers, optimizer, steps, **config):
    """Train on `steps`; (losses, gathered state on rank 0, engine's stats, working weights)."""
    engine = pf.Engine(layers, loss_fn, optimizer,
                       pf.Config(microbatches=3, bucket_mb=TINY, **config))
    losses = [engine.train_step(x, y) for x, y in steps]
    state = engine.gather_state_dict()
    working = {k: v.detach().clone() for k, v in engine.stage.module.state_dict().items()}
    result = (losses, state, engine.stats.grad_norm, working, engine.loss_scale,
              engine.stats.skipped_steps)
    engine.close()
    return result


def _verdict(ok: bool, text: str) -> None:
    """Every rank fails together (a rank-local assert would leave the others blocked)."""
    views = allgather(WORLD, (ok, text))
    bad = [f"rank {r}: {t}" for r, (o, t) in enumerate(views) if not o]
    assert not bad, "; ".join(bad)


def _same(state, other, rtol):
    try:
        assert_same_parameters(state, other, rtol=rtol)
    except AssertionError as exc:
        return False, str(exc)
    return True, ""


def _replicas_agree(working):
    """Each stage's replicas hold identical working weights after the all-gather."""
    views = allgather(WORLD, working)
    for other in views:
        for k, v in other.items():
            if k in working and not torch.equal(v, working[k]):
                return False, f"working weight {k} differs between replicas"
    return True, ""


CASES = {"sgd": (sgd, False, 0.0), "sgd-momentum-tied-clip": (sgd_momentum, True, 0.3),
         "adamw-tied-clip": (adamw, True, 0.3)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", GRIDS)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_trains_like_unsharded_and_one_process(pipeline, data, schedule, case):
    optimizer, tied, clip = CASES[case]
    layers = toy_layers(tied=tied)
    steps = batches(3, BATCH)
    grid = dict(pipeline=pipeline, data=data, schedule=schedule, clip=clip)
    plain = _run(layers, optimizer, steps, **grid)
    sharded = _run(layers, optimizer, steps, shard_optimizer=True, **grid)
    assert sharded[0] == pytest.approx(plain[0], rel=1e-6)
    if clip:
        assert sharded[2] > clip, "the clip never bit: the test would prove nothing"
        assert sharded[2] == pytest.approx(plain[2], rel=1e-6)
    ok, text = True, ""
    if WORLD.rank == 0:
        reference, ref_losses = train_reference(layers, steps, clip=clip, optimizer=optimizer)
        ok, text = _same(sharded[1], plain[1], 1e-6)
        if ok:
            ok, text = _same(sharded[1], reference.state_dict(), 1e-5)
        if ok and sharded[0] != pytest.approx(ref_losses, rel=1e-5):
            ok, text = False, f"losses {sharded[0]} != one process {ref_losses}"
    _verdict(ok, text)
    _verdict(*_replicas_agree(sharded[3]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", GRIDS)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_sharded_equals_unsharded(pipeline, data, precision):
    # The same fp32 accumulation, sum and update as unsharded: masters agree to fp32 rounding;
    # against one process in fp32 only within low precision's error.
    layers = toy_layers(tied=True)
    steps = batches(3, BATCH)
    grid = dict(pipeline=pipeline, data=data, precision=precision, clip=0.5)
    plain = _run(layers, sgd_momentum, steps, **grid)
    sharded = _run(layers, sgd_momentum, steps, shard_optimizer=True, **grid)
    assert sharded[0] == pytest.approx(plain[0], rel=1e-6)
    assert sharded[4] == plain[4]
    ok, text = True, ""
    if WORLD.rank == 0:
        ok, text = _same(sharded[1], plain[1], 1e-6)
        _, ref_losses = train_reference(layers, steps, clip=0.5, optimizer=sgd_momentum)
        if ok and sharded[0] != pytest.approx(ref_losses, rel=2e-2):
            ok, text = False, f"losses {sharded[0]} far from one process's {ref_losses}"
    _verdict(ok, text)
    _verdict(*_replicas_agree(sharded[3]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", GRIDS)
def test_fp16_overflow_skips_on_every_rank_alike(pipeline, data):
    # A loss scale of 2^30 overflows fp16 gradients: the first steps are skipped everywhere,
    # the scale backs off alike, and the weights follow the unsharded run's.
    layers = toy_layers()
    steps = batches(4, BATCH)
    grid = dict(pipeline=pipeline, data=data, precision="fp16", initial_loss_scale=2.0 ** 30)
    plain = _run(layers, sgd, steps, **grid)
    sharded = _run(layers, sgd, steps, shard_optimizer=True, **grid)
    views = allgather(WORLD, (sharded[4], sharded[5]))
    assert sharded[5] >= 1, "no step overflowed: the test would prove nothing"
    assert views == [views[0]] * WORLD.size
    assert (sharded[4], sharded[5]) == (plain[4], plain[5])
    ok, text = _same(sharded[1], plain[1], 1e-6) if WORLD.rank == 0 else (True, "")
    _verdict(ok, text)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", GRIDS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_parameters_stay_put_and_are_not_sharded(pipeline, data, precision):
    layers = toy_layers(blocks=3)
    layers[2] = pf.LayerSpec(FrozenBlock, layers[2].args[0], layers[2].args[1])
    steps = batches(3, BATCH)
    grid = dict(pipeline=pipeline, data=data, precision=precision)
    plain = _run(layers, adamw, steps, **grid)
    sharded = _run(layers, adamw, steps, shard_optimizer=True, **grid)
    ok, text = True, ""
    if WORLD.rank == 0:
        start = pf.build_sequential(layers, 0).state_dict()
        ok, text = _same(sharded[1], plain[1], 1e-6)
        if ok and not torch.equal(sharded[1]["2.up.weight"], start["2.up.weight"]):
            ok, text = False, "the frozen weight 2.up.weight moved"
        if ok and precision == "fp32":
            reference, _ = train_reference(layers, steps, optimizer=adamw)
            ok, text = _same(sharded[1], reference.state_dict(), 1e-5)
    _verdict(ok, text)


MARK = VOCAB - 1     # the token whose rows a `Gated` layer adds its bias to


class Gated(nn.Module):
    """A bias added only to the rows that hold `MARK`: in a micro-batch without one the bias
    is not in the graph at all (no gradient, not a zero one), as an expert of a mixture that
    no token was routed to."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x):
        h, tokens = x
        rows = (tokens == MARK).any(-1)
        if rows.any():
            h = h + self.bias * rows[:, None, None].to(h.dtype)
        return h, tokens


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", GRIDS)
def test_a_parameter_without_gradient_on_some_replicas_trains_like_one_process(pipeline,
                                                                              data):
    # Step 1 marks a row of the first replica only, step 2 one of the last replica only,
    # step 3 none: the gated bias's bucket gets a gradient on one replica and none on the
    # others (whose hooks never fire for it), then none anywhere. Every replica must still
    # reduce its bucket, and the update is one process's. The marks are in each replica's
    # first micro-batch: no replica's bucket is final in the last backward, so every replica
    # launches it at the end. (A mark in a replica's last micro-batch makes the bucket final
    # there only, and launched there early: the replicas' launch orders then differ, which
    # today sums unrelated buckets; that case waits for the fixed launch order.)
    layers = toy_layers(blocks=2)
    layers.insert(len(layers) - 1, pf.LayerSpec(Gated, layers[1].args[0]))
    steps = []
    for k, marked in enumerate([0, (data - 1) * BATCH // data, None]):
        x, y = batches(1, BATCH, seed=k + 3)[0]
        x = x % MARK
        if marked is not None:
            x[marked, 2] = MARK
        steps.append((x, y))
    grid = dict(pipeline=pipeline, data=data)
    plain = _run(layers, sgd, steps, **grid)
    sharded = _run(layers, sgd, steps, shard_optimizer=True, **grid)
    ok, text = True, ""
    if WORLD.rank == 0:
        start = pf.build_sequential(layers, 0).state_dict()
        reference, _ = train_reference(layers, steps, optimizer=sgd)
        ok, text = _same(sharded[1], reference.state_dict(), 1e-5)
        if ok:
            ok, text = _same(plain[1], reference.state_dict(), 1e-5)
        if ok and torch.equal(sharded[1]["3.bias"], start["3.bias"]):
            ok, text = False, "the gated bias never moved: the test would prove nothing"
    _verdict(ok, text)
    _verdict(*_replicas_agree(sharded[3]))


def _wide_layers(width: int = 64) -> list[pf.LayerSpec]:
    return [pf.LayerSpec(Embed, VOCAB, width), pf.LayerSpec(Block, width, 4 * width),
            pf.LayerSpec(Block, width, 4 * width), pf.LayerSpec(Head, width, VOCAB)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", GRIDS)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_sharded_bytes_per_parameter_meet_the_formula(pipeline, data, precision):
    # AdamW. Megatron-Core's 6 + 12/d bytes a parameter with bf16 weights: 2 (weights) + 4
    # (fp32 gradients, whole: micro-batches accumulate into them) + 12/d (fp32 master and two
    # moments, sharded). pipeflow's model states (masters + optimizer state + gradient
    # buffers, weights not counted) measure 4 + 16/d: the same 4 + 12/d plus the block of
    # the summed gradient the reduce-scatter writes (4/d), plus padding; at most
    # 6 + 12/d + 0.5 for d >= 2. Unsharded they are 4 + 4 + 8 = 16 (fp32: 4 + 8, the weights
    # are the masters). fp32 sharded keeps an fp32 master block too (the optimizer steps the
    # block, the weights are whole): 4 + 16/d as bf16. The planner's formulas
    # (`sharded_bytes_per_parameter`, `bytes_per_parameter`) are what the runtime measures.
    config = dict(pipeline=pipeline, data=data, microbatches=2, precision=precision)
    reports = {}
    for shard in (False, True):
        engine = pf.Engine(_wide_layers(), loss_fn, adamw,
                           pf.Config(shard_optimizer=shard, **config))
        engine.train_step(*batches(1, 4 * data)[0])    # the optimizer's state exists now
        reports[shard] = engine.memory_report()
        engine.close()
    per = reports[True]["bytes_per_parameter"]
    states, whole = per["model_states"], reports[False]["bytes_per_parameter"]["model_states"]
    work = itemsize(precision)
    formula = sharded_bytes_per_parameter(precision, data) - work
    ok = states <= 6 + 12 / data + 0.5 and states == pytest.approx(4 + 16 / data, abs=0.05) \
        and states == pytest.approx(formula, abs=0.05) \
        and whole == pytest.approx(bytes_per_parameter(precision) - work, abs=0.01)
    _verdict(ok, f"{precision}: sharded model states {states:.3f} B/param (measured; formula "
                 f"{formula:.3f}, 6 + 12/{data} + 0.5 = {6 + 12 / data + 0.5:.2f}, expected "
                 f"4 + 16/{data}); unsharded {whole:.3f} (formula "
                 f"{bytes_per_parameter(precision) - work}); {per}")
    assert per["optimizer_state"] == pytest.approx(8 / data, abs=0.05)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer", [adamw, sgd_momentum], ids=["adamw", "sgd-momentum"])
def test_sharded_checkpoint_resumes_on_other_data_sizes(tmp_path_factory, optimizer):
    # Saved at d = 2 sharded (each pair of ranks); resumed at d = 1 (unsharded, one rank)
    # and, on 4 ranks, at d = 4 sharded: the same as two more steps of the d = 2 run.
    layers = toy_layers(tied=True)
    steps = batches(4, BATCH)
    folder = bcast(WORLD, str(tmp_path_factory.mktemp("shard")) if WORLD.rank == 0 else None)
    folder = f"{folder}/pair{WORLD.rank // 2}"
    comm = pair()
    config = dict(pipeline=1, microbatches=3, bucket_mb=TINY, shard_optimizer=True)
    engine = pf.Engine(layers, loss_fn, optimizer, pf.Config(data=2, **config), comm=comm)
    for x, y in steps[:2]:
        engine.train_step(x, y)
    engine.save(folder)
    for x, y in steps[2:]:
        engine.train_step(x, y)
    uninterrupted = engine.gather_state_dict()
    engine.close()
    comm.Free()
    results = []
    for data in [1, 4][:WORLD.size // 2]:
        sub = MPI.COMM_SELF if data == 1 else WORLD
        source = bcast(WORLD, folder if WORLD.rank == 0 else None) if data == 4 else folder
        resumed = pf.Engine(layers, loss_fn, optimizer, pf.Config(data=data, **config),
                            comm=sub)
        resumed.load(source)
        for x, y in steps[2:]:
            resumed.train_step(x, y)
        results.append((data, resumed.gather_state_dict()))
        resumed.close()
    # The whole states are on the first rank of each engine's ranks: the uninterrupted one
    # on ranks 0 and 2 (each pair's first), d = 1 on every rank, d = 4 on rank 0.
    ok, text = True, ""
    for data, state in results:
        if ok and state is not None and uninterrupted is not None:
            ok, text = _same(state, uninterrupted, 1e-6)
            text = f"resumed at d = {data}: {text}"
    _verdict(ok, text)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["gloo", "strict"])
def test_torch_distributed_and_strict_paths_match_mpi(backend):
    # reduce_scatter_tensor / all_gather_into_tensor (NCCL's code path, gloo on CPUs), and
    # the MPI collectives under NCCL's rules (every rank issues the same collectives).
    pipeline, data = GRIDS[0]
    layers = toy_layers(tied=True)
    steps = batches(2, BATCH)
    grid = dict(pipeline=pipeline, data=data, clip=0.3, shard_optimizer=True)
    via_mpi = _run(layers, sgd, steps, backend="mpi", **grid)
    other = _run(layers, sgd, steps, backend=backend, **grid)
    ok, text = _same(other[1], via_mpi[1], 1e-6) if WORLD.rank == 0 else (True, "")
    _verdict(ok, f"backend {backend}: {text}")


class _Whole(torch.optim.Optimizer):
    """An optimizer of the user's that does not say its state is per element."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make,named", [
    (lambda ps: torch.optim.LBFGS(ps), "LBFGS"),
    (lambda ps: _Whole(ps), "_Whole")], ids=["lbfgs", "unknown"])
def test_whole_tensor_optimizers_are_refused(make, named):
    pipeline, data = GRIDS[0]
    with pytest.raises(ConfigError, match=f"shard_optimizer.*{named}"):
        pf.Engine(toy_layers(), loss_fn, make,
                  pf.Config(pipeline=pipeline, data=data, shard_optimizer=True))


@pytest.mark.mpi(min_size=2)
def test_param_group_settings_are_kept_per_group():
    # No weight decay on biases, decay on the rest: each block steps in its own group.
    def grouped(params):
        biases = [p for p in params if p.dim() == 1]
        rest = [p for p in params if p.dim() != 1]
        return torch.optim.AdamW([{"params": rest, "weight_decay": 0.5},
                                  {"params": biases, "weight_decay": 0.0, "lr": 0.03}],
                                 lr=1e-2)

    pipeline, data = GRIDS[0]
    layers = toy_layers()
    steps = batches(2, BATCH)
    plain = _run(layers, grouped, steps, pipeline=pipeline, data=data)
    sharded = _run(layers, grouped, steps, pipeline=pipeline, data=data, shard_optimizer=True)
    ok, text = True, ""
    if WORLD.rank == 0:
        reference, _ = train_reference(layers, steps, optimizer=grouped)
        ok, text = _same(sharded[1], plain[1], 1e-6)
        if ok:
            ok, text = _same(sharded[1], reference.state_dict(), 1e-5)
    _verdict(ok, text)


@pytest.mark.mpi(min_size=2)
def test_a_sharded_resume_loads_through_the_optimizers_own_load_state_dict(tmp_path_factory):
    # As an unsharded resume does: the optimizer's rules for its state (a fused or capturable
    # AdamW wants `step` on the parameters' device, which only a GPU can show) and its load
    # hooks apply, instead of state written into `optimizer.state` behind its back.
    folder = bcast(WORLD, str(tmp_path_factory.mktemp("hooks")) if WORLD.rank == 0 else None)
    comm = pair()
    folder = f"{folder}/pair{WORLD.rank // 2}"
    config = pf.Config(pipeline=1, data=2, microbatches=2, bucket_mb=TINY, shard_optimizer=True)
    engine = pf.Engine(toy_layers(), loss_fn, adamw, config, comm=comm)
    engine.train_step(*batches(1, BATCH)[0])
    engine.save(folder)
    loaded = []
    engine.stage.optimizer.register_load_state_dict_post_hook(lambda opt: loaded.append(opt))
    engine.load(folder)
    steps = [st["step"] for st in engine.stage.optimizer.state.values()]
    engine.close()
    comm.Free()
    assert loaded == [engine.stage.optimizer]
    assert steps and all(torch.is_tensor(s) and float(s) == 1.0 for s in steps)


@pytest.mark.mpi(min_size=2)
def test_every_replicas_block_starts_aligned():
    # Blocks of a bucket padded only to a multiple of d start at odd offsets (a bucket of
    # 1,001 elements on 2 replicas: the second block at element 501), which the collectives'
    # and optimizers' vector kernels take slowly or not at all.
    comm = pair()
    config = pf.Config(pipeline=1, data=2, microbatches=2, bucket_mb=TINY, shard_optimizer=True,
                       precision="bf16")
    engine = pf.Engine(toy_layers(), loss_fn, adamw, config, comm=comm)
    for b in engine.stage.shards.buckets:
        assert b.block.start * 4 % 256 == 0 and b.flat.numel() % (2 * 64) == 0, b.block
        offset = b.weights[b.block].data_ptr() - b.weights.data_ptr()
        assert offset % 128 == 0, (offset, b.weights.dtype)        # bf16: 64 elements
    engine.close()
    comm.Free()

def _two_groups(params):
    """AdamW in two groups, each with settings of its own (no weight decay on biases)."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                              {"params": [p for p in params if p.dim() <= 1], "lr": 0.03,
                               "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)


def _settings(engine):
    return [{k: v for k, v in g.items() if k != "params"}
            for g in engine.stage.optimizer.param_groups]


def _changed(saved, loaded) -> str:
    """The group settings that differ, named: '' when none."""
    if len(saved) != len(loaded):
        return f"{len(saved)} groups saved, {len(loaded)} loaded"
    return "; ".join(f"group {i} {k}: saved {a[k]}, loaded {b.get(k)}"
                     for i, (a, b) in enumerate(zip(saved, loaded)) for k in a
                     if b.get(k) != a[k])


@pytest.mark.mpi(min_size=2)
@pytest.mark.filterwarnings("ignore:.*the random state is not restored")
def test_a_sharded_resume_keeps_each_groups_own_and_changed_settings(tmp_path_factory):
    # Each group's settings, its own from the factory and those changed after the build (a
    # scheduler's lr, by hand), come back from a sharded checkpoint: on the same grid
    # (sharded, d = 2) and on one rank (unsharded), and the steps after equal the run that
    # never stopped.
    layers = toy_layers()
    steps = batches(4, BATCH)
    folder = bcast(WORLD, str(tmp_path_factory.mktemp("groups")) if WORLD.rank == 0 else None)
    folder = f"{folder}/pair{WORLD.rank // 2}"
    comm = pair()
    config = dict(pipeline=1, microbatches=3, bucket_mb=TINY)
    engine = pf.Engine(layers, loss_fn, _two_groups,
                       pf.Config(data=2, shard_optimizer=True, **config), comm=comm)
    engine.train_step(*steps[0])
    for group, change in zip(engine.stage.optimizer.param_groups,
                             [dict(lr=3e-3, betas=(0.8, 0.95)), dict(lr=2e-2, eps=1e-6)]):
        group.update(change)
    engine.train_step(*steps[1])
    engine.save(folder)
    saved = _settings(engine)
    for x, y in steps[2:]:
        engine.train_step(x, y)
    uninterrupted = engine.gather_state_dict()
    engine.close()
    problems = []
    for data, sub in [(2, comm), (1, MPI.COMM_SELF)]:
        resumed = pf.Engine(layers, loss_fn, _two_groups,
                            pf.Config(data=data, shard_optimizer=data > 1, **config), comm=sub)
        resumed.load(folder)
        changed = _changed(saved, _settings(resumed))
        if changed:
            problems.append(f"resumed at d = {data}: {changed}")
        for x, y in steps[2:]:
            resumed.train_step(x, y)
        state = resumed.gather_state_dict()
        if state is not None and uninterrupted is not None and not problems:
            ok, text = _same(state, uninterrupted, 1e-6)
            if not ok:
                problems.append(f"resumed at d = {data}: {text}")
        resumed.close()
    comm.Free()
    _verdict(not problems, "; ".join(problems))


# -- one step, the all-gather overlapped with the next step's forwards ----------------------

class _Logged:
    """A collective's request that logs its tests and waits (`_record_gathers`)."""

    def __init__(self, inner, key, log) -> None:
        self.inner, self.key, self.log = inner, key, log

    def test(self) -> bool:
        self.log.append(("test", self.key))
        return self.inner.test()

    def wait(self):
        self.log.append(("wait", self.key))
        return self.inner.wait()


def _record(engine, log, op: str = "iallgather_"):
    """Log the launch, tests and waits of the data group's `op` collectives in `log`."""
    comm = engine.stage.shards.comm
    real = getattr(comm, op)

    def launch(*args, key=None):
        log.append(("launch", key))
        return _Logged(real(*args, key=key), key, log)
    setattr(comm, op, launch)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_one_optimizer_step_per_engine_step():
    # Many buckets in two parameter groups: the optimizer steps once a train_step (its step
    # hooks run once, as unsharded), not once a bucket.
    pipeline, data = GRIDS[0]
    engine = pf.Engine(toy_layers(), loss_fn, _two_groups,
                       pf.Config(pipeline=pipeline, data=data, microbatches=3, bucket_mb=1e-9,
                                 shard_optimizer=True, clip=0.3))     # a bucket a parameter
    calls = []
    engine.stage.optimizer.register_step_post_hook(
        lambda opt, args, kwargs: calls.append(engine.stats.step))
    for x, y in batches(3, BATCH):
        engine.train_step(x, y)
    buckets = len(engine.stage.shards.buckets)
    engine.close()
    assert buckets >= 4, "a bucket or two: the test would prove little"
    assert calls == [0, 1, 2], f"{buckets} buckets: optimizer.step ran at steps {calls}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("pipeline,data", GRIDS)
@pytest.mark.parametrize("backend", ["mpi", "gloo", "strict"])
def test_the_all_gather_runs_into_the_next_steps_forwards(pipeline, data, backend):
    # train_step returns with every bucket's all-gather in flight; the next step waits for
    # a bucket just before the first forward of a layer it holds, on the first stage
    # (whose first instruction is a forward) layer by layer: later layers' gathers are
    # still in flight while the earlier layers run. A gather_state_dict right after a step
    # is one process's model, and so are the working weights it leaves.
    layers = toy_layers(tied=True)
    steps = batches(3, BATCH)
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=pipeline, data=data, microbatches=3, bucket_mb=TINY,
                                 shard_optimizer=True, clip=0.3, backend=backend))
    shards, log = engine.stage.shards, []
    _record(engine, log)
    layer_of = {}
    for name, layer in engine.stage.module.named_children():
        layer.register_forward_pre_hook(
            lambda m, args, i=int(name): log.append(("forward", i)))
        for p in layer.parameters():
            layer_of.setdefault(id(p), set()).add(int(name))   # a tied weight: both layers
    problems = []
    for k, (x, y) in enumerate(steps[:2]):
        engine.train_step(x, y)
        in_flight = [b.index for b in shards.buckets if b.gather is not None]
        if len(in_flight) != len(shards.buckets) or not shards.gathering:
            problems.append(f"step {k}: {len(in_flight)} of {len(shards.buckets)} gathers "
                            f"in flight when train_step returned")
        log.append(("return", k))
    engine.train_step(*steps[2])
    # Step 1's forwards, against the gathers step 0 launched.
    start, end = log.index(("return", 0)), log.index(("return", 1))
    part = log[start:end]
    waited = {key: i for i, (what, key) in reversed(list(enumerate(part)))
              if what == "wait"}
    first_forward = {key: i for i, (what, key) in reversed(list(enumerate(part)))
                     if what == "forward"}
    for b in shards.buckets:
        key = f"gradient bucket {b.index}"
        users = set().union(*(layer_of[id(p)] for p in b.params))
        if key not in waited:
            problems.append(f"{key} never waited in step 1")
            continue
        late = [i for i in sorted(users) if first_forward.get(i, len(part)) < waited[key]]
        if late:
            problems.append(f"layer(s) {late} ran before {key} (theirs) was waited")
    if engine.stage.index == 0 and not problems:
        head = min(first_forward.values())
        if all(i < head for i in waited.values()):
            problems.append("the first stage waited for every gather before its first "
                            "forward: nothing overlapped the forwards")
    state = engine.gather_state_dict()
    working = {k: v.detach().clone() for k, v in engine.stage.module.state_dict().items()}
    engine.close()
    reference, _ = train_reference(layers, steps, clip=0.3, optimizer=adamw)
    ref = reference.state_dict()
    mine = {k: ref[k] for k in working}
    ok, text = _same(working, mine, 1e-5)
    if not ok:
        problems.append(f"working weights after gather_state_dict: {text}")
    if state is not None:
        ok, text = _same(state, ref, 1e-5)
        if not ok:
            problems.append(f"gather_state_dict right after train_step: {text}")
    _verdict(not problems, f"backend {backend}: " + "; ".join(problems))


READS = ["eval_step", "gather_state_dict", "state_dict", "save", "load", "load_state_dict",
         "generate", "named_master_parameters", "close"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_every_read_between_steps_waits_for_the_gathers(tmp_path_factory):
    # After each train_step the gathers are in flight; each way of reading or writing the
    # weights between steps completes them first, and leaves the working weights equal to
    # the whole fp32 masters (fp32: the working weights are the masters, gathered).
    pipeline, data = GRIDS[0]
    folder = bcast(WORLD, str(tmp_path_factory.mktemp("reads")) if WORLD.rank == 0 else None)
    layers = toy_layers()
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=pipeline, data=data, microbatches=3, bucket_mb=TINY,
                                 shard_optimizer=True))
    shards, module = engine.stage.shards, engine.stage.module
    x, y = batches(1, BATCH)[0]
    problems = []
    for read in READS:
        engine.train_step(x, y)
        if not shards.gathering:
            problems.append(f"before {read}: no gather in flight, the test proves nothing")
        if read == "eval_step":
            engine.eval_step(x, y)
        elif read == "gather_state_dict":
            whole = engine.gather_state_dict()
        elif read == "state_dict":
            module.state_dict()
        elif read == "save":
            engine.save(folder)
        elif read == "load":
            engine.load(folder)
        elif read == "load_state_dict":
            engine.load_state_dict(bcast(WORLD, whole))
        elif read == "generate":
            engine.generate(x[:2, :3].tolist(), max_new_tokens=2)
        elif read == "named_master_parameters":
            engine.named_master_parameters()
        else:
            engine.close()
        pending = [b.index for b in shards.buckets if b.gather is not None]
        if pending or shards.gathering:
            problems.append(f"{read} left the gathers of buckets {pending} in flight")
        if read == "close":
            break
        working = {n: p.detach().clone() for n, p in module.named_parameters()}
        masters = dict(engine.named_master_parameters())
        wrong = [n for n in working if not torch.equal(working[n], masters[n])]
        if wrong:
            problems.append(f"after {read}: working weights {wrong[:3]} are not the masters")
    _verdict(not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_the_gathers_and_reduce_scatters_cost_linear_bookkeeping():
    # One bucket a parameter, 69 of them: the requests of a step's collectives are tested
    # and waited O(buckets + instructions) times, not once per pending gather at every
    # launch (n^2 / 2: 2,380 at n = 69) nor every bucket at every poll.
    comm = pair()
    engine = pf.Engine(toy_layers(blocks=16), loss_fn, sgd,
                       pf.Config(pipeline=1, data=2, microbatches=3, bucket_mb=1e-9,
                                 shard_optimizer=True), comm=comm)
    n = len(engine.stage.shards.buckets)
    steps = batches(3, BATCH)
    engine.train_step(*steps[0])
    gathers, scatters = [], []
    _record(engine, gathers)
    _record(engine, scatters, "ireduce_scatter_")
    engine.train_step(*steps[1])      # launches the gathers at its end
    engine.train_step(*steps[2])      # waits for them in its forwards
    engine.close()
    comm.Free()
    program = len(engine.plan.programs[0])
    ops = {what: sum(1 for w, _ in log if w == what) for log in (gathers,)
           for what in ("launch", "test", "wait")}
    scatter_tests = sum(1 for w, _ in scatters if w == "test")
    assert n >= 64, n
    assert ops["launch"] == 2 * n and ops["wait"] <= 2 * n, ops
    print(f"{n} buckets, {program} instructions: gathers {ops}, reduce-scatter tests "
          f"{sum(1 for w, _ in scatters if w == 'test')}")
    assert ops["test"] <= n + 2 * program, (n, program, ops)
    # Each poll (an instruction, a gradient hook) tests the first reduction in flight.
    params = sum(1 for _ in engine.stage.module.parameters())
    assert scatter_tests <= 2 * (n + program + params), (n, program, params, scatter_tests)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_compiled_layers_wait_for_their_gathers_too():
    # Under torch.compile the layers' pre-hook runs eagerly (a wait is not traceable): the
    # compiled sharded run is the eager one's, gathers in flight between its steps.
    comm = pair()
    results = {}
    for compile in (False, "aot_eager"):
        engine = pf.Engine(toy_layers(blocks=2), loss_fn, adamw,
                           pf.Config(pipeline=1, data=2, microbatches=2, bucket_mb=TINY,
                                     shard_optimizer=True, compile=compile), comm=comm)
        in_flight = []
        for x, y in batches(3, BATCH):
            engine.train_step(x, y)
            in_flight.append(engine.stage.shards.gathering)
        results[compile] = (in_flight, engine.gather_state_dict())
        engine.close()
    comm.Free()
    assert results[False][0] == results["aot_eager"][0] == [True] * 3
    if results[False][1] is not None:
        assert_same_parameters(results["aot_eager"][1], results[False][1], rtol=1e-6)
