"""`pipeflow sample` in one process: a checkpoint of `pipeflow train` (which records its run)
continues a prompt greedily exactly as `build_sequential` holding the checkpoint's weights
does; the text is printed; a Hugging Face folder samples as transformers' generate; errors
are one clear line."""

from __future__ import annotations

import json
import os

import pytest
import torch

import pipeflow as pf
from pipeflow.cli import main
from pipeflow.models import GPTConfig, gpt_layers
from pipeflow.runtime.checkpoint import read_params

RUN = """
[engine]
microbatches = 2
[model]
n_layers = 2
d_model = 32
n_heads = 2
seq_len = 16
[train]
steps = 6
batch_size = 4
log_every = 3
eval_batches = 1
"""


def trained(tmp_path) -> str:
    path = tmp_path / "run.toml"
    path.write_text(RUN)
    assert main(["train", str(path), "--save-dir", str(tmp_path / "ck")]) == 0
    return str(tmp_path / "ck")


def greedy_ids(checkpoint: str, prompt: str, n: int) -> list[int]:
    """The checkpoint's weights in `build_sequential`, the plainest greedy loop (cropped to
    the 16 positions, as nanoGPT's sampler crops)."""
    model = pf.build_sequential(gpt_layers(GPTConfig(n_layers=2, d_model=32, n_heads=2,
                                                     seq_len=16)), seed=0).eval()
    model.load_state_dict(read_params(checkpoint)[0])
    ids, out = list(prompt.encode()), []
    for _ in range(n):
        with torch.no_grad():
            out.append(int(model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
        ids.append(out[-1])
    return out


def test_sample_continues_a_checkpoint_like_build_sequential(tmp_path, capsys):
    ck = trained(tmp_path)
    capsys.readouterr()
    want = greedy_ids(ck, "def ", 20)
    assert main(["sample", ck, "--prompt", "def ", "--max-new-tokens", "20",
                 "--temperature", "0", "--ids"]) == 0
    assert json.loads(capsys.readouterr().out) == want
    assert main(["sample", ck, "--prompt", "def ", "--prompt", "class ",
                 "--max-new-tokens", "20", "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    first, second = text.split("\n---\n")
    assert first == "def " + bytes(want).decode("utf-8", errors="replace")
    assert second.startswith("class ")
    # Sampled: the seed decides, the same twice.
    runs = []
    for _ in range(2):
        assert main(["sample", ck, "--max-new-tokens", "12", "--seed", "3", "--top-k", "20",
                     "--ids"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]


def test_sample_errors_are_one_line(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and err.count("\n") == 1
    ck = trained(tmp_path)
    capsys.readouterr()
    assert main(["sample", ck, "--prompt", "", "--max-new-tokens", "2"]) == 2
    assert "--prompt '' is no token" in capsys.readouterr().err
    assert main(["sample", ck, "--top-p", "2", "--max-new-tokens", "2"]) == 2
    assert "top_p must be None or a number in (0, 1]" in capsys.readouterr().err
    assert main(["sample", ck, "--tensor", "3", "--max-new-tokens", "2"]) == 2
    assert "--tensor 3: the launch has 1 rank(s), which must be a multiple of the tensor " \
        "degree; use a divisor of 1" in capsys.readouterr().err


def test_sample_of_a_hugging_face_folder_equals_transformers(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, initializer_range=0.3)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "llama")
    prompt = list("hi there".encode())
    want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert main(["sample", str(tmp_path / "llama"), "--prompt", "hi there", "--tokenizer",
                 "byte", "--max-new-tokens", "10", "--temperature", "0", "--ids"]) == 0
    assert json.loads(capsys.readouterr().out) == want


def test_sample_with_a_config_of_another_model_names_the_config(tmp_path, capsys):
    """Issue 46 item 9: `--config OTHER.toml` on a checkpoint of another shape printed torch's
    multi-line `size mismatch for 0.tokens.weight ...`, --config never named."""
    ck = trained(tmp_path)
    other = tmp_path / "other.toml"
    other.write_text(RUN.replace("d_model = 32", "d_model = 64"))
    capsys.readouterr()
    assert main(["sample", ck, "--config", str(other), "--prompt", "x",
                 "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "size mismatch" not in err, err
    assert "tensor(s) of another shape than the model's (0.tokens.weight: given [256, 32], " \
        "the model's [256, 64]" in err
    assert f"the model comes from --config {other}, which describes another model" in err


def test_sample_of_a_save_dir_whose_latest_is_removed_while_read_takes_the_new_one(
        tmp_path, capsys, monkeypatch):
    """Issue 46 item 15: sampling a save_dir a run was writing picked step-N, which the run
    deleted while it was read: "no checkpoint in ... (the folder does not exist)"."""
    import shutil

    from pipeflow.runtime import checkpoint
    path = tmp_path / "run.toml"
    path.write_text(RUN.replace("log_every = 3", "log_every = 3\nsave_every = 3"))
    assert main(["train", str(path), "--save-dir", str(tmp_path / "ck")]) == 0
    ck = tmp_path / "ck"
    assert (ck / "step-00000003").is_dir() and (ck / "step-00000006").is_dir()
    (ck / "latest").write_text("step-00000003")       # the run had not published step 6 yet
    want = greedy_ids(str(ck / "step-00000006"), "def ", 8)
    original, calls = checkpoint.read_params, []

    def read_while_the_run_moves_on(directory, layers=None):
        calls.append(os.path.basename(str(directory)))
        if len(calls) == 1:                             # the run publishes 6, prunes 3
            (ck / "latest").write_text("step-00000006")
            shutil.rmtree(ck / "step-00000003")
        return original(directory, layers)
    monkeypatch.setattr(checkpoint, "read_params", read_while_the_run_moves_on)
    capsys.readouterr()
    assert main(["sample", str(ck), "--prompt", "def ", "--max-new-tokens", "8",
                 "--temperature", "0", "--ids"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out) == want
    assert calls == ["step-00000003", "step-00000006"]


def test_a_recorded_tokenizer_that_moved_is_named_with_the_fix(tmp_path, capsys, monkeypatch):
    """Issue 46 item 10: a tokenizer.json recorded in the run's meta.json and moved since gave
    "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    pytest.importorskip("tokenizers")
    from pipeflow.train import sample as sample_module
    ck = trained(tmp_path)
    moved = tmp_path / "data" / "tokenizer.json"
    monkeypatch.setattr(sample_module, "data_tokenizer", lambda run: f"hf:{moved}")
    capsys.readouterr()
    assert main(["sample", ck, "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"tokenizer hf:{moved}: expected a tokenizer.json file, the path does not exist" \
        in err and "pass --tokenizer SPEC to give it where it is now" in err, err
    assert "Repo id" not in err and err.count("\n") == 1


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _make_variable(name: str) -> str:
    import re
    (value,) = re.findall(rf"^{name} \?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    return value.strip()


@pytest.mark.timeout(240)
def test_make_trains_a_checkpoint_the_readme_sample_command_reads(tmp_path):
    # The first hour: `make train`'s config keeps a checkpoint and its metrics where the
    # README's sample command (and `make sample`'s RUN) reads them, prints the trained
    # model's greedy continuation with its prompt, and that command then writes text.
    import os
    import re
    import shlex
    import shutil
    import subprocess
    import sys

    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("needs mpirun on PATH")
    config, ranks, run_dir = (_make_variable(n) for n in ("CONFIG", "NP", "RUN"))
    readme = " ".join((ROOT / "README.md").read_text().split())
    (command,) = re.findall(r"`make sample` is `([^`]*)`", readme)
    argv = shlex.split(command)
    assert argv[:6] == ["mpirun", "-n", ranks, "pipeflow", "sample", run_dir], argv
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    python = [sys.executable, "-m", "pipeflow"]
    trained = subprocess.run([mpirun, "-n", ranks, *python, "train", str(ROOT / config),
                              "--steps", "3", "--set", "train.sample_tokens=12"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert trained.returncode == 0, trained.stderr[-3000:]
    lines = trained.stdout.splitlines()
    said = next(i for i, line in enumerate(lines) if "greedy continuation of 'def '" in line)
    more = next(i for i, line in enumerate(lines) if line.startswith("pipeflow: more with"))
    text = "\n".join(lines[said + 1:more])
    assert text.startswith("def ") and len(text) > len("def ")
    assert f"pipeflow sample {run_dir} --prompt" in lines[more]
    assert os.path.isfile(tmp_path / run_dir / "latest")
    records = [json.loads(x) for x in (tmp_path / run_dir / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [0, 2]
    sampled = subprocess.run([mpirun, *argv[1:3], *python, *argv[4:], "--max-new-tokens", "8",
                              "--temperature", "0"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=200)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    # The same model, the same greedy tokens: the sample command continues as the trainer did.
    assert sampled.stdout.startswith(argv[argv.index("--prompt") + 1])
    assert text.startswith(sampled.stdout.removesuffix("\n")), (text, sampled.stdout)
