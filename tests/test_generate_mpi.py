"""`engine.generate` on a grid: greedy tokens equal `build_sequential`'s greedy loop, and
sampled tokens (with an `eos` that stops some prompts early) equal one process's, on every
grid 2 ranks hold (pipeline 2 with one chunk, interleaved and V-shaped chunks, data 2), with
and without the cache, over MPI, NCCL's rules (strict) and gloo.

Run under `mpirun -n 2` (or `-n 4`: each grid's replicas fill the world) with `--with-mpi`.
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

import pipeflow as pf

from test_generate import PROMPTS, gpt_engine, gpt_model, greedy_reference
from toy import allgather

WORLD = MPI.COMM_WORLD
GRIDS = [dict(pipeline=2), dict(pipeline=2, schedule="interleaved", virtual_stages=2),
         dict(pipeline=2, schedule="zbv"), dict(pipeline=1)]
SAMPLING = dict(temperature=0.9, top_k=10, top_p=0.95, seed=11)


def grid_engine(backend: str = "mpi", **grid):
    """The GPT of `test_generate.gpt_model` on `grid`, replicas filling the world."""
    data = WORLD.size // grid["pipeline"]
    engine, _ = gpt_engine(microbatches=2, backend=backend, data=data, **grid)
    return engine


def assert_on_every_rank(ok: bool, what: str) -> None:
    """Every rank's verdict, so a failure on one is a failure on all (none left waiting)."""
    verdicts = allgather(WORLD, bool(ok))
    assert all(verdicts), f"{what}: ranks {[r for r, v in enumerate(verdicts) if not v]}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_greedy_on_the_grid_equals_build_sequential(grid, use_cache):
    _, _, ref = gpt_model()
    expected = [greedy_reference(ref, p, 10) for p in PROMPTS]
    engine = grid_engine(**grid)
    got = engine.generate(PROMPTS, 10, use_cache=use_cache)
    engine.close()
    assert_on_every_rank(got == expected, f"{grid}: {got} != {expected}")


def _one_process(n: int, eos: int | None) -> list[list[int]]:
    single, _ = gpt_engine(comm=MPI.COMM_SELF)
    out = single.generate(PROMPTS, n, eos=eos, **SAMPLING)
    single.close()
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["mpi", "strict", "gloo"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_sampled_tokens_are_the_same_on_every_grid(grid, backend):
    free = _one_process(12, None)
    # An eos that stops prompt 0 early and never comes in prompt 1: both paths cross ranks.
    eos = next(t for t in free[0][2:] if t not in free[1])
    expected = _one_process(12, eos)
    assert len(expected[0]) < 12 and expected[1] == free[1]
    engine = grid_engine(backend, **grid)
    got = engine.generate(PROMPTS, 12, eos=eos, **SAMPLING)
    engine.close()
    assert_on_every_rank(got == expected, f"{grid}, {backend}: {got} != {expected}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_prompts_that_stop_at_the_same_step(grid):
    """Two finished markers in a row on one link (each travels as a header alone)."""
    _, _, ref = gpt_model()
    full = greedy_reference(ref, PROMPTS[1], 10)
    k = next(i for i in range(1, 10) if full[i] not in full[:i])
    engine = grid_engine(**grid)
    got = engine.generate([PROMPTS[1]] * 2, 10, eos=full[k])
    engine.close()
    assert_on_every_rank(got == [full[:k + 1]] * 2, f"{grid}: {got}, stop at {k}")


@pytest.mark.mpi(min_size=2)
def test_different_arguments_on_two_ranks_are_refused_on_both():
    engine = grid_engine(pipeline=2)
    with pytest.raises(pf.ConfigError, match="different arguments on different ranks"):
        engine.generate(PROMPTS, 3 + engine.stage.topo.rank)
    # The engine still works: the refusal came before any message.
    assert engine.generate(PROMPTS, 2)[0] == engine.generate(PROMPTS, 2)[0]
    engine.close()
