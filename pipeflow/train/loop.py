"""`pipeflow train CONFIG.toml`: a model from the `[model]` table trained on the `[data]`,
with metrics, checkpoints that carry the data position, and a clean stop on SIGTERM."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow._io import atomic_write_bytes
from pipeflow.runtime.checkpoint import (CheckpointError, ModelMismatch, check_save_dir,
                                 read_sealed_json,
                                 resolve_checkpoint, saved_plan, sealed_json, step_name)
from pipeflow.config import Config, ConfigError
from pipeflow.train import hub
from pipeflow.train.export import ExportError, check_target
from pipeflow.runtime.recompute import reads_side_input
from pipeflow.train.data import Batches, load_corpus, packed_positions, token_file
from pipeflow.engine import FAILING_CLOSE_S, Engine
from pipeflow.runtime.failure import report_and_abort, say
from pipeflow.train.metrics import (MetricsLog, clock_text, count_parameters, devices_in_use,
                                    memory_reports, peak_flops, stage_stats)
from pipeflow.train.recipe import lr_at, optimizer_factory, weight_decay_groups
from pipeflow.train.trackers import check_tracker_paths, check_trackers, open_trackers
from pipeflow.train.model_table import Model, build_model
from pipeflow.train.run_config import (DATA_STATE, DataConfig, RunConfig, TrainConfig,
                                       load_run_config)
from pipeflow.train.sample import data_tokenizer, load_tokenizer
from pipeflow.train.trace import write_trace

__all__ = ["TrainConfig", "DataConfig", "RunConfig", "lr_at", "load_run_config",
           "weight_decay_groups", "train", "DATA_STATE"]

BYTE_CORPUS_LIMIT = 10**9    # tokens: a run this long on the built-in corpus is a mistake
STOPPED = "STOPPED"          # in save_dir while a run stopped by a signal has steps to go


def _optimizer(run: TrainConfig) -> Callable:
    return optimizer_factory(run)


# -- run checks that need the file system -------------------------------------------------
def _check_paths(run: TrainConfig) -> None:
    """Found at start, the same on every rank: a save_dir that is a file, a resume with
    nothing to resume from, TensorBoard asked for but not installed."""
    if run.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401  (needs the tensorboard package)
        except ImportError:
            raise ConfigError(f"[train] tensorboard = {run.tensorboard!r} needs the "
                              f"'tensorboard' package: pip install tensorboard (or "
                              f"\"pipeflow[monitor]\"), or set tensorboard = \"\"") from None
    check_trackers(run.trackers)
    check_tracker_paths(run)
    if run.save_dir:              # found now, not at the first save after hours of training
        try:
            check_save_dir(run.save_dir, where="[train] save_dir")
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
    if run.export_hf:             # refused now, not after the run
        try:
            check_target(run.export_hf, run.export_overwrite,
                         avoid=(run.save_dir,) if run.save_dir else (),
                         where="[train] export_hf =")
        except ExportError as exc:
            raise ConfigError(str(exc)) from None
    if run.resume and not os.path.isfile(os.path.join(run.save_dir, "latest")):
        what = "does not exist" if not os.path.exists(run.save_dir) else \
            "holds no checkpoint (no 'latest' file)"
        raise ConfigError(f"--resume: [train] save_dir = {run.save_dir!r} {what}; expected "
                          f"a folder written by an earlier run's checkpoints. Check the path, "
                          f"or drop --resume (resume = false) to start from step 0")


class SaveDirLock:
    """One run per checkpoint folder: rank 0 holds a lock on `save_dir/.pipeflow.lock` for the
    whole run (`fcntl.lockf`: released by the OS when the process ends, however it ends, and
    honoured across NFS clients), and writes its host and PID in it for the refusal."""

    NAME = ".pipeflow.lock"

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, self.NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the run that holds it."""
        import fcntl
        import socket
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"[train] save_dir: cannot create {self.path!r} ({exc}); "
                              f"choose a writable save_dir") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                f"[train] save_dir = {os.path.dirname(self.path)!r} is in use by another run "
                f"({holder}, which holds {self.path!r}); two runs saving into one folder would "
                f"overwrite each other's checkpoints: choose another save_dir, or wait for "
                f"that run to end") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)          # closing releases the lock; the file may stay
            self._fd = None


@contextlib.contextmanager
def _save_dir_locked(run: TrainConfig, comm: MPI.Comm) -> Iterator[None]:
    """The run holds its save_dir's lock (rank 0 takes it; a refusal is raised on every
    rank alike)."""
    if not run.save_dir:
        yield
        return
    lock, problem = SaveDirLock(run.save_dir), None
    if comm.rank == 0:
        try:
            lock.acquire()
        except ConfigError as exc:
            problem = str(exc)
    problem = waiting.bcast(comm, problem, 0)
    if problem:
        raise ConfigError(problem)
    try:
        yield
    finally:
        lock.release()


# -- data ------------------------------------------------------------------------------------
def _seq_len(data: DataConfig, model: Model) -> int:
    if data.seq_len and model.seq_len and data.seq_len > model.seq_len:
        raise ConfigError(f"[data] seq_len = {data.seq_len} is longer than the model's "
                          f"{model.seq_len} positions; lower [data] seq_len")
    seq = data.seq_len or model.seq_len
    if not seq:
        raise ConfigError(f"the model {model.name} does not say its sequence length: set "
                          f"[data] seq_len (or seq_len in the [model] table)")
    return int(seq)


def _check_batch_fits(batch_size: int, seq_len: int) -> None:
    """One global batch of int64 token windows (inputs and targets) must fit in this
    machine's memory: a typo of a batch size fails here, not in the allocator."""
    need = 2 * batch_size * (seq_len + 1) * 8
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise ConfigError(f"[train] batch_size = {batch_size} at seq_len {seq_len} needs "
                          f"{need / 2**30:.3g} GiB for one batch's tokens, this machine has "
                          f"{have / 2**30:.3g} GiB; lower batch_size (it is the global batch "
                          f"in sequences, split into micro-batches and replicas)")


def _check_token_file(path: str, dtype: str, model: Model) -> None:
    """A token file against the `meta.json` written beside it (`pipeflow prepare`, nanoGPT):
    its dtype, and a vocabulary that fits the model."""
    meta_path = os.path.join(os.path.dirname(os.path.abspath(path)), "meta.json")
    if not os.path.isfile(meta_path):
        return
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"[data]: cannot read {meta_path!r} ({exc}); fix or remove it") \
            from None
    written = meta.get("dtype") if isinstance(meta, dict) else None
    if written and written != dtype:
        raise ConfigError(f"[data] train = {path!r} holds {written} tokens ({meta_path}), "
                          f"[data] dtype = {dtype!r} would read them as garbage; set [data] "
                          f"dtype = {written!r}")
    vocab = meta.get("vocab_size", 0) if isinstance(meta, dict) else 0
    if model.vocab_size and vocab > model.vocab_size:
        raise ConfigError(f"[data] train = {path!r} was tokenized with {vocab} token ids "
                          f"({meta_path}), more than the model's vocab_size = "
                          f"{model.vocab_size}; set [model] vocab_size = {vocab}")


def _check_token_ids(batches: Batches, model: Model, what: str) -> None:
    """The first batch's token ids fit the model's vocabulary (an id past it would fail deep
    inside the first forward, as an IndexError of the embedding)."""
    if not model.vocab_size:
        return
    x, y = batches.batch(0)
    top = int(max(x.max(), y.max()))
    if top >= model.vocab_size:
        raise ConfigError(f"{what} holds token id {top}, the model's vocab_size is "
                          f"{model.vocab_size} (ids 0..{model.vocab_size - 1}); set [model] "
                          f"vocab_size = {top + 1} or more, or check [data] dtype")


def _datasets(run: RunConfig, model: Model) -> tuple[Batches, Batches | None, str]:
    """Training and validation samplers, and a description for the log."""
    t, d, seed = run.train, run.data, run.engine.seed
    seq = _seq_len(d, model)
    _check_batch_fits(t.batch_size, seq)
    try:
        if d.train:
            _check_token_file(d.train, d.dtype, model)
            tokens = token_file(d.train, d.dtype)
            val = Batches(token_file(d.val, d.dtype), t.batch_size, seq, seed,
                          split="val") if d.val else None
            train = Batches(tokens, t.batch_size, seq, seed)
            _check_token_ids(train, model, f"[data] train = {d.train!r}")
            return train, val, f"{d.train} ({len(tokens) / 1e6:.2f}M tokens, {d.dtype})"
        planned = t.steps * t.batch_size * seq
        if not t.corpus and planned >= BYTE_CORPUS_LIMIT:
            raise ConfigError(
                f"this run trains on {planned / 1e9:.3g}B tokens ([train] steps x batch_size "
                f"x seq_len) and names no data: the built-in byte corpus (the Python standard "
                f"library, 8 MiB) would repeat it thousands of times. Set [data] train = "
                f"\"DIR/train.bin\" (from `pipeflow prepare ... --out DIR`) or [train] "
                f"corpus = FILE")
        corpus = load_corpus(t.corpus or None)
        return (Batches(corpus, t.batch_size, seq, seed),
                Batches(corpus, t.batch_size, seq, seed, split="val"),
                f"{corpus.source} ({len(corpus) / 2**20:.1f} MiB of bytes)")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"[data]: {exc}") from None


def _packing_eot(data: DataConfig) -> int | None:
    """`[data] packed`: the end-of-text id after which positions restart ([data] eot, else
    the token file's meta.json "eot"); None when not packed."""
    if not data.packed:
        return None
    if data.eot >= 0:
        return data.eot
    meta_path = os.path.join(os.path.dirname(os.path.abspath(data.train)), "meta.json") \
        if data.train else ""
    eot = None
    if meta_path and os.path.isfile(meta_path):
        try:
            with open(meta_path) as f:
                eot = json.load(f).get("eot")
        except (OSError, ValueError, AttributeError):
            eot = None
    if not isinstance(eot, int) or isinstance(eot, bool) or eot < 0:
        where = f"{meta_path!r} records none" if meta_path else "the byte corpus has none"
        raise ConfigError(f"[data] packed = true needs the end-of-text token id that separates "
                          f"documents: set [data] eot = ID ({where}; `pipeflow prepare "
                          f"--tokenizer tiktoken:...` records it as \"eot\")")
    return eot


def _check_packing(eot: int | None, model: Model, data: DataConfig) -> None:
    """`[data] packed` only where it acts: an end-of-text id inside the vocabulary, and a
    model with a layer that reads `position_ids` (else packing trains exactly as unpacked)."""
    if eot is None:
        return
    source = f"[data] eot = {eot}" if data.eot >= 0 else \
        f"the end-of-text id {eot} (\"eot\" of the token file's meta.json)"
    if model.vocab_size is not None and not 0 <= eot < model.vocab_size:
        raise ConfigError(f"[data] packed = true: {source} is outside the model's vocabulary "
                          f"(ids 0..{model.vocab_size - 1}): no token can be it, so no "
                          f"document would be separated; set [data] eot to the tokenizer's "
                          f"end-of-text id")
    reads = [reads_side_input(spec.cls, "position_ids") for spec in model.layers]
    if not any(r is None or r for r in reads):
        names = sorted({spec.name for spec in model.layers})
        raise ConfigError(f"[data] packed = true restarts position_ids after each end-of-text "
                          f"token, but no layer of {model.name} reads position_ids (the "
                          f"forward of {names} takes none): it would train exactly as "
                          f"unpacked. Remove packed, or use a model whose layers take "
                          f"position_ids (kind = \"hf\", or a factory's)")


def _batch(batches: Batches, index: int, engine: Engine, eot: int | None = None
           ) -> tuple[tuple[Any, Any], dict[str, Any]]:
    """What this rank feeds the engine (built with `Config(batch="local")`), (inputs,
    targets) and side inputs: its replica's rows only, read alone, on the first and last
    stages, nothing on the stages in between (they receive activations). Packed rows (`eot`)
    add `position_ids`, which every stage reads."""
    plan, stage = engine.plan, engine.stage
    ends = plan.holds_first(stage.index) or plan.holds_last(stage.index)
    if eot is not None:
        x, y = batches.local_batch(index, stage.topo.replica, engine.config.data)
        side = {"position_ids": packed_positions(x, eot)}
        return (x, y) if ends else (None, None), side
    if not ends:
        return (None, None), {}
    return batches.local_batch(index, stage.topo.replica, engine.config.data), {}


# -- checkpoints with the data position ----------------------------------------------------
def _saved_position(save_dir: str, default: int) -> int:
    """The next batch index saved with the latest checkpoint (`default` when it has none: a
    checkpoint the library wrote)."""
    try:
        path = os.path.join(resolve_checkpoint(save_dir), DATA_STATE)
        if not os.path.exists(path):
            return default
        return int(read_sealed_json(path)["next_batch"])
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"--resume: cannot read the data position {DATA_STATE!r} of the "
                          f"checkpoint in {save_dir!r} ({type(exc).__name__}: {exc}); restore "
                          f"the file or resume from an earlier checkpoint") from None


def _save(engine: Engine, run: RunConfig, position: int, hf_config: Any = None,
          hf_source: str = "") -> str:
    """A checkpoint with the data position (and, for an HF model, its config and what its
    export writes, which `pipeflow export CKPT --hf OUT` reads)."""
    folder = engine.save(run.train.save_dir)
    if engine.stage.topo.rank == 0:
        state = {"next_batch": position, "seed": run.engine.seed,
                 "batch_size": run.train.batch_size,
                 "train": run.data.train or run.train.corpus or "stdlib",
                 "run": run.to_toml()}      # the model and data, for `pipeflow sample`
        if hf_config is not None:
            state["hf_config"] = json.loads(hf_config.to_json_string(use_diff=False))
            state.update(_export_record(run, hf_source))
        atomic_write_bytes(os.path.join(folder, DATA_STATE), sealed_json(state))
    with engine.watched("checkpoint's data position"):
        waiting.barrier(engine.stage.topo.world)
    return folder


def _export_record(run: RunConfig, hf_source: str) -> dict[str, Any]:
    """What `pipeflow export` of a checkpoint writes as `export_hf` would: the source folder
    whose other files it carries, the dtype, the shard size."""
    t = run.train
    return {"hf_source": os.path.abspath(hf_source) if hf_source else "",
            "hf_export_dtype": str(hub.export_dtype(t.export_dtype, run.engine.precision)
                                   ).removeprefix("torch."),
            "hf_max_shard_size": t.max_shard_size}


# -- preemption --------------------------------------------------------------------------------
class Preemption:
    """SIGTERM or SIGUSR1 (Slurm's warning before a kill) on any rank asks every rank to stop
    at the next step boundary: the flag is agreed with a one-integer all-reduce a step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def agreed(self, comm: MPI.Comm) -> int:
        """The signal any rank received (0: none), the same on every rank."""
        return max(waiting.allgather(comm, int(self.received)))


# -- the loop -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Loop:
    """A run in progress: what the step, log and eval helpers share."""

    run: RunConfig
    engine: Engine
    batches: Batches
    val: Batches | None
    out: MetricsLog | None           # rank 0 only
    position: int                    # index of the next training batch
    tokens: int                      # tokens per global batch
    flops_per_token: float
    peak_flops: float                # the job's: a device's peak x the devices in use
    first_step: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)
    eot: int | None = None           # [data] packed: the end-of-text id
    started: float = dataclasses.field(default_factory=time.perf_counter)
    hf_config: Any = None            # [model] kind "hf": saved with checkpoints, exported
    hf_source: str = ""              # [model] kind "hf": the folder whose other files exports carry
    tokenizer: Any = None            # [train] sample_prompt: the run's data's tokenizer
    trace: str | None = None         # --trace: where the last training step's timeline goes

    @property
    def rank0(self) -> bool:
        return self.out is not None


def _pin_measured_plan(run: RunConfig) -> str:
    """A resumed run keeps what the first one measured: schedule "auto" and partition "time"
    are taken from the checkpoint (measuring again may choose otherwise, and the run would
    no longer continue bit for bit). The text says what was kept."""
    c = run.engine
    if c.schedule != "auto" and c.partition != "time":
        return ""
    try:
        plan = saved_plan(run.train.save_dir)
    except CheckpointError:
        return ""                     # load reports the checkpoint's problem
    if plan is None:
        return ""
    kept = []
    if c.schedule == "auto":
        c.schedule, c.virtual_stages = plan["schedule"], plan["virtual_stages"]
        kept.append(f"schedule {c.schedule}")
    if c.partition == "time":
        c.partition = list(plan["boundaries"])
        kept.append(f"stages {c.partition}")
    c.validate()
    return f"; kept the measured {' and '.join(kept)}"


def _build_engine(run: RunConfig, model: Model, batches: Batches, comm: MPI.Comm) -> Engine:
    config = run.engine
    # partition = "time" and schedule = "auto" measure the layers on one micro-batch of the
    # real data.
    micro = max(1, run.train.batch_size // (config.data * config.microbatches))
    measured = config.partition == "time" or config.schedule == "auto"
    sample = batches.rows(0, 0, micro)[0] if measured else None
    # trace=True: each instruction's start and end, for the measured bubble per stage.
    # Each replica is fed its own rows (`_batch`), never a global batch of zeros elsewhere.
    config = dataclasses.replace(config, batch="local")
    return Engine(model.layers, model.loss_fn, _optimizer(run.train), config, comm=comm,
                  trace=True, sample=sample)


def _sample_tokenizer(run: RunConfig) -> Any:
    """`[train] sample_prompt`'s tokenizer: the run's data's (bytes on the byte corpus, the
    token file's meta.json), found at start, not after the run; None without a prompt."""
    prompt = run.train.sample_prompt
    if not prompt:
        return None
    spec = data_tokenizer(run)
    if not spec:
        raise ConfigError(f"[train] sample_prompt = {prompt!r} needs the tokenizer of the run's "
                          f"data, and [data] train = {run.data.train!r} has no meta.json "
                          f"beside it naming one (`pipeflow prepare` writes it); remove "
                          f"sample_prompt, or sample afterwards with `pipeflow sample CKPT "
                          f"--tokenizer SPEC`")
    try:
        tokenizer = load_tokenizer(spec)
    except ValueError as exc:
        raise ConfigError(f"[train] sample_prompt: {exc}") from None
    if not tokenizer.encode(prompt):
        raise ConfigError(f"[train] sample_prompt = {prompt!r} is no token with tokenizer "
                          f"{spec!r}; give at least one character, or \"\" for no sample")
    return tokenizer


def _sample(loop: _Loop) -> None:
    """The trained model's greedy continuation of `[train] sample_prompt`, on every rank (a
    collective), printed on rank 0 with the prompt."""
    t = loop.run.train
    prompt = loop.tokenizer.encode(t.sample_prompt)
    new = loop.engine.generate([prompt], t.sample_tokens, temperature=0.0)[0]
    if loop.rank0:
        loop.out.line(f"pipeflow: the trained model's greedy continuation of "
                      f"{t.sample_prompt!r} ({len(new)} tokens):")
        loop.out.line(loop.tokenizer.decode(prompt + new))
        if t.save_dir:
            loop.out.line(f"pipeflow: more with `mpirun -n {loop.engine.stage.topo.world.size} "
                          f"pipeflow sample {t.save_dir} --prompt TEXT`")


def _start(run: RunConfig, comm: MPI.Comm, log: Callable) -> _Loop:
    t = run.train
    tokenizer = _sample_tokenizer(run)
    pinned = _pin_measured_plan(run) if t.resume else ""
    model = build_model(run.model, run.source)
    eot = _packing_eot(run.data)
    _check_packing(eot, model, run.data)
    batches, val, source = _datasets(run, model)
    engine = _build_engine(run, model, batches, comm)
    position = engine.stats.step
    if t.resume:
        try:
            engine.load(t.save_dir)
        except ModelMismatch as exc:     # alike on every rank: one line, no abort
            engine.close()
            raise ConfigError(f"--resume: {exc}; resume with the run's own [model] (see "
                              f"--print-config), or start a new save_dir") from None
        position = _saved_position(t.save_dir, engine.stats.step)
    elif model.pretrained:
        _load_pretrained(engine, model)
    flops = model.flops_per_token or 6 * count_parameters(engine)
    devices = devices_in_use(engine)     # ranks sharing a GPU share its peak
    peak = waiting.bcast(
        comm, peak_flops(engine.stage.device, t.peak_tflops) if comm.rank == 0 else None, 0)
    out = None
    if comm.rank == 0:
        if t.save_dir and os.path.exists(os.path.join(t.save_dir, STOPPED)):
            os.unlink(os.path.join(t.save_dir, STOPPED))      # this run goes on from there
        trackers = open_trackers(t, run.tables(),
                                 engine.stats.step if t.resume else None)
        out = MetricsLog(list(trackers.values()), t.steps, engine.stats.step, t.progress, log)
        c = run.engine
        where = ", ".join(f"{name} {getattr(k, 'path', '')}".strip()
                          for name, k in trackers.items())
        out.line(f"pipeflow: {model.name} on {source}; grid {_grid_words(c)}, "
                 f"{c.microbatches} micro-batches, {engine.schedule}, stages "
                 f"{list(engine.plan.boundaries)}; MFU against {peak[0] / 1e12:.3g} TFLOP/s a "
                 f"rank ({peak[1]})" + (f"; metrics to {where}" if where else ""))
        for note in model.notes:
            out.line(note)
        if t.resume:
            out.line(f"pipeflow: resumed at step {engine.stats.step}, batch {position}, "
                     f"from {t.save_dir}{pinned}")
        if eot is not None:
            out.line(f"pipeflow: packed rows: position_ids restart after token {eot}")
    return _Loop(run, engine, batches, val, out, position, t.batch_size * batches.seq_len,
                 flops, peak[0] * devices, first_step=engine.stats.step, eot=eot,
                 hf_config=model.hf_config, hf_source=model.hf_source, tokenizer=tokenizer)


def _load_pretrained(engine: Engine, model: Model) -> None:
    """Every rank reads its own layers' tensors of the Hub folder (tensor-parallel: only the
    slices it keeps) and loads them as the engine's masters and working weights; a problem
    on any rank is raised on every rank."""
    problem = None
    try:
        state, _ = hub.read_layers(model.pretrained, model.hf_config,
                                   engine.stage.module.indices, engine.kept_ranges)
        engine.load_state_dict(state)
    except (ConfigError, OSError, ValueError, RuntimeError) as exc:
        problem = f"rank {engine.stage.topo.rank}: {exc}"
    with engine.watched("pretrained weights"):
        problems = [p for p in waiting.allgather(engine.stage.topo.world, problem) if p]
    if problems:
        raise ConfigError(f"[model] pretrained = {model.pretrained!r}: cannot load the weights "
                          f"({problems[0]}); is the folder's config.json the one its weights "
                          f"were saved with?")


def _export_hf(loop: _Loop) -> None:
    """`[train] export_hf`: the whole model gathered on rank 0 and written as a Hub folder;
    a failed write is raised on every rank."""
    engine, out = loop.engine, loop.run.train.export_hf
    state = engine.gather_state_dict()
    problem = None
    if engine.stage.topo.rank == 0:
        t = loop.run.train
        try:
            done = hub.write_folder(state, loop.hf_config, out, t.export_overwrite,
                                    avoid=(t.save_dir,) if t.save_dir else (),
                                    source=loop.hf_source,
                                    dtype=hub.export_dtype(t.export_dtype,
                                                           loop.run.engine.precision),
                                    max_shard_size=t.max_shard_size)
        except (OSError, ValueError) as exc:
            problem = (f"[train] export_hf: {exc}; the checkpoint, if any, is whole: write "
                       f"the folder from it with `pipeflow export CKPT --hf OUT`")
    with engine.watched("export_hf"):
        problem = waiting.bcast(engine.stage.topo.world, problem, 0)
    if problem:
        raise ConfigError(problem)
    if loop.rank0:
        more = done.describe()
        loop.out.line(f"pipeflow: wrote {out} (AutoModelForCausalLM.from_pretrained)"
                      + (f"; {more}" if more else ""))


def _evaluate(loop: _Loop) -> float | None:
    if loop.val is None:
        return None
    n = loop.run.train.eval_batches
    total = 0.0
    for i in range(n):
        args, side = _batch(loop.val, i, loop.engine, loop.eot)
        total += loop.engine.eval_step(*args, **side)
    return total / n


def _record(loop: _Loop, step: int, loss: float) -> None:
    """The step's metrics: a collective (stage statistics), written on rank 0."""
    engine, t = loop.engine, loop.run.train
    with engine.watched("metrics"):
        stages = stage_stats(engine)
        memory = memory_reports(engine)
    if not loop.rank0:
        return
    dt = engine.stats.step_time
    tokens_per_s = loop.tokens / dt
    mfu = loop.flops_per_token * tokens_per_s / loop.peak_flops
    loop.out.record({
        "step": step, "loss": loss, "lr": lr_at(step, t), "grad_norm": engine.stats.grad_norm,
        "loss_scale": engine.loss_scale, "skipped": engine.stats.skipped,
        "skipped_steps": engine.stats.skipped_steps,
        "tokens_per_s": tokens_per_s, "mfu": mfu, "step_time_s": dt,
        "flops_per_token": loop.flops_per_token, "stages": stages, "memory": memory})
    elapsed = time.perf_counter() - loop.started
    done = step + 1 - loop.first_step
    eta = elapsed / done * (t.steps - step - 1)
    loop.out.line(f"step {step:5d}/{t.steps}  loss {loss:.4f}  lr {lr_at(step, t):.2e}  "
                  f"{tokens_per_s:8.0f} tok/s  MFU {mfu:6.2%}  {dt * 1e3:7.1f} ms/step  "
                  f"bubble {[s['bubble'] for s in stages]}  elapsed {clock_text(elapsed)}  "
                  f"ETA {clock_text(eta)}")


def _report_recompute(loop: _Loop) -> None:
    """"auto" is resolved on each stage's first micro-batch: say what it chose."""
    engine = loop.engine
    with engine.watched("recompute report"):
        stage = engine.stage
        chosen = waiting.gather(stage.topo.world, (stage.index, stage.recompute,
                                                   engine.stats.peak_activation_bytes), 0)
    if loop.rank0:
        per_stage = {s: (p, b) for s, p, b in chosen}
        loop.out.line("pipeflow: recompute per stage: " + ", ".join(
            f"{s}: {p} ({b / 2**20:.1f} MiB stashed)" for s, (p, b) in sorted(per_stage.items())))


def _step(loop: _Loop, step: int) -> float:
    engine, t = loop.engine, loop.run.train
    if engine.stage.optimizer is not None:
        for group in engine.stage.optimizer.param_groups:
            group["lr"] = lr_at(step, t)
    first = step == loop.first_step and loop.run.engine.recompute != "none"
    # Count saved activations on the first step only: the meter costs time.
    engine.runner.measure_activations = first
    args, side = _batch(loop.batches, loop.position, engine, loop.eot)
    loss = engine.train_step(*args, **side)
    loop.position += 1
    if first:
        _report_recompute(loop)
    loop.losses.append(loss)
    if loop.trace is not None and step == t.steps - 1:
        _write_trace(loop)       # now: a validation's forwards would replace the timeline
    if loop.rank0:
        loop.out.advance(loss)
    if step % t.log_every == 0 or step == t.steps - 1:
        _record(loop, step, loss)
    if t.eval_every and (step + 1) % t.eval_every == 0:
        val_loss = _evaluate(loop)
        if loop.rank0 and val_loss is not None:
            loop.out.record({"step": step, "eval_loss": val_loss})
            loop.out.line(f"step {step:5d}  validation loss {val_loss:.4f}")
    if t.save_dir and t.save_every and (step + 1) % t.save_every == 0:
        _save(engine, loop.run, loop.position, loop.hf_config, loop.hf_source)
    return loss


def _stop_early(loop: _Loop, signum: int) -> None:
    t, step = loop.run.train, loop.engine.stats.step
    name = signal.Signals(signum).name
    if t.save_dir:
        # The periodic save may have just written this very step: a second write would only
        # spend the time a preemption warning leaves.
        just_saved = t.save_every and step % t.save_every == 0
        folder = os.path.join(t.save_dir, step_name(step)) if just_saved else \
            _save(loop.engine, loop.run, loop.position, loop.hf_config, loop.hf_source)
        what = f"checkpoint of step {step} in {folder}; continue with --resume"
        if loop.rank0 and step < t.steps:   # a batch script requeues on it (slurm.sbatch)
            atomic_write_bytes(os.path.join(t.save_dir, STOPPED),
                               f"{name} at step {step}\n".encode())
    else:
        what = "no [train] save_dir, so nothing was saved"
    if loop.rank0:
        loop.out.line(f"pipeflow: {name} received: stopped at step {step}; {what}")


def _write_trace(loop: _Loop) -> None:
    """The last training step's instruction timeline of every rank (a collective)."""
    write_trace(loop.engine, loop.trace)
    if loop.rank0:
        loop.out.line(f"pipeflow: wrote the last step's timeline to {loop.trace} (open it in "
                      f"https://ui.perfetto.dev, or `pipeflow trace {loop.trace} --png t.png`)")


def _finish(loop: _Loop, elapsed: float) -> None:
    engine, t = loop.engine, loop.run.train
    val_loss = _evaluate(loop)
    if t.save_dir and engine.stats.step and (not t.save_every or engine.stats.step % t.save_every):
        _save(engine, loop.run, loop.position, loop.hf_config, loop.hf_source)
    if t.export_hf:
        _export_hf(loop)
    if loop.rank0 and loop.losses:
        done = len(loop.losses)
        if val_loss is not None:
            loop.out.record({"step": engine.stats.step - 1, "eval_loss": val_loss})
        loop.out.line(f"pipeflow: {done} steps in {elapsed:.1f} s "
                      f"({done * loop.tokens / elapsed:.0f} tok/s); loss {loop.losses[0]:.3f}"
                      f" -> {loop.losses[-1]:.3f}" + (f", validation loss {val_loss:.3f}"
                                                       if val_loss is not None else "")
                      + (f"; checkpoint and metrics in {t.save_dir}" if t.save_dir else ""))
    if loop.tokenizer is not None:
        _sample(loop)


def train(run: RunConfig, comm: MPI.Comm | None = None, log: Callable = print,
          trace: str | None = None,
          on_step: Callable[[int], None] | None = None) -> list[float]:
    """Train `run`; returns this run's losses (alike on every rank).

    With `trace`, the last step's instruction timeline of every rank is written there as a
    Chrome/Perfetto trace. `on_step(step)` runs on every rank after each step (tests use it
    to send a signal mid-run). SIGTERM or SIGUSR1 on any rank saves a checkpoint at the next
    step boundary on every rank and returns.
    """
    comm = comm if comm is not None else MPI.COMM_WORLD
    torch.set_num_threads(run.train.threads)
    # Handlers first: a signal while the engine is built still stops at the first step.
    _check_paths(run.train)
    with Preemption() as preemption, _save_dir_locked(run.train, comm):
        loop = _start(run, comm, log)
        try:
            return _loop(loop, comm, preemption, trace, on_step)
        except KeyboardInterrupt as exc:
            if comm.size == 1:
                raise
            # No other rank can be expected at a step boundary: end the job now, named.
            report_and_abort(f"rank {comm.rank} interrupted at step {loop.engine.stats.step}",
                             exc)
        except Exception as exc:
            if not isinstance(exc, ConfigError):    # those are raised on every rank alike
                say(f"pipeflow: rank {comm.rank} raised at step {loop.engine.stats.step}:\n"
                    + "".join(traceback.format_exception(exc)) + "pipeflow: closing; unless "
                    f"every rank closes within {FAILING_CLOSE_S:g} s (they failed alike), "
                    f"the job ends then\n", logging.ERROR)
            raise
        finally:
            if loop.out is not None:
                loop.out.close()
            loop.engine.close()


def _loop(loop: _Loop, comm: MPI.Comm, preemption: Preemption, trace: str | None,
          on_step: Callable[[int], None] | None) -> list[float]:
    start = time.perf_counter()
    loop.trace = trace
    for step in range(loop.engine.stats.step, loop.run.train.steps):
        _step(loop, step)
        if on_step is not None:
            on_step(step)
        with loop.engine.watched("stop-signal agreement"):
            signum = preemption.agreed(comm)
        if signum:
            _stop_early(loop, signum)
            return loop.losses
    _finish(loop, time.perf_counter() - start)
    return loop.losses


def _grid_words(c: Config) -> str:
    """The grid as the run's first line says it: `pipeline=2 x data=1[ x tensor=2 ...]`."""
    words = f"pipeline={c.pipeline} x data={c.data}"
    if c.tensor > 1:
        words += f" x tensor={c.tensor}" + (" (sequence parallel)" if c.sequence_parallel
                                            else "")
    return words
