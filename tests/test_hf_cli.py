"""Hub folders through `pipeflow train` and `pipeflow export` in one process: a saved
transformers model is where the run starts (its logits, not a random model's), the folder the
run exports loads in transformers with the engine's trained logits, `pipeflow export` writes
the same folder from the checkpoint, and the `[model]` table refuses what it does not read.
The 2-rank run (each rank reading only its layers' tensors) is `test_hf_cli_mpi.py`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from mpi4py import MPI

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hub_run import (SEQ, VOCAB, logits_of, run_toml, safetensors_of, save_hub,  # noqa: E402
                     token_file, train_keeping_engine)
from pipeflow.cli import main                                      # noqa: E402
from pipeflow.config import ConfigError                            # noqa: E402
from pipeflow.train.model_table import build_model                 # noqa: E402


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,sharded", [("llama", True), ("gpt2", False)])
def test_pretrained_run_starts_from_the_folder_and_exports_what_it_trained(tmp_path, kind,
                                                                         sharded):
    hub, out, out2 = (str(tmp_path / n) for n in ("hub", "out", "out2"))
    reference = save_hub(hub, kind, sharded)
    path = run_toml(str(tmp_path), f'pretrained = "{hub}"',
                    train_extra=f'save_dir = "{tmp_path / "ckpt"}"\nexport_hf = "{out}"')
    ids, seen = _ids(), {}

    def before(loop):
        seen["before"] = logits_of(loop, ids)

    def after(loop):
        seen["after"] = logits_of(loop, ids)

    losses = train_keeping_engine(path, MPI.COMM_WORLD, before, after)
    assert len(losses) == 3
    with torch.no_grad():
        expected = reference(ids).logits
    # (a) the run started from the folder's weights, not from a random initialisation.
    torch.testing.assert_close(seen["before"], expected, atol=1e-5, rtol=1e-5)
    # (b) the exported folder is the trained model: transformers gives the engine's logits.
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="sdpa").eval()
    with torch.no_grad():
        theirs = exported(ids).logits
    assert not torch.allclose(seen["after"], expected, atol=1e-3)      # it trained
    torch.testing.assert_close(theirs, seen["after"], atol=1e-5, rtol=1e-5)
    # (c) `pipeflow export CKPT --hf OUT2` writes the same folder from the checkpoint.
    assert main(["export", str(tmp_path / "ckpt"), "--hf", out2]) == 0
    assert sorted(os.listdir(out)) == sorted(os.listdir(out2)) == ["config.json",
                                                                   "model.safetensors"]
    with open(os.path.join(out, "config.json")) as a, open(os.path.join(out2,
                                                                        "config.json")) as b:
        assert json.load(a) == json.load(b)
    first, second = safetensors_of(out), safetensors_of(out2)
    assert sorted(first) == sorted(second)
    assert all(torch.equal(first[k], second[k]) for k in first)
    if kind == "gpt2":       # tied: the head is the embedding, stored once
        assert "lm_head.weight" not in first
        assert torch.equal(exported.lm_head.weight, exported.transformer.wte.weight)


@pytest.mark.timeout(60)
def test_export_of_a_checkpoint_without_an_hf_config_needs_the_run_config(tmp_path, capsys):
    hub = str(tmp_path / "hub")
    save_hub(hub, "llama", sharded=False)
    path = run_toml(str(tmp_path), f'pretrained = "{hub}"', steps=1,
                    train_extra=f'save_dir = "{tmp_path / "ckpt"}"')
    train_keeping_engine(path, MPI.COMM_WORLD)
    folder = tmp_path / "ckpt" / "step-00000001"
    data = json.loads((folder / "data.json").read_text())
    data.pop("hf_config"), data.pop("sha256")
    (folder / "data.json").write_text(json.dumps(data))
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "x")]) == 2
    assert "--config RUN.toml" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "x"),
                 "--config", path]) == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "x")) is not None


def test_a_typo_in_an_hf_model_table_is_refused_with_the_close_key(tmp_path):
    hub = str(tmp_path / "hub")
    save_hub(hub, "llama", sharded=False)
    with pytest.raises(ConfigError) as info:
        build_model({"kind": "hf", "pretrained": hub, "seq_lne": 16})
    text = str(info.value)
    assert "'seq_lne'" in text and "did you mean 'seq_len'" in text and "pretrained" in text
    with pytest.raises(ConfigError, match="did you mean 'n_layers'"):
        build_model({"kind": "gpt", "n_layerz": 2})


@pytest.mark.parametrize("form", ["folder", "file"])
def test_config_of_a_folder_with_weights_says_it_initialises_at_random(tmp_path, form):
    hub = str(tmp_path / "hub")
    save_hub(hub, "llama", sharded=False)
    config = hub if form == "folder" else os.path.join(hub, "config.json")
    model = build_model({"kind": "hf", "config": config})
    assert not model.pretrained
    assert any("config only: random initialisation" in n and f"pretrained = {hub!r}" in n
               for n in model.notes), model.notes
    os.remove(os.path.join(hub, "model.safetensors"))
    assert build_model({"kind": "hf", "config": config}).notes == []


def test_pretrained_folder_without_safetensors_is_refused(tmp_path):
    hub = tmp_path / "hub"
    save_hub(str(hub), "llama", sharded=False)
    os.remove(hub / "model.safetensors")
    with pytest.raises(ConfigError, match="holds no safetensors weights"):
        build_model({"kind": "hf", "pretrained": str(hub)})


def test_eot_of_the_token_file_meta_is_the_default(tmp_path):
    from pipeflow.train.loop import _packing_eot
    from pipeflow.train.run_config import DataConfig
    tokens = token_file(str(tmp_path), eot=7)
    assert _packing_eot(DataConfig(train=tokens, packed=True)) == 7
    assert _packing_eot(DataConfig(train=tokens, packed=True, eot=3)) == 3
    os.remove(tmp_path / "meta.json")
    with pytest.raises(ConfigError, match="set \\[data\\] eot = ID"):
        _packing_eot(DataConfig(train=tokens, packed=True))


def test_an_export_records_the_dtype_of_the_tensors_it_writes(tmp_path):
    # A bf16 source (its config says bfloat16) trained and exported from fp32 masters: the
    # exported config.json must say float32, or `from_pretrained(dtype="auto")` casts the
    # trained weights down to bf16 and gives other logits than the engine's.
    from hub_run import hub_config
    from pipeflow import build_sequential
    from pipeflow.models import hf
    from pipeflow.train.hub import write_folder
    cfg = hub_config("llama")
    cfg.dtype = torch.bfloat16            # as transformers sets it for a bf16 checkpoint
    state = build_sequential(hf.causal_lm_layers(cfg), seed=0).state_dict()
    out = write_folder(state, cfg, str(tmp_path / "out"))
    written = {str(t.dtype).removeprefix("torch.") for t in safetensors_of(out).values()}
    with open(os.path.join(out, "config.json")) as f:
        recorded = json.load(f)["dtype"]
    assert written == {"float32"}
    assert recorded == "float32", f"config.json says {recorded}, the tensors are {written}"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}


def test_a_config_that_ties_a_head_the_weights_store_apart_loads_as_transformers_does(tmp_path):
    # transformers 5: "both are present in the checkpoints with different values, so we will
    # NOT tie them". pipeflow trained the tied model instead: logits 0.95 apart.
    hub = tmp_path / "hub"
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=SEQ,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hub)
    meta = json.loads((hub / "config.json").read_text())
    meta["tie_word_embeddings"] = True
    (hub / "config.json").write_text(json.dumps(meta))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(hub), attn_implementation="sdpa").eval()
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)
    model = build_model({"kind": "hf", "pretrained": str(hub)})
    assert any("loaded untied, as transformers does" in n for n in model.notes), model.notes
    import pipeflow as pf
    from pipeflow.train import hub as hub_io
    ours = pf.build_sequential(model.layers)
    state, _ = hub_io.read_layers(str(hub), model.hf_config, range(len(model.layers)))
    ours.load_state_dict(state)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_truncated_safetensors_file_is_named_with_what_to_do(tmp_path, sharded):
    hub = tmp_path / "hub"
    save_hub(str(hub), "llama", sharded=sharded)
    victim = sorted(hub.glob("*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    from pipeflow.train import hub as hub_io
    with pytest.raises((ConfigError, ValueError)) as info:
        model = build_model({"kind": "hf", "pretrained": str(hub)})
        hub_io.read_layers(str(hub), model.hf_config, range(len(model.layers)))
    text = str(info.value)
    assert str(victim) in text and "truncated or damaged" in text, text
    assert "download or save the folder again" in text and "\n" not in text
