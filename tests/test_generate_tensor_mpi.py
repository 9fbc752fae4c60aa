"""Generation on a tensor axis: `engine.generate` and `pipeflow sample` at `t2` (2 ranks),
`p2×t2` and `d2×t2` (4 ranks) give one process's tokens, greedy and sampled (every tensor rank
chooses the same token from the logits gathered whole), for the built-in GPT and a
transformers Llama; each rank's key/value cache holds 1/t of the (key/value) heads, allocated
once at the call's positions.

Run under `mpirun -n 2` and `-n 4` with `--with-mpi`.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from mpi4py import MPI

import pipeflow as pf
from pipeflow.cli import main
from pipeflow.models import gpt_loss

from test_generate import PROMPTS, Caches, gpt_model, greedy_reference
from test_generate_mpi import SAMPLING, assert_on_every_rank
from test_sample import RUN, greedy_ids
from toy import allgather, barrier, bcast, sgd

WORLD = MPI.COMM_WORLD
N = WORLD.size
# (pipeline, data, tensor) grids of this world with tensor 2
GRIDS = {2: [(1, 1, 2)], 4: [(2, 1, 2), (1, 2, 2)]}.get(N, [])
NEW = 10


def _engine(layers, state, grid, comm=WORLD):
    p, d, t = grid
    engine = pf.Engine(layers, gpt_loss, sgd, pf.Config(pipeline=p, data=d, tensor=t),
                       comm=comm)
    engine.load_state_dict(state)
    return engine


def _one_process(layers, state, prompts, **args):
    single = _engine(layers, state, (1, 1, 1), comm=MPI.COMM_SELF)
    with Caches() as caches:
        out = single.generate(prompts, NEW, **args)
    single.close()
    return out, caches.shapes


def _expected_caches(engine, prompts, kv_heads: int, head_dim: int, blocks: range):
    """This rank's key buffers: one per prompt of its replica and block it holds, each of
    1/t of the key/value heads and the prompt's positions for the call."""
    topo = engine.stage.topo
    held = sum(1 for i in engine.stage.module.indices if i in blocks)
    return sorted((1, kv_heads // topo.tensor, len(prompts[j]) + NEW - 1, head_dim)
                  for j in range(topo.replica, len(prompts), topo.data) for _ in range(held))


def _check(engine, prompts, want_greedy, layers, state, kv_heads, head_dim, blocks):
    """Greedy tokens as `want_greedy`; sampled ones (with an eos that stops prompt 0 early)
    as one process's; the caches as `_expected_caches` says, 1/t of one process's."""
    greedy = engine.generate(prompts, NEW)
    free, _ = _one_process(layers, state, prompts, **SAMPLING)
    eos = next(t for t in free[0][2:] if t not in free[1])
    one, one_caches = _one_process(layers, state, prompts, eos=eos, **SAMPLING)
    with Caches() as caches:
        sampled = engine.generate(prompts, NEW, eos=eos, **SAMPLING)
    where = engine.stage.describe()
    assert_on_every_rank(greedy == want_greedy, f"{where}: greedy {greedy} != {want_greedy}")
    assert_on_every_rank(sampled == one, f"{where}: sampled {sampled} != {one}")
    assert_on_every_rank(len(one[0]) < NEW and len(set(one[1])) > 1, f"weak case: {one}")
    expected = _expected_caches(engine, prompts, kv_heads, head_dim, blocks)
    assert_on_every_rank(sorted(caches.shapes) == expected,
                         f"{where}: caches {sorted(caches.shapes)} != {expected}")
    # Over the world, one process's cache exactly: each rank a slice, nothing twice.
    total = sum(allgather(WORLD, sum(torch.Size(s).numel() for s in caches.shapes)))
    alone = sum(torch.Size(s).numel() for s in one_caches)
    assert_on_every_rank(total == alone, f"{where}: {total} cached keys in all, {alone} alone")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "p%dxd%dxt%d" % g)
def test_gpt_generates_at_tensor_degree_as_one_process(grid):
    layers, state, ref = gpt_model()              # 2 heads of 16: one a tensor rank
    want = [greedy_reference(ref, p, NEW) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 3
    engine = _engine(layers, state, grid)
    _check(engine, PROMPTS, want, layers, state, kv_heads=2, head_dim=16, blocks=range(1, 3))
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "p%dxd%dxt%d" % g)
def test_llama_generates_at_tensor_degree_as_transformers(grid):
    """4 attention heads over 2 key/value heads (grouped): one key/value head a rank."""
    pytest.importorskip("transformers")
    from pipeflow.models import hf
    from test_generate import _transformers_greedy
    from test_hf import hf_model, make_config
    config = make_config("llama", initializer_range=0.3)
    model = hf_model(config).eval()
    layers = hf.causal_lm_layers(config)
    state = hf.from_hf_state_dict(model.state_dict(), config)
    prompts = PROMPTS[:2]
    want = _transformers_greedy(model, prompts, NEW)
    engine = _engine(layers, state, grid)
    _check(engine, prompts, want, layers, state, kv_heads=config.num_key_value_heads,
           head_dim=config.head_dim, blocks=range(1, config.num_hidden_layers + 1))
    engine.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_sample_of_a_checkpoint_trained_at_tensor_2_prints_what_one_process_prints(capsys):
    """`pipeflow train` at t2 (p2×t2 on 4 ranks), then `mpirun pipeflow sample --tensor 2`:
    greedy as `build_sequential` holding the checkpoint, sampled as one process's
    `pipeflow sample`, printed by rank 0 alone."""
    from pipeflow.train.sample import SampleArgs, sample
    folder = bcast(WORLD, tempfile.mkdtemp(prefix="pipeflow-sample-t2-")
                   if WORLD.rank == 0 else None)
    run, ck = os.path.join(folder, "run.toml"), os.path.join(folder, "ck")
    if WORLD.rank == 0:
        with open(run, "w") as f:
            f.write(RUN.replace("microbatches = 2", f"microbatches = 2\ntensor = 2\n"
                                                    f"pipeline = {N // 2}"))
    barrier(WORLD)
    assert main(["train", run, "--save-dir", ck]) == 0
    capsys.readouterr()
    prompts = ["def ", "import "]
    for how in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=7)):
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in how.items()]
        assert main(["sample", ck, *sum((["--prompt", p] for p in prompts), []),
                     "--max-new-tokens", "12", "--tensor", "2", "--pipeline", str(N // 2),
                     "--ids", *flags]) == 0
        printed = capsys.readouterr().out
        alone: list[str] = []
        new = sample(SampleArgs(ck, prompts, 12, ids=True, **how), comm=MPI.COMM_SELF,
                     out=alone.append)
        shown = allgather(WORLD, printed)
        assert all(s == "" for s in shown[1:]), shown       # rank 0 prints alone
        assert shown[0].splitlines() == alone, (shown[0], alone)
        if how["temperature"] == 0.0:
            assert new[0] == greedy_ids(ck, "def ", 12)
