"""The strict communicator refuses what NCCL would refuse, and the engine trains through it.

Run under `mpirun -n 2` and `-n 4` with `--with-mpi`.
"""

from __future__ import annotations

import threading

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.comm.base import CommDeviceError
from pipeflow.comm.strict import StrictCommError, StrictCommunicator

from toy import (adamw, assert_same_parameters, batches, loss_fn, pair, toy_layers,
                 train_reference)
from toy import allgather, barrier, receives_posted_ahead, watch_receives

WORLD = MPI.COMM_WORLD
# Representative grids: (pipeline, data, schedule, tied, clip); only those the world holds.
CASES = [(p, d, schedule, tied, clip)
         for p, d, schedule, tied, clip in [
             (2, 1, "1f1b", False, 0.0), (2, 1, "gpipe", True, 0.3),
             (2, 1, "interleaved", True, 0.3), (1, 2, "1f1b", False, 0.3),
             (4, 1, "1f1b", True, 0.3), (4, 1, "interleaved", False, 0.0),
             (2, 2, "1f1b", True, 0.3), (2, 2, "interleaved", True, 0.0)]
         if p * d == WORLD.size]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline,data,schedule,tied,clip", CASES)
def test_training_through_the_strict_communicator_equals_one_process(pipeline, data, schedule,
                                                                     tied, clip):
    interleaved = schedule == "interleaved"
    layers = toy_layers(blocks=2 * pipeline * 2 - 2 if interleaved else 5, tied=tied)
    m = 2 * pipeline if interleaved else 3
    config = pf.Config(pipeline=pipeline, data=data, microbatches=m, schedule=schedule,
                       virtual_stages=2 if interleaved else 1, clip=clip, backend="strict",
                       bucket_mb=0.001)
    engine = pf.Engine(layers, loss_fn, adamw, config)
    assert engine.stage.backend == "strict"
    assert isinstance(engine.stage.pipe_comm, StrictCommunicator)
    steps = batches(3, 4 * m * data)
    losses = [engine.train_step(x, y) for x, y in steps]
    reference, ref_losses = train_reference(layers, steps, clip=clip)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    pipe = engine.stage.pipe_comm
    assert pipe.collectives + pipe.object_collectives > 0   # checked
    engine.close()


@pytest.mark.mpi(min_size=2)
def test_receives_out_of_send_order_are_refused_although_tags_would_match():
    pair = WORLD.Split(0 if WORLD.rank < 2 else MPI.UNDEFINED, WORLD.rank)
    if WORLD.rank >= 2:
        barrier(WORLD)
        return
    comm = StrictCommunicator(pair)
    a, b = torch.ones(3), torch.full((3,), 2.0)
    if comm.rank == 0:
        sends = [comm.isend([a], 1, tag=10), comm.isend([b], 1, tag=11)]
        for s in sends:
            s.wait()
    else:
        meta = [((3,), torch.float32)]
        # MPI would match these by tag; NCCL hands over the first message sent.
        second = comm.irecv(meta, 0, tag=11, device=torch.device("cpu"))
        first = comm.irecv(meta, 0, tag=10, device=torch.device("cpu"))
        with pytest.raises(StrictCommError, match=r"rank 1, link from rank 0: receive 0 on "
                                                  r"this link expected tag 11 .* has tag 10"):
            second.wait()
        with pytest.raises(StrictCommError, match="receive 1 on this link expected tag 10"):
            first.wait()
    comm.free()
    pair.Free()
    barrier(WORLD)


@pytest.mark.mpi(min_size=2)
def test_in_order_messages_arrive_intact():
    comm = StrictCommunicator(WORLD)
    peer = (WORLD.rank + 1) % WORLD.size
    src = (WORLD.rank - 1) % WORLD.size
    sends = [comm.isend([torch.full((2,), float(WORLD.rank * 10 + k))], peer, tag=k)
             for k in range(3)]
    recvs = [comm.irecv([((2,), torch.float32)], src, tag=k, device=torch.device("cpu"))
             for k in range(3)]
    got = [r.wait()[0] for r in recvs]
    for s in sends:
        s.wait()
    assert [g.tolist() for g in got] == [[src * 10.0 + k] * 2 for k in range(3)]
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_ranks_issuing_different_collectives_are_refused_on_every_rank():
    comm = StrictCommunicator(WORLD)
    t = torch.ones(4) if WORLD.rank == 0 else torch.ones(5)
    with pytest.raises(StrictCommError, match=r"collective 0 of this group differs between "
                                              r"ranks \(rank 0: all_reduce\(\(4,\)"):
        comm.allreduce_(t)
    # The same collective everywhere passes, and sums.
    t = torch.ones(4)
    comm.allreduce_(t)
    assert t.tolist() == [float(WORLD.size)] * 4
    comm.free()



@pytest.mark.mpi(min_size=2)
def test_a_collective_of_the_same_shape_in_another_dtype_is_refused():
    # One rank's bucket in fp32, another's reinterpreted as int32 (or bf16 beside fp16): the
    # same shape and bytes, so MPI sums without a word; NCCL would sum unrelated numbers.
    comm = StrictCommunicator(WORLD)
    t = torch.ones(4) if WORLD.rank == 0 else torch.ones(4, dtype=torch.int32)
    with pytest.raises(StrictCommError, match=r"collective 0 of this group differs between "
                                              r"ranks \(rank 0: all_reduce\(\(4,\), "
                                              r"'torch.float32'\); rank 1: all_reduce\(\(4,\), "
                                              r"'torch.int32'\)"):
        comm.allreduce_(t)
    comm.free()

@pytest.mark.mpi(min_size=2)
def test_collectives_of_equal_size_issued_in_different_orders_are_refused():
    # Two gradient buckets of one size launched in different orders on two replicas: MPI
    # and NCCL would pair them silently and sum the wrong buckets. Shape and dtype agree, so
    # only the name the caller gives each collective tells them apart.
    comm = StrictCommunicator(WORLD)
    first = "gradient bucket 0" if WORLD.rank == 0 else "gradient bucket 1"
    with pytest.raises(StrictCommError, match=r"collective 0 of this group differs between "
                       r"ranks \(rank 0: all_reduce\[gradient bucket 0\]\(\(4,\), "
                       r"'torch.float32'\); rank 1: all_reduce\[gradient bucket 1\]"):
        comm.iallreduce_(torch.ones(4), key=first).wait()
    for op in ("all_reduce", "reduce_scatter", "all_gather"):   # the same name: it runs
        t = torch.ones(2 * WORLD.size)
        if op == "all_reduce":
            comm.iallreduce_(t, key="bucket").wait()
        elif op == "reduce_scatter":
            comm.ireduce_scatter_(t, torch.empty(2), key="bucket").wait()
        else:
            comm.iallgather_(torch.ones(2), t, key="bucket").wait()
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_calls_off_the_owning_thread_and_tensors_off_the_device_are_refused():
    comm = StrictCommunicator(WORLD)
    errors = []

    def hook():
        try:
            comm.iallreduce_(torch.ones(2))
        except StrictCommError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=hook)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "not from the thread that owns this communicator" in errors[0]
    meta = StrictCommunicator(WORLD, device="meta")
    with pytest.raises(CommDeviceError, match="all_reduce got a tensor .* on cpu"):
        meta.allreduce_(torch.ones(2))
    comm.free()
    meta.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_strict_send_completes_only_once_the_peer_receives():
    # NCCL's sends do not finish into a buffer: an order that works only because MPI
    # buffered a small message must fail under strict mode as it would hang under NCCL.
    import time
    group = pair()
    comm = StrictCommunicator(group)
    if group.rank == 0:
        request = comm.isend([torch.ones(4)], dest=1, tag=3)
        time.sleep(0.3)
        early = request.test()
        barrier(group)                       # only now does rank 1 post its receive
        request.wait()
        assert not early, "the send completed before any receive was posted"
    else:
        barrier(group)
        got = comm.irecv([((4,), torch.float32)], source=0, tag=3,
                         device=torch.device("cpu")).wait()
        assert torch.equal(got[0], torch.ones(4))
    comm.free()
    group.Free()


class SyncsTheDevice(torch.nn.Module):
    def forward(self, x):
        torch.cuda.synchronize()             # as the tracer did after every instruction
        return x


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_device_synchronize_inside_a_step_fails_under_strict_mode():
    group = pair()
    layers = toy_layers()
    layers.insert(1, pf.LayerSpec(SyncsTheDevice))
    # Replicas: each rank meets the synchronize in its own first forward.
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(data=2, microbatches=2, backend="strict"), comm=group,
                       abort_on_error=False)
    with pytest.raises(RuntimeError, match=r"torch.cuda.synchronize\(\) inside a step"):
        engine.train_step(*batches(1, 8)[0])
    assert torch.cuda.synchronize is not None and \
        torch.cuda.synchronize.__name__ == "synchronize"      # put back after the step
    group.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_tied_gradients_are_summed_through_the_strict_communicator():
    # Ties bypassed strict mode (a raw MPI all-reduce): a tie summed out of order would have
    # passed on CPUs and hung under NCCL. Each step's tie sum is now an agreed collective.
    group = pair()
    engine = pf.Engine(toy_layers(tied=True), loss_fn, adamw,
                       pf.Config(pipeline=2, microbatches=2, backend="strict"), comm=group)
    for x, y in batches(2, 8):
        engine.train_step(x, y)
    tie, = engine.stage.ties
    assert isinstance(tie.dist, StrictCommunicator)
    assert tie.dist.collectives == 2                  # one agreed sum a step
    engine.close()
    group.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_headers_travel_only_in_the_first_step_of_each_batch_shape():
    # Under NCCL's rules a receiver cannot probe: a link's shapes are agreed in the first
    # step of each batch shape, later steps send tensors alone, and a new sequence length
    # is announced again in its first step, then agreed too.
    comm = pair()
    m = 3
    layers = toy_layers(blocks=3)
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=2, microbatches=m, backend="strict"), comm=comm)
    headers, send = [], engine.stage.pipe_comm.send_message

    def counted(header, tensors, dest, tag):
        headers[-1] += header is not None
        return send(header, tensors, dest, tag)
    engine.stage.pipe_comm.send_message = counted
    g = torch.Generator().manual_seed(3)
    steps = [tuple(torch.randint(0, 13, (2 * m, seq), generator=g) for _ in range(2))
             for seq in (5, 5, 3, 5, 3, 3)]
    losses = []
    for x, y in steps:
        headers.append(0)
        losses.append(engine.train_step(x, y))
    first = engine.plan.holds_first(engine.stage.index)
    sent = [m, 0, m, 0, 0, 0] if first else [0] * 6   # gradients: never a header
    assert headers == sent
    reference, ref_losses = train_reference(layers, steps)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    local = engine.stage.module.state_dict()
    assert_same_parameters(local, {k: v for k, v in reference.state_dict().items()
                                   if k in local})
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["strict", "mpi"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_receives_are_posted_before_the_compute_before_them(schedule, backend):
    # Once a link has carried a message, each receive from another rank is posted before the
    # compute instruction that precedes it, so the transfer overlaps that compute: under
    # NCCL's rules (strict) for the link's agreed shapes; over MPI, which probes, for a
    # gradient the sizes of the activation sent and for an activation its link's last
    # header. Only a receive with no compute before it in the step, and over MPI a second
    # activation of one link in one window (whose header the first may change), is probed
    # where it stands; the training is still exact.
    from pipeflow.comm.mpi import MpiCommunicator

    comm = pair()
    interleaved = schedule == "interleaved"
    m = 4
    layers = toy_layers(blocks=6 if interleaved else 3)
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=2, microbatches=m, schedule=schedule,
                                 virtual_stages=2 if interleaved else 1, backend=backend),
                       comm=comm)
    events = watch_receives(engine)
    steps = batches(2, 4 * m)
    losses = [engine.train_step(*steps[0])]
    events.clear()                                 # the second step: every link has a header
    losses.append(engine.train_step(*steps[1]))
    probes = isinstance(engine.stage.pipe_comm, MpiCommunicator)   # not strict (the env)
    ahead, where_it_stands = receives_posted_ahead(engine, events, one_activation_a_link=probes)
    assert ahead >= m - 1
    if not probes:
        assert where_it_stands == (0 if engine.stage.index == 0 else 1)
    reference, ref_losses = train_reference(layers, steps)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    local = engine.stage.module.state_dict()
    assert_same_parameters(local, {k: v for k, v in reference.state_dict().items()
                                   if k in local})
    engine.close()
    comm.Free()


class FailsOnItsSecondForward(torch.nn.Module):
    """Stage 0's first layer: once armed (`calls` = 0), its second forward raises."""

    calls = None

    def forward(self, x):
        if FailsOnItsSecondForward.calls is not None:
            FailsOnItsSecondForward.calls += 1
            if FailsOnItsSecondForward.calls == 2:
                raise ValueError("second forward")
        return x


def _raise_in_backward(grad):
    raise ValueError("backward")


class FailsInBackward(torch.nn.Module):
    """The last stage's last layer: once armed, its backward raises."""

    armed = False

    def forward(self, x):
        x = x * 1.0
        if x.requires_grad and FailsInBackward.armed:
            x.register_hook(_raise_in_backward)
        return x


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_receive_left_posted_by_a_failed_step_fails_the_next_engine_as_nccl_would():
    # In the second step (the first agreed the links' shapes), stage 0 posts the gradient of
    # micro-batch 0 before its second forward, which raises; stage 1 posts the activation of
    # micro-batch 1 before its first backward, which raises. MPI withdraws such receives;
    # NCCL cannot, and the next engine on these ranks, reusing the cached link groups, would
    # read each message on those links one late.
    from pipeflow.comm.strict import forget_posted
    group = pair()
    layers = [pf.LayerSpec(FailsOnItsSecondForward), *toy_layers(), pf.LayerSpec(FailsInBackward)]
    config = pf.Config(pipeline=2, microbatches=4, backend="strict")
    engine = pf.Engine(layers, loss_fn, adamw, config, comm=group, abort_on_error=False)
    engine.train_step(*batches(1, 8)[0])
    FailsOnItsSecondForward.calls, FailsInBackward.armed = 0, True
    with pytest.raises(RuntimeError, match="second forward|backward"):
        engine.train_step(*batches(1, 8)[0])
    FailsOnItsSecondForward.calls, FailsInBackward.armed = None, False
    engine.close()
    try:
        # World ranks: 0 and 1 in the first pair, 2 and 3 in the second under -n 4.
        lo, hi = sorted(allgather(group, WORLD.rank))
        with pytest.raises(RuntimeError, match=rf"receives posted by an earlier engine and never "
                                               rf"matched \(1 on the link from rank {lo} to "
                                               rf"rank {hi}, 1 on the link from rank {hi} to "
                                               rf"rank {lo}\)"):
            pf.Engine(toy_layers(), loss_fn, adamw, config, comm=group, abort_on_error=False)
    finally:
        forget_posted()
    engine = pf.Engine(toy_layers(), loss_fn, adamw, config, comm=group)  # nothing left over
    engine.train_step(*batches(1, 8)[0])
    engine.close()
    group.Free()
