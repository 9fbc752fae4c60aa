"""`mpirun -n 2 pipeflow sample`: a GPT trained on a pipeline of 2 continues a prompt, on a
pipeline of 2 and on replicas of one stage, greedily as `build_sequential` holding its
checkpoint does; sampled text is the same on both grids; only rank 0 prints.

Run under `mpirun -n 2` (or `-n 4`: the pipelines of 2 get 2 replicas) with `--with-mpi`.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from mpi4py import MPI

from pipeflow.cli import main

from test_sample import RUN, greedy_ids
from toy import allgather, barrier, bcast

WORLD = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_sample_on_two_ranks_equals_one_process(capsys):
    assert WORLD.size % 2 == 0, "run this file under mpirun -n 2 or -n 4"
    folder = bcast(WORLD, tempfile.mkdtemp(prefix="pipeflow-sample-") if WORLD.rank == 0 else None)
    run = os.path.join(folder, "run.toml")
    if WORLD.rank == 0:
        with open(run, "w") as f:
            f.write(RUN.replace("microbatches = 2", f"microbatches = 2\npipeline = 2\n"
                                                    f"data = {WORLD.size // 2}"))
    barrier(WORLD)
    ck = os.path.join(folder, "ck")
    assert main(["train", run, "--save-dir", ck]) == 0
    capsys.readouterr()
    want = greedy_ids(ck, "def ", 20)
    outs = {}
    for pipeline in ("2", "1"):               # the checkpoint's grid, then 2 replicas
        for how in (["--temperature", "0"], ["--seed", "7", "--top-p", "0.9"]):
            assert main(["sample", ck, "--prompt", "def ", "--prompt", "import ",
                         "--max-new-tokens", "20", "--pipeline", pipeline, "--ids", *how]) == 0
            printed = capsys.readouterr().out
            outs[pipeline, how[0]] = [json.loads(line) for line in printed.splitlines()]
    shown = allgather(WORLD, outs)
    assert all(s == {k: [] for k in outs} for s in shown[1:])    # only rank 0 prints
    mine = shown[0]
    assert mine["2", "--temperature"][0] == want == mine["1", "--temperature"][0]
    assert mine["2", "--seed"] == mine["1", "--seed"]
    assert mine["2", "--seed"] != mine["2", "--temperature"]
