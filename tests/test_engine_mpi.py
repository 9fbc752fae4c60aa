"""Pipelined training equals one process, on every schedule, partition and micro-batch count.

Run under `mpirun -n 2` and `mpirun -n 4` with `--with-mpi`. On 4 ranks the 2-stage cases run
as two independent pipelines side by side (the world split in halves).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
from mpi4py import MPI
from torch import nn

import pipeflow as pf
from pipeflow.schedules import build_schedule, names, simulate
from pipeflow.schedules import get as get_schedule

from toy import (Drop, adamw, assert_same_parameters, batches, loss_fn, sgd, sub_world,
                 toy_layers, train_reference)
from toy import allgather, bcast

WORLD = MPI.COMM_WORLD
BATCH = 24
STEPS = 3
EXPLICIT = {2: [0, 1, 7], 4: [0, 4, 5, 6, 7]}     # uneven on purpose
# Interleaved: 2 chunks a rank, so 2p virtual stages of a 9-layer model.
EXPLICIT_INTERLEAVED = {2: [0, 2, 3, 6, 9], 4: [0, 1, 2, 3, 4, 5, 6, 7, 9]}
MICROBATCHES = {2: [1, 2, 3, 8], 4: [2, 4, 6, 12]}  # below, equal to and above the stages


_sub_world = sub_world


@functools.lru_cache(maxsize=None)
def _reference(blocks: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """`train_reference(toy_layers(blocks), batches(STEPS, BATCH))` once per module: its
    final state and losses, the same for every schedule, partition and micro-batch count of
    `test_pipeline_trains_like_one_process` (which only reads them)."""
    model, losses = train_reference(toy_layers(blocks=blocks), batches(STEPS, BATCH))
    return model.state_dict(), losses


def _chunks(schedule: str) -> int:
    """Model chunks a rank the schedule runs by default (interleaved: 2; a V: 2)."""
    return get_schedule(schedule).resolve_chunks(None)


def _cases():
    # Only grids this world can hold: `mpirun -n 2` runs the 2-stage cases, `-n 4` both.
    for p in (p for p in (2, 4) if p <= WORLD.size):
        for m in MICROBATCHES[p]:
            for schedule in names():            # every registered schedule
                if get_schedule(schedule).problem(p, m):
                    continue        # e.g. interleaving runs micro-batches in groups of p
                for part in ("uniform", "parameters", "time", "explicit"):
                    yield p, m, schedule, part


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stages,microbatches,schedule,partition", list(_cases()))
def test_pipeline_trains_like_one_process(stages, microbatches, schedule, partition):
    comm = _sub_world(stages)
    interleaved = _chunks(schedule) > 1                     # two model chunks a rank
    blocks = 7 if interleaved else 5
    layers = toy_layers(blocks=blocks)
    explicit = (EXPLICIT_INTERLEAVED if interleaved else EXPLICIT)[stages]
    config = pf.Config(pipeline=stages, microbatches=microbatches, schedule=schedule,
                       virtual_stages=2 if interleaved else 1,
                       partition=explicit if partition == "explicit" else partition)
    data = batches(STEPS, BATCH)
    engine = pf.Engine(layers, loss_fn, adamw, config, comm=comm,
                       sample=data[0][0][:BATCH // microbatches])
    losses = [engine.train_step(x, y) for x, y in data]
    ref_state, ref_losses = _reference(blocks)

    # The same loss, bit for bit, on every rank; and the one-process loss.
    assert allgather(comm, losses) == [losses] * comm.size
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # This stage's parameters, then the gathered whole model.
    local = engine.stage.module.state_dict()
    assert_same_parameters(local, {k: ref_state[k] for k in local})
    full = engine.gather_state_dict()
    if comm.rank == 0:
        assert_same_parameters(full, ref_state)
    else:
        assert full is None
    # The stash measured at run time is the simulator's figure.
    expected = simulate(build_schedule(schedule, stages, microbatches,
                                       chunks=config.virtual_stages)).peak_stash
    assert engine.stats.peak_stash == expected[engine.stage.index]
    if schedule == "1f1b":
        assert engine.stats.peak_stash == min(stages - engine.stage.index, microbatches)
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_clipping_by_global_norm_matches_one_process(schedule):
    comm = _sub_world(2)
    layers = toy_layers()
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=2, microbatches=4, schedule=schedule, clip=0.05),
                       comm=comm)
    data = batches(STEPS, BATCH)
    for x, y in data:
        engine.train_step(x, y)
    reference, _ = train_reference(layers, data, clip=0.05)
    # The clip must have bitten, or this test would prove nothing.
    unclipped, _ = train_reference(layers, data)
    assert engine.stats.grad_norm > 0.05
    full = engine.gather_state_dict()
    if comm.rank == 0:
        assert_same_parameters(full, reference.state_dict())
        with pytest.raises(AssertionError):
            assert_same_parameters(full, unclipped.state_dict())
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_eval_step_is_forward_only_and_agrees_everywhere():
    comm = _sub_world(2)
    layers = toy_layers()
    engine = pf.Engine(layers, loss_fn, adamw, pf.Config(pipeline=2, microbatches=3), comm=comm)
    x, y = batches(1, 12)[0]
    before = {k: v.clone() for k, v in engine.stage.module.state_dict().items()}
    loss = engine.eval_step(x, y)
    reference = pf.build_sequential(layers, 0)
    assert loss == pytest.approx(loss_fn(reference(x), y).item(), rel=1e-6)
    assert allgather(comm, loss) == [loss] * comm.size
    assert all(torch.equal(before[k], v) for k, v in engine.stage.module.state_dict().items())
    # A different batch shape afterwards: shapes are exchanged again, not assumed.
    x2, y2 = batches(1, 6, seed=5)[0]
    assert engine.train_step(x2, y2) == pytest.approx(loss_fn(reference(x2), y2).item(),
                                                      rel=1e-6)
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_eval_step_turns_dropout_off_and_repeats_exactly(schedule):
    comm = _sub_world(2)
    layers = toy_layers(blocks=7)
    layers.insert(2, pf.LayerSpec(Drop, 0.5))       # on the first stage
    layers.insert(-1, pf.LayerSpec(Drop, 0.5))      # on the last stage
    interleaved = schedule == "interleaved"
    engine = pf.Engine(layers, loss_fn, sgd,
                       pf.Config(pipeline=2, microbatches=4, schedule=schedule,
                                 virtual_stages=2 if interleaved else 1), comm=comm)
    x, y = batches(1, 12)[0]
    reference = pf.build_sequential(layers, 0).eval()
    for when in ("fresh", "after a train_step"):   # train_step turns dropout on
        if when != "fresh":
            engine.train_step(x, y)
            reference.load_state_dict(bcast(comm, engine.gather_state_dict(), root=0))
        with torch.no_grad():
            expected = loss_fn(reference(x), y).item()
        losses = [engine.eval_step(x, y) for _ in range(2)]
        assert losses[0] == losses[1], f"{when}: eval is not repeatable: {losses}"
        assert losses[0] == pytest.approx(expected, rel=1e-6), \
            f"{when}: eval loss {losses[0]} != build_sequential(...).eval() loss {expected}"
    engine.close()
    comm.Free()


class Slow(nn.Module):
    """Identity, slowly: the stage after it receives each message well after it was sent."""

    def forward(self, x):
        time.sleep(0.05)
        return x


class _Watched:
    """A send request that remembers whether it was seen complete (`wait`, or a true `test`)."""

    def __init__(self, request: Any) -> None:
        self.request, self.done = request, False

    def test(self) -> bool:
        self.done = self.done or self.request.test()
        return self.done

    def wait(self) -> Any:
        out = self.request.wait()
        self.done = True
        return out


class SendWatch:
    """Wraps a communicator's `send_message` to list the sends never seen complete."""

    def __init__(self, comm: Any) -> None:
        self._send = comm.send_message
        self.requests: list[_Watched] = []
        comm.send_message = self.send_message

    def send_message(self, header, tensors, dest, tag) -> _Watched:
        self.requests.append(_Watched(self._send(header, tensors, dest, tag)))
        return self.requests[-1]

    def open(self) -> list[int]:
        return [i for i, r in enumerate(self.requests) if not r.done]


def _assert_sends_completed(comm: MPI.Comm, watch: SendWatch) -> None:
    # Every rank checks every rank's sends, so all fail together rather than some hang.
    left = allgather(comm, watch.open())
    assert left == [[]] * comm.size, f"sends (by rank) never seen complete: {left}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_messages_of_megabytes_arrive_whole_and_every_send_completes(backend):
    # Several MB a message: MPI sends them by rendezvous, not eagerly, so a send still in
    # flight when the step returns would read a buffer already freed. The slow last stage
    # takes each activation long after the first stage sent it and returned from eval_step.
    comm = WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)
    if backend == "gloo" and comm.size != WORLD.size:
        comm.Free()
        comm = WORLD                      # torch.distributed spans the whole world
    layers = toy_layers()
    layers.insert(-1, pf.LayerSpec(Slow))
    engine = pf.Engine(layers, loss_fn, sgd,
                       pf.Config(pipeline=comm.size, microbatches=4, backend=backend),
                       comm=comm)
    watch = SendWatch(engine.stage.pipe_comm)
    x, y = batches(1, 4 * 2**12)[0]       # 4096 samples a micro-batch: 1.3 MB of activations
    loss = engine.train_step(x, y)
    _assert_sends_completed(comm, watch)
    reference, ref_losses = train_reference(layers, [(x, y)], optimizer=sgd)
    assert loss == pytest.approx(ref_losses[0], rel=1e-5)
    local = engine.stage.module.state_dict()
    # Sums over 80000 tokens in another order: 1e-4, where a lost message is off by far more.
    assert_same_parameters(local, {k: v for k, v in reference.state_dict().items()
                                   if k in local}, rtol=1e-4)
    with torch.no_grad():
        expected = loss_fn(reference(x), y).item()
    assert engine.eval_step(x, y) == pytest.approx(expected, rel=1e-5)
    _assert_sends_completed(comm, watch)
    engine.close()
    if comm is not WORLD:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_bad_batches_raise_the_same_clear_error_on_every_rank():
    comm = _sub_world(2)
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(pipeline=2, microbatches=4),
                       comm=comm)
    x, y = batches(1, 10)[0]
    with pytest.raises(pf.BatchError, match="batch of 10 samples does not divide into 1 "
                                             "replica\\(s\\) x 4 micro-batches"):
        engine.train_step(x, y)
    x, y = batches(1, 8)[0]
    # Only the last stage lacks its targets; every rank learns of it.
    with pytest.raises(pf.BatchError, match="stage 1 of 2.*targets=None"):
        engine.train_step(x, None if engine.plan.holds_last(engine.stage.index) else y)
    # Other ranks may pass None for what they do not use.
    first, last = engine.plan.holds_first(engine.stage.index), \
        engine.plan.holds_last(engine.stage.index)
    loss = engine.train_step(x if first else None, y if last else None)
    assert allgather(comm, loss) == [loss] * comm.size
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_grid_that_does_not_fit_the_world_is_an_error_on_every_rank():
    with pytest.raises(pf.ConfigError, match=f"needs {WORLD.size + 1} ranks, but the job has "
                                             f"{WORLD.size}"):
        pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(pipeline=WORLD.size + 1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer", [adamw, sgd], ids=["adamw", "sgd"])
def test_checkpoint_resumes_onto_a_different_grid(tmp_path_factory, optimizer):
    comm = _sub_world(2)
    # Every pipeline in the world writes its own folder; rank 0 of the pipeline names it.
    folder = bcast(comm, str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)
    layers = toy_layers()
    data = batches(4, BATCH)
    engine = pf.Engine(layers, loss_fn, optimizer, pf.Config(pipeline=2, microbatches=4),
                       comm=comm)
    for x, y in data[:2]:
        engine.train_step(x, y)
    engine.save(folder)
    # Resume on the same ranks with another partition and schedule: two model chunks a rank.
    resumed = pf.Engine(layers, loss_fn, optimizer,
                        pf.Config(pipeline=2, microbatches=2, schedule="interleaved",
                                  virtual_stages=2, partition=[0, 1, 4, 5, 7]), comm=comm)
    resumed.load(folder)
    assert resumed.stats.step == 2
    for x, y in data[2:]:
        resumed.train_step(x, y)
    reference, _ = train_reference(layers, data, optimizer=optimizer)
    full = resumed.gather_state_dict()
    if comm.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    engine.close()
    resumed.close()
    comm.Free()


def _sgd_cases():
    for momentum in (0.0, 0.9):
        for schedule in names():
            for m in (1, 3, 8):
                if not get_schedule(schedule).problem(2, m):
                    yield momentum, schedule, m


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("momentum,schedule,microbatches", list(_sgd_cases()))
def test_plain_sgd_update_equals_one_process(momentum, schedule, microbatches):
    # AdamW's first steps are nearly lr * sign(g), blind to a wrong gradient scale; SGD's
    # update is the gradient itself, so a mis-scaled micro-batch loss shows here.
    comm = _sub_world(2)
    interleaved = _chunks(schedule) > 1
    layers = toy_layers(blocks=7 if interleaved else 5)

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.5, momentum=momentum)

    engine = pf.Engine(layers, loss_fn, optimizer,
                       pf.Config(pipeline=2, microbatches=microbatches, schedule=schedule,
                                 virtual_stages=2 if interleaved else 1),
                       comm=comm)
    data = batches(STEPS, BATCH)
    for x, y in data:
        engine.train_step(x, y)
    reference, _ = train_reference(layers, data, optimizer=optimizer)
    full = engine.gather_state_dict()
    if comm.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    engine.close()
    comm.Free()


class Ragged(nn.Module):
    """Adds a leaf whose length depends on the micro-batch's data (1 to 3 of its first
    tokens): the message that crosses after it changes shape within a step."""

    def forward(self, x):
        h, tokens = x
        return h, tokens, tokens[:, :1 + int(tokens[0, 0]) % 3]


class Unragged(nn.Module):
    def forward(self, x):
        h, tokens, _ = x
        return h, tokens


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_mpi_receives_posted_for_old_shapes_give_way_to_new_ones(schedule, monkeypatch):
    # A receive posted for a link's last shapes meets a message of new shapes (a leaf whose
    # length follows the data, within a step; another sequence length; eval's tensors that
    # need no gradient): the posted receive is withdrawn and the announced message taken
    # whole, and training still equals one process on every step.
    from pipeflow.comm import mpi as mpi_comm
    from toy import Block, Embed, Head, VOCAB, WIDTH, pair

    withdrawn = []
    cancel = mpi_comm._MpiRecv.cancel
    monkeypatch.setattr(mpi_comm._MpiRecv, "cancel",
                        lambda self: (withdrawn.append(1), cancel(self))[1])
    comm = pair()
    interleaved = schedule == "interleaved"
    m = 4
    # The ragged leaf crosses from stage 0 to 1 (1F1B), or from rank 1's first chunk to
    # rank 0's second (interleaved).
    layers = [pf.LayerSpec(Embed, VOCAB, WIDTH), pf.LayerSpec(Block, WIDTH, 8),
              pf.LayerSpec(Ragged), pf.LayerSpec(Unragged), pf.LayerSpec(Block, WIDTH, 12),
              pf.LayerSpec(Head, WIDTH, VOCAB)]
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=2, microbatches=m, schedule=schedule,
                                 virtual_stages=2 if interleaved else 1,
                                 partition=[0, 2, 3, 4, 6] if interleaved else [0, 3, 6],
                                 backend="mpi"),
                       comm=comm)
    g = torch.Generator().manual_seed(3)
    steps = [(torch.randint(0, VOCAB, (4 * m, seq), generator=g),
              torch.randint(0, VOCAB, (4 * m, seq), generator=g)) for seq in (5, 5, 7, 7, 5)]
    losses = []
    for k, (x, y) in enumerate(steps):
        losses.append(engine.train_step(x, y))
        if k == 1:
            engine.eval_step(x, y)
    reference, ref_losses = train_reference(layers, steps)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    local = engine.stage.module.state_dict()
    assert_same_parameters(local, {k: v for k, v in reference.state_dict().items()
                                   if k in local})
    # Strict mode (PIPEFLOW_STRICT_COMM) runs this as NCCL would: headers agreed per batch
    # shape, a link whose shapes change within a step announcing every message; nothing is
    # withdrawn there.
    if isinstance(engine.stage.pipe_comm, mpi_comm.MpiCommunicator):
        assert sum(allgather(comm, len(withdrawn))) > 0
    engine.close()
    comm.Free()
