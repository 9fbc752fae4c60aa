"""The command line in one process: train, schedule and clear errors."""

import os
import subprocess
import sys

import pytest

from pipeflow.cli import main
from pipeflow.train.loop import TrainConfig, lr_at

SMALL = """
[engine]
microbatches = 2
[model]
n_layers = 2
d_model = 32
n_heads = 2
seq_len = 16
[train]
steps = 12
batch_size = 4
lr = 3e-3
warmup = 2
log_every = 4
eval_batches = 1
"""


def test_train_logs_loss_throughput_and_step_time(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(SMALL)
    assert main(["train", str(path), "--save-dir", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "step     0/12  loss" in out and "tok/s" in out and "ms/step" in out
    assert "elapsed 0:" in out and "ETA 0:" in out
    assert "12 steps in" in out
    assert (tmp_path / "ck" / "latest").read_text() == "step-00000012"
    # Resuming at the last step trains nothing more.
    assert main(["train", str(path), "--save-dir", str(tmp_path / "ck"), "--resume"]) == 0


def test_bad_config_file_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(SMALL.replace("[train]", "[train]\nbatchsize = 3"))
    assert main(["train", str(path)]) == 2
    assert "unknown key(s) ['batchsize'] in [train]" in capsys.readouterr().err
    path.write_text(SMALL.replace("microbatches = 2", "microbatches = 3"))
    assert main(["train", str(path)]) == 2
    assert "does not divide into 1 replica(s) x 3 micro-batches" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_schedule_command_prints_table_bubble_and_stash(capsys):
    assert main(["schedule", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble 0.273" in out and "peak stash per stage [4, 3, 2, 1]" in out
    assert main(["schedule", "-p", "4", "-m", "8", "-s", "interleaved"]) == 0
    assert "bubble 0.158" in capsys.readouterr().out       # 3 / (2 * 8 + 3)
    assert main(["schedule", "-p", "4", "-m", "6", "-s", "interleaved"]) == 2
    assert "multiple of 4, found 6" in capsys.readouterr().err


def test_learning_rate_warms_up_then_decays_to_the_floor():
    run = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, run) == pytest.approx(0.1)
    assert lr_at(9, run) == pytest.approx(1.0)
    assert lr_at(99, run) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, run) >= lr_at(s + 1, run) for s in range(10, 99))


def test_trace_writes_the_last_steps_timeline(tmp_path):
    import json

    path = tmp_path / "run.toml"
    path.write_text(SMALL)
    out = tmp_path / "trace.json"
    assert main(["train", str(path), "--steps", "2", "--trace", str(out)]) == 0
    events = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    # One stage, 2 micro-batches under 1F1B: F0 B0 F1 B1, then the optimizer step.
    assert [e["name"] for e in events] == ["F0", "B0", "F1", "B1", "optimizer step"]
    assert all(e["dur"] >= 0 for e in events)
    assert all(a["ts"] <= b["ts"] for a, b in zip(events, events[1:]))


def test_the_command_line_and_the_planner_import_neither_torch_nor_mpi():
    # `pipeflow --help` took 6.2 s: importing pipeflow imported torch and started MPI. Only
    # what trains needs them; help, the schedule and the planner are plain Python.
    code = ("import sys, contextlib, io, pipeflow, pipeflow.cli, pipeflow.planner\n"
            "from pipeflow.planner import search\n"
            "for argv in (['--help'], ['schedule', '--help'], ['plan', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        pipeflow.cli.main(argv)\n"
            "print(sorted(m for m in ('torch', 'mpi4py.MPI', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PMI_SIZE": "1"})
    assert out.stdout.split("\n")[-2] == "[]", out.stdout + out.stderr


def test_resume_with_a_changed_model_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(SMALL.replace("steps = 12", "steps = 2"))
    assert main(["train", str(path), "--save-dir", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    path.write_text(SMALL.replace("n_layers = 2", "n_layers = 3"))
    assert main(["train", str(path), "--save-dir", str(tmp_path / "ck"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeflow: error: --resume: rank 0") and err.count("\n") == 1
    assert "holds 4 layers, the model has 5" in err


def test_errors_are_printed_as_written(tmp_path, capsys):
    from pipeflow.train.loop import train as run_train, load_run_config
    path = tmp_path / "run.toml"
    path.write_text(SMALL.replace("steps = 12", "steps = 1"))
    run_train(load_run_config(path, [f'train.save_dir="{tmp_path}/ck"']), log=lambda *a, **k: None)
    (tmp_path / "ck" / "step-00000001" / "data.json").unlink()
    assert main(["export", str(tmp_path / "ck"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err           # the folder's opening quote is kept
    assert f"error: '{tmp_path}/ck/step-00000001' records no Hugging Face config" in err


def test_a_process_alone_under_torchrun_says_how_to_launch(monkeypatch):
    import torch

    import pipeflow as pf
    from toy import toy_layers
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(pf.ConfigError, match=r"RANK=1 and WORLD_SIZE=4 from torchrun, but its "
                                             r"MPI world holds 1 rank.*launched with mpirun or "
                                             r"srun.*`mpirun -n 4 pipeflow train"):
        pf.Engine(toy_layers(blocks=1), lambda o, t: o.sum(),
                  lambda ps: torch.optim.SGD(ps, lr=0.1))
