"""Replicas and the batches they are given; figures across ranks. Run under `mpirun -n 2`
(and `-n 4`, pairs side by side) with `--with-mpi`.

- `Config(batch="global")` (the default): replicas given batches of the same shape but
  their own values (the DDP habit) are refused on every rank, naming both ranks;
- `Config(batch="local")`: each replica passes its own rows, and the update is one
  process's on the whole batch;
- `memory_report` of a sharded stage with frozen parameters of two dtypes counts each
  frozen parameter's fp32 master once.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf

from toy import (Block, Head, assert_same_parameters, batches, loss_fn, pair, sgd, toy_layers,
                 train_reference)
from toy import allgather

WORLD = MPI.COMM_WORLD


def _verdict(ok: bool, text: str) -> None:
    views = allgather(WORLD, (ok, text))
    bad = [f"rank {r}: {t}" for r, (o, t) in enumerate(views) if not o]
    assert not bad, "; ".join(bad)


@pytest.mark.mpi(min_size=2)
def test_replicas_given_their_own_batches_under_global_are_refused_on_every_rank():
    comm = pair()
    engine = pf.Engine(toy_layers(), loss_fn, sgd, pf.Config(data=2, microbatches=2),
                       comm=comm)
    mine = batches(1, 8, seed=10 + comm.rank)[0]          # each replica its own values
    try:
        engine.train_step(*mine)
        ok, text = False, "a local batch each was trained on without a word"
    except pf.BatchError as exc:
        text = str(exc)
        ok = all(f in text for f in ("ranks were given different values for the inputs",
                                     "rank 0 (replica 0) and rank 1 (replica 1)",
                                     'Config(batch="local")'))
    # The same global batch on both: accepted, as before.
    engine.train_step(*batches(1, 8)[0])
    engine.close()
    _verdict(ok, text)


@pytest.mark.mpi(min_size=2)
def test_local_batches_train_like_one_process_on_the_global_batch():
    comm = pair()
    layers = toy_layers()
    steps = batches(3, 8)
    engine = pf.Engine(layers, loss_fn, sgd,
                       pf.Config(data=2, microbatches=2, batch="local"), comm=comm)
    r = engine.stage.topo.replica
    for x, y in steps:
        engine.train_step(x[4 * r:4 * (r + 1)], y[4 * r:4 * (r + 1)])   # its rows only
    state = engine.gather_state_dict()
    engine.close()
    ok, text = True, ""
    if comm.rank == 0:
        reference, _ = train_reference(layers, steps, optimizer=sgd)
        try:
            assert_same_parameters(state, reference.state_dict())
        except AssertionError as exc:
            ok, text = False, str(exc)
    _verdict(ok, text)


class FrozenUp(Block):
    """A block whose first projection is frozen: a bf16 frozen weight under bf16."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__(width, hidden)
        self.up.requires_grad_(False)


class FrozenNormHead(Head):
    """A head whose LayerNorm (kept fp32 by fp32_modules) is frozen: an fp32 frozen weight."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__(width, vocab)
        self.norm.requires_grad_(False)


@pytest.mark.mpi(min_size=2)
def test_memory_report_counts_the_masters_of_frozen_parameters_of_several_dtypes():
    layers = toy_layers(blocks=2)
    layers[1] = pf.LayerSpec(FrozenUp, *layers[1].args)
    layers[-1] = pf.LayerSpec(FrozenNormHead, *layers[-1].args)
    engine = pf.Engine(layers, loss_fn, sgd,
                       pf.Config(data=2, microbatches=2, precision="bf16",
                                 shard_optimizer=True, bucket_mb=0.0005), comm=pair())
    engine.train_step(*batches(1, 8)[0])
    report = engine.memory_report()
    frozen = [p for p in engine.stage.module.parameters() if not p.requires_grad]
    dtypes = sorted({str(p.dtype) for p in frozen})
    expected = engine.stage.shards.memory()["masters"] + 4 * sum(p.numel() for p in frozen)
    engine.close()
    _verdict(dtypes == ["torch.bfloat16", "torch.float32"] and report["masters"] == expected,
             f"frozen dtypes {dtypes}; masters {report['masters']} B, expected {expected} B "
             f"(the sharded blocks and 4 bytes a frozen element)")
