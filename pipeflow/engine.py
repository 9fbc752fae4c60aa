"""`Engine`: the public facade. Builds this rank's `Stage`, then per step: split → run → close.

    engine.py      Engine: the facade (this file)
      batch.py     the global batch and side inputs into micro-batches, agreed across ranks
      runner.py    one stage's instruction list for one batch: a handler per instruction
      optim_step.py  closing a step: norm, non-finite verdict, clip, optimizer, working copies
      failure.py   one rank's failure ends the job, named; the hang watchdog
    stage.py       Stage: what one rank holds (layers, device, communicators, precision)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from mpi4py import MPI
from torch import nn

from pipeflow import tree
from pipeflow.comm import waiting
from pipeflow.comm.topology import Topology, bind_device
from pipeflow.config import Config, ConfigError
from pipeflow.layers import LayerSpec, _check_layers, fingerprint
from pipeflow.runtime.batch import BatchError, SummedLossCheck, agree_call, split_step
from pipeflow.runtime import tensor_parallel as tp
from pipeflow.runtime.checkpoint import (CheckpointState, load_checkpoint,
                                         load_optimizer_by_name, save_checkpoint)
from pipeflow.runtime.failure import (CollectiveError, Watchdog, abort_world,
                                      check_failure_mode, install_excepthook, report_and_abort,
                                      say)
from pipeflow.runtime.hostmem import keep_freed_memory
from pipeflow.runtime.optim_step import close_step
from pipeflow.runtime.arrange import ArrangeSettings, arrange_pipeline
from pipeflow.runtime.rng import seed_everything
from pipeflow.runtime.runner import Runner, StepState
from pipeflow.runtime.stage import (Stage, StageModule, StageSettings, StepSettings,
                                    default_device)
from pipeflow.schedules import Action

__all__ = ["Engine", "StageModule", "BatchError", "StepStats"]

Batch = Any           # a tensor or any structure of tensors, batch dimension first
LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass
class StepStats:
    """What the last step measured; the same loss, norm and verdict on every rank."""

    step: int = 0
    loss: float = float("nan")
    grad_norm: float | None = None
    skipped: bool = False
    skipped_steps: int = 0             # in the whole run (fp16 overflow or non-finite)
    nonfinite_in_row: int = 0
    # The host's time for the step: on a GPU up to the optimizer's launch (the step's last
    # host sync is the gradient norm's read; traced steps synchronize and time the device)
    step_time: float = 0.0
    peak_stash: int = 0                # most micro-batches stashed at once
    peak_activation_bytes: int = 0     # saved for backward (with measure_activations)
    peak_memory_bytes: int | None = None   # allocator peak (GPU)


class Engine:
    """Pipeline-parallel training of a layer list on this rank's stage of the grid.

    Every rank builds only its own layers (seeded per layer, as `build_sequential` does),
    runs its stage's instruction list from the schedule, and steps its own optimizer.

    `comm` runs the engine on a sub-communicator instead of `MPI.COMM_WORLD`; `device`
    overrides the default (this rank's GPU by node-local rank, else the CPU); `trace` records
    each instruction's start and end (`runner.timeline`); `measure_activations` counts the
    bytes stashed for backward (`stats.peak_activation_bytes`); `sample`, a micro-batch of
    inputs, is what `partition = "time"` and `schedule = "auto"` measure the layers on. With
    `count_items` (`targets of a micro-batch -> number of valid items`, e.g. non-padding
    tokens), `loss_fn` returns each micro-batch's summed loss and the engine divides by the
    global batch's count, so a padded token-mean loss equals the one-process model's.

    What this rank holds is `engine.stage` (layers, device, communicators, precision,
    optimizer: `runtime.stage.Stage`) and what every rank runs `engine.plan`
    (`schedules.plan.Plan`); their facts are read there.
    """

    def __init__(self, layers: Sequence[LayerSpec], loss_fn: LossFn,
                 optimizer: OptimizerFactory, config: Config | None = None, *,
                 comm: MPI.Comm | None = None, device: str | torch.device | None = None,
                 abort_on_error: bool = True, trace: bool = False,
                 measure_activations: bool = False, sample: Batch | None = None,
                 count_items: Callable[[Any], Any] | None = None) -> None:
        world = comm if comm is not None else MPI.COMM_WORLD
        self._where = f"rank {world.rank}"
        self._instruction = "setup"
        self.abort_on_error = abort_on_error
        self._world_size = world.size
        self.stats = StepStats()
        if world.size > 1 and abort_on_error:
            install_excepthook()
        try:
            self._build(layers, loss_fn, optimizer, config, world, device, sample)
        except ConfigError:
            raise                      # raised on every rank alike: nothing hangs
        except Exception as exc:  # noqa: BLE001 - a failure on some ranks only ends the job
            self._fail(exc)
        self.count_items = count_items
        self.runner.trace = trace
        self.runner.measure_activations = measure_activations

    def _build(self, layers, loss_fn, optimizer, config, world, device, sample) -> None:
        self.config = config = config if config is not None else Config()
        config.validate()
        check_launcher(world)
        _check_layers(layers)
        self._fingerprint = fingerprint(layers)
        topo = Topology(world, config.pipeline, config.data, config.tensor)
        # How this process waits on MPI from here on (process-wide: see pipeflow.comm.waiting).
        waiting.use(waiting.choose(config.wait, topo.local_size, topo.local_cores))
        dev = default_device(topo, torch.device(device) if device is not None else None)
        bind_device(dev)      # before CUDA's first use: layer building forks its RNG
        arranged = arrange_pipeline(layers, fields_of(ArrangeSettings, config), world,
                                    topo.pipeline, sample, dev)
        self.schedule_choice = arranged.choice       # why ("" unless schedule "auto")
        # What this rank holds (layers, device, communicators, precision, optimizer) and
        # what every rank runs: read their facts there (`engine.stage.topo`, `engine.plan`).
        self.stage = Stage(layers, fields_of(StageSettings, config),
                           fields_of(StepSettings, config), topo, arranged.plan, optimizer, dev)
        self.plan = self.stage.plan
        self._where = self.stage.describe()
        check_failure_mode(self.stage.backend, topo.pipeline, self.abort_on_error, self._where)
        if self.stage.vocab_logits:      # logits cut along the vocabulary into the loss
            loss_fn = tp.vocab_loss(loss_fn, self.stage.tensor)
        self.loss_fn = loss_fn
        # With count_items the first training step checks that the loss is a sum.
        self._loss_check = SummedLossCheck(loss_fn)
        self._loss_checked = False
        # Callbacks hold the engine weakly: a cycle would keep a dropped engine's weights and
        # optimizer state (on the GPU) alive until the garbage collector happens to run.
        self.runner = Runner(self.stage, self._loss_check, _weak(self._at))
        if config.keep_host_memory and self.plan.spec.split_backward \
                and dev.type == "cpu":
            keep_freed_memory()     # B to W keeps more graphs alive: no page faults each step
        self._control = world.Dup()    # the per-step agreement and the close check
        # Dropout and other random draws: reproducible from Config.seed, different per rank
        # (replicas must not draw the same masks), alike over a tensor group (whose ranks
        # compute the replicated parts alike). Layers were built under their own seeds.
        seed_everything(config.seed, topo.grid.group("tensor", world.rank)[0])
        if config.deterministic:
            use_deterministic_algorithms()
        self.watchdog = Watchdog(config.watchdog_s, _weak(self._report_where))
        _OPEN.add(self)

    # -- the documented shortcuts (docs/design.md); every other fact is read where it lives:
    # `engine.stage` (this rank's share), `engine.plan` (what every rank runs), `engine.stats`.
    @property
    def schedule(self) -> str:
        """The schedule that runs: `Config.schedule` with "auto" resolved (why:
        `schedule_choice`)."""
        return self.plan.spec.name

    @property
    def loss_scale(self) -> float:
        """The current dynamic loss scale (fp16); 1.0 without scaling. Alike on every rank."""
        return self.stage.precision.loss_scale

    def named_master_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, the fp32 parameter the optimizer steps), tied names included; trainable
        parameters only. Sharded (`stage.shards`), each replica steps blocks of them: this is then
        their whole fp32 values, gathered over the data group (call it on every replica)."""
        stage = self.stage
        named = [(n, p) for n, p in stage.module.named_parameters(remove_duplicate=False)
                 if p.requires_grad]
        if stage.shards is not None:
            whole = stage.shards.full_masters()
            return [(n, whole[id(p)]) for n, p in named]
        return [(n, stage.precision.master_of(p)) for n, p in named]

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state dict with full-precision values (frozen parameters included).
        Sharded: gathered over the data group; tensor-parallel: whole tensors, gathered over
        the tensor group; so every replica and tensor rank calls it."""
        stage = self.stage
        state = {k: v.detach() for k, v in stage.module.state_dict().items()}
        whole = stage.shards.full_masters() if stage.shards is not None else {}
        for name, p in stage.module.named_parameters(remove_duplicate=False):
            state[name] = whole[id(p)] if id(p) in whole else \
                stage.precision.master_of(p).detach()
        return self._whole(state)

    def _whole(self, values: dict[str, Any]) -> dict[str, Any]:
        """Tensor-parallel: each cut parameter's value (by name) gathered whole."""
        if self.stage.tensor_comm is None:
            return values
        splits = self._splits()
        return {n: tp.gather_whole(self.stage.tensor, v, *splits[n], f"{n} whole")
                if n in splits else v for n, v in values.items()}

    def _cut(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Tensor-parallel: this rank's slice of each whole value of a cut parameter (a value
        that is already this rank's slice, as a slice reader gives it, kept as it is)."""
        if self.stage.tensor_comm is None:
            return dict(values)
        splits, group, whole = self._splits(), self.stage.tensor, self._whole_shapes()
        return {n: tp.cut(v, *splits[n], group.size, group.rank)
                if n in splits and v.shape == whole[n] else v for n, v in values.items()}

    def _whole_shapes(self) -> dict[str, torch.Size]:
        """Each parameter's and buffer's whole shape by name (a cut one's before the cut)."""
        splits, size = self._splits(), self.stage.tensor.size
        return {n: tp.whole_shape(v.shape, splits[n][0], size) if n in splits else v.shape
                for n, v in self.stage.module.state_dict(keep_vars=True).items()}

    def kept_ranges(self, name: str, shape: Sequence[int]) -> tuple[int, list] | None:
        """The part of the whole tensor `name` (of `shape`, as a file states it before it is
        read) this tensor rank keeps: `(dim, [(start, stop), ...])` along `dim`
        (`tensor_parallel.kept_ranges`); None: read it whole (a parameter not cut, or a
        layout without ranges: `load_state_dict` cuts it). A reader that reads only these
        parts (`pipeflow.train.hub`) passes them to `load_state_dict`."""
        split = self._splits().get(name)
        if split is None:
            return None
        return tp.kept_ranges(shape, split, self.stage.tensor.size, self.stage.tensor.rank)

    def _splits(self) -> dict[str, tuple[int, int]]:
        return {n: tp.split_of(p) for n, p in
                self.stage.module.named_parameters(remove_duplicate=False)
                if tp.split_of(p) is not None}

    def memory_report(self) -> dict[str, Any]:
        """This rank's bytes of model state and activations (see `runtime.memory`)."""
        from pipeflow.runtime.memory import memory_report
        return memory_report(self.stage, self.stats.peak_activation_bytes)

    # -- steps ----------------------------------------------------------------------------
    def train_step(self, inputs: Batch | None, targets: Batch | None, **side: Any) -> float:
        """One optimizer step on the global batch; the global mean loss, alike on every rank.

        The first stage needs `inputs` and the last `targets`; other ranks may pass `None`.
        Side inputs (`attention_mask=...`) are split like the inputs and given, on every
        stage, to the layers whose `forward` names them; pass them on every rank.
        """
        stage = self.stage
        cuda = stage.device.type == "cuda"
        if cuda:     # the step's own peak: its forwards, backwards, reductions and optimizer
            torch.cuda.reset_peak_memory_stats(stage.device)
        start = time.perf_counter()
        with self.watchdog:
            stage.module.train()
            st = self._start("train_step", inputs, targets, side, train=True)
            # Agreed on every rank: the batch agreement counted items (count_items is set).
            checking = st.batches.items is not None and not self._loss_checked
            if checking and self.count_items is not None:
                self._loss_check.arm(self.count_items)
            if stage.reducer is not None:
                stage.reducer.begin_step()     # the views, after a user's zero_grad
            self._measure(lambda: self.runner.run(self.plan.programs[stage.index], st))
            loss = self._guarded("loss", lambda: self._global_loss(st.losses, st))
            if checking:        # before the update: a wrong loss never moves the weights
                self._loss_checked = True
                self._guarded("loss contract", self._agree_loss_contract)
            self._guarded("optimizer step", lambda: close_step(stage, loss, self.stats))
            if cuda and self.runner.trace:   # device time for the trace: a host sync more
                self._guarded("device synchronize", lambda: torch.cuda.synchronize(stage.device))
        if cuda:
            self.stats.peak_memory_bytes = torch.cuda.max_memory_allocated(stage.device)
        self.stats.loss = loss
        self.stats.step += 1
        self.stats.peak_stash = st.peak_stash
        self.stats.step_time = time.perf_counter() - start
        return loss

    @torch.no_grad()
    def eval_step(self, inputs: Batch | None, targets: Batch | None = None, *,
                  return_outputs: bool = False, **side: Any) -> Any:
        """Forward only, no state changes: the global mean loss, alike on every rank.

        With `return_outputs=True` (or without targets) the last stage's outputs for the whole
        global batch come back on world rank 0 (`None` elsewhere): `(loss, outputs)` with
        targets, `outputs` without.
        """
        with self.watchdog:
            self.stage.module.eval()
            st = self._start("eval_step", inputs, targets, side, train=False)
            self._weights_ready()
            # Whether targets were given is the agreed view of the ranks holding the last
            # stage, never this rank's own: a rank in the middle passes none either way.
            keep = st.keep_outputs = return_outputs or not st.batches.has_targets
            program = self.plan.eval_programs[self.stage.index]
            self._guarded("eval", lambda: self.runner.run(program, st))
            loss = self._guarded("loss", lambda: self._global_loss(st.losses, st)) \
                if st.batches.has_targets else None
            outputs = self._guarded("outputs", lambda: self._gather_outputs(st.outputs)) \
                if keep else None
        if not keep:
            return loss
        return (loss, outputs) if loss is not None else outputs

    @torch.no_grad()
    def generate(self, prompt_ids: Any, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None,
                 eos: int | Sequence[int] | None = None, seed: int = 0,
                 use_cache: bool | None = None) -> list[list[int]]:
        """New tokens for each prompt, the same list on every rank: `prompt_ids` one prompt
        (a list of token ids, a 1-D tensor) or several (a list of lists, a 2-D tensor), each
        a micro-batch of its own (replicas share the prompts out). Temperature 0 is greedy;
        otherwise `top_k` and `top_p` restrict the draw, from a random stream seeded by
        `(seed, prompt index)`, so the tokens are the same on every grid. A prompt stops at
        a token of `eos` (kept in its list) or after `max_new_tokens`. `use_cache`: the
        layers' key/value caches (`decode`; None: where every layer has one and the text
        fits the model's positions) or the whole sequence every step. Call it on every rank
        with the same arguments (see `pipeflow.runtime.generate`)."""
        from pipeflow.runtime import generate as gen

        with self.watchdog:
            self._agree("generate")
            self.stage.module.eval()
            request, problem = None, None
            try:
                request = gen.Request.make(prompt_ids, max_new_tokens, temperature, top_k,
                                           top_p, eos, seed, use_cache)
            except (TypeError, ValueError) as exc:
                problem = str(exc)
            missing, limit = gen.layer_report(self.stage)
            views = waiting.allgather(self._control, (
                request.digest() if request else None, problem, missing, limit,
                gen.vocabulary(self.stage)))
            request, cached, limit = self._agree_generate(request, views)
            topo = self.stage.topo
            mine = range(topo.replica, len(request.prompts), topo.data)
            decoding = gen.Decoding(self.stage, request, mine, cached, limit, self._at)
            results = self._guarded("generate", decoding.run)
            last = self.plan.holds_last(self.stage.index)
            shared = self._guarded("generate results", lambda: waiting.allgather(
                self._control, results if last else None))
        merged = {i: toks for part in shared if part for i, toks in part.items()}
        return [merged[i] for i in range(len(request.prompts))]

    def _agree_generate(self, request: Any, views: list) -> tuple[Any, bool, int | None]:
        """Every rank's view of a `generate` call: the same arguments, the layers without a
        cache and the position limit of all stages; a ConfigError alike on every rank."""
        from pipeflow.runtime import generate as gen

        problems = [(r, v[1]) for r, v in enumerate(views) if v[1]]
        if problems:
            raise ConfigError(f"rank {problems[0][0]}: {problems[0][1]}")
        digests = {v[0] for v in views}
        if len(digests) > 1:
            raise ConfigError("generate() was called with different arguments on different "
                              "ranks (prompts, max_new_tokens, sampling, eos or seed); pass "
                              "the same on every rank")
        vocabs = [v[4] for v in views if v[4] is not None]
        gen.check_vocabulary(request, min(vocabs) if vocabs else None)   # alike on all ranks
        missing = sorted({m for v in views for m in v[2]})
        limits = [v[3] for v in views if v[3] is not None]
        limit = min(limits) if limits else None
        try:
            cached = gen.choose_cache(request, missing, limit)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return request, cached, limit

    def _start(self, call: str, inputs, targets, side: Mapping[str, Any],
               train: bool) -> StepState:
        self._instruction = "batch"
        self._check_open(call)
        try:
            batches = split_step(call, self.stats.step, inputs, targets, side, stage=self.stage,
                                 control=self._control, needs_targets=train,
                                 count_items=self.count_items, deadline_s=self.config.agree_s)
        except waiting.NotJoined as exc:
            self._not_joined(call, exc)
        cfg = self.config
        if self.count_items is not None and batches.items is not None:
            mult = 1.0 / max(batches.items, 1)
        else:
            mult = 1.0 / (cfg.microbatches * cfg.data)   # the mean over m and d
        scale = self.stage.precision.loss_scale
        return StepState(train=train, batches=batches, loss_multiplier=mult * scale,
                         aux_multiplier=scale / (cfg.microbatches * cfg.data))

    def _measure(self, run: Callable[[], Any]) -> None:
        meter = self.runner.activation_meter
        meter.reset_peak()
        self._guarded("run", run)
        self.stats.peak_activation_bytes = meter.peak

    def _global_loss(self, losses: list[torch.Tensor], st: StepState) -> float:
        """The global loss on every rank: mean of the micro-batch means (or, with
        count_items, the sum over the global batch divided by its item count)."""
        d = self.config.data
        counted = self.count_items is not None and st.batches.items is not None
        if not losses:
            total = 0.0
        elif counted:     # this replica's share of the global sum over the global count
            total = float(torch.stack(losses).double().sum()) / max(st.batches.items, 1)
        else:
            total = float(torch.stack(losses).double().mean()) / d
        # Auxiliary losses (`pf.add_aux_loss`) from every stage: the mean over micro-batches
        # and replicas of each micro-batch's sum.
        aux = float(torch.stack(st.aux).double().sum()) / (self.config.microbatches * d) \
            if st.aux else 0.0
        if d > 1:
            # On the data group's object channel: its tensor channel may still carry the
            # gradient buckets' reductions, and every rank sums in the same order.
            parts = self.stage.data_comm.allgather_object((total, aux))
            total, aux = math.fsum(p[0] for p in parts), math.fsum(p[1] for p in parts)
        parts = self.stage.pipe_comm.allgather_object((total, aux))
        return parts[self._last_rank()][0] + math.fsum(p[1] for p in parts)

    def _agree_loss_contract(self) -> None:
        """The verdict of the first step's loss check (`SummedLossCheck`), from the ranks
        holding the last stage to every rank: a ConfigError raised on all alike."""
        check = self._loss_check
        check.count_items = None                 # no micro-batch gave a loss: not checked
        mine = check.problem if self.plan.holds_last(self.stage.index) else None
        problems = [p for p in waiting.allgather(self._control, mine) if p]
        if problems:
            raise ConfigError(f"{self.stage.describe()}: stopped at the first training step, "
                              f"before its update: {problems[0]}")

    def _last_rank(self) -> int:
        """The pipeline rank holding the last virtual stage."""
        return self.plan.owner(self.plan.last_virtual)[0]

    def _gather_outputs(self, outputs: list[Any]) -> Any:
        """The last stage's outputs of every micro-batch and replica, in global batch order,
        on world rank 0."""
        if self.stage.vocab_logits:      # whole logits for the caller
            outputs = [tp.gather_vocab(o, self.stage.tensor) for o in outputs]
        # The tensor ranks of the last stage hold the same outputs: tensor rank 0's count.
        mine = tree.map_tensors(lambda t: t.to("cpu"), outputs) \
            if self.plan.holds_last(self.stage.index) and self.stage.topo.tensor_rank == 0 \
            else None
        parts = waiting.gather(self._control, (self.stage.topo.replica, mine), 0)
        if self._control.rank != 0:
            return None
        pieces = [o for _, outs in sorted((p for p in parts if p[1] is not None),
                                          key=lambda p: p[0]) for o in outs]
        leaves = [tree.flatten(p)[0] for p in pieces]
        spec = tree.flatten(pieces[0])[1]
        joined = [torch.cat(col) if isinstance(col[0], torch.Tensor) else col[0]
                  for col in zip(*leaves)]
        return tree.unflatten(joined, spec)

    # -- state ----------------------------------------------------------------------------
    def gather_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model's state dict on world rank 0 (keys as in `build_sequential`). Call
        it on every rank."""
        with self.watchdog:
            self._agree("gather_state_dict")
            return self._guarded("gather_state_dict", self._gather_state)

    def _gather_state(self) -> dict[str, torch.Tensor] | None:
        local = {k: v.to("cpu") for k, v in self.master_state_dict().items()}
        topo = self.stage.topo
        parts = waiting.gather(topo.pipe, local, 0) if topo.replica == 0 else None
        if topo.rank != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return dict(sorted(merged.items(), key=lambda kv: _key_order(kv[0])))

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a whole model's state dict (keys as in `build_sequential`, e.g. from
        `gather_state_dict` or `models.hf.from_hf_state_dict`): each rank takes its layers'
        entries; masters and working copies are both set. Pass it on every rank.

        Tensor-parallel, a cut parameter's value is its whole tensor (cut here), or this
        tensor rank's slice of it (`kept_ranges` says which: a reader that reads only its
        slices passes those); its shape tells which."""
        module = self.stage.module
        mine = {k: v for k, v in state.items() if _key_order(k) in set(module.indices)}
        local = module.state_dict()
        expected = set(local)
        missing, unexpected = sorted(expected - set(mine)), sorted(set(mine) - expected)
        if missing or unexpected:
            raise ConfigError(
                f"{self.stage.describe()}: load_state_dict expected the keys of layers "
                f"{module.indices[0]}..{module.indices[-1]}; missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}; use build_sequential's keys ('<layer>.<name>')")
        whole = self._whole_shapes() if self.stage.tensor_comm is not None else {}
        wrong = [f"{k}: given {list(mine[k].shape)}, the model's {list(whole.get(k, v.shape))}"
                 for k, v in local.items() if mine[k].shape not in (v.shape, whole.get(k))]
        if wrong:
            raise ConfigError(
                f"{self.stage.describe()}: load_state_dict: {len(wrong)} tensor(s) of another "
                f"shape than the model's ({'; '.join(wrong[:3])}"
                f"{'; ...' if len(wrong) > 3 else ''}): the state is of another model (width, "
                f"vocabulary, heads); build the engine from the layers that wrote it")
        self._load_params(mine)

    def _load_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """Full-precision values by name: the working weights (cast) and the masters."""
        stage = self.stage
        self._weights_ready()            # no gather may write the weights after this
        params = self._cut(params)
        stage.module.load_state_dict({k: v.to(stage.device) for k, v in params.items()})
        values = {id(p): params[n].to(stage.device) for n, p in
                  stage.module.named_parameters(remove_duplicate=False) if n in params}
        stage.precision.load_masters(values)
        if stage.shards is not None:
            stage.shards.load_full(values)       # this replica's blocks of the masters

    def save(self, directory: str | os.PathLike) -> str:
        """Write a checkpoint (per-layer shards, atomically, checksummed); returns its folder.
        Call it on every rank."""
        with self.watchdog:
            self._agree("save")
        with self.watchdog.allow(self._io_allowance_s()):
            return save_checkpoint(self._checkpoint_state(), directory)

    def load(self, directory: str | os.PathLike) -> None:
        """Restore the latest checkpoint in `directory`, written on any grid. Call it on every
        rank."""
        with self.watchdog:
            self._agree("load")
        with self.watchdog.allow(self._io_allowance_s()):
            self.stats.step = load_checkpoint(self._checkpoint_state(), directory)

    def _io_allowance_s(self) -> float:
        """Seconds a checkpoint's I/O may take beyond `watchdog_s`: the largest rank's bytes
        (masters and optimizer state) at `CHECKPOINT_IO_BYTES_S`, a slow shared file system's
        rate; agreed, so the ranks that wait on the writers allow as long as they write."""
        stage = self.stage
        mine = sum(p.numel() * 4 for p in stage.module.parameters())
        state = stage.optimizer.state if stage.optimizer is not None else {}
        blocks = stage.topo.data if stage.shards is not None else 1   # sharded: 1/d held here
        mine += blocks * sum(v.numel() * v.element_size() for st in state.values()
                             for v in st.values() if torch.is_tensor(v))
        return max(waiting.allgather(self._control, mine)) / CHECKPOINT_IO_BYTES_S

    def _checkpoint_state(self) -> CheckpointState:
        """What a checkpoint reads and writes: a narrow view, not the engine."""
        stage, sharded = self.stage, self.stage.shards is not None
        tensor = stage.tensor_comm is not None and stage.optimizer is not None
        return CheckpointState(
            topo=stage.topo, n_layers=stage.n_layers, step=self.stats.step,
            config=self.config.to_dict(), layer_indices=stage.module.indices,
            master_state_dict=self.master_state_dict,
            named_master_parameters=self.named_master_parameters,
            load_params=self._load_params, optimizer=stage.optimizer,
            scaler=stage.precision.scaler, device=stage.device, model=self._fingerprint,
            optimizer_entries=self._sharded_entries if sharded else
            self._tensor_entries if tensor else None,
            load_optimizer_entries=self._load_sharded_entries if sharded else
            self._load_tensor_entries if tensor else None,
            plan={"schedule": self.schedule, "virtual_stages": self.plan.chunks,
                  "boundaries": list(self.plan.boundaries)})

    def _names(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.stage.module.named_parameters(remove_duplicate=False)
                if p.requires_grad]

    def _sharded_entries(self) -> tuple[dict[str, dict], dict[str, dict]]:
        """Sharded: whole optimizer state and group settings by parameter name, as an
        unsharded run saves them (gathered over the data group: every replica calls it;
        tensor-parallel, over the tensor group too)."""
        states, settings = self.stage.shards.full_optimizer_state()
        named = self._names()
        return (self._whole_state({n: states[id(p)] for n, p in named if id(p) in states}),
                {n: settings[id(p)] for n, p in named if id(p) in settings})

    def _tensor_entries(self) -> tuple[dict[str, dict], dict[str, dict]]:
        """Tensor-parallel: optimizer state by parameter name, a cut parameter's state tensors
        gathered whole (every tensor rank calls it), and group settings."""
        opt = self.stage.optimizer
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        named = self.named_master_parameters()
        states = self._whole_state({n: opt.state[p] for n, p in named if p in opt.state})
        return states, {n: {k: v for k, v in group_of[id(p)].items() if k != "params"}
                        for n, p in named if id(p) in group_of}

    def _whole_state(self, states: dict[str, dict]) -> dict[str, dict]:
        """Per-name optimizer state, a cut parameter's per-element tensors gathered whole."""
        splits, shapes = self._splits(), {n: p.shape for n, p in self._names()}
        return {n: {k: tp.gather_whole(self.stage.tensor, v, *splits[n], f"{n} {k}")
                    if n in splits and torch.is_tensor(v) and v.shape == shapes[n] else v
                    for k, v in st.items()} for n, st in states.items()}

    def _cut_state(self, states: dict[str, dict]) -> dict[str, dict]:
        """Whole per-name optimizer state cut into this tensor rank's slices."""
        if self.stage.tensor_comm is None:
            return states
        splits, group = self._splits(), self.stage.tensor
        whole = {n: tp.whole_shape(p.shape, splits[n][0], group.size) for n, p in self._names()
                 if n in splits}
        return {n: {k: tp.cut(v, *splits[n], group.size, group.rank)
                    if n in whole and torch.is_tensor(v) and v.shape == whole[n] else v
                    for k, v in st.items()} for n, st in states.items()}

    def _load_tensor_entries(self, states: dict[str, dict], settings: dict[str, dict]) -> None:
        """Tensor-parallel: whole per-name optimizer state cut into this rank's slices."""
        load_optimizer_by_name(self.stage.optimizer, self.named_master_parameters(),
                               self._cut_state(states), settings)

    def _load_sharded_entries(self, states: dict[str, dict], settings: dict[str, dict]) -> None:
        """Sharded: whole per-name optimizer state (of a checkpoint of any grid, sharded or
        not) cut into this replica's blocks (and first into this tensor rank's slices)."""
        named, states = self._names(), self._cut_state(states)
        self.stage.shards.load_optimizer_state(
            {id(p): states[n] for n, p in named if n in states},
            {id(p): settings[n] for n, p in named if n in settings})

    def close(self) -> None:
        """Check that every rank made the same calls, then free this engine's communicators
        (an engine per test would otherwise exhaust MPI's context ids)."""
        if self not in _OPEN:
            return
        _OPEN.discard(self)
        # Closing while this rank's own exception propagates (a `finally:` after user code
        # raised on this rank only): the other ranks may be in the next step, not here, so
        # the agreement waits only FAILING_CLOSE_S, not agree_s, before ending the job. An
        # exception raised on every rank alike (ConfigError) meets the others at once.
        failing = sys.exc_info()[1]
        grace = None
        if failing is not None and not isinstance(failing, ConfigError) \
                and self._world_size > 1:
            grace = min(self.config.agree_s or FAILING_CLOSE_S, FAILING_CLOSE_S)
        try:
            with self.watchdog:         # still armed: a rank that never closes is reported
                self._agree("close", grace, failing)
        finally:
            self.watchdog.close()
        self._control.Free()
        self.stage.close()

    @contextlib.contextmanager
    def watched(self, what: str) -> Iterator[None]:
        """A collective of the caller's own (a training loop's stop flag, its metrics) under
        the engine's watchdog: a rank that never arrives is reported as being in `what`."""
        self._instruction = what
        with self.watchdog:
            yield

    def _agree(self, call: str, deadline_s: float | None = None,
               failing: BaseException | None = None) -> None:
        """The agreement a call without a batch starts with: every rank in the same call at
        the same step, within `Config.agree_s` (or `deadline_s`, while this rank is raising
        `failing`)."""
        self._instruction = call
        if call != "close":            # close() took itself off the open engines already
            self._check_open(call)
        try:
            agree_call(self._control, call, self.stats.step,
                       self.config.agree_s if deadline_s is None else deadline_s)
        except waiting.NotJoined as exc:
            self._not_joined(call, exc, failing)
        self._weights_ready()

    def _weights_ready(self) -> None:
        """Sharded: the all-gathers of the working weights that the last step launched (and
        the next step's forwards would wait for, layer by layer) completed, before a call
        other than a training step reads or writes the weights. Every rank of the data
        group launched them, so every rank's wait completes."""
        if self.stage.shards is not None:
            self.stage.shards.wait_gathers()

    def _check_open(self, call: str) -> None:
        if self not in _OPEN:
            raise ConfigError(f"{self._where}: {call}() on a closed engine; build a new Engine "
                              f"(close() frees its communicators)")

    def _not_joined(self, call: str, exc: waiting.NotJoined,
                    failing: BaseException | None = None) -> None:
        """Not every rank came to `call` in time: this rank's view, then the end of the job
        (the agreement's messages are still in flight, so the engine cannot go on)."""
        who = (f"rank(s) {', '.join(map(str, exc.missing))} did not" if exc.missing else
               "rank 0, which collects the agreement, gave no verdict: not every rank did")
        if failing is not None:
            text = (f"{self._where} closed the engine while raising "
                    f"{type(failing).__name__}: {failing}; {who} close within "
                    f"{exc.waited:.0f} s (they are not failing alike, so they will not come): "
                    f"ending the job now rather than after agree_s = {self.config.agree_s:g}")
        else:
            text = (f"{self._where} called {call}() at step {self.stats.step}; {who} within "
                    f"{exc.waited:.0f} s (agree_s = {self.config.agree_s:g}). Call the "
                    f"engine's collective methods (train_step, eval_step, save, load, "
                    f"gather_state_dict, close) on every rank alike, never under `if rank == "
                    f"0:`; raise agree_s if some rank is legitimately that much later")
        _OPEN.discard(self)
        self.watchdog.close()
        if not self.abort_on_error:
            raise CollectiveError(f"pipeflow: {text}")
        say(f"\npipeflow: {text}. Aborting all ranks.\n")
        abort_world()

    # -- failure --------------------------------------------------------------------------
    def _at(self, instruction: str | Action) -> None:
        self._instruction = instruction
        self.watchdog.beat()

    def _instruction_text(self, probe: bool = False) -> str:
        """The running instruction as a report names it (a message with its peer rank)."""
        x = self._instruction
        return self.runner.describe(x, probe) if isinstance(x, Action) else x

    def _report_where(self) -> str:
        """The watchdog's report: where this rank is, and what it waits for."""
        text = (f"{self._where} at instruction {self._instruction_text(probe=True)} of step "
                f"{self.stats.step}")
        inside = self.stage.tensor.waiting
        if inside:    # a layer's collective over the tensor group, by the layer's name
            text += (f"; inside {inside} (tensor group ranks "
                     f"{topo_group(self.stage.topo, 'tensor')}): a tensor rank that skipped "
                     f"or reordered a cut layer's collective leaves the others here")
        stuck = [op for comm in (self.stage.pipe_comm, self.stage.data_comm,
                                 self.stage.tensor_comm)
                 if comm is not None for op in comm.in_flight()]
        if stuck:     # NCCL: the host waits at a later point than the link that is stuck
            text += "; on the device, still waiting: " + "; ".join(stuck[:4])
        topo = self.stage.topo
        if waiting.policy() == "spin" and \
                waiting.choose("auto", topo.local_size, topo.local_cores) == "yield":
            text += (f" (this node runs {topo.local_size} ranks on {topo.local_cores} cores "
                     f"and they spin while they wait, starving the ranks they wait for: set "
                     f"wait = 'auto' or 'yield')")
        return text

    def _guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        if what not in ("run", "eval"):
            self._at(what)
        t0 = self.runner.clock.mark() if self.runner.trace and what == "optimizer step" else None
        try:
            result = fn()
        except ConfigError:
            raise                       # agreed on every rank: raised everywhere alike
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - mid-step: end the job
            self._fail(exc)
        if t0 is not None:
            self.runner.note(what, t0, self.runner.clock.mark())
        return result

    def _fail(self, exc: BaseException) -> None:
        """Name the rank, stage and instruction, then end the whole job (no rank left hanging)."""
        where = f"{self._where} failed at instruction {self._instruction_text()} of step " \
                f"{self.stats.step}"
        if not self.abort_on_error or self._world_size == 1:
            if isinstance(exc, KeyboardInterrupt):
                raise exc               # Ctrl-C stays Ctrl-C where nobody else waits
            raise RuntimeError(f"pipeflow: {where}: {exc}") from exc
        report_and_abort(where, exc)


_OPEN: "weakref.WeakSet[Engine]" = weakref.WeakSet()
# The slowest disk a checkpoint's watchdog allowance assumes (bytes a second): 20 s a GB, a
# loaded shared file system's rate; the allowance is added to `watchdog_s` for save and load.
CHECKPOINT_IO_BYTES_S = 50e6
# close() while this rank raises its own exception: how long the others are waited for (ranks
# failing alike arrive together; one failing alone would otherwise hold the job agree_s).
FAILING_CLOSE_S = 1.0


def topo_group(topo: Topology, axis: str) -> list[int]:
    """The world ranks of this rank's group along `axis`."""
    return topo.grid.group(axis, topo.rank)


def check_launcher(world: MPI.Comm) -> None:
    """A process alone in its MPI world while a launcher of another kind (torchrun, a
    torch.distributed script) says the job has more ranks: each process would train a whole
    model of its own. Refused, saying how pipeflow is launched."""
    size = os.environ.get("WORLD_SIZE", "")
    if world.size != 1 or not size.isdigit() or int(size) <= 1:
        return
    who = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "a launcher"
    raise ConfigError(
        f"this process has RANK={os.environ.get('RANK', '?')} and WORLD_SIZE={size} from "
        f"{who}, but its MPI world holds 1 rank: every process would train alone. pipeflow "
        f"is launched with mpirun or srun, which start the ranks of one MPI job: `mpirun -n "
        f"{size} pipeflow train CONFIG.toml` (or `srun -n {size} ...`), not torchrun")


def fields_of(settings: type, config: Config) -> Any:
    """The frozen record `settings` (a part's own dataclass: `StageSettings`, ...) filled
    from `config` by field name: a part reads only the fields it declares, never `Config`."""
    return settings(**{f.name: getattr(config, f.name) for f in dataclasses.fields(settings)})


def use_deterministic_algorithms() -> None:
    """Deterministic kernels for this process (`Config.deterministic`). cuBLAS needs its
    workspace fixed for that, before its first use: set here unless the user set it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` of an object, called through a weak reference to the object."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return bound(*args) if bound is not None else None
    return call


def _key_order(key: str) -> int:
    # By layer only: the sort is stable, so names keep their order within a layer.
    head = key.partition(".")[0]
    return int(head) if head.isdigit() else sys.maxsize
