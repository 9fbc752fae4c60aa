"""The GPU path's decisions, shown on a CPU with `torch.cuda` and MPI stood in for: which
backend a grid gets, which GPU a rank binds, what MPI is handed (host or device memory)."""

from __future__ import annotations

import types

import pytest
import torch

import pipeflow as pf
from pipeflow import topology
from pipeflow.stage import default_device


class _World:
    """A world of `n` ranks whose allgather hands back what each rank would say."""

    def __init__(self, views) -> None:
        self.views, self.rank, self.size = views, 0, len(views)

    def allgather(self, mine):
        return [(gpu, mine[1]) for gpu in self.views]


def _topo(gpus):
    return types.SimpleNamespace(world=_World(gpus), describe=lambda: "rank 0 (stage 0 of 2)")


@pytest.fixture
def gpus_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(topology, "_nccl_available", lambda: True)
    monkeypatch.setattr(topology, "_gpu_identity", lambda device: ("node1", "GPU-a"))


def test_explicit_nccl_with_two_ranks_on_one_gpu_is_refused_before_nccl_is(gpus_here):
    topo = _topo([("node1", "GPU-a"), ("node1", "GPU-a")])
    with pytest.raises(pf.ConfigError, match=r"backend 'nccl' needs a GPU of its own for every "
                       r"rank, and ranks \[0, 1\] share GPU GPU-a on node1.*Duplicate GPU"):
        topology.choose_backend("nccl", topo, torch.device("cuda", 0))


def test_auto_with_shared_gpus_chooses_mpi_and_says_why(gpus_here, capsys):
    topo = _topo([("node1", "GPU-a"), ("node1", "GPU-a")])
    assert topology.choose_backend("auto", topo, torch.device("cuda", 0)) == "mpi"
    assert "backend 'auto' chose MPI, not NCCL: ranks [0, 1] share GPU" in capsys.readouterr().err
    topo = _topo([("node1", "GPU-a"), ("node1", "GPU-b")])
    assert topology.choose_backend("auto", topo, torch.device("cuda", 0)) == "nccl"


def test_gloo_with_cuda_tensors_is_refused(gpus_here):
    with pytest.raises(pf.ConfigError, match="backend 'gloo' sends no CUDA tensors"):
        topology.choose_backend("gloo", _topo([None]), torch.device("cuda", 0))


def test_a_bare_cuda_device_means_this_ranks_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for local_rank, index in [(0, 0), (3, 3), (5, 1)]:
        topo = types.SimpleNamespace(local_rank=local_rank, describe=lambda: "rank")
        assert default_device(topo, torch.device("cuda")) == torch.device("cuda", index)
        assert default_device(topo, torch.device("cuda", 2)) == torch.device("cuda", 2)
        assert default_device(topo, None) == torch.device("cuda", index)
    assert default_device(topo, torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pf.ConfigError, match="device 'cuda' asked for, and this rank sees no"):
        default_device(topo, torch.device("cuda"))


class _Stream:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        self.log.append("stream drained")


class _Event:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def test_reductions_of_gpu_tensors_go_through_the_host_even_on_a_cuda_aware_mpi(monkeypatch):
    # Open MPI's nonblocking collectives are not CUDA-aware: a bucket or tie reduced by
    # Iallreduce on device pointers crashes or sums garbage. Only host memory reaches it.
    import contextlib

    from pipeflow import cuda_mpi
    log: list[str] = []
    monkeypatch.setenv(cuda_mpi.CUDA_AWARE_ENV, "1")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(log))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(cuda_mpi, "side_stream", lambda device: _Stream(log))
    monkeypatch.setattr(cuda_mpi, "_PINNED", cuda_mpi.PinnedBuffers(pin_memory=False))

    class GpuTensor:        # a CUDA tensor as far as the reduction looks; values in `data`
        device, dtype, shape = torch.device("cuda", 0), torch.float32, (3,)

        def __init__(self, data):
            self.data = data

        def detach(self):
            return self

        def numel(self):
            return self.data.numel()

        def is_contiguous(self):
            return True

        def reshape(self, *shape):
            return self.data.reshape(*shape)

        def view(self, *shape):
            log.append("device memory handed to MPI")
            return self.data.view(*shape)

        def record_stream(self, stream):
            pass

        def copy_(self, src, non_blocking=False):
            self.data.copy_(src)

    class Done:
        def Wait(self):
            return None

        def Test(self):
            return True

    class Comm:             # two ranks holding the same values
        def Iallreduce(self, send, recv, op):
            log.append(f"Iallreduce on {type(recv).__module__}.{type(recv).__name__}")
            recv *= 2
            return Done()

    t = GpuTensor(torch.arange(3.0))
    cuda_mpi.iallreduce_cuda_(Comm(), t).wait()
    assert log == ["Iallreduce on numpy.ndarray"]
    assert t.data.tolist() == [0.0, 2.0, 4.0]


def test_a_cuda_aware_receive_drains_the_stream_before_mpi_writes(monkeypatch):
    # The caching allocator may hand a receive a block whose last owner's kernels are still
    # queued; MPI writes at once, outside stream order: the stream is drained first.
    from pipeflow import comm
    from pipeflow.cuda_mpi import CUDA_AWARE_ENV
    log: list[str] = []
    real_empty = torch.empty

    def empty(*shape, **kwargs):
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            log.append("device buffer")
            kwargs.pop("device")
        return real_empty(*shape, **kwargs)

    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(log))
    monkeypatch.setattr(torch, "empty", empty)
    buf = comm._incoming((2, 3), torch.float32, torch.device("cuda", 0))
    assert buf.shape == (2, 3)
    assert log == ["device buffer", "stream drained"]
    monkeypatch.setenv(CUDA_AWARE_ENV, "0")       # staged: pinned host memory, no drain
    log.clear()
    monkeypatch.setattr(torch, "empty", lambda *s, **k: real_empty(*s, **{**k,
                                                                           "pin_memory": False}))
    comm._incoming((2, 3), torch.float32, torch.device("cuda", 0))
    assert log == []
