"""The GPU path: equivalence with `build_sequential` run on the same GPU, over NCCL on one rank
and over MPI with 2 or 4 ranks sharing one GPU (NCCL refuses two ranks on one GPU; on two or
more GPUs, `auto` runs the same cases over NCCL).

Run by `bash tests/gpu/run.sh` (under 8 minutes on one GPU). Without CUDA these tests skip;
`bash tests/gpu/run.sh --device cpu` (PIPEFLOW_TEST_DEVICE=cpu) runs the same cases on the
CPU as a dry run of the script and the tests themselves.
"""

from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.train.data import Batches, load_corpus
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss

from test_precision_mpi import ARMED, Injector
from toy import adamw, assert_same_parameters, batches, loss_fn, toy_layers, train_reference

WORLD = MPI.COMM_WORLD
DEVICE = os.environ.get("PIPEFLOW_TEST_DEVICE", "cuda")
ON_GPU = DEVICE.startswith("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(),
                       reason="no CUDA device here: `bash tests/gpu/run.sh --device cpu` runs "
                              "the same cases on the CPU"),
]
# GPU kernels sum in their own order (and differently for a micro-batch than for the whole
# batch): a pipeline matches the one-process run to rounding, not bit for bit.
RTOL = 1e-4 if ON_GPU else 1e-5


def _device() -> torch.device:
    """This rank's device: ranks share GPU 0 when there is one GPU, else one GPU each."""
    if not ON_GPU:
        return torch.device("cpu")
    return torch.device("cuda", WORLD.rank % torch.cuda.device_count())


def test_one_rank_over_torch_distributed_equals_build_sequential():
    backend = "nccl" if ON_GPU else "gloo"
    layers = toy_layers(tied=True)
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(microbatches=2, backend=backend, clip=0.3),
                       comm=MPI.COMM_SELF if WORLD.size == 1 else None, device=_device())
    assert engine.stage.backend == backend
    steps = batches(3, 8)
    losses = [engine.train_step(x, y) for x, y in steps]
    reference, ref_losses = train_reference(layers, steps, clip=0.3, device=_device())
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert_same_parameters(engine.gather_state_dict(),
                           {k: v.cpu() for k, v in reference.state_dict().items()}, RTOL)
    engine.close()


def _grid(kind: str) -> dict:
    n = WORLD.size
    if kind == "pipeline":
        return dict(pipeline=n, microbatches=2 * n)
    if kind == "data":
        return dict(pipeline=n // 2, data=2, microbatches=2)
    return dict(pipeline=n, microbatches=2 * n, schedule="interleaved", virtual_stages=2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["pipeline", "data", "interleaved"])
@pytest.mark.parametrize("tied,clip", [(True, 0.3), (False, 0.0)], ids=["tied-clip", "plain"])
def test_grid_on_the_device_equals_build_sequential(kind, tied, clip):
    grid = _grid(kind)
    interleaved = kind == "interleaved"
    layers = toy_layers(blocks=4 * grid["pipeline"] - 2 if interleaved else 5, tied=tied)
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(**grid, clip=clip, bucket_mb=0.001), device=_device())
    steps = batches(3, 4 * grid["microbatches"] * grid.get("data", 1))
    losses = [engine.train_step(x, y) for x, y in steps]
    reference, ref_losses = train_reference(layers, steps, clip=clip, device=_device())
    assert WORLD.allgather(losses) == [losses] * WORLD.size
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    full = engine.gather_state_dict()
    if WORLD.rank == 0:
        assert_same_parameters(full, {k: v.cpu() for k, v in reference.state_dict().items()},
                               RTOL)
    engine.close()


@pytest.mark.mpi(min_size=2)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    layers = toy_layers()
    layers.insert(1, pf.LayerSpec(Injector))            # on stage 0
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=WORLD.size, microbatches=2, precision="fp16",
                                 initial_loss_scale=1024.0, clip=1.0), device=_device())
    steps = batches(3, 8)
    engine.train_step(*steps[0])
    before = [m.detach().clone() for m in engine.stage.precision.masters]
    ARMED["on"] = WORLD.rank == 0
    engine.train_step(*steps[1])
    ARMED["on"] = False
    assert all(torch.equal(b, m) for b, m in zip(before, engine.stage.precision.masters))
    assert WORLD.allgather((engine.loss_scale, engine.stats.skipped_steps)) == \
        [(512.0, 1)] * WORLD.size
    engine.train_step(*steps[2])
    assert not all(torch.equal(b, m) for b, m in zip(before, engine.stage.precision.masters))
    engine.close()


def _gpt(precision: str, recompute: str = "none", dropout: float = 0.0, steps: int = 4):
    cfg = GPTConfig(n_layers=2 * WORLD.size, d_model=64, n_heads=4, seq_len=32,
                    dropout=dropout)
    torch.manual_seed(1000 + WORLD.rank)       # dropout: the same stream for every policy
    if ON_GPU:
        torch.cuda.manual_seed(1000 + WORLD.rank)
    engine = pf.Engine(gpt_layers(cfg), gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                       pf.Config(pipeline=WORLD.size, microbatches=4, precision=precision,
                                 recompute=recompute, deterministic=ON_GPU), device=_device())
    data = Batches(load_corpus(), 8, cfg.seq_len, seed=0)
    losses = [engine.train_step(*data.batch(i)) for i in range(steps)]
    state = {k: v.cpu() for k, v in engine.master_state_dict().items()}
    engine.close()
    return losses, state


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_bf16_follows_the_fp32_loss_curve():
    fp32, _ = _gpt("fp32")
    bf16, _ = _gpt("bf16")
    # bf16 rounds to 8 significant bits: a few tenths of a percent a step (see
    # tests/test_precision_mpi.py); a wrong scale or stale working weight moves far more.
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.03 * a, (fp32, bf16)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_with_dropout_is_bit_equal_to_none(policy):
    # Recomputation replays the random state (on a GPU: the CUDA generator), so the dropout
    # masks, and so every bit of training, are those of the run that stashed everything.
    base_losses, base = _gpt("fp32", "none", dropout=0.1, steps=2)
    losses, state = _gpt("fp32", policy, dropout=0.1, steps=2)
    assert losses == base_losses
    for name, value in base.items():
        assert torch.equal(value, state[name]), name


def _generated(comm, **grid) -> list[list[int]]:
    """Greedy and sampled tokens of `test_generate`'s GPT on this rank's device."""
    from test_generate import PROMPTS, gpt_model
    layers, state, _ = gpt_model()
    engine = pf.Engine(layers, gpt_loss, adamw, pf.Config(microbatches=2, **grid), comm=comm,
                       device=_device())
    engine.load_state_dict(state)
    out = engine.generate(PROMPTS, 8) + engine.generate(PROMPTS, 8, temperature=0.9, top_k=10,
                                                        seed=3)
    engine.close()
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_generation_on_two_ranks_sharing_the_device_equals_one_rank():
    # Over MPI (NCCL refuses two ranks on one GPU): the cache, the decode headers and the
    # token hand-back on the device, against one rank's tokens.
    alone = _generated(MPI.COMM_SELF)
    assert _generated(WORLD, pipeline=WORLD.size, backend="mpi") == alone


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_changing_sequence_lengths_over_mpi_withdraw_posted_receives():
    # Over MPI a receive is posted for the link's last shapes; a step of another sequence
    # length announces new ones and the posted receive is withdrawn (MPI_Cancel), on the
    # device's buffers too. Every step equals one process.
    layers = toy_layers()
    n = WORLD.size
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(pipeline=n, microbatches=2 * n, backend="mpi"),
                       device=_device())
    steps = [(x[:, :length], y[:, :length]) for (x, y), length in
             zip(batches(4, 4 * n), [5, 3, 5, 2])]
    losses = [engine.train_step(x, y) for x, y in steps]
    reference, ref_losses = train_reference(layers, steps, device=_device())
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    engine.close()
