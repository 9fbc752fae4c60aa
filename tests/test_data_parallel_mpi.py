"""Hybrid pipeline x data parallelism equals one process on the whole batch.

Run under `mpirun -n 2` and `-n 4` with `--with-mpi`: the grids 1x2 and 2x1 on two ranks;
1x4, 2x2 and 4x1 on four. Tied weights (embedding = output projection) and clipping by the
global norm are covered on every grid.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.comm import mpi as pf_mpi, torch_dist as pf_dist

from toy import adamw, assert_same_parameters, batches, loss_fn, toy_layers, train_reference
from toy import sgd as plain_sgd
from toy import sgd_momentum
from toy import allgather

WORLD = MPI.COMM_WORLD
GRIDS = {2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2), (4, 1)]}.get(WORLD.size, [])
BATCH = 24


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", GRIDS)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("clip", [0.0, 0.3], ids=["noclip", "clip"])
@pytest.mark.parametrize("optimizer", [adamw, sgd_momentum], ids=["adamw", "sgd"])
def test_grid_trains_like_one_process(pipeline, data, schedule, tied, clip, optimizer):
    _check_grid(pipeline, data, schedule, tied, clip, optimizer)


def _check_grid(pipeline, data, schedule, tied, clip, optimizer):
    layers = toy_layers(tied=tied)
    config = pf.Config(pipeline=pipeline, data=data, microbatches=3, schedule=schedule,
                       clip=clip, bucket_mb=0.001)   # tiny buckets: several per stage
    engine = pf.Engine(layers, loss_fn, optimizer, config)
    steps = batches(3, BATCH)
    losses = [engine.train_step(x, y) for x, y in steps]
    reference, ref_losses = train_reference(layers, steps, clip=clip, optimizer=optimizer)
    assert allgather(WORLD, losses) == [losses] * WORLD.size
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    if clip:
        assert engine.stats.grad_norm > clip, "the clip never bit: the test would prove nothing"
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    # Every replica holds the same weights, and tied copies on two stages are identical.
    local = {k: v for k, v in engine.stage.module.state_dict().items()}
    everyone = allgather(WORLD, local)
    for other in everyone:
        for k, v in other.items():
            if k in local:
                assert torch.equal(v, local[k]), k
    if tied:
        copies = [d[k] for d in everyone for k in d if k in ("0.emb.weight", "6.out.weight")]
        assert all(torch.equal(c, copies[0]) for c in copies)
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", GRIDS)
def test_host_staged_reductions_train_like_one_process(monkeypatch, pipeline, data):
    # Every all-reduce through a host copy, as on a GPU with the MPI backend: the replicas'
    # buckets and the tied weight's sum over stages must land back in the gradients.
    monkeypatch.setattr(pf_mpi, "FORCE_HOST_STAGING", True)
    _check_grid(pipeline, data, "1f1b", tied=True, clip=0.0, optimizer=plain_sgd)


@pytest.mark.mpi(min_size=2)
def test_gradient_reduction_overlaps_the_last_backward():
    layers = toy_layers()
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=1, data=WORLD.size, microbatches=2, bucket_mb=0.0005))
    reducer = engine.stage.reducer
    assert len(reducer.buckets) >= 3
    # Mark the moment backward reaches the stage's first layer.
    first_layer = engine.stage.module.get_submodule(str(engine.stage.module.indices[0]))
    next(first_layer.parameters()).register_post_accumulate_grad_hook(
        lambda p: reducer.events.append(("first layer", -1)) if reducer.armed else None)
    engine.train_step(*batches(1, 4 * WORLD.size)[0])
    kinds = [kind for kind, _ in reducer.events]
    assert kinds.count("launch") == len(reducer.buckets)
    # The last layers' bucket was on the wire while backward still worked on earlier layers.
    assert kinds.index("launch") < kinds.index("first layer"), reducer.events
    assert reducer.events[0] == ("launch", 0)
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,backend", [("fp16", "mpi"), ("bf16", "gloo")])
@pytest.mark.parametrize("shard", [False, True], ids=["plain", "sharded"])
def test_gradients_reduced_in_half_precision_train_close_to_one_process(dtype, backend, shard):
    # grad_reduce_dtype casts each fp32 bucket for the reduction only: the update is the
    # one-process update to the dtype's rounding, and not bit for bit the fp32 reduction's
    # (so the cast really happened).
    layers = toy_layers()
    steps = batches(2, BATCH)
    states = {}
    for reduce in (dtype, "fp32"):
        config = pf.Config(pipeline=1, data=WORLD.size, microbatches=2, bucket_mb=0.001,
                           backend=backend, shard_optimizer=shard, grad_reduce_dtype=reduce)
        engine = pf.Engine(layers, loss_fn, plain_sgd, config)
        for x, y in steps:
            engine.train_step(x, y)
        states[reduce] = engine.gather_state_dict()
        engine.close()
    reference, _ = train_reference(layers, steps, optimizer=plain_sgd)
    if WORLD.rank == 0:
        assert_same_parameters(states["fp32"], reference.state_dict())
        assert_same_parameters(states[dtype], reference.state_dict(), rtol=2e-2)
        assert any(not torch.equal(states[dtype][k], states["fp32"][k]) for k in states[dtype])


@pytest.mark.mpi(min_size=2)
def test_bf16_gradient_reduction_over_mpi_is_refused():
    config = pf.Config(pipeline=1, data=WORLD.size, microbatches=2, grad_reduce_dtype="bf16")
    with pytest.raises(pf.ConfigError, match=r'grad_reduce_dtype = "bf16" needs a bf16 sum, '
                                              r"which MPI \(backend '(mpi|strict)'\)"):
        pf.Engine(toy_layers(), loss_fn, plain_sgd, config)


# Two stages with two replicas: four ranks (the 2-rank run has no grid with both).
if WORLD.size >= 4:
    @pytest.mark.mpi(min_size=2)
    @pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
    def test_every_chunks_buckets_overlap_that_chunks_last_backward(schedule):
        # Two chunks a rank: the later chunk's last backward comes well before the earlier
        # chunk's, and its buckets must be on the wire while that one still runs (armed only at
        # the step's very last backward, they waited for finish(), fully exposed).
        layers = toy_layers(blocks=6)
        config = pf.Config(pipeline=2, data=WORLD.size // 2, microbatches=4, schedule=schedule,
                           bucket_mb=0.0005, **({"virtual_stages": 2} if schedule == "interleaved"
                                                else {}))
        engine = pf.Engine(layers, loss_fn, plain_sgd, config)
        reducer, stage = engine.stage.reducer, engine.stage
        last = stage.plan.last_gradient_actions(stage.index)
        final = max(last.values(), key=stage.plan.programs[stage.index].index)
        early = [c for c, act in last.items() if act != final]
        assert early, last
        # Mark the moment the step's last gradient action starts its backward.
        first = next(p for layer in stage.chunk_layers[final.chunk] for p in layer.parameters())
        first.register_post_accumulate_grad_hook(
            lambda p: reducer.events.append(("final chunk", -1))
            if reducer.armed and id(p) in reducer._armed_ids else None)
        steps = batches(2, 8 * (WORLD.size // 2))
        for x, y in steps:
            engine.train_step(x, y)
        kinds = [kind for kind, _ in reducer.events]
        assert "launch" in kinds[:kinds.index("final chunk")], reducer.events
        reference, _ = train_reference(layers, steps, optimizer=plain_sgd)
        full = engine.gather_state_dict()
        if WORLD.rank == 0:
            assert_same_parameters(full, reference.state_dict())
        engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer,clip", [(adamw, 0.3), (plain_sgd, 0.0)],
                         ids=["adamw-clip", "sgd"])
def test_torch_distributed_path_gloo_matches_mpi(optimizer, clip):
    # The NCCL backend's code path (torch.distributed bootstrapped from MPI), run with gloo
    # on CPUs: the same update as one process. Plain SGD unclipped: the update is the
    # gradient itself, so a gradient of the wrong size shows (a clip that bites hides it).
    pipeline, data = (2, WORLD.size // 2)
    layers = toy_layers(tied=True)
    config = pf.Config(pipeline=pipeline, data=data, microbatches=2, backend="gloo", clip=clip)
    engine = pf.Engine(layers, loss_fn, optimizer, config)
    steps = batches(2, BATCH)
    for x, y in steps:
        engine.train_step(x, y)
    reference, _ = train_reference(layers, steps, clip=clip, optimizer=optimizer)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipeline", sorted({2, WORLD.size}))
def test_tied_gradients_are_summed_by_torch_distributed_not_mpi(pipeline, monkeypatch):
    # Under gloo (NCCL's code path on CPUs) a tied weight's gradient is summed by a
    # torch.distributed group of its holders, one per replica, on the stage's device: MPI
    # host staging (the whole vocab x d gradient every step) is never used for it.
    from pipeflow.runtime import optim_step

    def refuse(comm, tensor):
        raise AssertionError(f"rank {WORLD.rank}: a tied gradient of shape "
                             f"{tuple(tensor.shape)} was summed over MPI under backend 'gloo'")

    monkeypatch.setattr(optim_step, "mpi_iallreduce_", refuse)
    layers = toy_layers(tied=True)
    config = pf.Config(pipeline=pipeline, data=WORLD.size // pipeline, microbatches=2,
                       backend="gloo")
    engine = pf.Engine(layers, loss_fn, plain_sgd, config)
    stage = engine.stage
    ties = stage.ties
    assert len(ties) == (1 if stage.index in (0, pipeline - 1) else 0)
    assert all(t.dist is not None and t.dist.size == 2 for t in ties)
    _trains_like_one_process(engine, layers, batches(2, BATCH), clip=0.0, optimizer=plain_sgd)
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_torch_distributed_groups_outlive_close_and_are_reused():
    # A group torn down while its peers still hold theirs can block a rank at whatever later
    # point garbage collection runs it (a hang seen on 4 ranks): groups live for the process,
    # and a second engine on the same grid makes none and trains on the first one's.
    import torch.distributed as dist

    config = pf.Config(pipeline=2, data=WORLD.size // 2, microbatches=2, backend="gloo")
    layers = toy_layers(tied=True)
    first = pf.Engine(layers, loss_fn, plain_sgd, config)
    families = dict(pf_dist._FAMILIES)
    first.close()
    assert all(g is None or dist.get_rank(g) >= 0 for g in families.values())   # alive
    made = dist.distributed_c10d._world.group_count
    second = pf.Engine(layers, loss_fn, plain_sgd, config)
    assert dist.distributed_c10d._world.group_count == made
    assert pf_dist._FAMILIES == families
    _trains_like_one_process(second, layers, batches(2, BATCH), clip=0.0, optimizer=plain_sgd)
    second.close()
    # torch.distributed torn down and started again by the user: new groups, not the dead.
    dist.destroy_process_group()
    third = pf.Engine(layers, loss_fn, plain_sgd, config)
    assert pf_dist._FAMILIES and all(pf_dist._FAMILIES.get(k) is not g for k, g in families.items()
                                     if g is not None)
    _trains_like_one_process(third, layers, batches(2, BATCH), clip=0.0, optimizer=plain_sgd)
    third.close()


def _trains_like_one_process(engine, layers, steps, clip, optimizer):
    """Same losses and parameters as build_sequential on one process; returns the model."""
    losses = [engine.train_step(x, y) for x, y in steps]
    reference, ref_losses = train_reference(layers, steps, clip=clip, optimizer=optimizer)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    return reference


def _summed_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             ignore_index=-100, reduction="sum")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline,data", [g for g in GRIDS if g[1] > 1])
def test_counted_items_are_summed_over_every_replica(pipeline, data):
    # count_items: each replica counts the valid tokens of its own rows, and the loss is
    # divided by the whole global batch's count. The replicas are padded unequally (the
    # first replica's rows mostly padding), so a count taken from one replica, or one
    # replica's count times d, normalises wrongly; plain SGD shows the size of the update.
    layers = toy_layers()
    engine = pf.Engine(layers, _summed_loss, plain_sgd,
                       pf.Config(pipeline=pipeline, data=data, microbatches=3),
                       count_items=lambda t: (t != -100).sum())
    steps = []
    for x, y in batches(3, BATCH):
        pad = torch.zeros_like(y, dtype=torch.bool)
        pad[:BATCH // data, 1:] = True            # replica 0: one valid token a row
        pad[BATCH // data:, -1] = True            # the others: all but the last
        steps.append((x, y.masked_fill(pad, -100)))
    _trains_like_one_process(engine, layers, steps, clip=0.0, optimizer=plain_sgd)
    engine.close()


@pytest.mark.mpi(min_size=2)
def test_batch_must_divide_by_replicas_times_microbatches():
    engine = pf.Engine(toy_layers(), loss_fn, adamw,
                       pf.Config(pipeline=1, data=WORLD.size, microbatches=3))
    x, y = batches(1, 3 * WORLD.size + 1)[0]
    with pytest.raises(pf.BatchError, match=f"batch of {3 * WORLD.size + 1} samples does not "
                                             f"divide into {WORLD.size} replica"):
        engine.train_step(x, y)
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("backend,grid", [("mpi", "hybrid"), ("gloo", "pipeline")])
def test_interleaved_chunks_with_tied_weights_and_clipping(backend, grid, schedule):
    # Two model chunks a rank: the embedding (chunk 0 of rank 0) and the head (the last chunk
    # of the last rank) are tied across the ring's wrap-around.
    pipeline, data = (2, WORLD.size // 2) if grid == "hybrid" else (WORLD.size, 1)
    layers = toy_layers(blocks=2 * pipeline * 2 - 2, tied=True)
    config = pf.Config(pipeline=pipeline, data=data, microbatches=2 * pipeline,
                       schedule=schedule, virtual_stages=2, clip=0.3, backend=backend,
                       bucket_mb=0.001)
    engine = pf.Engine(layers, loss_fn, sgd_momentum, config)
    steps = batches(3, 8 * pipeline * data)
    reference = _trains_like_one_process(engine, layers, steps, clip=0.3, optimizer=sgd_momentum)
    # Forward only, in the interleaved order.
    x, y = steps[0]
    assert engine.eval_step(x, y) == pytest.approx(loss_fn(reference(x), y).item(), rel=1e-5)
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("where", ["autograd thread", "engine thread"])
def test_hooks_off_the_engine_thread_only_mark_buckets_ready(where):
    # On CUDA, autograd calls gradient hooks on its device thread. The strict communicator
    # refuses any call from a thread other than its creator's, so a launch from the hook
    # would fail this test.
    import threading

    from pipeflow.runtime.data_parallel import GradReducer
    from pipeflow.comm.strict import StrictCommunicator

    comm = StrictCommunicator(WORLD)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 2, 4)]
    reducer = GradReducer(params, comm, bucket_bytes=16)
    assert len(reducer.buckets) >= 3
    for step in range(2):
        reducer.arm()
        for k, p in enumerate(params):
            p.grad.copy_(torch.arange(p.numel()) * (WORLD.rank + 1) + k + step)

        def hooks():
            for p in reversed(params):        # backward's order
                reducer._on_grad(p)

        if where == "autograd thread":
            worker = threading.Thread(target=hooks)
            worker.start()
            worker.join()
            assert reducer.events == [], "launched from the hook's thread"
            assert all(b.request is None for b in reducer.buckets)
            reducer.poll()                     # the engine's next instruction boundary
        else:
            hooks()
        # Every bucket launched on the engine's thread, in backward's order, this step only.
        assert reducer.events == [("launch", i) for i in range(len(reducer.buckets))]
        reducer.finish()
        ranks = sum(range(1, WORLD.size + 1))
        for k, p in enumerate(params):
            want = torch.arange(p.numel()) * ranks + (k + step) * WORLD.size
            assert torch.equal(p.grad, want.float()), (k, p.grad, want)
        reducer.zero_grad()
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_closed_replicated_engine_frees_its_weights_without_the_garbage_collector():
    # The reducer's gradient hooks hold the reducer, which holds the parameters: until close
    # removed them, a dropped engine's weights (on a GPU) waited for gc.collect().
    import gc
    import weakref
    engine = pf.Engine(toy_layers(), loss_fn, adamw,
                       pf.Config(pipeline=1, data=WORLD.size, microbatches=2))
    engine.train_step(*batches(1, 4 * WORLD.size)[0])
    weights = weakref.ref(next(engine.stage.module.parameters()))
    engine.close()
    gc.collect()
    gc.disable()
    try:
        del engine
        freed = weights() is None
    finally:
        gc.enable()
    assert allgather(WORLD, freed) == [True] * WORLD.size


# The package's own folder: a clone or a virtual environment can itself sit under a folder
# named pipeflow, so a caller is pipeflow's only when its file is inside this one.
_PACKAGE = os.path.dirname(os.path.abspath(pf.__file__)) + os.sep


class _HostSyncs:
    """Counts the engine's own reads of tensor values (`item`, `tolist`, `float`, `int`,
    `bool` called from pipeflow's code): on a GPU each waits for the device. (torch.optim's
    reads of its step counts are of CPU tensors.)"""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self) -> None:
        self.count = 0
        self.where: list[str] = []
        self.real = {name: getattr(torch.Tensor, name) for name in self.NAMES}

    def __enter__(self) -> "_HostSyncs":
        for name, real in self.real.items():
            setattr(torch.Tensor, name, self._counted(real))
        return self

    def _counted(self, real):
        def read(t, *args):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(_PACKAGE):
                self.count += 1
                self.where.append(f"{caller.co_filename}:{caller.co_name}")
            return real(t, *args)
        return read

    def __exit__(self, *exc) -> None:
        for name, real in self.real.items():
            setattr(torch.Tensor, name, real)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shard", [False, True])
def test_a_step_reads_the_device_once_off_the_last_stage_and_twice_on_it(shard):
    # torch.distributed (gloo here, NCCL on GPUs): the gradient norm and the replicas'
    # "gradient present" flags are read together, the loss once more on the last stage.
    # Before: the flags' tolist, the norm's item and the loss, 2 and 3 a step.
    d = WORLD.size // 2
    engine = pf.Engine(toy_layers(), loss_fn, adamw,
                       pf.Config(pipeline=2, data=d, microbatches=4, backend="gloo",
                                 shard_optimizer=shard and d > 1))
    steps = batches(5, 8)
    for x, y in steps[:2]:
        engine.train_step(x, y)
    with _HostSyncs() as syncs:
        for x, y in steps[2:]:
            engine.train_step(x, y)
    last = engine.plan.holds_last(engine.stage.index)
    assert syncs.count <= 3 * (2 if last else 1), (engine.stage.describe(), syncs.where)
    engine.close()
