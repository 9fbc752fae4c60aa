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
                     save_tokenizer, token_file, train_keeping_engine)
from test_hf import MODELS, make_config, run_layers                # noqa: E402
import pipeflow as pf                                              # noqa: E402
from pipeflow.models import hf                                     # noqa: E402
from pipeflow.train import hub as hub_io                           # noqa: E402
from pipeflow.train.loop import train                              # noqa: E402
from pipeflow.train.run_config import load_run_config              # noqa: E402
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
    # The source folder's generation config comes along; the weights are one file (small).
    assert sorted(os.listdir(out)) == sorted(os.listdir(out2)) == [
        "config.json", "generation_config.json", "model.safetensors"]
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
    out = write_folder(state, cfg, str(tmp_path / "out")).path
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


def _keys_and_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    out = {}
    for key, path in hub_io.weight_index(folder).items():
        with safe_open(path, framework="pt") as f:
            out[key] = f.get_tensor(key)
    return out


# Twelve experts a layer: checkpoint keys in index order (expert 2 before expert 10, as
# transformers merges them), never as strings sort them (0, 1, 10, 11, 2, ...).
ROUND_TRIPS = [(kind, {}) for kind in MODELS] + [
    ("mixtral", {"num_local_experts": 12}), ("qwen3_moe", {"num_experts": 12})]


@pytest.mark.parametrize("kind,overrides", ROUND_TRIPS,
                         ids=[k + ("-12-experts" if o else "") for k, o in ROUND_TRIPS])
def test_every_family_round_trips_through_the_folders_save_pretrained_writes(tmp_path, kind,
                                                                             overrides):
    # save_pretrained's folder (one file, then shards and their index) -> pipeflow's layers
    # (transformers' conversions applied: Mixtral's experts merged, GPT-NeoX's embed_out),
    # whose logits are the model's -> pipeflow's export: the files hold the same keys and
    # tensors, and from_pretrained of the export gives the model's logits.
    cfg = make_config(kind, **overrides)
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=hf.attention_implementation(cfg)).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(ids).logits
    layers = hf.causal_lm_layers(cfg)
    for shard in ("5GB", "30KB"):
        src, out = str(tmp_path / f"src-{shard}"), str(tmp_path / f"out-{shard}")
        model.save_pretrained(src, max_shard_size=shard)
        assert os.path.isfile(os.path.join(src, hub_io.INDEX)) == (shard == "30KB")
        state, _ = hub_io.read_layers(src, cfg, range(len(layers)))
        seq = pf.build_sequential(layers, seed=1).eval()
        seq.load_state_dict(state, strict=True)
        with torch.no_grad():
            torch.testing.assert_close(run_layers(seq, ids), expected, atol=1e-5, rtol=1e-5)
        hub_io.write_folder(seq.state_dict(), cfg, out, source=src, max_shard_size=shard)
        theirs, ours = _keys_and_tensors(src), _keys_and_tensors(out)
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
        assert os.path.isfile(os.path.join(out, hub_io.INDEX)) == (shard == "30KB")
        back = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation=hf.attention_implementation(cfg)).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(ids).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_export_carries_the_tokenizer_and_writes_the_runs_precision_sharded(tmp_path):
    # A bf16 folder with a tokenizer, a chat template and a README, trained in bf16: the
    # export is bf16 (config too), the tokenizer loads equal, shards past max_shard_size.
    hub, out, out32 = (str(tmp_path / n) for n in ("hub", "out", "out32"))
    save_hub(hub, "llama", sharded=False, dtype=torch.bfloat16)
    source = save_tokenizer(hub)
    with open(os.path.join(hub, "README.md"), "w") as f:
        f.write("# a tiny model\n")
    path = run_toml(str(tmp_path), f'pretrained = "{hub}"', steps=1,
                    train_extra=f'export_hf = "{out}"\nmax_shard_size = "20KB"\n'
                                f'save_dir = "{tmp_path / "ckpt"}"')
    quiet = dict(log=lambda *a, **k: None)
    train(load_run_config(path, ['engine.precision="bf16"']), **quiet)
    files = sorted(os.listdir(out))
    assert hub_io.INDEX in files and sum(f.endswith(".safetensors") for f in files) > 1
    for name in hub_io.extra_files(hub):
        assert name in files, name
    assert {"tokenizer.json", "tokenizer_config.json", "README.md",
            "generation_config.json"} <= set(files)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert {t.dtype for t in _keys_and_tensors(out).values()} == {torch.bfloat16}
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.bfloat16
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text, chat = "w5 w9 w3 nope", [{"role": "user", "content": "w7 w8"}]
    assert tok(text).input_ids == source(text).input_ids
    assert tok.get_vocab() == source.get_vocab()
    assert tok.all_special_tokens == source.all_special_tokens
    assert tok.apply_chat_template(chat, tokenize=False) == \
        source.apply_chat_template(chat, tokenize=False)
    # export_dtype says otherwise: float32 (and `pipeflow export --dtype` alike).
    assert main(["export", str(tmp_path / "ckpt"), "--hf", out32, "--dtype", "float32"]) == 0
    with open(os.path.join(out32, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    assert {t.dtype for t in _keys_and_tensors(out32).values()} == {torch.float32}
    assert transformers.AutoTokenizer.from_pretrained(out32)(text).input_ids == \
        source(text).input_ids


MAMBA2 = dict(model_type="mamba2", hidden_size=32, num_heads=4, head_dim=3, vocab_size=VOCAB)


@pytest.mark.parametrize("where", ["table", "folder", "config"])
def test_an_unsupported_model_type_is_one_line_naming_it_and_the_supported(tmp_path, where,
                                                                           capsys):
    # A Mamba2 config transformers itself would refuse (its own validation error) must not
    # get that far: pipeflow names the type and what it supports, exit 2, on every path.
    folder = tmp_path / "mamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MAMBA2))
    (folder / "model.safetensors").write_bytes(b"")
    model = {"table": "[model.config]\n" + "\n".join(
        f"{k} = {json.dumps(v)}" for k, v in MAMBA2.items()),
        "folder": f'pretrained = "{folder}"', "config": f'config = "{folder}"'}[where]
    if where == "table":     # a sub-table must come after the [model] keys
        path = run_toml(str(tmp_path), "", steps=1)
        text = open(path).read().replace('seq_len = 16\n', 'seq_len = 16\n' + model + "\n", 1)
        open(path, "w").write(text)
    else:
        path = run_toml(str(tmp_path), model, steps=1)
    if where == "folder":
        os.remove(folder / "model.safetensors")
        from safetensors.torch import save_file
        save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))
    assert main(["train", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "'mamba2' is not supported" in err[0] and "llama" in err[0] and "mixtral" in err[0]
    # The Python API: the same refusal from the layers.
    with pytest.raises(ValueError, match="'mamba2'.*not supported"):
        hf.causal_lm_layers(transformers.Mamba2Config(hidden_size=32, num_heads=4,
                                                      head_dim=16, vocab_size=VOCAB))
