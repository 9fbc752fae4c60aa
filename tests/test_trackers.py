"""`[train] trackers`: TensorBoard's loss scalars and the offline W&B run's equal the JSONL's;
an unknown tracker and a missing package are refused naming the fix; log lines count
`step i/N` with elapsed time and ETA."""

from __future__ import annotations

import glob
import json
import os
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


def _scalars_by_step(folder, tag="loss") -> dict[int, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder))
    events.Reload()
    out: dict[int, list[float]] = {}
    for e in events.Scalars(tag):
        out.setdefault(e.step, []).append(e.value)
    return out


@pytest.mark.timeout(180)
def test_a_resumed_run_logs_one_record_a_step_equal_to_an_uninterrupted_run(tmp_path):
    """Issue 46 item 2: killed after step 5 with the step-4 checkpoint latest, a resumed run
    kept the dead run's steps 4-5 beside its own in metrics.jsonl and TensorBoard. Now each
    holds one record a step, equal to an uninterrupted run's."""
    pytest.importorskip("tensorboard")
    quiet = {"log": lambda *a, **k: None}

    def run(folder, *more):
        return _run(tmp_path, f'train.save_dir="{folder}"', "train.steps=6",
                    "train.save_every=2", 'train.trackers=["tensorboard"]', *more)
    train(run(tmp_path / "whole"), **quiet)
    train(run(tmp_path / "cut"), **quiet)
    # As if killed after step 5 was logged, before the step-6 checkpoint: latest is step 4.
    assert (tmp_path / "cut" / "step-00000004").is_dir()
    (tmp_path / "cut" / "latest").write_text("step-00000004")
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 9')          # and a record cut short by the kill
    train(run(tmp_path / "cut", "train.resume=true"), **quiet)

    def records(folder):
        out = []
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            out.append({k: r[k] for k in ("step", "loss", "eval_loss", "lr") if k in r})
        return out
    whole, cut = records(tmp_path / "whole"), records(tmp_path / "cut")
    assert [r["step"] for r in cut if "loss" in r] == list(range(6))
    assert cut == whole
    tb_whole = _scalars_by_step(tmp_path / "whole" / "tensorboard")
    tb_cut = _scalars_by_step(tmp_path / "cut" / "tensorboard")
    assert sorted(tb_cut) == list(range(6)) and all(len(v) == 1 for v in tb_cut.values())
    assert tb_cut == tb_whole


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
