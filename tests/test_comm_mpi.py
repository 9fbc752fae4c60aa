"""The communicator on its own: messages of megabytes, all-reduces of views.

Run under `mpirun -n 2` and `-n 4` with `--with-mpi`.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from mpi4py import MPI

from pipeflow.comm.mpi import MpiCommunicator, mpi_iallreduce_
from toy import allgather, barrier

WORLD = MPI.COMM_WORLD
N = 2**20                 # 4 MB of fp32 a message: sent by rendezvous, not eagerly


@pytest.mark.mpi(min_size=2)
def test_isend_keeps_megabyte_buffers_alive_until_the_receiver_takes_them():
    # The sender drops its tensors at once and fills fresh memory before the receiver posts
    # a single receive: what arrives must still be what was sent.
    comm = WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)
    pipe = MpiCommunicator(comm)
    meta = [((N,), torch.float32)]
    if comm.rank == 0:
        requests = [pipe.isend([torch.full((N,), float(i + 1))], 1, i) for i in range(4)]
        junk = [torch.full((N,), -7.0) for _ in range(8)]
        barrier(comm)
        for r in requests:
            r.wait()
        del junk
    else:
        barrier(comm)
        for i in range(4):
            (got,) = pipe.irecv(meta, 0, i, torch.device("cpu")).wait()
            wrong = int((got != i + 1).sum())
            assert wrong == 0, f"message {i}: {wrong} of {N} values are not {i + 1}"
    pipe.free()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("view", ["transposed", "strided"])
def test_non_contiguous_all_reduce_sums_into_the_tensor_itself(view):
    # MPI reduces a contiguous buffer: a view that is not one goes through a host copy,
    # and the sum must come back into the view, leaving the rest of its storage alone.
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 100 * WORLD.rank
    t = base.t() if view == "transposed" else base[:, ::2]
    assert not t.is_contiguous()
    expected = sum(t - 100 * WORLD.rank + 100 * r for r in range(WORLD.size))
    untouched = base[:, 1::2].clone()
    mpi_iallreduce_(WORLD, t).wait()
    assert torch.equal(t, expected), f"rank {WORLD.rank}: {t} != {expected}"
    if view == "strided":
        assert torch.equal(base[:, 1::2], untouched)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_hang_report_tells_a_silent_peer_from_an_unmatched_message():
    # The watchdog's report asks the transport what has arrived from the peer a receive
    # waits on: nothing (the peer never sent) or a message nobody received (a mismatch).
    from pipeflow.tree import header_of

    comm = WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)
    pipe = MpiCommunicator(comm)
    header, tensors = header_of(torch.ones(3, 5))
    if comm.rank == 1:
        assert pipe.arrived_from(0) == "nothing from rank 0 of the pipeline has arrived"
    barrier(comm)
    if comm.rank == 0:
        pipe.send_message(header, tensors, 1, tag=7).wait()
    barrier(comm)
    if comm.rank == 1:
        # The header comes first (an odd wire tag), then 60 bytes of tensor.
        assert pipe.arrived_from(0) == (f"message 7 (a header) of {len(pickle.dumps(header))} "
                                        "bytes from rank 0 of the pipeline has arrived and "
                                        "waits to be received")
        got_header, (got,) = pipe.recv_message(0, 7, None, torch.device("cpu"))
        assert got_header == header and torch.equal(got, tensors[0])
        assert pipe.arrived_from(0).startswith("nothing")
    pipe.free()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_engines_on_sub_communicators_of_one_node_take_different_gpus(monkeypatch):
    # Two engines of one rank each on one node: within its own communicator each rank is
    # the node's rank 0, so choosing the GPU by that would put both on GPU 0.
    from pipeflow.comm.topology import Topology
    from pipeflow.runtime.stage import default_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    alone = WORLD.Split(color=WORLD.rank, key=0)
    topo = Topology(alone, pipeline=1)
    assert topo.local_rank == 0
    assert default_device(topo) == torch.device("cuda", node.rank % 8)
    assert len(set(allgather(WORLD, topo.gpu_slot))) == WORLD.size
    topo.free()
    alone.Free()
    node.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("new_length", [2, 6, 4])
def test_a_receive_posted_for_old_shapes_never_takes_a_message_of_new_ones(new_length):
    # The receiver posts message 1's receive for the shapes message 0 announced; the sender
    # announces new ones instead (shorter, longer, or the same). The whole message has
    # arrived before the receiver looks (a barrier lets MPI match what it can): the posted
    # receive must not have matched the new tensors, and the message comes back whole.
    from pipeflow import tree

    comm = WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)
    pipe = MpiCommunicator(comm)
    cpu = torch.device("cpu")
    old = (torch.zeros(3, 4), torch.arange(3))
    new = (torch.full((3, new_length), 5.0), torch.arange(3) + 10)
    if comm.rank == 0:
        first, ts = tree.header_of(old)
        pipe.send_message(first, ts, 1, 0).wait()
        header, ts = tree.header_of(new)
        # Announced as new even when the shapes are the old ones: the requires_grad flag
        # differs (a header of other leaves, the same sizes).
        header = header._replace(metas=tuple(m._replace(requires_grad=True)
                                             for m in header.metas))
        pipe.send_message(header, ts, 1, 1).wait()
        barrier(comm)
    else:
        first, _ = pipe.recv_message(0, 0, None, cpu)
        posted = pipe.irecv_message([(m.shape, m.dtype) for m in first.metas], 0, 1, cpu)
        barrier(comm)
        for _ in range(100):              # let MPI progress: any match happens now
            comm.Iprobe(source=0, tag=MPI.ANY_TAG)
        header, got = pipe.recv_posted(posted, 0, 1, first, cpu)
        assert [tuple(m.shape) for m in header.metas] == [(3, new_length), (3,)]
        assert all(m.requires_grad for m in header.metas)
        assert torch.equal(got[0], new[0]) and torch.equal(got[1], new[1])
    pipe.free()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_message_longer_than_its_posted_receive_is_a_protocol_error_naming_it():
    # A sender that changes shapes without announcing them (a bug of the protocol's users)
    # overruns the receive posted for the link's last shapes: a ProtocolError that names
    # the message, the rank and the shapes expected, not MPI's bare truncation code.
    from pipeflow import tree
    from pipeflow.comm.base import ProtocolError

    comm = WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)
    pipe = MpiCommunicator(comm)
    cpu = torch.device("cpu")
    if comm.rank == 0:
        header, ts = tree.header_of(torch.zeros(4))
        pipe.send_message(header, ts, 1, 0).wait()
        pipe.send_message(None, [torch.zeros(6)], 1, 1).wait()     # not announced
        barrier(comm)
    else:
        first, _ = pipe.recv_message(0, 0, None, cpu)
        posted = pipe.irecv_message([(m.shape, m.dtype) for m in first.metas], 0, 1, cpu)
        with pytest.raises(ProtocolError, match=r"expected message 1 from rank 0 of the "
                                                r"pipeline as \[\(4,\) float32\].*does not fit"):
            pipe.recv_posted(posted, 0, 1, first, cpu)
        barrier(comm)
    pipe.free()
    comm.Free()
