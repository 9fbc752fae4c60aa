"""`[model] pretrained` on a pipeline of 2: each rank reads from the sharded safetensors files
only the tensors of its own layers, the run starts from them (transformers' logits) and
`export_hf` writes the trained model (the engine's logits in transformers), in the layout
`save_pretrained` writes: Llama, Mixtral (per-expert tensors on disk) and GPT-NeoX
(`embed_out`).

Run under `mpirun -n 2` with `--with-mpi`."""

from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from hub_run import (SEQ, VOCAB, CountingOpen, logits_of, run_toml, save_hub,  # noqa
                     train_keeping_engine)
from pipeflow.train import hub as hub_io                                             # noqa
from toy import bcast, gather                                                        # noqa

WORLD = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
# Mixtral's folder holds per-expert tensors (merged on the way in, split on the way out),
# GPT-NeoX's `embed_out` (transformers' `lm_head`).
@pytest.mark.parametrize("kind", ["llama", "mixtral", "gpt_neox"])
def test_each_rank_reads_only_its_layers_and_the_run_exports_what_it_trained(tmp_path_factory,
                                                                            monkeypatch, kind):
    comm = WORLD.Split(color=0 if WORLD.rank < 2 else MPI.UNDEFINED, key=WORLD.rank)
    if comm == MPI.COMM_NULL:
        return
    folder = str(tmp_path_factory.mktemp("hub")) if comm.rank == 0 else None
    folder = bcast(comm, folder)
    hub, out = os.path.join(folder, "hub"), os.path.join(folder, "out")
    reference = save_hub(hub, kind, sharded=True, layers=4) if comm.rank == 0 else None
    path = run_toml(folder, f'pretrained = "{hub}"', pipeline=2,
                    train_extra=f'export_hf = "{out}"') if comm.rank == 0 else None
    path = bcast(comm, path)
    counting = CountingOpen(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", counting)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(5))
    seen = {}

    def before(loop):
        seen["layers"] = list(loop.engine.stage.module.indices)
        seen["before"] = logits_of(loop, ids)

    def after(loop):
        seen["after"] = logits_of(loop, ids)

    train_keeping_engine(path, comm, before, after)
    # Every key this rank read belongs to one of its own layers, and it read all of them.
    index = hub_io.weight_index(hub)
    views = gather(comm, (seen["layers"], sorted(k for k, _ in counting.reads)), root=0)
    if comm.rank == 0:
        config = reference.config
        sources, _ = hub_io.layer_sources(index, config)
        for layers, keys in views:
            mine = sorted({src for pf, srcs in sources.items() for src in srcs
                           if int(pf.split(".")[0]) in layers})
            assert keys == mine, (layers, sorted(set(keys) ^ set(mine)))
        assert len(views[0][1]) + len(views[1][1]) == len(index)   # no tensor read twice
        assert views[0][0] != views[1][0]
        with torch.no_grad():
            torch.testing.assert_close(seen["before"], reference(ids).logits, atol=1e-5,
                                       rtol=1e-5)
            exported = transformers.AutoModelForCausalLM.from_pretrained(
                out, attn_implementation="sdpa").eval()
            torch.testing.assert_close(exported(ids).logits, seen["after"], atol=1e-5,
                                       rtol=1e-5)
            assert not torch.allclose(seen["after"], seen["before"], atol=1e-3)
        # The export is the checkpoint save_pretrained writes: the source folder's own keys.
        assert sorted(hub_io.weight_index(out)) == sorted(index)
    comm.Free()
