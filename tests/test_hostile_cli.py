"""Hostile input to `pipeflow train`, `schedule`, `trace`, `plot`, `prepare`: each row a bad
file, option or value, the error text it must give, and how long the answer may take."""

import json
import time

import pytest
import tomli_w

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from pipeflow.cli import main

BASE = """
[engine]
microbatches = 2
[model]
n_layers = 1
d_model = 16
n_heads = 2
seq_len = 8
[train]
steps = 2
batch_size = 4
eval_batches = 1
"""

# (name, lines added to [train] or a table of their own, extra argv, expected error text)
TRAIN_ROWS = [
    ("steps is a word", "steps = 'ten'", [],
     "[train] steps must be an integer >= 1, found 'ten' (str)"),
    ("batch_size is a string", "batch_size = '4'", [],
     "[train] batch_size must be an integer >= 1, found '4' (str)"),
    ("lr is a word", "lr = 'fast'", [], "[train] lr must be a number > 0.0, found 'fast'"),
    ("lr is zero", "lr = 0.0", [], "[train] lr must be a number > 0.0, found 0.0"),
    ("log_every is zero", "log_every = 0", [],
     "[train] log_every must be an integer >= 1, found 0"),
    ("steps negative", "steps = -5", [], "[train] steps must be an integer >= 1, found -5"),
    ("save_every negative", "save_every = -1", [],
     "[train] save_every must be an integer >= 0, found -1"),
    ("threads is a bool", "threads = true", [],
     "[train] threads must be an integer >= 1, found True (bool)"),
    ("beta1 too large", "beta1 = 1.5", [],
     "[train] beta1 must be a number >= 0.0 and < 1, found 1.5"),
    ("eval_batches zero", "eval_batches = 0", [],
     "[train] eval_batches must be an integer >= 1, found 0"),
    ("resume without save_dir", "resume = true", [],
     "[train] resume = true needs a checkpoint folder: set [train] save_dir"),
    ("unknown train key", "stepz = 3", [], "unknown key(s) ['stepz'] in [train]"),
    ("corpus and token data", "corpus = 'a.txt'\n[data]\ntrain = 'b.bin'", [],
     "both name training data: keep one"),
    ("token dtype", "[data]\ntrain = 'x.bin'\ndtype = 'int8'", [],
     '[data] dtype must be "uint16" or "uint32", found \'int8\''),
    ("missing token file", "[data]\ntrain = 'missing.bin'", [],
     "token file 'missing.bin' not found; write one with `pipeflow prepare"),
    ("val without train", "[data]\nval = 'v.bin'", [], "[data] val = 'v.bin' needs [data] train"),
    ("batch_size that cannot fit", "batch_size = 1000000000000", [],
     "[train] batch_size = 1000000000000 at seq_len 8 needs"),
    ("seq_len longer than model", "[data]\nseq_len = 64", [],
     "[data] seq_len = 64 is longer than the model's 8 positions"),
    ("unknown table", "[optim]\nlr = 1", [], "unknown table(s) ['optim']"),
    ("--set without =", "", ["--set", "train.steps"], "--set expects table.key=value"),
    ("--set unknown table", "", ["--set", "optim.lr=1"], "unknown table [optim]"),
    ("--set wrong type", "", ["--set", "train.steps=ten"],
     "[train] steps must be an integer >= 1, found 'ten'"),
    ("--set engine value", "", ["--set", "engine.microbatches=0"],
     "Config.microbatches must be a positive integer, found 0"),
    ("--steps negative", "", ["--steps", "-1"], "[train] steps must be an integer >= 1"),
    ("factory module missing", "[model]\nfactory = 'no_such_module_x:fn'", [],
     "cannot import module 'no_such_module_x'"),
    ("factory name missing", "[model]\nfactory = 'factory_models:nothing'", [],
     "module 'factory_models' has no 'nothing'"),
    ("factory spec malformed", "[model]\nfactory = 'factory_models'", [],
     '[model] factory must look like "package.module:function"'),
    ("factory returns no list", "[model]\nfactory = 'factory_models:not_a_list'", [],
     "must return a non-empty list of pipeflow.LayerSpec, found str"),
    ("factory bad kwargs", "[model]\nfactory = 'factory_models:token_mlp'\nwidth = 3", [],
     "does not take the table's keys ['width']"),
    ("model kind unknown", "[model]\nkind = 'bert'", [], "[model] kind must be"),
    ("gpt key unknown", "[model]\nn_layer = 2", [], "[model] (kind \"gpt\")"),
    ("engine schedule is a number", "[engine]\nschedule = 3", [],
     "[engine] schedule must be a string, found 3 (int)"),
    ("engine initial_loss_scale is a word", "[engine]\ninitial_loss_scale = 'big'", [],
     "[engine] initial_loss_scale must be a number, found 'big' (str)"),
    ("engine loss_scale renamed", "[engine]\nloss_scale = 1024.0", [],
     "[engine] 'loss_scale' was renamed 'initial_loss_scale' (it is the scale fp16 training "
     "starts from; the current one is `engine.loss_scale`); write initial_loss_scale = 1024.0"),
    ("engine loss_scale renamed, --set", "", ["--set", "engine.loss_scale=512"],
     "[engine] 'loss_scale' was renamed 'initial_loss_scale'"),
    ("engine pipeline is a string", "", ["--set", "engine.pipeline='2'"],
     "[engine] pipeline must be an integer, found '2' (str)"),
    ("engine clip is a bool", "[engine]\nclip = true", [],
     "[engine] clip must be a number, found True (bool)"),
    ("hf without what it needs", "[model]\nkind = 'hf'", [], '[model] kind = "hf" needs'),
    ("packed on a model without position ids", "[data]\npacked = true\neot = 10", [],
     "reads position_ids (the forward of"),
    ("eot outside the vocabulary", "[data]\npacked = true\neot = 256", [],
     "[data] eot = 256 is outside the model's vocabulary (ids 0..255)"),
]


def _config(tmp_path, extra: str) -> str:
    """BASE with `extra` merged in: bare keys go to [train], tables merge key by key."""
    doc = tomllib.loads(BASE)
    more = tomllib.loads(extra)
    for key, value in more.items():
        if isinstance(value, dict):
            doc.setdefault(key, {}).update(value)
        else:
            doc["train"][key] = value
    if "factory" in doc["model"] or "kind" in doc["model"]:
        doc["model"] = more["model"]
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(doc))
    return str(path)


def _expect_error(argv, expected, capsys, limit_s=10.0):
    start = time.perf_counter()
    assert main(argv) == 2
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert expected in err, err
    assert err.startswith(("pipeflow: error: ", "pipeflow plan: error: "))
    assert elapsed < limit_s, f"the error took {elapsed:.1f} s"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,extra,argv,expected", TRAIN_ROWS, ids=[r[0] for r in TRAIN_ROWS])
def test_train_rejects(tmp_path, capsys, name, extra, argv, expected):
    _expect_error(["train", _config(tmp_path, extra), *argv], expected, capsys)


@pytest.mark.timeout(30)
def test_resume_on_a_missing_folder_is_an_error_not_a_fresh_start(tmp_path, capsys):
    path = _config(tmp_path, "")
    _expect_error(["train", path, "--save-dir", str(tmp_path / "nope"), "--resume"],
                  f"--resume: [train] save_dir = '{tmp_path / 'nope'}' does not exist", capsys)
    (tmp_path / "empty").mkdir()
    _expect_error(["train", path, "--save-dir", str(tmp_path / "empty"), "--resume"],
                  "holds no checkpoint (no 'latest' file)", capsys)


@pytest.mark.timeout(30)
def test_save_dir_that_is_a_file_is_found_at_start(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    _expect_error(["train", _config(tmp_path, ""), "--save-dir", str(tmp_path / "file")],
                  "is a file, expected a folder for checkpoints", capsys)


OTHER_ROWS = [
    (["schedule", "-p", "0"], "--stages/-p (pipeline stages) must be a positive integer, found 0"),
    (["schedule", "-p", "-3"], "--stages/-p (pipeline stages) must be a positive integer, found -3"),
    (["schedule", "-m", "0"], "--microbatches/-m must be a positive integer, found 0"),
    (["schedule", "-s", "interleaved", "-v", "0"], "--chunks/-v must be a positive integer"),
    (["trace", "missing-trace.json", "--png", "x.png"], "cannot draw x.png"),
    (["prepare", "missing.txt", "--out", "data"], "missing.txt"),
    (["prepare", "--tokenizer", "sentencepiece:x", "in.txt", "--out", "data"],
     "--tokenizer must be 'byte', 'tiktoken:NAME'"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv,expected", OTHER_ROWS, ids=[" ".join(r[0]) for r in OTHER_ROWS])
def test_other_commands_reject(tmp_path, capsys, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("hello")
    _expect_error(argv, expected, capsys)


def _hardware_file(tmp_path, how: str) -> str:
    from pipeflow.planner.hardware import PRESETS
    path = tmp_path / "hw.json"
    PRESETS["h100"].save(path)
    text = path.read_text()
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
    elif how == "negative":
        record = json.loads(text)
        record["memory_bytes"] = -80e9
        path.write_text(json.dumps(record))
    elif how == "not a record":
        path.write_text("[1, 2]")
    return str(path)


PLAN_ROWS = [
    ("truncated", "is not JSON (truncated or damaged?)"),
    ("negative", "memory_bytes must be a finite number > 0, found -80000000000.0"),
    ("not a record", "is not a hardware record"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how,expected", PLAN_ROWS, ids=[r[0] for r in PLAN_ROWS])
def test_plan_refuses_a_bad_hardware_file_in_one_line(tmp_path, capsys, how, expected):
    path = _hardware_file(tmp_path, how)
    assert main(["plan", "--params", "1e9", "--hardware-file", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--hardware-file {path!r}" in err and expected in err, err
    assert "--calibrate --save-hardware" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,expected", [
    # The largest shape (512 layers): every depth's partition was O(n^2 p), minutes a depth.
    (["--params", "2e13", "--gpus", "8", "--shard-optimizer"], "no plan fits"),
    (["--params", "1e15", "--gpus", "8", "--shard-optimizer"],
     "1e+15 parameters is above the largest GPT this planner shapes"),
])
def test_plan_answers_the_largest_requests_within_seconds(capsys, argv, expected):
    _expect_error(["plan", *argv], expected, capsys, limit_s=20.0)


@pytest.mark.timeout(30)
def test_plot_of_a_file_without_training_records(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "eval_loss": 1.0}\n')
    _expect_error(["plot", str(path), "--png", str(tmp_path / "x.png")],
                  "has no training records", capsys)


def _token_file(tmp_path, ids, dtype: str, meta: dict | None = None) -> str:
    import json

    import numpy as np
    path = tmp_path / "tokens" / "train.bin"
    path.parent.mkdir(exist_ok=True)
    np.asarray(ids, dtype=dtype).tofile(path)
    if meta is not None:
        (path.parent / "meta.json").write_text(json.dumps(meta))
    return str(path)


@pytest.mark.timeout(30)
def test_a_token_file_read_with_another_dtype_than_its_meta_says(tmp_path, capsys):
    # uint32 tokens read as uint16 would train on garbage: meta.json says what was written.
    data = _token_file(tmp_path, list(range(200)) * 10, "uint32",
                       {"vocab_size": 256, "dtype": "uint32"})
    _expect_error(["train", _config(tmp_path, ""), "--set", f'data.train="{data}"'],
                  "holds uint32 tokens", capsys)


@pytest.mark.timeout(30)
def test_token_ids_past_the_vocabulary_are_found_before_step_0(tmp_path, capsys):
    # No meta.json to say it: the first batch is checked instead of an IndexError in F1.
    data = _token_file(tmp_path, [300] * 2000, "uint16")
    _expect_error(["train", _config(tmp_path, ""), "--set", f'data.train="{data}"'],
                  "holds token id 300, the model's vocab_size is 256", capsys)


@pytest.mark.timeout(30)
def test_a_run_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "latin1.toml"
    path.write_bytes(BASE.encode() + "# caf\xe9\n".encode("latin-1"))
    _expect_error(["train", str(path)], "is not UTF-8 text", capsys)


@pytest.mark.timeout(30)
def test_an_empty_token_file_is_named(tmp_path, capsys):
    data = _token_file(tmp_path, [], "uint16")
    _expect_error(["train", _config(tmp_path, ""), "--set", f'data.train="{data}"'],
                  f"token file '{data}' is empty", capsys)


@pytest.mark.timeout(30)
def test_a_sample_prompt_without_the_datas_tokenizer_is_refused_at_start(tmp_path, capsys):
    # [train] sample_prompt needs the run's data's tokenizer: a token file with no meta.json
    # naming one is refused before the engine is built, not after the run.
    data = _token_file(tmp_path, list(range(200)) * 10, "uint16")
    _expect_error(["train", _config(tmp_path, ""), "--set", f'data.train="{data}"',
                   "--set", 'train.sample_prompt="def "'],
                  "[train] sample_prompt = 'def ' needs the tokenizer of the run's data", capsys)
