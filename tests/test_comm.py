"""Communicator checks that need no second rank: the device rule of torch.distributed groups,
and the bytes a host tensor hands MPI."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from pipeflow.comm.base import CommDeviceError, check_on_device
from pipeflow.comm.mpi import MpiCommunicator


def test_tensors_on_the_groups_device_pass():
    check_on_device("all_reduce", [torch.zeros(3), torch.ones(2, 2)], torch.device("cpu"))
    check_on_device("isend", [torch.zeros(1, device="meta")], torch.device("meta"))


@pytest.mark.parametrize("tensor_device,group_device", [("cpu", "meta"), ("meta", "cpu"),
                                                        ("cpu", "cuda:0"), ("cpu", "cuda")])
def test_a_tensor_on_another_device_is_refused_naming_op_and_devices(tensor_device,
                                                                     group_device):
    t = torch.empty(4, 2, device=tensor_device)
    with pytest.raises(CommDeviceError) as info:
        check_on_device("all_reduce", [t], torch.device(group_device),
                        "rank 3 of a 4-rank group")
    text = str(info.value)
    assert "all_reduce" in text and "rank 3" in text and "(4, 2)" in text
    assert f"on {tensor_device}" in text and f"communicates on {group_device}" in text


def test_mpi_communicator_stages_through_the_host():
    comm = MpiCommunicator(MPI.COMM_SELF)
    assert comm.device == torch.device("cpu")
    comm.free()


def test_backend_choice_on_cpus_and_the_strict_switch(monkeypatch):
    from pipeflow.comm.topology import STRICT_ENV, Topology, choose_backend
    from pipeflow.config import ConfigError

    topo = Topology(MPI.COMM_SELF, 1, 1)
    cpu = torch.device("cpu")
    monkeypatch.delenv(STRICT_ENV, raising=False)
    assert choose_backend("auto", topo, cpu) == "mpi"      # no GPU of its own: MPI
    assert choose_backend("strict", topo, cpu) == "strict"
    monkeypatch.setenv(STRICT_ENV, "1")
    assert choose_backend("auto", topo, cpu) == "strict"
    assert choose_backend("mpi", topo, cpu) == "strict"
    assert choose_backend("gloo", topo, cpu) == "gloo"     # torch.distributed stays itself
    with pytest.raises(ConfigError, match="backend 'nccl' needs CUDA tensors"):
        choose_backend("nccl", topo, cpu)
    topo.free()


def test_rendezvous_address_is_reachable_not_the_loopback_alias(monkeypatch):
    from pipeflow.comm.torch_dist import rendezvous_address

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert rendezvous_address(["node-a", "node-a"]) == "127.0.0.1"   # one host: loopback
    # Another host: the address of the interface that routes to it (here: the loopback
    # route to "localhost"), never 127.0.1.1 from /etc/hosts.
    assert rendezvous_address(["this-node", "localhost"]) == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert rendezvous_address(["node-a", "node-b"]) == "10.1.2.3"
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(RuntimeError, match="set MASTER_ADDR"):
        rendezvous_address(["this-node", "no-such-host.invalid"])


def test_config_defaults_to_auto_backend():
    from pipeflow import Config
    assert Config().backend == "auto"


def test_a_rank_binds_its_gpu_whatever_the_backend(monkeypatch):
    from pipeflow.comm.topology import bind_device

    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    bind_device(torch.device("cuda", 3))
    bind_device(torch.device("cuda"))       # the current GPU: nothing to bind
    bind_device(torch.device("cpu"))
    assert bound == [torch.device("cuda", 3)]


def test_nccl_families_keep_each_role_apart_and_gloo_shares_them(monkeypatch):
    # A link's two directions have the same ranks. Under NCCL (matching by order on one
    # stream per communicator) each must be a communicator of its own; gloo matches by tag,
    # so one group serves every role of the same ranks.
    import torch.distributed as dist

    from pipeflow.comm import torch_dist as pf_comm

    monkeypatch.setattr(pf_comm, "_FAMILIES", {})
    monkeypatch.setattr(pf_comm, "_FAMILIES_OF", [dist.group.WORLD])
    monkeypatch.setattr(pf_comm, "_new_family", lambda lists, backend: object())
    pair = [[0, 1]]
    roles = ("pipeline", "forward", "backward", "data", "tie")
    nccl = [pf_comm._split_family(pair, "nccl", role) for role in roles]
    assert len({id(g) for g in nccl}) == len(roles)
    assert pf_comm._split_family(pair, "nccl", "forward") is nccl[1]        # reused
    gloo = {id(pf_comm._split_family(pair, "gloo", role)) for role in roles}
    assert len(gloo) == 1


def test_a_links_header_is_agreed_per_batch_shape_and_never_where_it_varied():
    from pipeflow.runtime.runner import LinkShapes
    from pipeflow.tree import header_of

    small, _ = header_of(torch.zeros(2, 3))
    wide, _ = header_of(torch.zeros(2, 4))
    link, other = (1, 0), (1, 1)
    ends = LinkShapes()
    ends.begin("seq 3")                  # the first step of a batch shape: announced
    assert ends.known(link) is None
    ends.seen(link, small)
    ends.seen(link, small)
    ends.seen(other, small)
    ends.seen(other, wide)               # two shapes in one step on this link
    ends.end()
    ends.begin("seq 3")
    assert ends.known(link) == small     # agreed: no header in later steps
    assert ends.known(other) is None     # varied: announced in every step
    ends.end()
    ends.begin("seq 4")                  # a new batch shape: announced again
    assert ends.known(link) is None
    ends.seen(link, wide)
    ends.end()
    ends.begin("seq 3")
    assert ends.known(link) == small     # the earlier shape is still agreed
    ends.begin(None)                     # no agreed batch shape: always announced
    assert ends.known(link) is None
    ends.end()
    for n in range(LinkShapes.LIMIT):    # the oldest batch shapes are forgotten alike
        ends.begin(f"shape {n}")
        ends.seen(link, small)
        ends.end()
    ends.begin("seq 3")
    assert ends.known(link) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_host_tensor_goes_to_mpi_as_its_own_bytes_by_address(dtype):
    from pipeflow.comm.base import as_bytes

    whole = torch.arange(12).to(dtype)
    part = whole[3:9]                                 # an offset into the storage
    buf, kind = as_bytes(part)
    assert kind == MPI.BYTE
    assert bytes(buf) == part.view(torch.uint8).numpy().tobytes()
    # MPI writes into it (a receive): the tensor itself changes, no copy in between.
    out = torch.empty(6, dtype=dtype)
    buf2, _ = as_bytes(out)
    MPI.COMM_SELF.Sendrecv([buf, MPI.BYTE], 0, 0, [buf2, MPI.BYTE], 0, 0)
    assert torch.equal(out, part)
    assert len(as_bytes(torch.empty(0, dtype=dtype))[0]) == 0


def test_a_strided_tensor_is_refused_before_mpi_reads_the_wrong_bytes():
    from pipeflow.comm.base import as_bytes

    wanted = r"contiguous.*shape \(4, 3\) with strides \(1, 4\).*\.contiguous\(\)"
    with pytest.raises(ValueError, match=wanted):
        as_bytes(torch.zeros(3, 4).t())
