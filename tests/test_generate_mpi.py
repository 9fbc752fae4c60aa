"""`engine.generate` on a grid: greedy tokens equal `build_sequential`'s greedy loop, and
sampled tokens (with an `eos` that stops some prompts early) equal one process's, on every
grid 2 ranks hold (pipeline 2 with one chunk, interleaved and V-shaped chunks, data 2), with
and without the cache, over MPI, NCCL's rules (strict) and gloo; a call agrees each link's
headers once, whatever the tokens, and reads a token on the host only to hand it back to a
first stage on another rank.

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
    """Two prompts stopped at one step (every rank told by the last stage's hand-back)."""
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


# -- what the host does per token (issue 45 item 7) ----------------------------------------

def _sends(engine) -> list[int]:
    """The rank each of this rank's virtual stages sends its activations to, a token and
    prompt, while generating (none from the last, nor to itself)."""
    plan, me = engine.plan, engine.stage.index
    return [plan.owner(v + 1)[0] for v in plan.programs.layout[me]
            if v != plan.last_virtual and plan.owner(v + 1)[0] != me]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["strict", "gloo", "mpi"])
@pytest.mark.parametrize("grid", GRIDS[:3], ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_a_call_agrees_each_links_header_once_not_each_token(grid, backend):
    """Where a receiver cannot probe (torch.distributed, NCCL's rules) a header went with
    every message, a pickled one a token a stage: now once a link per number of positions
    (the prompts' lengths, 3, 5 and 1, and one decode step) whatever the tokens asked."""
    engine = grid_engine(backend, **grid)
    comm = engine.stage.pipe_comm
    real, sent = comm.send_message, []
    comm.send_message = lambda header, *rest: sent.append(header is not None) or \
        real(header, *rest)
    counts = {}
    for n in (4, 12):
        sent.clear()
        engine.generate(PROMPTS, n)
        counts[n] = (sum(sent), len(sent))
    del comm.send_message
    mine = [PROMPTS[j] for j in range(engine.stage.topo.replica, len(PROMPTS),
                                      engine.stage.topo.data)]
    sends = _sends(engine)
    most = (len({len(p) for p in mine}) + 1) * len(set(sends))
    engine.close()
    assert_on_every_rank(counts[4][0] == counts[12][0] <= most and
                         counts[12][1] - counts[4][1] == 8 * len(mine) * len(sends),
                         f"{grid}, {backend}: (headers, messages) {counts}, at most {most}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_the_host_reads_a_token_only_to_hand_it_to_another_rank(grid):
    """A token read from the device (`_HostSyncs`: item, tolist, int... from pipeflow's
    files) once a token and prompt on the last stage where the first is on another rank (the
    hand-back), never elsewhere; the tokens left on the device read once a call."""
    from test_data_parallel_mpi import _HostSyncs
    engine = grid_engine("gloo", **grid)
    engine.generate(PROMPTS, 2)
    reads = {}
    for n in (4, 12):
        with _HostSyncs() as syncs:
            engine.generate(PROMPTS, n)
        reads[n] = syncs.count
    plan, me, topo = engine.plan, engine.stage.index, engine.stage.topo
    last = plan.holds_last(me)
    hands_back = last and plan.owner(0)[0] != me
    mine = len(range(topo.replica, len(PROMPTS), topo.data))
    engine.close()
    # The hand-back of every token but the last of each prompt; the rest read in one go
    # (none on a replica with no prompt: 3 prompts over 4 replicas).
    want = {n: (mine * (n - 1) if hands_back else 0) + (1 if last and mine else 0)
            for n in reads}
    assert_on_every_rank(reads == want, f"{grid}: reads {reads}, expected {want}")
