"""Hostile inputs: each row does one wrong thing and names the error it must give.

A row is `Hostile(id, action, expected, error)`: `action(tmp_path)` must raise `error` (any
exception by default) whose message contains every fragment of `expected` (plain text, not a
regular expression). Add rows for new guards here: API, TOML, CLI, checkpoints, faults. Each
row runs under the module's time limit, so a guard that hangs fails instead of stalling.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import pipeflow as pf
from pipeflow.runtime.checkpoint import CheckpointError, check_save_dir
from pipeflow.schedules import names

from toy import adamw, batches, loss_fn, toy_layers

pytestmark = pytest.mark.timeout(60)


@dataclasses.dataclass(frozen=True)
class Hostile:
    id: str
    action: Callable[[Path], Any]
    expected: str | tuple[str, ...]        # fragments the message must contain
    error: type[BaseException] = Exception


def config(**kwargs: Any) -> Callable[[Path], Any]:
    return lambda tmp: pf.Config(**kwargs)


def toml(text: str) -> Callable[[Path], Any]:
    def load(tmp: Path) -> Any:
        (tmp / "run.toml").write_text(text)
        return pf.Config.load(tmp / "run.toml")
    return load


CONFIG = [
    Hostile("schedule-int", config(schedule=3),
            (f"Config.schedule must be a string, one of {[*names(), 'auto']}",
             "found 3 (int)", 'set schedule = "1f1b"'), pf.ConfigError),
    Hostile("loss-scale-str", config(initial_loss_scale="big"),
            ("Config.initial_loss_scale must be a finite number >= 1", "found 'big' (str)",
             "set initial_loss_scale to a number"), pf.ConfigError),
    # The old name of the initial scale (the current one is engine.loss_scale), refused
    # with the new one, from Python and through dataclasses.replace.
    Hostile("loss-scale-renamed", config(loss_scale=1024.0),
            ("Config(loss_scale=...): 'loss_scale' was renamed 'initial_loss_scale'",
             "the current one is `engine.loss_scale`", "write Config(initial_loss_scale=1024.0)"),
            pf.ConfigError),
    Hostile("loss-scale-renamed-replace",
            lambda tmp: dataclasses.replace(pf.Config(), loss_scale=8.0),
            "write Config(initial_loss_scale=8.0)", pf.ConfigError),
    Hostile("loss-scale-renamed-toml", toml("[engine]\nloss_scale = 1024.0\n"),
            ("run.toml: [engine] 'loss_scale' was renamed 'initial_loss_scale'",
             "write initial_loss_scale = 1024.0"), pf.ConfigError),
    Hostile("pipeline-zero", config(pipeline=0),
            ("Config.pipeline must be a positive integer, found 0 (int)",
             "set pipeline to a whole number >= 1"), pf.ConfigError),
    Hostile("pipeline-bool", config(pipeline=True),
            "Config.pipeline must be a positive integer, found True (bool)", pf.ConfigError),
    Hostile("data-str", config(data="2"),
            "Config.data must be a positive integer, found '2' (str)", pf.ConfigError),
    Hostile("microbatches-float", config(microbatches=2.5),
            "Config.microbatches must be a positive integer, found 2.5 (float)", pf.ConfigError),
    Hostile("microbatches-negative", config(microbatches=-4),
            "Config.microbatches must be a positive integer, found -4", pf.ConfigError),
    Hostile("virtual-stages-bool", config(virtual_stages=False),
            "Config.virtual_stages must be a positive integer, found False (bool)",
            pf.ConfigError),
    Hostile("virtual-stages-without-interleaved", config(pipeline=2, virtual_stages=2),
            ("'1f1b' runs exactly 1 model chunk per rank, found virtual_stages = 2",
             "leave virtual_stages out (or set 1)"), pf.ConfigError),
    Hostile("interleaved-partial-group",
            config(schedule="interleaved", virtual_stages=2, pipeline=4, microbatches=6),
            ("microbatches must be a multiple of 4, found 6", "set microbatches = 8"),
            pf.ConfigError),
    Hostile("interleaved-one-stage",
            config(schedule="interleaved", virtual_stages=2, pipeline=1, microbatches=2),
            ("schedule 'interleaved'", "needs Config.pipeline >= 2, found pipeline = 1",
             "use schedule '1f1b'"), pf.ConfigError),
    Hostile("precision-int", config(precision=16),
            "Config.precision must be a string, one of ['fp32', 'bf16', 'fp16'], found 16",
            pf.ConfigError),
    Hostile("wait-unknown", config(wait="sleep"),
            "Config.wait must be one of ['auto', 'spin', 'yield'], found 'sleep'",
            pf.ConfigError),
    Hostile("backend-unknown", config(backend="tcp"),
            "Config.backend must be one of ['mpi', 'nccl', 'gloo', 'auto', 'strict'], found 'tcp'",
            pf.ConfigError),
    Hostile("partition-empty-stage", config(pipeline=3, partition=[0, 3, 3, 7]),
            ("Config.partition must be one of", "increasing stage boundaries",
             "found [0, 3, 3, 7] (list)", "give each stage at least one layer"), pf.ConfigError),
    Hostile("partition-not-from-zero", config(partition=[1, 7]),
            "found [1, 7] (list)", pf.ConfigError),
    Hostile("partition-bool", config(partition=[0, True]),
            "found [0, True] (list)", pf.ConfigError),
    Hostile("fp32-modules-str", config(fp32_modules="LayerNorm"),
            ("Config.fp32_modules must be a list of module class names",
             "found 'LayerNorm' (str)"), pf.ConfigError),
    Hostile("loss-scale-below-min", config(initial_loss_scale=0.5),
            "Config.initial_loss_scale must be a finite number >= 1 (at least loss_scale_min), "
            "found 0.5", pf.ConfigError),
    Hostile("loss-scale-min-zero", config(loss_scale_min=0),
            "Config.loss_scale_min must be a finite number > 0, found 0", pf.ConfigError),
    Hostile("loss-scale-growth-below-one", config(loss_scale_growth=0.5),
            "Config.loss_scale_growth must be a finite number >= 1, found 0.5", pf.ConfigError),
    Hostile("loss-scale-backoff-one", config(loss_scale_backoff=1.0),
            ("0 < loss_scale_backoff < 1", "found 1.0", "set e.g. loss_scale_backoff = 0.5"),
            pf.ConfigError),
    Hostile("loss-scale-interval-zero", config(loss_scale_interval=0),
            "Config.loss_scale_interval must be a positive integer, found 0", pf.ConfigError),
    Hostile("recompute-int", config(recompute=5),
            "Config.recompute must be a policy (none, selective, every:k", pf.ConfigError),
    Hostile("recompute-every-zero", config(recompute="every:0"),
            "needs a whole number k >= 1, found 'every:0'", pf.ConfigError),
    Hostile("recompute-list-length", config(pipeline=2, recompute=["full"]),
            "lists 1 policies ['full'] for 2 pipeline stages", pf.ConfigError),
    Hostile("activation-budget-negative", config(activation_budget_mb=-1),
            "Config.activation_budget_mb must be a finite number >= 0, found -1",
            pf.ConfigError),
    Hostile("recompute-auto-without-budget", config(recompute="auto"),
            "set activation_budget_mb", pf.ConfigError),
    Hostile("bucket-zero", config(bucket_mb=0),
            "Config.bucket_mb must be a finite number > 0, found 0", pf.ConfigError),
    Hostile("clip-nan", config(clip=float("nan")),
            "Config.clip must be a norm >= 0 (0 turns clipping off), found nan", pf.ConfigError),
    Hostile("seed-str", config(seed="0"),
            ("Config.seed must be an integer, found '0' (str)", "set seed to a whole number"),
            pf.ConfigError),
    Hostile("seed-bool", config(seed=True),
            "Config.seed must be an integer, found True (bool)", pf.ConfigError),
    Hostile("watchdog-negative", config(watchdog_s=-1),
            ("Config.watchdog_s must be a finite number >= 0 (0 turns the watchdog off)",
             "found -1"), pf.ConfigError),
    Hostile("watchdog-str", config(watchdog_s="5m"),
            "Config.watchdog_s must be a finite number >= 0", pf.ConfigError),
    Hostile("max-nonfinite-negative", config(max_nonfinite_steps=-1),
            "Config.max_nonfinite_steps must be an integer >= 0, found -1", pf.ConfigError),
    Hostile("max-nonfinite-float", config(max_nonfinite_steps=1.5),
            "Config.max_nonfinite_steps must be an integer >= 0, found 1.5 (float)",
            pf.ConfigError),
    Hostile("unknown-key", lambda tmp: pf.Config.from_dict({"pipelines": 2}),
            ("unknown engine setting(s) ['pipelines']", "did you mean 'pipeline'?",
             "remove or rename them"), pf.ConfigError),
    Hostile("settings-not-a-table", lambda tmp: pf.Config.from_dict(["pipeline", 2]),
            "engine settings must be a table of name = value, found list", pf.ConfigError),
    Hostile("toml-schedule-int", toml("[engine]\nschedule = 3\n"),
            ("run.toml: [engine] Config.schedule must be a string", "found 3 (int)"),
            pf.ConfigError),
    Hostile("toml-pipeline-str", toml('[engine]\npipeline = "2"\n'),
            ("run.toml: [engine] Config.pipeline must be a positive integer", "found '2'"),
            pf.ConfigError),
    Hostile("toml-unknown-key", toml("[engine]\nmicro_batches = 4\n"),
            ("run.toml: [engine] unknown engine setting(s) ['micro_batches']",
             "did you mean 'microbatches'?"), pf.ConfigError),
    Hostile("toml-syntax", toml("[engine]\npipeline = = 2\n"),
            ("run.toml' is not valid TOML", "line 2"), pf.ConfigError),
    Hostile("table-from-a-named-file",
            lambda tmp: pf.Config.from_dict({"initial_loss_scale": "big"}, source="run.toml"),
            "run.toml: [engine] Config.initial_loss_scale must be a finite number",
            pf.ConfigError),
    Hostile("toml-missing-file", lambda tmp: pf.Config.load(tmp / "absent.toml"),
            ("absent.toml", "not found"), pf.ConfigError),
]


# -- checkpoints --------------------------------------------------------------------------

def _engine() -> pf.Engine:
    return pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(microbatches=2))


def _saved(tmp: Path) -> Path:
    """A whole checkpoint of a trained step in `tmp/ckpt`; returns its step folder."""
    engine = _engine()
    engine.train_step(*batches(1, 4)[0])
    folder = Path(engine.save(tmp / "ckpt"))
    engine.close()
    return folder


def _load(path: Path) -> None:
    engine = _engine()
    try:
        engine.load(path)
    finally:
        engine.close()


def damaged(damage: Callable[[Path], Any]) -> Callable[[Path], Any]:
    """Save a checkpoint, `damage(step_folder)`, then load it through `latest`."""
    def act(tmp: Path) -> None:
        damage(_saved(tmp))
        _load(tmp / "ckpt")
    return act


def _flip(path: Path, offset: int = 512, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _without_checksums(folder: Path) -> None:
    """Make the checkpoint look like one of format 1 (no checksums to verify)."""
    meta = json.loads((folder / "engine.json").read_text())
    for key in ("checksums", "sha256", "model"):      # what format 1 lacks
        del meta[key]
    meta["format"] = 1
    (folder / "engine.json").write_text(json.dumps(meta))


class _Payload:
    def __reduce__(self):
        return (os.getcwd, ())          # would run on an unrestricted torch.load


def _code_in_shard(folder: Path) -> None:
    _without_checksums(folder)
    torch.save({"params": {}, "optim": {}, "groups": {}, "x": _Payload()},
               folder / "layer-00000.pt")


def _save_into_file(tmp: Path) -> None:
    (tmp / "ckpt").write_text("not a folder")
    engine = _engine()
    try:
        engine.save(tmp / "ckpt")
    finally:
        engine.close()


CHECKPOINT = [
    Hostile("shard-64-bytes-flipped", damaged(lambda f: _flip(f / "layer-00003.pt")),
            ("layer-00003.pt", "fails its checksum", "load an earlier checkpoint"),
            CheckpointError),
    Hostile("shard-truncated", damaged(lambda f: _truncate(f / "layer-00002.pt")),
            ("layer-00002.pt", "fails its checksum", "truncated"), CheckpointError),
    Hostile("shard-missing", damaged(lambda f: (f / "layer-00001.pt").unlink()),
            ("layer-00001.pt", "cannot read", "incomplete"), CheckpointError),
    Hostile("engine-json-truncated", damaged(lambda f: _truncate(f / "engine.json")),
            ("engine.json", "truncated or corrupt"), CheckpointError),
    Hostile("engine-json-not-ours", damaged(lambda f: (f / "engine.json").write_text("[]")),
            ("engine.json", "lacks 'step' and 'n_layers'"), CheckpointError),
    Hostile("rng-flipped", damaged(lambda f: _flip(f / "rng-rank00000.pt", offset=200)),
            ("rng-rank00000.pt", "fails its checksum"), CheckpointError),
    Hostile("old-format-shard-truncated",
            damaged(lambda f: (_without_checksums(f), _truncate(f / "layer-00004.pt"))),
            ("layer-00004.pt", "cannot read", "truncated or corrupt"), CheckpointError),
    Hostile("shard-runs-code", damaged(_code_in_shard),
            ("layer-00000.pt", "cannot read", "UnpicklingError"), CheckpointError),
    Hostile("latest-names-deleted-folder",
            damaged(lambda f: (f.parent / "latest").write_text("step-00000099")),
            ("step-00000099", "named by", "incomplete or missing",
             "whole checkpoints here: ['step-00000001']"), CheckpointError),
    Hostile("load-missing-folder", lambda tmp: _load(tmp / "nowhere"),
            ("no checkpoint in", "nowhere", "the folder does not exist"), CheckpointError),
    Hostile("save-into-a-file", _save_into_file,
            ("rank 0 (stage 0 of 1", "the checkpoint folder", "ckpt", "is a file"),
            CheckpointError),
    Hostile("save-dir-below-a-file", lambda tmp: (
        (tmp / "f").write_text("x"), check_save_dir(tmp / "f" / "ckpt")),
        ("cannot create checkpoints in", "is not a writable folder"), CheckpointError),
]

# -- engine calls --------------------------------------------------------------------------

def _other_tensors(tmp: Path) -> None:
    mine = torch.nn.Linear(2, 2)            # a model of the user's own, not the engine's
    pf.Engine(toy_layers(), loss_fn, lambda params: torch.optim.SGD(mine.parameters(), lr=0.1),
              pf.Config())


def _some_of_them(tmp: Path) -> None:
    pf.Engine(toy_layers(), loss_fn, lambda params: torch.optim.SGD(list(params)[:3], lr=0.1),
              pf.Config())


def _step(**side: Any) -> Callable[[Path], Any]:
    def act(tmp: Path) -> None:
        engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(microbatches=2))
        try:
            engine.train_step(*batches(1, 8)[0], **side)
        finally:
            engine.close()
    return act


def _after_close(tmp: Path) -> None:
    engine = _engine()
    engine.close()
    engine.train_step(*batches(1, 4)[0])


API = [
    Hostile("optimizer-over-other-tensors", _other_tensors,
            ("the optimizer must step exactly the parameters its factory is given",
             "of which 2 are other tensors", "build it over the `params` argument"),
            pf.ConfigError),
    Hostile("optimizer-over-some-of-them", _some_of_them,
            ("the optimizer must step exactly the parameters", "misses"), pf.ConfigError),
    Hostile("side-input-fewer-rows", _step(mask=torch.ones(2, 5)),
            ("side input 'mask' has 2 rows", "the batch has 8", "one row per sample"),
            pf.BatchError),
    Hostile("call-after-close", _after_close,
            ("train_step() on a closed engine", "build a new Engine"), pf.ConfigError),
]

CASES = CONFIG + CHECKPOINT + API


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_gives_a_clear_error(case: Hostile, tmp_path: Path):
    with pytest.raises(case.error) as caught:
        case.action(tmp_path)
    message = str(caught.value)
    fragments = (case.expected,) if isinstance(case.expected, str) else case.expected
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_the_table_is_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


def test_limits_at_their_edge_are_accepted(monkeypatch):
    monkeypatch.delenv("PIPEFLOW_WATCHDOG_S", raising=False)     # the suite sets its own
    config = pf.Config(watchdog_s=0, max_nonfinite_steps=0, clip=0, seed=-3,
                       partition=[0, 7], schedule="GPipe", initial_loss_scale=1)
    assert (config.watchdog_s, config.max_nonfinite_steps, config.schedule) == (0, 0, "gpipe")
    assert pf.Config().watchdog_s == 300.0 and pf.Config().max_nonfinite_steps == 3
    assert pf.Config(schedule="interleaved", virtual_stages=2, pipeline=2,
                     microbatches=2).pipeline == 2


def test_the_watchdog_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PIPEFLOW_WATCHDOG_S", "42")
    assert pf.Config().watchdog_s == 42.0 and pf.Config(watchdog_s=7).watchdog_s == 7
    monkeypatch.setenv("PIPEFLOW_WATCHDOG_S", "5m")
    with pytest.raises(pf.ConfigError, match=r"PIPEFLOW_WATCHDOG_S must be a number of "
                                             r"seconds .*found '5m'"):
        pf.Config()
    monkeypatch.setenv("PIPEFLOW_WATCHDOG_S", "-1")
    with pytest.raises(pf.ConfigError, match="Config.watchdog_s must be a finite number >= 0"):
        pf.Config()


def test_the_wait_policy_default_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("PIPEFLOW_WAIT", raising=False)
    assert pf.Config().wait == "auto"
    monkeypatch.setenv("PIPEFLOW_WAIT", "yield")
    assert pf.Config().wait == "yield" and pf.Config(wait="spin").wait == "spin"
    monkeypatch.setenv("PIPEFLOW_WAIT", "polite")
    with pytest.raises(pf.ConfigError, match=r"PIPEFLOW_WAIT must be one of \['auto', 'spin', "
                                             r"'yield'\]; found 'polite'"):
        pf.Config()
