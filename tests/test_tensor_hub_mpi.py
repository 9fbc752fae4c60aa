"""Hub folders at `tensor > 1`: each rank reads from the safetensors files only the slices it
keeps (`get_slice(key)[...]` in the ranges `Engine.kept_ranges` gives, only its stage's
layers), the engine loads what `tensor = 1` loads, and a run at `p2×t2` exports the whole
model, which transformers loads with the engine's logits.

Run under `mpirun -n 2` (t2) and `-n 4` (p2×t2) with `--with-mpi`; the first test is plain."""

from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

import pipeflow as pf                                                          # noqa: E402
from hub_run import (SEQ, VOCAB, CountingOpen, logits_of, run_toml,             # noqa: E402
                     save_hub, train_keeping_engine)
from pipeflow.models import hf                                                 # noqa: E402
from pipeflow.runtime import tensor_parallel as tp                             # noqa: E402
from pipeflow.train import hub as hub_io                                       # noqa: E402
from pipeflow.train.loop import _load_pretrained                               # noqa: E402
from pipeflow.train.model_table import build_model                             # noqa: E402
from toy import allgather, barrier, bcast, sgd                                        # noqa: E402

WORLD = MPI.COMM_WORLD
FOUR = WORLD.size == 4


@pytest.mark.parametrize("shape,split", [((12, 8), (0, 1)), ((12, 8), (1, 1)),
                                         ((24, 8), (0, 3)), ((4, 24), (1, 3)),
                                         ((2, 24, 8), (1, 2)),
                                         # Phi-3's q | k | v of unequal widths
                                         ((32, 8), (0, (16, 8, 8))), ((8, 24), (1, (8, 16)))])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_kept_ranges_read_what_cut_keeps(shape, split, size):
    """The ranges a reader reads, concatenated, are `cut`'s slice, for every rank."""
    whole = torch.arange(torch.Size(shape).numel()).reshape(shape)
    widths = split[1] if isinstance(split[1], tuple) else \
        (shape[split[0]] // split[1],) * split[1]
    if sum(widths) != shape[split[0]] or any(w % size for w in widths):
        assert tp.kept_ranges(shape, split, size, 0) is None     # left to `cut`
        return
    for rank in range(size):
        dim, spans = tp.kept_ranges(shape, split, size, rank)
        assert dim == split[0] and len(spans) == len(widths)
        read = torch.cat([whole.narrow(dim, a, b - a) for a, b in spans], dim)
        assert torch.equal(read, tp.cut(whole, *split, size, rank))


def test_kept_ranges_leave_what_they_do_not_know_to_cut():
    assert tp.kept_ranges((6, 8), (0, 1), 4, 0) is None          # 6 rows over 4: uneven
    assert tp.kept_ranges((8, 8), ("heads", 3), 2, 0) is None    # a layout of another kind


def _engine(layers, comm, tensor: int, pipeline: int = 1):
    return pf.Engine(layers, hf.causal_lm_loss, sgd,
                     pf.Config(pipeline=pipeline, tensor=tensor), comm=comm)


def _expected_bytes(engine, folder: str, config, stages: int = 1) -> tuple[int, int, int]:
    """What this rank must read of the folder: its layers' tensors, a cut one's bytes / t,
    a whole one's (norms, embedding, head) all; and the folder's cut and whole bytes."""
    index = hub_io.weight_index(folder)
    sources, _ = hub_io.layer_sources(index, config)
    t = engine.stage.tensor.size
    cut = {n for n, p in engine.stage.module.named_parameters() if tp.split_of(p) is not None}
    sizes = {}
    for key, path in index.items():
        with safetensors.safe_open(path, framework="pt") as f:
            sizes[key] = f.get_tensor(key).nbytes
    mine = [pf_key for pf_key in sources if int(pf_key.split(".")[0]) in
            engine.stage.module.indices]
    expected = sum(sizes[sources[k][0]] // (t if k in cut else 1) for k in mine)
    # the whole model's: which of its keys a tensor rank cuts (every stage's engine agrees)
    cut_names = set().union(*allgather(engine.stage.topo.world, cut))
    cut_bytes = sum(sizes[sources[k][0]] for k in sources if k in cut_names)
    return expected, cut_bytes, sum(sizes.values()) - cut_bytes


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_loading_at_t2_reads_only_its_slices_and_equals_t1(tmp_path_factory, monkeypatch,
                                                           sharded):
    comm = WORLD.Split(color=0 if WORLD.rank < 2 else MPI.UNDEFINED, key=WORLD.rank)
    if comm == MPI.COMM_NULL:
        return
    folder = bcast(comm, str(tmp_path_factory.mktemp("hub")) if comm.rank == 0 else None)
    if comm.rank == 0:
        save_hub(folder, "llama", sharded=sharded, layers=2)
    barrier(comm)
    model = build_model({"kind": "hf", "pretrained": folder})
    one, two = _engine(model.layers, MPI.COMM_SELF, 1), _engine(model.layers, comm, 2)
    _load_pretrained(one, model)
    counting = CountingOpen(safetensors.safe_open)
    with monkeypatch.context() as patch:
        patch.setattr(safetensors, "safe_open", counting)
        _load_pretrained(two, model)
    expected, cut_bytes, whole_bytes = _expected_bytes(two, folder, model.hf_config)
    # Exactly this rank's slices and its whole tensors: a cut tensor's bytes / 2, never all.
    assert counting.bytes == expected, (counting.bytes, expected)
    assert counting.bytes == cut_bytes // 2 + whole_bytes
    assert sum(allgather(comm, counting.bytes)) == cut_bytes + 2 * whole_bytes
    states = [e.gather_state_dict() for e in (one, two)]
    # A whole state (transformers' own, as `load_state_dict` takes it at t = 1) is cut alike.
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    two.load_state_dict(hf.from_hf_state_dict(reference.state_dict(), model.hf_config))
    states.append(two.gather_state_dict())
    if comm.rank == 0:
        assert states[0].keys() == states[1].keys() == states[2].keys()
        for key, value in states[0].items():
            assert torch.equal(states[1][key], value), key
            assert torch.equal(states[2][key], value), key
    for e in (one, two):
        e.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_state_of_neither_shape_is_refused_naming_the_whole_one():
    comm = WORLD.Split(color=0 if WORLD.rank < 2 else MPI.UNDEFINED, key=WORLD.rank)
    if comm == MPI.COMM_NULL:
        return
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32,
                                      intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB)
    engine = _engine(hf.causal_lm_layers(config), comm, 2)
    state = engine.gather_state_dict()
    state = bcast(comm, state if comm.rank == 0 else None)
    key = "1.layer.mlp.down_proj.weight"             # whole [32, 64], a rank's [32, 32]
    state[key] = torch.zeros(32, 48)
    with pytest.raises(pf.ConfigError, match=r"down_proj.weight: given \[32, 48\], the "
                       r"model's \[32, 64\]"):
        engine.load_state_dict(state)
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
def test_a_sharded_bf16_folder_trained_at_p2xt2_exports_the_whole_model(tmp_path_factory,
                                                                       monkeypatch):
    """`pipeflow train` from a TOML (the trainer's own start and loop) at pipeline 2 x tensor
    2 from a bf16 folder in 20 KB shards: each rank reads its stage's slices only; the run
    exports (`export_hf`) and checkpoints; transformers loads the export with the engine's
    logits, and `pipeflow export` of the checkpoint writes the same tensors."""
    folder = bcast(WORLD, str(tmp_path_factory.mktemp("hub")) if WORLD.rank == 0 else None)
    hub, out, ckpt = (os.path.join(folder, n) for n in ("hub", "out", "ckpt"))
    if WORLD.rank == 0:
        reference = save_hub(hub, "llama", sharded=True, layers=4, dtype=torch.bfloat16)
        assert {t.dtype for t in reference.state_dict().values()} == {torch.bfloat16}
        run_toml(folder, f'pretrained = "{hub}"', pipeline=2, engine_extra="tensor = 2",
                 train_extra=f'export_hf = "{out}"\nsave_dir = "{ckpt}"')
    path = bcast(WORLD, os.path.join(folder, "run.toml"))
    counting = CountingOpen(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", counting)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(5))
    seen = {}

    def before(loop):
        seen["read"] = counting.bytes
        seen["expected"] = _expected_bytes(loop.engine, hub, loop.hf_config)
        seen["before"] = logits_of(loop, ids)

    def after(loop):
        seen["after"] = logits_of(loop, ids)

    train_keeping_engine(path, WORLD, before, after)
    monkeypatch.undo()
    expected, cut_bytes, whole_bytes = seen["expected"]
    # This rank's stage's layers, a cut tensor's bytes / 2: a quarter of the cut bytes (the
    # layers split evenly over the two stages) plus the whole tensors of its stage.
    assert seen["read"] == expected, (seen["read"], expected)
    reads = allgather(WORLD, seen["read"])
    assert sum(reads) == cut_bytes + 2 * whole_bytes            # each cut byte read once
    assert max(reads) <= cut_bytes / 4 + whole_bytes
    if WORLD.rank == 0:
        import pipeflow.cli
        assert pipeflow.cli.main(["export", ckpt, "--hf", os.path.join(folder, "again")]) == 0
        with torch.no_grad():
            start = reference.float()(ids).logits          # bf16 weights, computed in fp32
            torch.testing.assert_close(seen["before"], start, atol=1e-5, rtol=1e-5)
            exported = transformers.AutoModelForCausalLM.from_pretrained(
                out, attn_implementation="sdpa").eval()
            torch.testing.assert_close(exported(ids).logits, seen["after"], atol=1e-5,
                                       rtol=1e-5)
            assert not torch.allclose(seen["after"], seen["before"], atol=1e-3)
        written = {n: hub_io.weight_index(d) for n, d in (("out", out), ("again", os.path.join(
            folder, "again")))}
        assert sorted(written["out"]) == sorted(hub_io.weight_index(hub))   # the whole model
        for key, path in written["out"].items():
            assert torch.equal(hub_io.read_tensor(path, key),
                               hub_io.read_tensor(written["again"][key], key)), key


if FOUR:      # the 2-rank tests on 2 of 4 ranks would show nothing new, at the others' wait
    del test_loading_at_t2_reads_only_its_slices_and_equals_t1
    del test_a_state_of_neither_shape_is_refused_naming_the_whole_one
else:
    del test_a_sharded_bf16_folder_trained_at_p2xt2_exports_the_whole_model
