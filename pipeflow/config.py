"""`Config`: one field per knob of the engine, loaded from and saved to TOML."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
import tomli_w

__all__ = ["Config", "ConfigError", "SCHEDULES", "PARTITIONS"]

SCHEDULES = ("1f1b", "gpipe", "interleaved")
PARTITIONS = ("uniform", "parameters", "time")
PRECISIONS = ("fp32", "bf16", "fp16")
BACKENDS = ("mpi", "nccl", "gloo", "auto", "strict")


class ConfigError(ValueError):
    """A configuration value that the engine cannot run; the message says what to change."""


@dataclasses.dataclass
class Config:
    """How to run a model: the grid, the schedule, the partition and the numerics.

    `partition` is `"uniform"` (equal layer counts), `"parameters"` (balanced parameter
    counts), `"time"` (balanced forward + backward time, measured on a sample micro-batch) or
    explicit stage boundaries `[0, b1, ..., n_layers]` (stage `s` owns layers `b[s]` to
    `b[s+1] - 1`).
    """

    pipeline: int = 1          # pipeline stages
    data: int = 1              # data-parallel replicas of every stage
    microbatches: int = 1      # micro-batches per step: the gradient accumulation
    schedule: str = "1f1b"     # "1f1b", "gpipe" or "interleaved"
    virtual_stages: int = 1    # model chunks per rank; >= 2 with schedule "interleaved"
    partition: str | list[int] = "uniform"
    precision: str = "fp32"    # "fp32", or "bf16"/"fp16" working weights with fp32 masters
    fp32_modules: list[str] = dataclasses.field(default_factory=lambda: ["LayerNorm"])
    loss_scale: float = 65536.0          # fp16 only: initial dynamic loss scale
    loss_scale_growth: float = 2.0       # x this after `loss_scale_interval` good steps
    loss_scale_backoff: float = 0.5      # x this after an overflow (the step is skipped)
    loss_scale_interval: int = 2000
    loss_scale_min: float = 1.0
    # "none", "full", "every:k", "selective", "auto", or a list with one policy per stage
    recompute: str | list[str] = "none"
    activation_budget_mb: float = 0.0    # per rank, for recompute = "auto"
    # "auto" (NCCL when every rank has a GPU of its own, MPI otherwise), "mpi", "nccl";
    # "gloo" runs the torch.distributed path on CPUs (tests); "strict": MPI under NCCL's rules
    backend: str = "auto"
    bucket_mb: float = 25.0    # gradient all-reduce bucket size, MiB
    clip: float = 0.0          # clip gradients to this global norm; 0 turns clipping off
    seed: int = 0              # layer i is built under a seed derived from (seed, i)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("pipeline", "data", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Config.{name} must be a positive integer, found {value!r}")
        _one_of("schedule", self.schedule.lower(), SCHEDULES)
        self.schedule = self.schedule.lower()
        v = self.virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"Config.virtual_stages must be a positive integer, found {v!r}")
        if self.schedule == "interleaved" and v < 2:
            raise ConfigError("schedule 'interleaved' runs several model chunks per rank: set "
                              "virtual_stages >= 2 (2 halves the bubble)")
        if self.schedule != "interleaved" and v != 1:
            raise ConfigError(f"virtual_stages = {v} needs schedule 'interleaved'; "
                              f"{self.schedule!r} runs one model chunk per rank")
        if self.schedule == "interleaved" and self.microbatches % self.pipeline:
            raise ConfigError(
                f"schedule 'interleaved' runs micro-batches in groups of the {self.pipeline} "
                f"stages: microbatches must be a multiple of {self.pipeline}, found "
                f"{self.microbatches}")
        if isinstance(self.partition, str):
            _one_of("partition", self.partition, PARTITIONS,
                    hint="or a list of stage boundaries [0, b1, ..., n_layers]")
        elif not (isinstance(self.partition, (list, tuple))
                  and all(isinstance(b, int) for b in self.partition)):
            raise ConfigError(
                f"Config.partition must be one of {PARTITIONS} or a list of stage boundaries "
                f"[0, b1, ..., n_layers], found {self.partition!r}")
        else:
            self.partition = list(self.partition)
        _one_of("precision", self.precision, PRECISIONS)
        if not (isinstance(self.fp32_modules, (list, tuple))
                and all(isinstance(n, str) for n in self.fp32_modules)):
            raise ConfigError(f"Config.fp32_modules must be a list of module class names, "
                              f"found {self.fp32_modules!r}")
        self.fp32_modules = list(self.fp32_modules)
        if not (self.loss_scale_min > 0 and self.loss_scale >= self.loss_scale_min
                and self.loss_scale_growth >= 1 and 0 < self.loss_scale_backoff < 1
                and isinstance(self.loss_scale_interval, int) and self.loss_scale_interval >= 1):
            raise ConfigError(
                f"loss scaling needs loss_scale >= loss_scale_min > 0, loss_scale_growth >= 1, "
                f"0 < loss_scale_backoff < 1 and loss_scale_interval >= 1; found "
                f"{self.loss_scale}, {self.loss_scale_min}, {self.loss_scale_growth}, "
                f"{self.loss_scale_backoff}, {self.loss_scale_interval}")
        from pipeflow.recompute import parse_policy   # torch-side module; imported lazily
        policies = parse_policy(self.recompute, self.pipeline)
        if "auto" in policies and not self.activation_budget_mb > 0:
            raise ConfigError(
                f"Config.recompute 'auto' chooses each stage's policy to fit a memory budget: "
                f"set activation_budget_mb (MiB of stashed activations per rank), found "
                f"{self.activation_budget_mb!r}")
        if isinstance(self.recompute, tuple):
            self.recompute = list(self.recompute)
        _one_of("backend", self.backend, BACKENDS)
        if not isinstance(self.bucket_mb, (int, float)) or self.bucket_mb <= 0:
            raise ConfigError(f"Config.bucket_mb must be > 0 MiB, found {self.bucket_mb!r}")
        if not isinstance(self.clip, (int, float)) or self.clip < 0:
            raise ConfigError(f"Config.clip must be a norm >= 0 (0 = off), found {self.clip!r}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"Config.seed must be an integer, found {self.seed!r}")

    # -- TOML ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown engine setting(s) {unknown}; known settings are {sorted(known)}")
        return cls(**dict(values))

    def to_toml(self) -> str:
        return tomli_w.dumps({"engine": self.to_dict()})

    def save(self, path: str | os.PathLike) -> None:
        from pipeflow._io import atomic_write_bytes
        atomic_write_bytes(path, self.to_toml().encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Config":
        """Read the `[engine]` table of a TOML file (or its top level when it has none)."""
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        return cls.from_dict(doc.get("engine", doc))


def _one_of(name: str, value: Any, allowed: tuple, hint: str = "") -> None:
    if value not in allowed:
        extra = f" ({hint})" if hint else ""
        raise ConfigError(f"Config.{name} must be one of {list(allowed)}, found {value!r}{extra}")
