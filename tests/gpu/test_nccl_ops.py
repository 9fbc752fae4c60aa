"""Every NCCL operation pipeflow issues, on one GPU: a 1-rank NCCL group's send to itself,
all-reduce, reduce-scatter, all-gather, the gradient reducer (buckets launched from autograd's
device thread, on the side stream) and the sharded optimizer over a 1-rank group.

One rank (`tests/gpu/first_run.sh`, step nccl-ops); NCCL refuses two ranks on one GPU, so
these are the NCCL paths a single GPU can run before a user's multi-GPU job does. On the CPU
(`--device cpu`) the same code runs over gloo, so the script and the tests are checked too;
each test's id names the backend, and first_run.sh's summary has a row for each.
"""

from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.comm.torch_dist import TorchDistCommunicator, init_torch_distributed
from pipeflow.runtime.data_parallel import GradReducer
from pipeflow.runtime.shard import ShardedOptimizer

from toy import adamw, batches, loss_fn, toy_layers, train_reference

DEVICE = os.environ.get("PIPEFLOW_TEST_DEVICE", "cuda")
ON_GPU = DEVICE.startswith("cuda")
BACKEND = "nccl" if ON_GPU else "gloo"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(),
                       reason="no CUDA device here: `bash tests/gpu/first_run.sh --device cpu` "
                              "runs the same cases over gloo"),
    pytest.mark.skipif(MPI.COMM_WORLD.size != 1, reason="one rank: a 1-rank NCCL group"),
]


def _device() -> torch.device:
    return torch.device("cuda", 0) if ON_GPU else torch.device("cpu")


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist
    init_torch_distributed(BACKEND, _device(), timeout_s=60.0)
    return dist.new_group([0], backend=BACKEND)


@pytest.fixture
def comm(group):
    c = TorchDistCommunicator(MPI.COMM_WORLD, group, {(0, 0): group}, device=_device())
    yield c
    c.free()


def _synced(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return t.cpu()


@pytest.mark.parametrize("backend", [BACKEND])
def test_send_to_itself(group, backend):
    # Both sides in one grouped call: NCCL runs a send and a receive of one rank together.
    if not ON_GPU:
        pytest.skip("gloo connects no rank to itself; NCCL does, on the GPU run")
    import torch.distributed as dist
    sent = torch.arange(6, dtype=torch.float32, device=_device())
    got = torch.zeros_like(sent)
    ops = [dist.P2POp(dist.isend, sent, 0, group), dist.P2POp(dist.irecv, got, 0, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(_synced(got), _synced(sent))


class _OneBatch:
    """torch.distributed with a message's send batch held back and issued with its receive
    batch, in one `batch_isend_irecv`: NCCL runs a rank's send to itself and the receive
    together only in one grouped call."""

    def __init__(self, dist) -> None:
        self.dist, self.held = dist, []

    def __getattr__(self, name):
        return getattr(self.dist, name)

    def batch_isend_irecv(self, ops):
        if ops[0].op is self.dist.isend:
            self.held = ops
            return []
        return self.dist.batch_isend_irecv(self.held + ops)


@pytest.mark.parametrize("backend", [BACKEND])
def test_a_mixed_message_through_the_communicator_to_itself(comm, backend):
    # The communicator's own path (one batch a message, never a plain isend, which makes a
    # second NCCL communicator): bf16, int64 and bool, a non-contiguous view, a zero-size
    # tensor, sent and received in one batch.
    if not ON_GPU:
        pytest.skip("gloo connects no rank to itself; NCCL does, on the GPU run")
    import torch.distributed as dist
    dev = _device()
    square = torch.arange(16, dtype=torch.float32, device=dev).reshape(4, 4)
    sent = [torch.randn(3, 5, device=dev).to(torch.bfloat16),
            torch.arange(7, dtype=torch.int64, device=dev),
            torch.tensor([True, False, True], device=dev),
            square.t()[1:3],                              # a non-contiguous view
            torch.empty(0, 4, device=dev)]
    comm._dist = _OneBatch(dist)
    send = comm.isend(sent, 0, tag=3)
    got = comm.irecv([(tuple(t.shape), t.dtype) for t in sent], 0, tag=3, device=dev).wait()
    send.wait()
    for a, b in zip(got, sent):
        assert a.dtype == b.dtype and torch.equal(_synced(a), _synced(b.contiguous()))


@pytest.mark.parametrize("backend", [BACKEND])
def test_all_reduce_reduce_scatter_all_gather(comm, backend):
    t = torch.arange(8, dtype=torch.float32, device=_device())
    comm.iallreduce_(t, key="all-reduce").wait()
    assert torch.equal(_synced(t), torch.arange(8, dtype=torch.float32))   # a sum of one
    out = torch.empty(8, device=_device())
    comm.ireduce_scatter_(t, out, key="reduce-scatter").wait()
    assert torch.equal(_synced(out), torch.arange(8, dtype=torch.float32))
    whole = torch.empty(8, device=_device())
    comm.iallgather_(t, whole, key="all-gather").wait()
    assert torch.equal(_synced(whole), torch.arange(8, dtype=torch.float32))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4)).to(_device())


@pytest.mark.parametrize("backend", [BACKEND])
def test_gradient_reducer_from_autograds_thread(comm, backend):
    # On a GPU the hooks run on autograd's device thread and launch each bucket there, on
    # the communication stream: the reduced gradients must be the computed ones.
    model = _model()
    params = list(model.parameters())
    reducer = GradReducer(params, comm, bucket_bytes=256)
    assert len(reducer.buckets) >= 2
    x = torch.randn(8, 16, device=_device())
    reducer.arm()
    model(x).square().sum().backward()
    reducer.finish()
    got = [_synced(p.grad.clone()) for p in params]
    expected = torch.autograd.grad(model(x).square().sum(), params)
    for g, e in zip(got, expected):
        assert torch.allclose(g, _synced(e), rtol=1e-5, atol=1e-6)
    assert sorted(i for _, i in reducer.events) == list(range(len(reducer.buckets)))
    reducer.close()


@pytest.mark.parametrize("backend", [BACKEND])
def test_sharded_optimizer_over_a_one_rank_group(comm, backend):
    # Reduce-scatter of the buckets, the optimizer on the block, all-gather of the weights:
    # over one rank the step is the plain optimizer's. The gathers stay in flight after a
    # step; the model's forward pre-hook waits for them (on NCCL: the compute stream waits
    # for the communication stream), `wait_gathers` before the weights are read here.
    model, plain = _model(), _model()
    params = list(model.parameters())
    initial = {id(p): p.detach().clone() for p in params}
    probe = torch.optim.AdamW(params, lr=1e-2)
    shards = ShardedOptimizer(params, initial, [], comm, 256, probe, "rank 0")
    shards.watch_layers([model])
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x = torch.randn(8, 16, device=_device())
    for _ in range(2):
        shards.zero_grad()
        shards.arm()
        model(x).square().sum().backward()
        shards.finish()
        shards.step()
        reference.zero_grad()
        plain(x).square().sum().backward()
        reference.step()
    assert shards.gathering
    shards.wait_gathers()
    for p, q in zip(params, plain.parameters()):
        assert torch.allclose(_synced(p.detach()), _synced(q.detach()), rtol=1e-5, atol=1e-6)
    shards.close()


@pytest.mark.parametrize("backend", [BACKEND])
def test_engine_over_a_one_rank_group_with_shard_and_clip(backend):
    # The engine's own path over torch.distributed (its grid groups, the norm's reduction).
    layers = toy_layers(tied=True)
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(microbatches=2, backend=backend, clip=0.3),
                       comm=MPI.COMM_SELF, device=_device())
    steps = batches(2, 8)
    losses = [engine.train_step(x, y) for x, y in steps]
    _, ref_losses = train_reference(layers, steps, clip=0.3, device=_device())
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    engine.close()
