"""`Config`: one field per knob of the engine, loaded from and saved to TOML."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from typing import Any, Mapping, NoReturn, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
import tomli_w

from pipeflow.schedules import registry as schedule_registry

__all__ = ["Config", "ConfigError", "SCHEDULES", "PARTITIONS", "POLICIES", "parse_policy",
           "normalise_policy", "read_toml"]

SCHEDULES = (*schedule_registry.names(), "auto")
PARTITIONS = ("uniform", "parameters", "time")
PRECISIONS = ("fp32", "bf16", "fp16")
BACKENDS = ("mpi", "nccl", "gloo", "auto", "strict")
WAITS = ("auto", "spin", "yield")
BATCHES = ("global", "local")


class ConfigError(ValueError):
    """A configuration value that the engine cannot run; the message says what to change."""


def _env_choice(name: str, default: str, allowed: tuple) -> str:
    """A default from the environment variable `name`, if set: one of `allowed`."""
    raw = os.environ.get(name, "").strip()
    if raw and raw not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}; found {raw!r}. Set it to "
                          f"one of those, or unset it for the default {default!r}")
    return raw or default


def _env_flag(name: str, default: bool) -> bool:
    """A default on/off from the environment variable `name`, if set: 1/0, true/false."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise ConfigError(f"{name} must be 1 or 0; found {raw!r}. Set it to 1 (on) or 0 "
                          f"(off), or unset it for the default {int(default)}")
    return raw in ("1", "true", "yes", "on")


def _env_seconds(name: str, default: float) -> float:
    """A default in seconds from the environment variable `name`, if set."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds (0: no limit); "
                          f"found {raw!r}. Set it to e.g. 600, or unset it for the default "
                          f"{default:g}") from None


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
    # tensor-parallel ranks of every stage (consecutive ranks: one node): each layer's tp_plan
    # cuts its matrices over them (docs/design.md, "The tensor axis"); world = p · d · t
    tensor: int = 1
    # with tensor > 1: norms, dropout and residuals of the cut layers run on this rank's
    # slice of the sequence (Korthikanti et al. 2022), their activations 1/tensor as large
    sequence_parallel: bool = False
    microbatches: int = 1      # micro-batches per step: the gradient accumulation
    # a registered schedule (`pipeflow schedule --list`), or "auto": the fastest that fits
    # activation_budget_mb, simulated from F, B and W measured on the Engine's `sample`
    schedule: str = "1f1b"
    virtual_stages: int = 1    # model chunks per rank; >= 2 with schedule "interleaved"
    partition: str | list[int] = "uniform"
    precision: str = "fp32"    # "fp32", or "bf16"/"fp16" working weights with fp32 masters
    # Module classes kept in fp32 under bf16/fp16, by class-name suffix ("RMSNorm" covers
    # LlamaRMSNorm) or, from Python, by type; their buffers (rotary inv_freq) stay fp32 too.
    fp32_modules: list[str] = dataclasses.field(
        default_factory=lambda: ["LayerNorm", "RMSNorm", "RotaryEmbedding"])
    # fp16 only: the dynamic loss scale the run starts from (the current one, which moves
    # with overflows and good steps, is `Engine.loss_scale`)
    initial_loss_scale: float = 65536.0
    loss_scale_growth: float = 2.0       # x this after `loss_scale_interval` good steps
    loss_scale_backoff: float = 0.5      # x this after an overflow (the step is skipped)
    loss_scale_interval: int = 2000
    loss_scale_min: float = 1.0
    # "none", "full", "every:k", "selective", "auto", or a list with one policy per stage
    recompute: str | list[str] = "none"
    activation_budget_mb: float = 0.0    # per rank, for recompute and schedule = "auto"
    # What recompute = "selective" checkpoints: module classes by name suffix (e.g.
    # ["LlamaAttention"]), besides modules marked `pipeflow_selective = True`.
    recompute_modules: list[str] = dataclasses.field(default_factory=list)
    # "auto" (NCCL when every rank has a GPU of its own, MPI otherwise), "mpi", "nccl";
    # "gloo" runs the torch.distributed path on CPUs (tests); "strict": MPI under NCCL's rules
    backend: str = "auto"
    free_sent_outputs: bool = True   # free an activation's storage once it is sent; the
                                     # stash keeps its graph (Megatron-Core's deallocation)
    # On CPUs under a split-backward (zero-bubble) schedule, keep what malloc frees for
    # reuse instead of faulting it in again every step (pipeflow.runtime.hostmem); glibc only
    keep_host_memory: bool = True
    bucket_mb: float = 25.0    # gradient all-reduce bucket size, MiB
    # The dtype gradients cross the data group in: "fp32" (exact, the default), or "bf16" /
    # "fp16" (half the bytes; Megatron-Core's default is bf16). Accumulation over micro-batches
    # and the optimizer stay fp32 either way: each bucket is cast for the reduction only.
    # MPI sums fp16 but has no bf16 sum: bf16 needs the NCCL (or gloo) backend.
    grad_reduce_dtype: str = "fp32"
    clip: float = 0.0          # clip gradients to this global norm; 0 turns clipping off
    # The distributed optimizer (ZeRO-1): with data > 1, each replica keeps the fp32 masters and
    # optimizer state of 1/data of its stage's parameters; gradients are reduce-scattered and
    # the working weights all-gathered (pipeflow.runtime.shard). Per-element optimizers only.
    shard_optimizer: bool = False
    # torch.compile each layer (`nn.Module.compile`, names and state dicts unchanged): false
    # (eager, the default), true (the "inductor" backend) or a torch.compile backend's name
    # ("aot_eager", ...). Compiled when first run, on every rank for its layers. CUDA-graph
    # backends and modes ("cudagraphs", "reduce-overhead") are refused: see `_check_compile`.
    compile: bool | str = False
    seed: int = 0              # layer i is built under a seed derived from (seed, i)
    # What train_step/eval_step are given: "global", the whole global batch on every rank
    # (each replica takes its rows; replicas given different values are refused), or
    # "local", each replica only its own B/d rows, as DistributedDataParallel takes them
    # (`pipeflow train` feeds local batches)
    batch: str = "global"
    # abort when no instruction completes for this long; 0: off. The default, 300 s, can be
    # set for every engine of a job by PIPEFLOW_WATCHDOG_S (a site's or a test suite's choice)
    watchdog_s: float = dataclasses.field(
        default_factory=lambda: _env_seconds("PIPEFLOW_WATCHDOG_S", 300.0))
    # Every engine call that needs all ranks (train_step, eval_step, save, load,
    # gather_state_dict, close) starts with an agreement; a rank not there within agree_s
    # seconds (one that skipped the call, `if rank == 0: engine.save(d)`) ends the job, named.
    # 0: no limit (the watchdog still applies). PIPEFLOW_AGREE_S sets it for a whole job.
    agree_s: float = dataclasses.field(
        default_factory=lambda: _env_seconds("PIPEFLOW_AGREE_S", 30.0))
    # Deterministic kernels (torch.use_deterministic_algorithms, and cuBLAS's workspace set
    # for it): on a GPU, bit-for-bit claims (resume, recompute, replicas) need it; some ops
    # get slower, and one without a deterministic kernel raises. CPUs are deterministic.
    # PIPEFLOW_DETERMINISTIC=1 sets the default for every engine of a job (the GPU test
    # scripts do, for their bit-for-bit claims).
    deterministic: bool = dataclasses.field(
        default_factory=lambda: _env_flag("PIPEFLOW_DETERMINISTIC", False))
    max_nonfinite_steps: int = 3   # abort after this many non-finite steps in a row
    # How a rank waits on MPI (pipeflow.comm.waiting): "spin" inside MPI, "yield" its core between
    # tests, or "auto": yield where a node runs more ranks than it has cores, else spin.
    # PIPEFLOW_WAIT sets the default for every engine of a job.
    wait: str = dataclasses.field(
        default_factory=lambda: _env_choice("PIPEFLOW_WAIT", "auto", WAITS))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; a `ConfigError` names the field, what it needs and what to set."""
        for name in ("pipeline", "data", "tensor", "microbatches", "virtual_stages"):
            _integer(name, getattr(self, name), 1)
        self.schedule = _choice("schedule", self.schedule, SCHEDULES)
        self._check_schedule()
        self._check_partition()
        self.precision = _choice("precision", self.precision, PRECISIONS)
        for name in ("fp32_modules", "recompute_modules"):
            value = getattr(self, name)
            if not (isinstance(value, (list, tuple))
                    and all(isinstance(n, (str, type)) for n in value)):
                _fail(name, "a list of module class names", value,
                      f'set e.g. {name} = ["LayerNorm"], or [] for none')
            setattr(self, name, list(value))
        self._check_loss_scale()
        self._check_recompute()
        self.backend = _choice("backend", self.backend, BACKENDS)
        _number("bucket_mb", self.bucket_mb, 0.0, strict=True)
        self.grad_reduce_dtype = _choice("grad_reduce_dtype", self.grad_reduce_dtype,
                                         PRECISIONS)
        _number("clip", self.clip, 0.0, hint="0 turns clipping off", what="a norm")
        _integer("seed", self.seed, None)
        _check_compile(self.compile)
        for name in ("free_sent_outputs", "keep_host_memory", "deterministic",
                     "shard_optimizer", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "true or false", getattr(self, name),
                      f"set {name} = true (the default) or false")
        if self.sequence_parallel and self.tensor == 1:
            _fail("sequence_parallel", "false with tensor = 1 (it cuts the sequence over the "
                  "tensor group)", self.sequence_parallel,
                  "set tensor > 1, or sequence_parallel = false")
        if self.shard_optimizer and self.sequence_parallel and self.data > 1:
            _fail("shard_optimizer", "false with sequence_parallel (the sharded optimizer "
                  "reduce-scatters gradients during the backward, before the whole weights of "
                  "cut layers are summed over the tensor group)", self.shard_optimizer,
                  "set shard_optimizer = false, or sequence_parallel = false")
        _number("watchdog_s", self.watchdog_s, 0.0, hint="0 turns the watchdog off")
        _number("agree_s", self.agree_s, 0.0, hint="0 waits without a limit")
        _integer("max_nonfinite_steps", self.max_nonfinite_steps, 0)
        self.wait = _choice("wait", self.wait, WAITS)
        self.batch = _choice("batch", self.batch, BATCHES)

    def _check_schedule(self) -> None:
        """The schedule's own constraints (`ScheduleSpec.problem`), and its chunks per rank."""
        v = self.virtual_stages
        if self.schedule == "auto":
            if v != 1:
                raise ConfigError(f"schedule 'auto' chooses the model chunks per rank with the "
                                  f"schedule, found virtual_stages = {v}; leave virtual_stages "
                                  f"= 1 or name a schedule ('interleaved' with {v})")
            return
        spec = schedule_registry.get(self.schedule)
        problem = spec.problem(self.pipeline, self.microbatches, v)
        if problem:
            raise ConfigError(problem)
        self.virtual_stages = spec.resolve_chunks(v)

    def _check_partition(self) -> None:
        if isinstance(self.partition, str):
            _one_of("partition", self.partition, PARTITIONS,
                    hint="or a list of stage boundaries [0, b1, ..., n_layers]")
            return
        bounds = self.partition
        if not (isinstance(bounds, (list, tuple)) and len(bounds) >= 2
                and all(_is_int(b) for b in bounds) and bounds[0] == 0
                and all(a < b for a, b in zip(bounds, bounds[1:]))):
            _fail("partition", f"one of {list(PARTITIONS)} or a list of increasing stage "
                  f"boundaries [0, b1, ..., n_layers]", bounds,
                  "give each stage at least one layer, e.g. partition = [0, 3, 7]")
        self.partition = list(bounds)

    def _check_loss_scale(self) -> None:
        _number("loss_scale_min", self.loss_scale_min, 0.0, strict=True)
        _number("initial_loss_scale", self.initial_loss_scale, self.loss_scale_min,
                hint="at least loss_scale_min")
        _number("loss_scale_growth", self.loss_scale_growth, 1.0)
        _number("loss_scale_backoff", self.loss_scale_backoff, 0.0, strict=True)
        if self.loss_scale_backoff >= 1:
            _fail("loss_scale_backoff", "a factor with 0 < loss_scale_backoff < 1",
                  self.loss_scale_backoff, "set e.g. loss_scale_backoff = 0.5")
        _integer("loss_scale_interval", self.loss_scale_interval, 1)

    def _check_recompute(self) -> None:
        policies = parse_policy(self.recompute, self.pipeline)
        _number("activation_budget_mb", self.activation_budget_mb, 0.0)
        if "auto" in policies and not self.activation_budget_mb > 0:
            raise ConfigError(
                f"Config.recompute 'auto' chooses each stage's policy to fit a memory budget: "
                f"set activation_budget_mb (MiB of stashed activations per rank), found "
                f"{self.activation_budget_mb!r}")
        if isinstance(self.recompute, tuple):
            self.recompute = list(self.recompute)

    # -- TOML ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str | os.PathLike | None = None
                  ) -> "Config":
        """A validated `Config` from a table of settings; `source`, the file the table came
        from, starts every error message (`run.toml: [engine] Config.pipeline must ...`)."""
        try:
            return cls._from_dict(values)
        except ConfigError as e:
            if source is None:
                raise
            raise ConfigError(f"{os.fspath(source)}: [engine] {e}") from None

    @classmethod
    def _from_dict(cls, values: Mapping[str, Any]) -> "Config":
        if not isinstance(values, Mapping):
            raise ConfigError(f"engine settings must be a table of name = value, found "
                              f"{type(values).__name__}: {values!r}")
        refuse_renamed(values, toml=True)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known), key=str)
        if unknown:
            close = {u: difflib.get_close_matches(str(u), known, n=1) for u in unknown}
            hints = "; ".join(f"{u!r}: did you mean {c[0]!r}?" for u, c in close.items() if c)
            raise ConfigError(
                f"unknown engine setting(s) {unknown}; known settings are {sorted(known)}"
                + (f" ({hints})" if hints else "") + "; remove or rename them")
        return cls(**dict(values))

    def to_toml(self, **tables: Mapping[str, Any]) -> str:
        """The `[engine]` table, followed by any other `tables` (a run file's `[model]` and
        `[train]`, as `pipeflow train` reads them)."""
        return tomli_w.dumps({"engine": self.to_dict(), **tables})

    def save(self, path: str | os.PathLike) -> None:
        from pipeflow._io import atomic_write_bytes
        atomic_write_bytes(path, self.to_toml().encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Config":
        """Read the `[engine]` table of a TOML file (or its top level when it has none).

        Every error names the file: a missing file, bad TOML, a wrong type or value.
        """
        doc = read_toml(path)
        return cls.from_dict(doc.get("engine", doc), source=os.fspath(path))


# Fields that were renamed: old name -> (new name, why). The old name is refused, named, in
# `Config(...)`, `dataclasses.replace`, an `[engine]` table and `--set engine.NAME=...`.
RENAMED = {"loss_scale": ("initial_loss_scale", "it is the scale fp16 training starts from; "
                          "the current one is `engine.loss_scale`")}


def refuse_renamed(values: Mapping[str, Any], toml: bool) -> None:
    """A ConfigError for the first old name among `values` (an `[engine]` table's keys, or
    `Config`'s keyword arguments), naming the new one."""
    for old in values:
        if old in RENAMED:
            new, why = RENAMED[old]
            value = values[old]
            write = f"{new} = {tomli_w.dumps({new: value}).split('=', 1)[1].strip()}" if toml \
                else f"Config({new}={value!r})"
            where = "" if toml else f"Config({old}=...): "
            raise ConfigError(f"{where}{old!r} was renamed {new!r} ({why}); write {write}")


_dataclass_init = Config.__init__


def _init(self: Config, *args: Any, **kwargs: Any) -> None:
    refuse_renamed(kwargs, toml=False)
    _dataclass_init(self, *args, **kwargs)


_init.__doc__, _init.__wrapped__ = _dataclass_init.__doc__, _dataclass_init  # type: ignore
Config.__init__ = _init  # type: ignore[method-assign]


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML file as a dict; every problem a `ConfigError` naming the file and the fix."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {where!r} not found: check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {where!r} is a folder, expected a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {where!r} is not valid TOML: {exc}; fix the line "
                          f"named") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {where!r} is not UTF-8 text (byte {exc.start}: "
                          f"{exc.reason}); TOML files are UTF-8: save it as UTF-8") from None


# torch.compile backends and modes that replay CUDA graphs out of static buffers.
CUDA_GRAPH_COMPILES = ("cudagraphs", "reduce-overhead", "max-autotune")


def _check_compile(value: Any) -> None:
    """`Config.compile`: a bool or a backend's name, never one that replays CUDA graphs. A
    graph's outputs live in static buffers that its next replay overwrites; a stage runs one
    layer for several micro-batches before their backward (the stash holds each output) and
    NCCL reads a sent output asynchronously, so a replay would overwrite outputs still
    stashed or in flight."""
    if not isinstance(value, (bool, str)) or value == "":
        _fail("compile", 'true, false or a torch.compile backend\'s name', value,
              'set compile = true (inductor), "aot_eager", or false')
    if isinstance(value, str) and any(g in value.lower() for g in CUDA_GRAPH_COMPILES):
        raise ConfigError(
            f"Config.compile = {value!r} replays CUDA graphs, whose outputs live in static "
            f"buffers overwritten by the next replay; a pipeline stage keeps several "
            f"micro-batches' outputs stashed for their backward and NCCL reads sent outputs "
            f"asynchronously, so they would be overwritten while still in use. Use compile = "
            f"true (inductor without CUDA graphs) or \"aot_eager\"")


def _fail(name: str, expected: str, value: Any, change: str) -> NoReturn:
    raise ConfigError(f"Config.{name} must be {expected}, found {value!r} "
                      f"({type(value).__name__}); {change}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(name: str, value: Any, minimum: int | None) -> None:
    if _is_int(value) and (minimum is None or value >= minimum):
        return
    if minimum is None:
        _fail(name, "an integer", value, f"set {name} to a whole number, e.g. {name} = 0")
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    _fail(name, expected, value, f"set {name} to a whole number >= {minimum}")


def _number(name: str, value: Any, minimum: float, strict: bool = False,
            hint: str = "", what: str = "a finite number") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        bound = f"{'>' if strict else '>='} {minimum:g}"
        extra = f" ({hint})" if hint else ""
        _fail(name, f"{what} {bound}{extra}", value,
              f"set {name} to a number {bound}")


def _choice(name: str, value: Any, allowed: tuple) -> str:
    if not isinstance(value, str):
        _fail(name, f"a string, one of {list(allowed)}", value,
              f'set {name} = "{allowed[0]}" (quoted)')
    _one_of(name, value.lower(), allowed)
    return value.lower()


def _one_of(name: str, value: Any, allowed: tuple, hint: str = "") -> None:
    if value not in allowed:
        extra = f" ({hint})" if hint else ""
        raise ConfigError(f"Config.{name} must be one of {list(allowed)}, found {value!r}{extra}")


# -- recomputation policies (parsed here so the config needs no torch) --------------------

# Cheapest in compute first. `every:k` and `full` both recompute the whole stage forward once
# in the backward (every segment is rerun), so they cost the same FLOPs and differ in memory.
POLICIES = ("none", "selective", "every:k", "full", "auto")
_NAMED = ("none", "selective", "full", "auto")


def parse_policy(spec: str | Sequence[str], stages: int) -> list[str]:
    """`Config.recompute` -> one normalised policy per stage.

    `spec` is one policy for every stage or a list with one per stage. A policy is `"none"`,
    `"full"`, `"every:k"` (k >= 1), `"selective"` or `"auto"`; `"auto"` is returned as is and
    resolved on its stage by `choose_auto` (or `auto_policy`) once the stage can be measured.
    """
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"stages must be a positive integer, found {stages!r}")
    if isinstance(spec, str):
        return [normalise_policy(spec)] * stages
    if not isinstance(spec, (list, tuple)):
        raise ConfigError(
            f"Config.recompute must be a policy {_expected()} or a list of {stages} of them "
            f"(one per stage), found {type(spec).__name__}: {spec!r}")
    if len(spec) != stages:
        raise ConfigError(
            f"Config.recompute lists {len(spec)} policies {list(spec)} for {stages} pipeline "
            f"stages; give exactly one per stage, or a single policy for all")
    return [normalise_policy(p, stage=s) for s, p in enumerate(spec)]


def _expected() -> str:
    return "(none, selective, every:k with k >= 1, full or auto)"


def normalise_policy(policy: Any, stage: int | None = None) -> str:
    """One recomputation policy in its canonical form (`" Every:02 "` -> `"every:2"`)."""
    where = f" for stage {stage}" if stage is not None else ""
    if not isinstance(policy, str):
        raise ConfigError(f"Config.recompute{where} must be a policy {_expected()}, found "
                          f"{type(policy).__name__}: {policy!r}")
    p = policy.strip().lower()
    if p in _NAMED:
        return p
    if p.startswith("every:"):
        k = p.split(":", 1)[1].strip()
        if not k.lstrip("+").isdigit() or int(k) < 1:
            raise ConfigError(
                f"Config.recompute{where}: 'every:k' checkpoints every k consecutive layers "
                f"and needs a whole number k >= 1, found {policy!r}")
        return f"every:{int(k)}"
    raise ConfigError(f"Config.recompute{where} must be a policy {_expected()}, found {policy!r}")
