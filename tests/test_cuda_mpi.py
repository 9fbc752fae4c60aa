"""GPU tensors over MPI, the parts a CPU can show: whether MPI is CUDA-aware (the env override
and MPI's own answer) and the reuse of host staging buffers."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from pipeflow.comm import cuda as cuda_mpi
from pipeflow.comm.cuda import CUDA_AWARE_ENV, PinnedBuffers, cuda_aware_mpi


def _raise(error):
    def query(*args):
        raise error
    return query


@pytest.mark.parametrize("query,expected", [
    (lambda: True, True), (lambda: False, False), (lambda: 1, True),
    (_raise(NotImplementedError()), False)], ids=["yes", "no", "int", "unsupported"])
def test_mpi_is_asked_when_the_env_says_nothing(monkeypatch, query, expected):
    monkeypatch.delenv(CUDA_AWARE_ENV, raising=False)
    assert cuda_aware_mpi(query) is expected


def test_without_a_query_it_is_off_by_default(monkeypatch):
    monkeypatch.delenv(CUDA_AWARE_ENV, raising=False)
    monkeypatch.delattr(MPI, "Query_cuda_support", raising=False)
    assert cuda_aware_mpi() is False
    monkeypatch.setattr(MPI, "Query_cuda_support", lambda: True, raising=False)
    assert cuda_aware_mpi() is True           # mpi4py >= 4's query, found on MPI


@pytest.mark.parametrize("value,answer", [("1", False), ("0", True), (" 1 ", False)])
def test_the_env_override_wins_over_mpis_answer(monkeypatch, value, answer):
    monkeypatch.setenv(CUDA_AWARE_ENV, value)
    assert cuda_aware_mpi(lambda: answer) is (value.strip() == "1")


def test_a_bad_env_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(CUDA_AWARE_ENV, "yes")
    with pytest.raises(ValueError, match=f"{CUDA_AWARE_ENV}='yes': expected 1 .* or 0"):
        cuda_aware_mpi(lambda: True)


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_staging_buffers_are_reused_per_size_and_dtype():
    cache = PinnedBuffers(pin_memory=False)
    a = cache.take(6, torch.float32)
    cache.give(a)
    assert cache.take(6, torch.float32) is a                 # the same memory, next step
    b = cache.take(6, torch.float32)                         # a is taken: a second buffer
    assert b is not a and cache.allocated == 2
    assert cache.take(6, torch.float16) is not a and cache.take(7, torch.float32) is not b
    assert cache.allocated == 4
    cache.give(a)
    cache.give(b)
    assert {id(cache.take(6, torch.float32)) for _ in range(2)} == {id(a), id(b)}
    assert cache.allocated == 4
    assert a.numel() == 6 and a.dtype == torch.float32 and not a.is_pinned()


def test_a_buffer_is_reused_only_after_its_copy_back_is_done():
    cache = PinnedBuffers(pin_memory=False)
    a = cache.take(4, torch.float32)
    copy_back = _Event(done=False)
    cache.give(a, copy_back)
    b = cache.take(4, torch.float32)
    assert b is not a                       # a's copy to the device may still read it
    cache.give(b)
    copy_back.done = True
    assert {id(cache.take(4, torch.float32)) for _ in range(2)} == {id(a), id(b)}
    assert cache.allocated == 2


def test_cpu_tensors_never_reach_the_gpu_path(monkeypatch):
    # The CPU all-reduce stays the host path it was: cuda_mpi is for CUDA tensors only.
    from pipeflow.comm import mpi as comm

    monkeypatch.setattr(cuda_mpi, "iallreduce_cuda_", _raise(AssertionError("GPU path")))
    t = torch.arange(4.0)
    comm.mpi_iallreduce_(MPI.COMM_SELF, t).wait()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


class _Log:
    """Stands in for CUDA streams, a CUDA tensor and torch.distributed: records the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.active = "compute"

    def stream(self, name: str):
        log = self

        class Stream:
            def wait_stream(self, other) -> None:
                log.calls.append(f"{name} waits for {other.name}")
        s = Stream()
        s.name = name
        return s


def test_nccl_all_reduce_runs_on_its_own_stream_and_wait_orders_the_compute_stream(
        monkeypatch):
    import contextlib

    from pipeflow.comm.torch_dist import TorchDistCommunicator

    log = _Log()
    compute, side = log.stream("compute"), log.stream("side")

    @contextlib.contextmanager
    def on(stream):
        before, log.active = log.active, stream.name
        yield
        log.active = before

    class Work:
        def wait(self):
            log.calls.append("work waited")

        def is_completed(self):
            return True

    class Dist:
        def all_reduce(self, tensor, group, async_op):
            log.calls.append(f"all_reduce on {log.active}, group {group}, async {async_op}")
            return Work()

    class Tensor:          # a CUDA tensor, as far as the communicator looks
        device, shape = torch.device("cuda", 0), (3,)

        def record_stream(self, stream):
            log.calls.append(f"tensor kept for {stream.name}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(cuda_mpi, "side_stream", lambda device: side)
    comm = TorchDistCommunicator.__new__(TorchDistCommunicator)
    comm._dist, comm.group, comm.device, comm.rank, comm.size = Dist(), "g", \
        torch.device("cuda", 0), 0, 2
    request = comm.iallreduce_(Tensor())
    assert log.calls == ["side waits for compute", "all_reduce on side, group g, async True",
                         "tensor kept for side"]
    request.wait()
    assert log.calls[3:] == ["work waited", "compute waits for side"]
    # A CPU tensor (gloo) is reduced as before: no stream, the work itself.
    log.calls.clear()
    comm.device = torch.device("cpu")
    comm.iallreduce_(torch.zeros(3)).wait()
    assert log.calls == ["all_reduce on compute, group g, async True", "work waited"]


@pytest.mark.parametrize("value", ["1", "0"])
def test_point_to_point_hands_mpi_gpu_memory_only_when_mpi_is_cuda_aware(monkeypatch, value):
    from pipeflow.comm import mpi as comm

    monkeypatch.setenv(CUDA_AWARE_ENV, value)
    assert comm._device_aware(torch.device("cuda", 0)) is (value == "1")
    assert comm._device_aware(torch.device("cpu")) is False     # the host path, as before
    t = torch.arange(6.0).view(2, 3).t()                         # CPU, not contiguous
    sent = comm._outgoing([t])
    assert sent[0].is_contiguous() and torch.equal(sent[0], t) and sent[0].device == t.device
    got = comm._incoming((2, 3), torch.float16, torch.device("cpu"))
    assert got.shape == (2, 3) and got.dtype == torch.float16 and not got.is_pinned()
