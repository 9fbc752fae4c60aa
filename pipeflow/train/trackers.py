"""Where a run's metrics go, rank 0 only: `[train] trackers = ["jsonl", "tensorboard", "wandb"]`.

One small interface (`Tracker`: `log(record)` with the record's `"step"`, `close()`), one
class a backend, and one row a backend in `TRACKERS`: its constructor from the run's `[train]`
table, and the package and extra it needs. Adding a tracker is a class and a row. Each gets
every record the JSONL file holds; TensorBoard and W&B take its numbers as scalars (nested
tables such as `stages` and `memory` stay in the JSONL). A tracker whose package is missing is
refused before the engine is built, naming the extra.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import os
import dataclasses
from typing import Any, Callable, Protocol

from pipeflow._io import atomic_write_bytes
from pipeflow.config import ConfigError

__all__ = ["Tracker", "TrackerKind", "TRACKERS", "check_trackers", "check_tracker_paths",
           "open_trackers",
           "JsonlTracker", "TensorBoardTracker", "WandbTracker"]


class Tracker(Protocol):
    """A destination of metric records."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool)}


def strict_record(record: dict[str, Any]) -> dict[str, Any]:
    """`record` as strict JSON can hold it: each non-finite number (NaN, ±Infinity, which
    `json.dumps` would write bare and strict parsers such as `jq` refuse) becomes null, and
    `"nonfinite"` lists where, as dotted paths with the value's name (`{"loss": "nan"}`,
    `{"stages.1.bubble": "inf"}`)."""
    found: dict[str, str] = {}

    def clean(value: Any, path: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            found[path] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{path}.{i}") for i, v in enumerate(value)]
        return value

    out = clean(record, "")
    if found:
        out["nonfinite"] = found
    return out


def _records_before(path: str, step: int) -> bytes:
    """The lines of the JSONL file `path` whose record's step is before `step` (records
    without a step kept); a line torn by a kill mid-write is dropped."""
    kept = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            if not isinstance(record.get("step"), int) or record["step"] < step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    return b"".join(kept)


class JsonlTracker:
    """One JSON line a record. A run resumed at step `resumed_at` keeps the records of the
    steps before it and appends its own: the records of later steps, which a run killed after
    its last checkpoint had logged and the resumed run logs again, are dropped (as
    TensorBoard's `purge_step`), so each step is in the file once."""

    @classmethod
    def for_run(cls, train: Any, config: dict[str, Any],
                resumed_at: int | None) -> "JsonlTracker":
        return cls(_jsonl_path(train), resumed_at)

    def __init__(self, path: str, resumed_at: int | None = None) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        if resumed_at is not None and os.path.isfile(path):
            atomic_write_bytes(path, _records_before(path, resumed_at))
        self.file = open(path, "a" if resumed_at is not None else "w", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(strict_record(record), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardTracker:
    """TensorBoard event files (`torch.utils.tensorboard`), one scalar a number at its step.
    A run resumed at step `resumed_at` hides the events of that step and later ones that
    earlier event files hold (`purge_step`), as the JSONL drops their records."""

    @classmethod
    def for_run(cls, train: Any, config: dict[str, Any],
                resumed_at: int | None) -> "TensorBoardTracker":
        return cls(_tensorboard_folder(train), resumed_at)

    def __init__(self, folder: str, resumed_at: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.path = folder
        self.writer = SummaryWriter(folder, purge_step=resumed_at)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (`WANDB_MODE=offline` writes it locally, for `wandb sync`)."""

    @classmethod
    def for_run(cls, train: Any, config: dict[str, Any],
                resumed_at: int | None) -> "WandbTracker":
        return cls(train.wandb_project, _folder(train), config)

    def __init__(self, project: str, folder: str, config: dict[str, Any]) -> None:
        import wandb
        os.makedirs(folder, exist_ok=True)
        self.run = wandb.init(project=project, dir=folder, config=config)
        self.path = self.run.dir

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _folder(train: Any) -> str:
    """Where a tracker writes unless told: the run's save_dir, else the working folder."""
    return train.save_dir or "."


@dataclasses.dataclass(frozen=True)
class TrackerKind:
    """A row of `TRACKERS`: how to open the tracker for a run, and what it needs."""

    # (the run's [train] table, every table as plain values, the step a resumed run starts
    # at or None) -> Tracker
    open: Callable[[Any, dict[str, Any], int | None], Tracker]
    module: str | None = None     # the package it imports, checked before the run starts
    extra: str | None = None      # the pipeflow extra that installs it


TRACKERS: dict[str, TrackerKind] = {
    "jsonl": TrackerKind(JsonlTracker.for_run),
    "tensorboard": TrackerKind(TensorBoardTracker.for_run, "tensorboard", "monitor"),
    "wandb": TrackerKind(WandbTracker.for_run, "wandb", "wandb"),
}


def check_trackers(names: list[str]) -> None:
    """Known names with their packages installed; a ConfigError naming the fix otherwise."""
    for name in names:
        if name not in TRACKERS:
            close = difflib.get_close_matches(str(name), list(TRACKERS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"[train] trackers: unknown tracker {name!r}; {hint}known: "
                              f"{sorted(TRACKERS)}")
        kind = TRACKERS[name]
        if kind.module is None:
            continue
        try:
            importlib.import_module(kind.module)
        except ImportError:
            install = f"pip install \"pipeflow[{kind.extra}]\" (or pip install " \
                f"{kind.module})" if kind.extra else f"pip install {kind.module}"
            raise ConfigError(f"[train] trackers = [..., {name!r}] needs the {kind.module!r} "
                              f"package: {install}, or remove {name!r} from trackers") from None


def open_trackers(train: Any, config: dict[str, Any],
                  resumed_at: int | None = None) -> dict[str, Tracker]:
    """The trackers `[train]` asks for, by name: `trackers`, plus "jsonl" where `metrics` or
    `save_dir` is set and "tensorboard" where `tensorboard` names a folder (as before
    `trackers` existed). `resumed_at`: the step a resumed run starts at (None: a new run)."""
    return {name: TRACKERS[name].open(train, config, resumed_at) for name in _names(train)}


def _names(train: Any) -> list[str]:
    return list(dict.fromkeys(list(train.trackers)
                              + (["jsonl"] if train.metrics or train.save_dir else [])
                              + (["tensorboard"] if train.tensorboard else [])))


def _jsonl_path(train: Any) -> str:
    return train.metrics or os.path.join(_folder(train), "metrics.jsonl")


def _tensorboard_folder(train: Any) -> str:
    return train.tensorboard or os.path.join(_folder(train), "tensorboard")


def check_tracker_paths(train: Any) -> None:
    """The trackers' files and folders can be written: TensorBoard's folder is a folder (or
    can be made) that takes a file, the JSONL file is no folder. A ConfigError naming the
    field, the path and what to change otherwise, found at start on every rank (not a raw
    OSError on rank 0 once the engine is built)."""
    names = _names(train)
    if "tensorboard" in names:
        folder = _tensorboard_folder(train)
        where = "[train] tensorboard" if train.tensorboard else "[train] trackers " \
            "\"tensorboard\" (in save_dir)"
        problem = _unwritable_folder(folder)
        if problem:
            raise ConfigError(f"{where}: expected a folder TensorBoard can write its event "
                              f"files in, {folder!r} {problem}; choose another folder with "
                              f"[train] tensorboard = \"PATH\" or fix the path's permissions")
    if "jsonl" in names:
        path = _jsonl_path(train)
        where = "[train] metrics" if train.metrics else "[train] save_dir's metrics.jsonl"
        if os.path.isdir(path):
            raise ConfigError(f"{where}: expected a file for the metric records, {path!r} is "
                              f"a folder; name a file with [train] metrics = \"PATH.jsonl\"")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise ConfigError(f"{where}: {path!r} is read-only; fix its permissions or name "
                              f"another file with [train] metrics = \"PATH.jsonl\"")


def _unwritable_folder(folder: str) -> str:
    """Why `folder` cannot take a new file ("is a file", "is read-only ..."), "" if it can."""
    import tempfile
    if os.path.exists(folder) and not os.path.isdir(folder):
        return "is a file"
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"cannot take a file ({exc.strerror or exc})"
    return ""
