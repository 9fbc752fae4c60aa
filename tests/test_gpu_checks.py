"""The GPU path's decisions, shown on a CPU with `torch.cuda` and MPI stood in for: which
backend a grid gets, which GPU a rank binds, what MPI is handed (host or device memory)."""

from __future__ import annotations

import logging
import os
import types

import pytest
import torch

import pipeflow as pf
from pipeflow.comm import topology
from pipeflow.runtime.stage import default_device


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
    # The fake world answers a plain allgather; the wait policy's is MPI's non-blocking one.
    monkeypatch.setattr(topology.waiting, "allgather", lambda comm, obj: comm.allgather(obj))


def test_explicit_nccl_with_two_ranks_on_one_gpu_is_refused_before_nccl_is(gpus_here):
    topo = _topo([("node1", "GPU-a"), ("node1", "GPU-a")])
    with pytest.raises(pf.ConfigError, match=r"backend 'nccl' needs a GPU of its own for every "
                       r"rank, and ranks \[0, 1\] share GPU GPU-a on node1.*Duplicate GPU"):
        topology.choose_backend("nccl", topo, torch.device("cuda", 0))


def test_auto_with_shared_gpus_chooses_mpi_and_says_why(gpus_here, caplog):
    topo = _topo([("node1", "GPU-a"), ("node1", "GPU-a")])
    assert topology.choose_backend("auto", topo, torch.device("cuda", 0)) == "mpi"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "backend 'auto' chose MPI, not NCCL: ranks [0, 1] share GPU" \
        in warned[0].getMessage() and warned[0].name == "pipeflow.comm.topology"
    topo = _topo([("node1", "GPU-a"), ("node1", "GPU-b")])
    assert topology.choose_backend("auto", topo, torch.device("cuda", 0)) == "nccl"


def test_gloo_with_cuda_tensors_is_refused(gpus_here):
    with pytest.raises(pf.ConfigError, match="backend 'gloo' sends no CUDA tensors"):
        topology.choose_backend("gloo", _topo([None]), torch.device("cuda", 0))


def test_a_bare_cuda_device_means_this_ranks_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for local_rank, index in [(0, 0), (3, 3), (5, 1)]:
        topo = types.SimpleNamespace(gpu_slot=local_rank, describe=lambda: "rank")
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

    from pipeflow.comm import cuda as cuda_mpi
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


def test_a_cuda_aware_receive_takes_a_block_no_queued_kernel_uses_without_a_sync(monkeypatch):
    # The caching allocator may hand a receive a block whose last owner's kernels are still
    # queued on the compute stream; MPI writes at once, outside stream order. The stream was
    # drained before each receive (the GPU idled for the host's launch latency at every
    # message); now the buffer comes from a stream no kernel runs on, recorded on the compute
    # stream that reads it.
    import contextlib
    from pipeflow.comm import cuda, mpi as comm
    from pipeflow.comm.cuda import CUDA_AWARE_ENV
    log: list[str] = []
    real_empty = torch.empty
    receiving = _Stream(log)
    current = [None]

    def empty(*shape, **kwargs):
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            log.append("device buffer on the receive stream" if current[0] is receiving
                       else "device buffer on the compute stream")
            kwargs.pop("device")
        return real_empty(*shape, **kwargs)

    @contextlib.contextmanager
    def stream(s):
        current[0] = s
        yield
        current[0] = None

    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(cuda, "receive_stream", lambda device: receiving)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: log.append(f"recorded on {s}"), raising=False)
    buf = comm._incoming((2, 3), torch.float32, torch.device("cuda", 0))
    assert buf.shape == (2, 3)
    assert log == ["device buffer on the receive stream", "recorded on compute"]
    monkeypatch.setenv(CUDA_AWARE_ENV, "0")       # staged: pinned host memory
    log.clear()
    monkeypatch.setattr(torch, "empty", lambda *s, **k: real_empty(*s, **{**k,
                                                                           "pin_memory": False}))
    comm._incoming((2, 3), torch.float32, torch.device("cuda", 0))
    assert log == []


def test_tracing_on_a_gpu_records_events_and_never_synchronizes_inside_the_step(monkeypatch):
    # The tracer used to end every instruction with torch.cuda.synchronize(): after a send
    # that waits for the peer's receive, and in 1F1B two stages doing so wait for each other.
    # On a GPU it records CUDA events and reads them once, after the step.
    from pipeflow.runtime.runner import CudaClock
    from toy import adamw, batches, loss_fn, toy_layers

    ticks = iter(range(1, 10_000))

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self, stream=None):
            self.at = next(ticks)            # device milliseconds, in order of recording

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return float(other.at - self.at)

    def synchronize(device=None):
        raise AssertionError("the device was synchronized inside a step")

    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(microbatches=2), trace=True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    engine.runner.clock = CudaClock(torch.device("cuda", 0))
    engine.train_step(*batches(1, 4)[0])
    timeline = engine.runner.timeline
    names = [name for name, _, _ in timeline]
    assert names == ["F0", "B0", "F1", "B1", "optimizer step"], names
    starts = [t0 for _, t0, _ in timeline]
    assert starts == sorted(starts) and all(t1 > t0 for _, t0, t1 in timeline)
    # Event times: 1 ms apart in recording order, from the step's start.
    assert timeline[1][1] - timeline[0][1] == pytest.approx(2e-3)
    assert engine.runner.timeline == timeline                # read once, then plain seconds
    engine.close()


def test_mfu_on_a_gpu_missing_from_the_table_is_measured_on_that_gpu(monkeypatch):
    # It was a timed fp32 matmul on the host's CPU: MFU of thousands of percent on a GPU.
    from pipeflow.train import metrics
    measured = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B999")
    monkeypatch.setattr(metrics, "_measured_matmul_flops",
                        lambda device=None, trials=8: measured.append(device) or 1.5e15)
    flops, source = metrics.peak_flops(torch.device("cuda", 1))
    assert (flops, source) == (1.5e15, "measured bf16 matmul on NVIDIA B999")
    assert measured == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 SXM")
    assert metrics.peak_flops(torch.device("cuda", 0)) == (989e12, "NVIDIA H100 SXM bf16 "
                                                                    "data sheet")


def test_flops_count_a_tied_weight_once_and_no_embedding_lookups():
    # 6 N FLOPs a token: N counts what a token multiplies. Tied embedding and head (GPT-2)
    # on one stage or two: the head's matmul once; the position table not at all.
    from pipeflow.train.metrics import count_parameters
    from toy import adamw, loss_fn, toy_layers
    engine = pf.Engine(toy_layers(tied=True), loss_fn, adamw, pf.Config())
    layers = engine.stage.module
    embedding = sum(p.numel() for n, p in layers.named_parameters() if "emb" in n)
    every = sum(p.numel() for p in layers.parameters())        # each tensor once
    assert count_parameters(engine) == every                   # the tied table, as the head
    engine.close()
    untied = pf.Engine(toy_layers(tied=False), loss_fn, adamw, pf.Config())
    everything = sum(p.numel() for p in untied.stage.module.parameters())
    assert count_parameters(untied) == everything - embedding  # the lookup table left out
    untied.close()


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_auto_and_partition_time_measure_layers_in_the_runs_precision(precision, dtype):
    # They measured fp32 layers for bf16/fp16 runs: other times (on a GPU's tensor cores,
    # several-fold) and twice the saved bytes the run will really stash.
    from pipeflow.runtime.arrange import measure_layer_costs
    seen: list = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            seen.append((self.lin.weight.dtype, x.dtype))
            return self.lin(x)

    layers = [pf.LayerSpec(Probe), pf.LayerSpec(Probe)]
    fp32 = measure_layer_costs(layers, torch.randn(8, 4), repeats=1)
    assert set(seen) == {(torch.float32, torch.float32)}
    seen.clear()
    low = measure_layer_costs(layers, torch.randn(8, 4), repeats=1, precision=precision)
    assert set(seen) == {(dtype, dtype)}
    assert low.saved_bytes[1] * 2 == fp32.saved_bytes[1]          # half the stash


@pytest.mark.parametrize("nccl", [True, False], ids=["nccl-from-hooks", "mpi-polled"])
def test_buckets_start_before_the_last_backward_ends_when_hooks_run_off_thread(nccl):
    # On CUDA, gradient hooks run on autograd's device thread while the engine's thread waits
    # in backward(): with NCCL a bucket launches from its hook, so reductions overlap the
    # rest of the backward; with MPI (one thread) the hook marks it, the engine launches.
    import threading
    import time

    from pipeflow.comm.base import Request
    from pipeflow.runtime.data_parallel import GradReducer

    timeline: list[tuple[str, float]] = []

    class Done(Request):
        def test(self):
            return True

        def wait(self):
            return None

    class Comm:
        launch_from_any_thread = nccl

        def iallreduce_(self, tensor, key=None):
            if key.startswith("gradient bucket"):    # not the presence flags after them
                timeline.append((f"launch on {threading.current_thread().name}",
                                 time.monotonic()))
            return Done()

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 2, 4)]
    reducer = GradReducer(params, Comm(), bucket_bytes=16)
    reducer.arm()

    def backward():                       # autograd's device thread, in backward's order
        for p in reversed(params):
            reducer._on_grad(p)
            time.sleep(0.01)              # the rest of this layer's backward
        timeline.append(("backward ends", time.monotonic()))

    worker = threading.Thread(target=backward, name="autograd")
    worker.start()
    worker.join()
    reducer.finish()
    names = [name for name, _ in timeline]
    if nccl:
        end = names.index("backward ends")
        assert names[:end] == ["launch on autograd"] * len(reducer.buckets), names
    else:
        assert names == ["backward ends"] + ["launch on MainThread"] * len(reducer.buckets)


def test_a_closed_engine_frees_its_weights_without_the_garbage_collector():
    # Reference cycles (the runner's and the watchdog's callbacks) kept a closed engine's
    # weights and optimizer state alive until gc.collect(): on a GPU, a benchmark's next
    # engine ran out of memory, or its peak counted the last one's.
    import gc
    import weakref

    from toy import adamw, batches, loss_fn, toy_layers
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(microbatches=2))
    engine.train_step(*batches(1, 4)[0])
    weights = weakref.ref(next(engine.stage.module.parameters()))
    engine.close()
    gc.disable()
    try:
        del engine
        assert weights() is None, gc.get_referrers(weights())[:3]
    finally:
        gc.enable()


def test_deterministic_runs_ask_torch_for_deterministic_kernels(monkeypatch):
    # Bit-for-bit claims on a GPU (resume, recompute) hold only with deterministic kernels:
    # Config.deterministic asks for them, and fixes cuBLAS's workspace unless already set.
    from toy import adamw, loss_fn, toy_layers
    asked = []
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on: asked.append(on))
    pf.Engine(toy_layers(), loss_fn, adamw, pf.Config()).close()
    assert asked == []
    pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(deterministic=True)).close()
    assert asked == [True]
    import os
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    with pytest.raises(pf.ConfigError, match="deterministic"):
        pf.Config(deterministic="yes")


def test_a_stuck_nccl_link_is_named_in_the_hang_report():
    # NCCL's waits never block the host: a receive that never completes shows up later, as a
    # host stuck at "loss" or "optimizer step" with no peer. The report now lists what is
    # still outstanding on the device, with its peer.
    from pipeflow.comm.torch_dist import TorchDistCommunicator
    from pipeflow.comm.torch_dist import _DistWork
    from toy import adamw, loss_fn, toy_layers

    class Work:
        done = False

        def is_completed(self):
            return self.done

    comm = TorchDistCommunicator.__new__(TorchDistCommunicator)
    comm.device, comm._flight = torch.device("cuda", 0), []
    stuck, sent = Work(), Work()
    comm._issued("send of message 4 to rank 2", _DistWork([sent]))
    comm._issued("receive of message 7 from rank 1", _DistWork([stuck]))
    sent.done = True
    flight = comm.in_flight()
    assert len(flight) == 1 and flight[0].startswith("receive of message 7 from rank 1 (issued")
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config())
    engine.stage.pipe_comm.in_flight = comm.in_flight
    engine._instruction = "loss"
    report = engine._report_where()
    assert "at instruction loss" in report
    assert "on the device, still waiting: receive of message 7 from rank 1" in report
    stuck.done = True
    assert comm.in_flight() == [] and "still waiting" not in engine._report_where()
    engine.close()


def test_nccl_waits_as_long_as_the_watchdog(monkeypatch):
    # torch's default NCCL timeout (10 minutes) outlives any watchdog_s: a stuck collective
    # was ended by pipeflow's watchdog or never.
    import torch.distributed as dist
    from pipeflow.comm import torch_dist
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch_dist, "_rendezvous_store", lambda world: "store")
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw))
    torch_dist.init_torch_distributed("gloo", torch.device("cpu"), timeout_s=30.0)
    assert seen["timeout"].total_seconds() == 30.0 + torch_dist.NCCL_TIMEOUT_MARGIN_S
    seen.clear()
    torch_dist.init_torch_distributed("gloo", torch.device("cpu"), timeout_s=0.0)
    assert "timeout" not in seen


def test_an_nccl_launch_order_that_would_deadlock_the_schedule_is_refused(monkeypatch):
    # NCCL_LAUNCH_ORDER_IMPLICIT=1 runs a GPU's NCCL operations in host order, each waiting
    # for its peer: 1F1B's sends and receives to its two neighbours would then wait for each
    # other (the direction-split links exist so that they never do). GPipe survives it.
    from pipeflow.comm.torch_dist import check_nccl_launch_order
    from pipeflow.schedules import build_schedule
    from pipeflow.schedules.links import ordered_launch_stalls
    assert ordered_launch_stalls(build_schedule("1f1b", 4, 8)) != []
    assert ordered_launch_stalls(build_schedule("gpipe", 4, 8)) == []
    monkeypatch.setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1")
    with pytest.raises(pf.ConfigError, match=r"rank 0: NCCL_LAUNCH_ORDER_IMPLICIT=1 .* would "
                                              r"then deadlock \(ranks \["):
        check_nccl_launch_order(build_schedule("1f1b", 4, 8), "rank 0")
    check_nccl_launch_order(build_schedule("gpipe", 4, 8), "rank 0")
    monkeypatch.setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "0")
    check_nccl_launch_order(build_schedule("1f1b", 4, 8), "rank 0")


def test_mfu_counts_a_gpu_that_ranks_share_once(monkeypatch):
    # Four ranks sharing one GPU over MPI do the work of one GPU: dividing by the peak of
    # four understated MFU fourfold.
    from pipeflow.train import metrics
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(uuid=f"GPU-{device.index}"))
    engine = types.SimpleNamespace(stage=types.SimpleNamespace(
        device=torch.device("cuda", 0), topo=types.SimpleNamespace(world="world", rank=0)))
    views = {}
    monkeypatch.setattr(metrics.waiting, "allgather", lambda comm, mine: views["all"])
    views["all"] = [("node1", "GPU-0")] * 4
    assert metrics.devices_in_use(engine) == 1
    views["all"] = [("node1", "GPU-0"), ("node1", "GPU-1"), ("node2", "GPU-0"),
                    ("node2", "GPU-0")]
    assert metrics.devices_in_use(engine) == 3


class _FakeNccl:
    """torch.distributed as ProcessGroupNCCL behaves for point-to-point: a batched operation
    runs on its group's own communicator; a plain `isend`/`irecv` makes (lazily, once per
    pair) a two-rank communicator of its own (pytorch#129140)."""

    class Work:
        def is_completed(self):
            return True

        def wait(self):
            return True

    def __init__(self, groups) -> None:
        self.communicators = {("group", g) for g in groups}
        self.batched: list = []

    def P2POp(self, op, tensor, peer, group, tag):
        return (op, tensor, peer, group)

    def isend(self, tensor, peer, group=None, tag=0):
        self.communicators.add(("pair", group, peer))
        return self.Work()

    def irecv(self, tensor, peer, group=None, tag=0):
        return self.isend(tensor, peer, group, tag)

    def batch_isend_irecv(self, ops):
        self.batched.append([(op.__name__, peer, group) for op, _, peer, group in ops])
        return [self.Work() for _ in ops]


@pytest.mark.parametrize("tensors", [1, 3])
def test_nccl_messages_go_through_batch_isend_irecv_and_make_no_second_communicator(tensors):
    # A one-tensor message once went through a plain isend/irecv: ProcessGroupNCCL gave every
    # link a second communicator, whose first send blocks the host until the peer arrives.
    from mpi4py import MPI
    from pipeflow.comm.torch_dist import TorchDistCommunicator
    forward, backward = "link 0->0", "link 0<-0"
    comm = TorchDistCommunicator(MPI.COMM_SELF, "pipeline",
                                 {(0, 0): forward}, device="cuda")
    fake = _FakeNccl(["pipeline", forward, backward])
    comm._dist, comm._check = fake, lambda op, ts: None
    assert comm.batch_p2p
    comm.isend([torch.ones(2)] * tensors, 0, tag=5).wait()
    comm.irecv([((2,), torch.float32)] * tensors, 0, tag=5, device=torch.device("cpu")).wait()
    assert len(fake.communicators) == 3, sorted(fake.communicators, key=str)
    assert fake.batched == [[("isend", 0, forward)] * tensors, [("irecv", 0, forward)] * tensors]
    comm.free()


def test_one_cuda_connection_posts_nothing_ahead_and_refuses_a_schedule_that_stalls(monkeypatch):
    # CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's recipes) runs one NCCL kernel at a time:
    # posting ahead is off, and 1F1B, which would deadlock even so, is refused with a reason.
    from pipeflow.comm.torch_dist import nccl_post_ahead
    from pipeflow.schedules import build_schedule
    assert nccl_post_ahead(build_schedule("1f1b", 4, 8), "rank 0", reductions=True) == 1
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert nccl_post_ahead(build_schedule("gpipe", 4, 8), "rank 0", reductions=True) == 0
    with pytest.raises(pf.ConfigError, match=r"rank 0: CUDA_DEVICE_MAX_CONNECTIONS=1 puts "
                                              r".* would deadlock .*schedule 'gpipe'"):
        nccl_post_ahead(build_schedule("1f1b", 4, 8), "rank 0", reductions=True)


def test_surviving_a_failed_step_is_refused_for_a_pipeline_on_nccl():
    # A failed step leaves receives posted ahead that NCCL cannot withdraw, on cached link
    # groups: the next engine would read each message one late.
    from pipeflow.runtime.failure import check_failure_mode
    with pytest.raises(pf.ConfigError, match=r"rank 3: abort_on_error=False with a pipeline on "
                                              r"NCCL: .* cannot withdraw"):
        check_failure_mode("nccl", 2, False, "rank 3")
    check_failure_mode("nccl", 2, True, "rank 3")
    check_failure_mode("nccl", 1, False, "rank 3")        # replicas only: nothing posted
    check_failure_mode("mpi", 2, False, "rank 3")         # MPI cancels a posted receive
