"""How ranks wait on MPI (`pipeflow.comm.waiting`): yielding gives what MPI's blocking calls give,
leaves the core to others while it waits, and trains exactly like one process.

Run under `mpirun -n 2` and `-n 4` with `--with-mpi`.
"""

from __future__ import annotations

import time

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.comm import waiting

from toy import (assert_same_parameters, batches, loss_fn, sgd_momentum, toy_layers,
                 train_reference)

WORLD = MPI.COMM_WORLD


@pytest.fixture
def policy():
    """Run a test under a policy, and put the process's back afterwards."""
    before = waiting.policy()
    yield waiting.use
    waiting.use(before)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", ["spin", "yield", "mixed"])
def test_each_wait_gives_what_mpi_gives(policy, wait):
    # "mixed": rank 0 spins, the others yield (nodes with and without spare cores under
    # "auto", or a setting on one rank only): every collective must still meet.
    comm = WORLD.Dup()
    r, n = comm.rank, comm.size
    policy("yield" if wait == "yield" or (wait == "mixed" and r > 0) else "spin")
    mine = {"rank": r, "blob": bytes(range(r % 7)) * (1000 * r + 1)}   # ragged sizes
    assert waiting.allgather(comm, mine) == comm.allgather(mine)
    root = n - 1
    sent = {"from": root, "items": list(range(50))}
    got = waiting.bcast(comm, sent if r == root else None, root)
    assert got == sent and got is not sent            # a copy on the root too, as MPI's
    assert waiting.gather(comm, mine, root) == comm.gather(mine, root=root)
    waiting.barrier(comm)
    # Point to point: an object, then a probed buffer, from each rank to the next.
    nxt, prv = (r + 1) % n, (r - 1) % n
    req = comm.isend(("hello", r), dest=nxt, tag=3)
    assert waiting.recv_object(comm, prv, 3) == ("hello", prv)
    waiting.wait(req)
    data = torch.full((1000 + r,), float(r))
    sends = [comm.Isend(data.numpy(), dest=nxt, tag=4)]
    status = MPI.Status()
    msg = waiting.mprobe(comm, prv, MPI.ANY_TAG, status)
    assert (status.tag, status.Get_count(MPI.FLOAT)) == (4, 1000 + prv)
    out = torch.empty(1000 + prv)
    msg.Recv(out.numpy())
    assert bool((out == prv).all())
    waiting.waitall(sends)
    obj_req = comm.irecv(source=prv, tag=5)
    comm.send(None, dest=nxt, tag=5)                   # None: a result _until must not skip
    assert waiting.wait_object(obj_req) is None
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_yielding_rank_leaves_its_core_while_it_waits(policy):
    # Rank 0 sends after 0.6 s; rank 1 waits for it. Yielding, its thread uses a small part
    # of that time on the CPU (MPI's own blocking receive, on MPICH, spins through all of it).
    policy("yield")
    comm = WORLD.Dup()
    if comm.rank == 0:
        time.sleep(0.6)
        comm.send("late", dest=1, tag=9)
    elif comm.rank == 1:
        wall, cpu = time.perf_counter(), time.thread_time()
        assert waiting.recv_object(comm, 0, 9) == "late"
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        assert wall > 0.4, wall
        assert cpu < 0.25 * wall, f"{cpu:.3f} s on the CPU in {wall:.3f} s of waiting"
    waiting.barrier(comm)
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("wait", ["yield", "auto", "mixed"])
def test_yielding_trains_like_one_process(policy, backend, wait):
    if wait == "mixed":                     # the last rank spins, the others yield
        wait = "spin" if WORLD.rank == WORLD.size - 1 else "yield"
    p = WORLD.size
    layers = toy_layers(blocks=2 * p * 2 - 2, tied=True)
    config = pf.Config(pipeline=p, data=1, microbatches=2 * p, schedule="interleaved",
                       virtual_stages=2, clip=0.3, backend=backend, wait=wait)
    engine = pf.Engine(layers, loss_fn, sgd_momentum, config)
    topo = engine.stage.topo
    assert waiting.policy() == waiting.choose(wait, topo.local_size, topo.local_cores)
    steps = batches(3, 8 * p)
    losses = [engine.train_step(x, y) for x, y in steps]
    reference, ref_losses = train_reference(layers, steps, clip=0.3, optimizer=sgd_momentum)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, reference.state_dict())
    x, y = steps[0]
    assert engine.eval_step(x, y) == pytest.approx(loss_fn(reference(x), y).item(), rel=1e-5)
    engine.close()
