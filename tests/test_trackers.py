"""`[train] trackers`: TensorBoard's loss scalars and the offline W&B run's equal the JSONL's;
an unknown tracker and a missing package are refused naming the fix; log lines count
`step i/N` with elapsed time and ETA."""

from __future__ import annotations

import glob
import json
import os
import shutil
import time

import pytest

from pipeflow.config import ConfigError
from pipeflow.train.loop import load_run_config, train
from pipeflow.train.trackers import check_trackers

from factory_models import RUN_TOML


def _run(tmp_path, *overrides):
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML.format(pipeline=1, data=1, steps=4, batch_size=4, log_every=1))
    return load_run_config(path, overrides)


@pytest.mark.timeout(120)
def test_tensorboard_and_offline_wandb_get_the_jsonl_losses(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lines = []
    train(_run(tmp_path, f'train.save_dir="{tmp_path}/ck"',
               'train.trackers=["tensorboard", "wandb"]'),
          log=lambda text, **k: lines.append(text))
    records = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text()
               .splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4
    events = EventAccumulator(str(tmp_path / "ck" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, rel=1e-6)
    runs = glob.glob(str(tmp_path / "ck" / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    # The offline run's log (what `wandb sync` uploads) holds each loss as its JSON text.
    # wandb's service process writes it: under load its last records land a moment after
    # finish() returns (one run of the suite read the file before they had), so it is read
    # until they are there, for at most 30 s.
    (log,) = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    deadline = time.monotonic() + 30
    while True:
        with open(log, "rb") as f:
            raw = f.read()
        missing = [x for x in losses if json.dumps(x).encode() not in raw]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, f"losses {missing} not in {log} ({len(raw)} bytes) after 30 s"
    steps = [x for x in lines if x.startswith("step ")]
    assert steps[0].startswith("step     0/4  loss") and "elapsed 0:" in steps[0]
    assert "ETA 0:" in steps[-1]


def test_unknown_tracker_and_missing_package_are_named(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"unknown tracker 'tensorbord'; did you mean "
                                          r"'tensorboard'\?"):
        check_trackers(["tensorbord"])
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)   # as if not installed
    with pytest.raises(ConfigError, match=r"needs the 'wandb' package: pip install "
                                          r"\"pipeflow\[wandb\]\""):
        train(_run(tmp_path, 'train.trackers=["wandb"]'), log=lambda *a, **k: None)
    with pytest.raises(ConfigError, match=r"\[train\] trackers must be a list of strings"):
        _run(tmp_path, "train.trackers=[1]")


def _curve(path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())
            if "loss" in r]


@pytest.mark.timeout(120)
def test_a_resumed_run_keeps_the_history_and_logs_each_point_at_its_step(tmp_path):
    # A run killed after its last checkpoint (step 2 of 4, save_every = 2: steps 2 and 3
    # logged, not saved; its last line torn) and resumed: metrics.jsonl keeps the records of
    # the steps before the resume, drops those the resumed run logs again, and appends, so it
    # holds the uninterrupted run's curve (each step once, in order, the same losses: the
    # resume is exact). TensorBoard's scalars sit at the JSONL's steps, its purged too.
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    quiet = dict(log=lambda *a, **k: None)
    ck = tmp_path / "ck"
    save = [f'train.save_dir="{ck}"', "train.save_every=2", 'train.trackers=["tensorboard"]']
    train(_run(tmp_path, *save), **quiet)
    whole = _curve(ck / "metrics.jsonl")
    assert [s for s, _ in whole] == [0, 1, 2, 3]
    shutil.rmtree(ck / "step-00000004")                  # the kill came before this save
    (ck / "latest").write_text("step-00000002")
    with open(ck / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    train(_run(tmp_path, *save, "train.resume=true"), **quiet)
    assert _curve(ck / "metrics.jsonl") == whole
    events = EventAccumulator(str(ck / "tensorboard"))
    events.Reload()
    board = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in board] == [s for s, _ in whole]
    assert [v for _, v in board] == pytest.approx([v for _, v in whole], rel=1e-6)


def test_a_tensorboard_folder_that_is_a_file_is_refused_at_start(tmp_path):
    """Issue 46 item 12: a TensorBoard folder that is a file (or read-only) gave a raw
    traceback and "rank 0 raised an uncaught OSError" once the engine was built."""
    pytest.importorskip("tensorboard")
    (tmp_path / "tb").write_text("a file where the folder should be")
    with pytest.raises(ConfigError, match=r"\[train\] tensorboard: expected a folder "
                                          r"TensorBoard can write its event files in, .*tb' "
                                          r"is a file; choose another folder"):
        train(_run(tmp_path, f'train.tensorboard="{tmp_path}/tb"'), log=lambda *a, **k: None)
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"\[train\] metrics: expected a file for the metric "
                                          r"records, .*m' is a folder"):
        train(_run(tmp_path, f'train.metrics="{tmp_path}/m"'), log=lambda *a, **k: None)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_tensorboard_folder_is_refused_at_start(tmp_path):
    pytest.importorskip("tensorboard")
    (tmp_path / "tb").mkdir()
    os.chmod(tmp_path / "tb", 0o555)
    try:
        with pytest.raises(ConfigError, match=r"\[train\] tensorboard: expected a folder .* "
                                              r"cannot take a file"):
            train(_run(tmp_path, f'train.tensorboard="{tmp_path}/tb"'),
                  log=lambda *a, **k: None)
    finally:
        os.chmod(tmp_path / "tb", 0o755)


class _Memory:
    """A tracker written as a user would add one: a class (and a row in TRACKERS)."""

    opened: list["_Memory"] = []

    def __init__(self, train, config, resumed_at):
        self.records, self.closed, self.path = [], False, f"memory of {config['train']['steps']}"
        self.resumed_at = resumed_at
        _Memory.opened.append(self)

    def log(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


def test_a_tracker_is_a_class_and_a_row(tmp_path, monkeypatch):
    from pipeflow.train import trackers
    monkeypatch.setitem(trackers.TRACKERS, "memory", trackers.TrackerKind(_Memory))
    monkeypatch.setattr(_Memory, "opened", [])
    lines = []
    train(_run(tmp_path, 'train.trackers=["memory"]', f'train.metrics="{tmp_path}/m.jsonl"'),
          log=lambda text, **k: lines.append(text))
    (memory,) = _Memory.opened
    jsonl = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert memory.records == jsonl and len([r for r in jsonl if "loss" in r]) == 4
    assert memory.closed and memory.resumed_at is None      # a new run, not a resumed one
    assert "metrics to memory memory of 4, jsonl " in lines[0]
    # A row's package is checked before the run, named with its extra.
    monkeypatch.setitem(trackers.TRACKERS, "memory",
                        trackers.TrackerKind(_Memory, "no_such_package_x", "memory"))
    with pytest.raises(ConfigError, match=r"needs the 'no_such_package_x' package: pip install "
                                          r"\"pipeflow\[memory\]\""):
        check_trackers(["memory"])


_SMALL_RUN = """
[engine]
pipeline = 2
microbatches = 2
[model]
n_layers = 2
d_model = 32
n_heads = 2
seq_len = 16
[train]
steps = 6
batch_size = 4
log_every = 2
eval_batches = 1
"""


def _launch(tmp_path, terminal: bool) -> str:
    """`mpirun -n 2 pipeflow train` with mpirun's stdout a terminal (a pseudo-terminal, as a
    person's) or a pipe; everything it wrote."""
    import pty
    import select
    import shutil
    import subprocess
    import sys

    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("needs mpirun on PATH")
    (tmp_path / "run.toml").write_text(_SMALL_RUN)
    argv = [mpirun, "-n", "2", sys.executable, "-m", "pipeflow", "train",
            str(tmp_path / "run.toml")]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    if not terminal:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    pid, fd = pty.fork()
    if pid == 0:                                    # the child: mpirun on the terminal
        os.execvpe(argv[0], argv, env)
    out, deadline = b"", time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:                             # the terminal closed: mpirun ended
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


@pytest.mark.timeout(300)
def test_progress_updates_in_place_under_mpirun_on_a_terminal_and_not_on_a_pipe(tmp_path):
    pytest.importorskip("tqdm")
    import re
    shown = _launch(tmp_path, terminal=True)
    # tqdm's bar, redrawn in place (a carriage return, no new line) as the steps go by, on
    # rank 0 alone (one bar: its count never goes back); the log lines still each whole.
    counts = [int(n) for n in re.findall(r"\r[ \d]{3}%[^\r\n]*? (\d)/6 \[", shown)]
    assert len(set(counts)) >= 3 and counts[-1] == 6 and counts == sorted(counts), shown
    assert all(f"step     {s}/6  loss" in shown for s in (0, 2, 4, 5))
    piped = _launch(tmp_path, terminal=False)
    assert "\r" not in piped and "/6 [" not in piped
    assert [line[:18] for line in piped.splitlines() if line.startswith("step ")] == \
        [f"step     {s}/6  loss" for s in (0, 2, 4, 5)]
