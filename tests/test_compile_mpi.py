"""`Config(compile=...)`: every layer compiled (torch.compile per layer) trains like the eager
engine, on 1F1B, interleaved and a zero-bubble schedule, with recomputation and in bf16.

Run under `mpirun -n 2` (and -n 4) with `--with-mpi`. The backend here is "aot_eager": the
same graph capture (dynamo) and AOT autograd as inductor, without generating C++ on a CPU
(which takes a minute a layer on these machines); inductor's speed is in BENCHMARKS.md.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf

from toy import assert_same_parameters, batches, loss_fn, sgd_momentum, toy_layers

WORLD = MPI.COMM_WORLD
CASES = [("1f1b", "none", "fp32"), ("interleaved", "none", "fp32"), ("zb-h1", "none", "fp32"),
         ("1f1b", "full", "fp32"), ("1f1b", "none", "bf16")]


def _train(schedule: str, recompute: str, precision: str, compile: bool | str):
    comm = WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)
    config = pf.Config(pipeline=2, microbatches=4, schedule=schedule, recompute=recompute,
                       precision=precision, compile=compile,
                       virtual_stages=2 if schedule == "interleaved" else 1)
    layers = toy_layers(blocks=6)
    engine = pf.Engine(layers, loss_fn, sgd_momentum, config, comm=comm)
    losses = [engine.train_step(x, y) for x, y in batches(3, 8)]
    state = engine.gather_state_dict()
    engine.close()
    comm.Free()
    return losses, state


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,recompute,precision", CASES)
def test_compiled_layers_train_like_the_eager_engine(schedule, recompute, precision):
    eager_losses, eager = _train(schedule, recompute, precision, False)
    losses, compiled = _train(schedule, recompute, precision, "aot_eager")
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    if compiled is not None:
        assert_same_parameters(compiled, eager, rtol=1e-5)


@pytest.mark.mpi(min_size=2)
def test_an_unknown_compile_backend_is_refused_by_name():
    comm = WORLD.Split(color=WORLD.rank // 2, key=WORLD.rank)
    with pytest.raises(pf.ConfigError, match=r"compile = 'inductr' names no torch.compile "
                                              r"backend; found \[.*'inductor'"):
        pf.Engine(toy_layers(), loss_fn, sgd_momentum,
                  pf.Config(pipeline=2, microbatches=2, compile="inductr"), comm=comm)
    comm.Free()
