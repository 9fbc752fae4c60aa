"""`Engine`: runs one stage's instruction list, micro-batch by micro-batch, then steps."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Sequence

import torch
from mpi4py import MPI
from torch import nn

from pipeflow import schedule as sched
from pipeflow.checkpoint import load_checkpoint, save_checkpoint
from pipeflow.comm import Communicator, Request, TensorMeta, meta_of, mpi_iallreduce_
from pipeflow.config import Config, ConfigError
from pipeflow.data_parallel import GradReducer
from pipeflow.layers import (LayerSpec, _check_layers, build_layer, get_parameter,
                             set_parameter, tie_groups)
from pipeflow.partition import measure_layer_times, partition_layers
from pipeflow.precision import LossScaler, Precision, cast_floating
from pipeflow.recompute import SavedTensorMeter, auto_policy, parse_policy, stage_forward
from pipeflow.topology import Topology, bind_device, choose_backend, grid_communicators

__all__ = ["Engine", "StageModule", "BatchError"]

Batch = Any           # a tensor, or a tuple/list of tensors, batch dimension first
LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

_ACT, _GRAD = 0, 1    # tag = 2 · micro-batch + kind


class BatchError(ConfigError):
    """A batch the engine cannot split or use; raised on every rank alike."""


class StageModule(nn.Module):
    """The contiguous slice of layers one stage owns, named by their global indices.

    Parameter names are those of `build_sequential` (`"{layer}.{name}"`), so state dicts of
    all stages together are the sequential model's.
    """

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.indices = sorted(layers)
        for i in self.indices:
            self.add_module(str(i), layers[i])

    def forward(self, x: Any) -> Any:
        for i in self.indices:
            x = self._modules[str(i)](x)
        return x


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _from_tuple(ts: Sequence[torch.Tensor], was_tuple: bool) -> Any:
    return tuple(ts) if was_tuple else ts[0]


class Engine:
    """Pipeline-parallel training of a layer list on this rank's stage of the grid.

    Every rank builds only its own layers (seeded per layer, as `build_sequential` does),
    runs its stage's instruction list from the schedule, and steps its own optimizer.

    `comm` runs the engine on a sub-communicator instead of `MPI.COMM_WORLD`; `device`
    overrides the default (this rank's GPU by node-local rank, else the CPU); `trace` records
    each instruction's start and end (`timeline`); `measure_activations` counts the bytes
    stashed for backward (`peak_activation_bytes`); `sample`, a micro-batch of inputs, is what
    `partition = "time"` measures each layer's forward and backward on.
    """

    def __init__(self, layers: Sequence[LayerSpec], loss_fn: LossFn,
                 optimizer: OptimizerFactory, config: Config | None = None, *,
                 comm: MPI.Comm | None = None, device: str | torch.device | None = None,
                 abort_on_error: bool = True, trace: bool = False,
                 measure_activations: bool = False, sample: Batch | None = None) -> None:
        self.config = config = config if config is not None else Config()
        config.validate()
        _check_layers(layers)
        world = comm if comm is not None else MPI.COMM_WORLD
        self.topo = topo = Topology(world, config.pipeline, config.data)
        self.stage, self.stages = topo.stage, topo.pipeline
        self.abort_on_error = abort_on_error
        self.device = torch.device(device) if device is not None else _default_device(topo)
        bind_device(self.device)      # before CUDA's first use: layer building forks its RNG
        self.loss_fn = loss_fn
        self.n_layers = len(layers)
        times = None
        if config.partition == "time":
            # Measured once, on world rank 0, so every rank splits the model the same way.
            if world.rank == 0 and sample is not None:
                times = measure_layer_times(layers, sample, config.seed, device=self.device)
            times = world.bcast(times, root=0)
        self.layer_times = times
        # Model chunks (virtual stages) per rank: 1, or more under the interleaved schedule.
        # Virtual stage k = chunk · pipeline + stage; boundaries are per virtual stage.
        self.chunks = config.virtual_stages
        self.boundaries = partition_layers(layers, self.stages * self.chunks,
                                           config.partition, times)
        chunk_layers = [range(self.boundaries[c * self.stages + self.stage],
                              self.boundaries[c * self.stages + self.stage + 1])
                        for c in range(self.chunks)]
        built = {i: build_layer(layers[i], config.seed, i) for r in chunk_layers for i in r}
        self._tied = self._tie(layers, built)
        self.module = StageModule(built).to(self.device)
        scaler = LossScaler(config.loss_scale, config.loss_scale_growth,
                            config.loss_scale_backoff, config.loss_scale_interval,
                            config.loss_scale_min) if config.precision == "fp16" else None
        self.precision = Precision(self.module, config.precision, config.fp32_modules, scaler)
        params = self.precision.working
        masters = self.precision.masters
        self.skipped_steps = 0        # steps skipped for an overflow (fp16)
        self._chunks = [[self.module.get_submodule(str(i)) for i in r] for r in chunk_layers]
        # This stage's recomputation policy ("auto" is resolved on the first micro-batch).
        self.recompute = parse_policy(config.recompute, self.stages)[self.stage]
        # With measure_activations (settable per step): count the bytes autograd saves for
        # backward. Off by default: the count runs Python for every saved tensor.
        self.measure_activations = measure_activations
        self.activation_meter = SavedTensorMeter()
        self.peak_activation_bytes = 0   # bytes saved for backward, most held in last step
        self.peak_memory_bytes: int | None = None   # allocator peak of the last step (GPU)
        self.backend = choose_backend(config.backend, topo, self.device)
        self.pipe, self.data = self._communicators()
        self.reducer: GradReducer | None = None
        if self.data is not None:
            if params:
                self.reducer = GradReducer(params, self.data, int(config.bucket_mb * 2**20),
                                           grad_params=masters)
        # Parameters this stage counts in the gradient norm: a tied weight counts on the
        # first stage that holds it only.
        self._norm_params = [self.precision.master_of(p) for p in params
                             if all(p is not t for t, first, _ in self._tied if not first)]
        self.optimizer = optimizer(masters) if masters else None
        # Validate the schedule once, the same way on every rank, before any message moves.
        programs = sched.build_schedule(config.schedule, self.stages, config.microbatches,
                                        chunks=self.chunks)
        self.expected_peak_stash = sched.simulate(programs).peak_stash
        self.program = programs[self.stage]
        # Evaluation runs the forwards alone, in the training schedule's order (for GPipe
        # and 1F1B, micro-batch order), so every rank meets its inputs in the order sent.
        forwards = self.program if self.chunks > 1 else \
            sched.gpipe(self.stage, self.stages, config.microbatches)
        self.eval_program = [a for a in forwards
                             if a.op in (sched.RECV_ACT, sched.FORWARD, sched.SEND_ACT)]
        self.step_count = 0
        self.peak_stash = 0           # most micro-batches stashed at once in the last step
        self.last_grad_norm: float | None = None
        self.last_step_time = 0.0
        # Shapes of the tensors crossing each stage boundary, per (batch signature, chunk):
        # exchanged once, then receives are pre-posted into buffers of the cached shapes.
        self._act_meta: dict[tuple[Any, int], tuple[bool, tuple[TensorMeta, ...]]] = {}
        self._sent_meta: dict[tuple[Any, int], tuple[TensorMeta, ...]] = {}
        self._instruction: str = "setup"
        # With trace=True: (instruction, start, end) in perf_counter seconds, last step only.
        self.trace = trace
        self.timeline: list[tuple[str, float, float]] = []
        if world.size > 1 and abort_on_error:
            _install_abort_hook()

    # -- public API ---------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.topo.is_first

    @property
    def is_last(self) -> bool:
        return self.topo.is_last

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.module.parameters()

    @property
    def loss_scale(self) -> float:
        """The current dynamic loss scale (fp16); 1.0 without scaling. Alike on every rank."""
        return self.precision.loss_scale

    def named_master_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, the fp32 parameter the optimizer steps), tied names included."""
        return [(n, self.precision.master_of(p))
                for n, p in self.module.named_parameters(remove_duplicate=False)]

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state dict with full-precision values (the masters)."""
        state = {k: v.detach() for k, v in self.module.state_dict().items()}
        for name, master in self.named_master_parameters():
            state[name] = master.detach()
        return state

    def train_step(self, inputs: Batch | None, targets: Batch | None) -> float:
        """One optimizer step on the global batch; the global mean loss, alike on every rank.

        The first stage needs `inputs` and the last `targets`; other ranks may pass `None`.
        """
        start = time.perf_counter()
        self.module.train()
        sig, in_mbs, tgt_mbs = self._prepare(inputs, targets)
        losses = self._run(self.program, sig, in_mbs, tgt_mbs, train=True)
        self._guarded("optimizer step", self._step)
        loss = self._global_loss(losses)
        self.step_count += 1
        self.last_step_time = time.perf_counter() - start
        return loss

    @torch.no_grad()
    def eval_step(self, inputs: Batch | None, targets: Batch | None) -> float:
        """Forward only: the global mean loss, alike on every rank; no state changes."""
        self.module.eval()
        sig, in_mbs, tgt_mbs = self._prepare(inputs, targets)
        losses = self._run(self.eval_program, sig, in_mbs, tgt_mbs, train=False)
        return self._global_loss(losses)

    def gather_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model's state dict on world rank 0 (keys as in `build_sequential`)."""
        local = {k: v.to("cpu") for k, v in self.master_state_dict().items()}
        parts = self.topo.pipe.gather(local, root=0) if self.topo.replica == 0 else None
        if self.topo.rank != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return dict(sorted(merged.items(), key=lambda kv: _key_order(kv[0])))

    def save(self, directory: str | os.PathLike) -> str:
        """Write a checkpoint (per-layer shards, atomically); returns its folder."""
        return save_checkpoint(self, directory)

    def load(self, directory: str | os.PathLike) -> None:
        """Restore the latest checkpoint in `directory`, written on any grid."""
        load_checkpoint(self, directory)

    def close(self) -> None:
        """Free this engine's communicators (an engine per test would otherwise exhaust MPI's
        context ids)."""
        self.pipe.free()
        if self.data is not None:
            self.data.free()
        for comm in self._tie_comms.values():
            comm.Free()
        self.topo.free()

    # -- construction -------------------------------------------------------------------
    def _tie(self, layers: Sequence[LayerSpec],
             built: dict[int, nn.Module]) -> list[tuple[nn.Parameter, bool, MPI.Comm]]:
        """Make tied weights identical; open a communicator per tie that spans stages.

        Returns, for each tie this stage shares with others: the parameter, whether this stage
        is its first holder, and the communicator of its holders (one replica's stages).
        """
        stage_of = {i: k % self.stages for k in range(len(self.boundaries) - 1)
                    for i in range(self.boundaries[k], self.boundaries[k + 1])}
        self._tie_comms: dict[str, MPI.Comm] = {}
        tied: list[tuple[nn.Parameter, bool, MPI.Comm]] = []
        for key, holders in tie_groups(layers).items():
            stages = sorted({stage_of[i] for i, _ in holders})
            mine = [(i, attr) for i, attr in holders if i in built]
            member = self.stage in stages and len(stages) > 1
            # Collective over the world: every rank takes part, members per replica.
            comm = self.topo.world.Split(self.topo.replica if member else MPI.UNDEFINED,
                                         self.stage)
            if member:
                self._tie_comms[key] = comm
            if not mine:
                continue
            first, first_attr = holders[0]
            if first in built:
                shared = get_parameter(built[first], first_attr)
            else:
                # The first holder lives on another stage: start from its initialisation.
                shared = get_parameter(build_layer(layers[first], self.config.seed, first),
                                       first_attr)
            for i, attr in mine:
                set_parameter(built[i], attr, shared)
            if member:
                tied.append((shared, stages[0] == self.stage, comm))
        return tied

    def _communicators(self) -> tuple[Communicator, Communicator | None]:
        """The pipeline's communicator and, with replicas, the stage's data group's."""
        return grid_communicators(self.topo, self.backend, self.device, ring=self.chunks > 1)

    # -- the step -------------------------------------------------------------------------
    def _prepare(self, inputs: Batch | None, targets: Batch | None):
        """Split the batch into micro-batches; agree on its signature across the pipeline.

        Every rank learns of a bad batch on any rank, and all raise the same error.
        """
        m, d = self.config.microbatches, self.config.data
        problem, sig, in_mbs, tgt_mbs = None, None, None, None
        try:
            if self.is_first:
                in_mbs = self._split("inputs", inputs, m, d)
                sig = tuple((tuple(t.shape), str(t.dtype)) for t in _as_tuple(in_mbs[0]))
            if self.is_last:
                tgt_mbs = self._split("targets", targets, m, d)
        except BatchError as exc:
            problem = str(exc)
        views = self.pipe.allgather_object((problem, sig))
        errors = [p for p, _ in views if p]
        if errors:
            raise BatchError(errors[0])
        return views[0][1], in_mbs, tgt_mbs

    def _split(self, what: str, batch: Batch | None, m: int, d: int) -> list[Any]:
        where = f"{self.topo.describe()}"
        if batch is None:
            raise BatchError(
                f"{where}: train_step got {what}=None, but the "
                f"{'first' if what == 'inputs' else 'last'} stage needs the {what}; pass "
                f"the global batch's {what} on every rank (or at least on this one)")
        tensors = _as_tuple(batch)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise BatchError(f"{where}: {what} must be a tensor or a tuple of tensors, found "
                             f"{[type(t).__name__ for t in tensors]}")
        n = tensors[0].shape[0] if tensors[0].dim() else 0
        if any(t.dim() == 0 or t.shape[0] != n for t in tensors):
            raise BatchError(f"{where}: every tensor of {what} needs the same batch dimension "
                             f"first; found shapes {[tuple(t.shape) for t in tensors]}")
        if n == 0 or n % (m * d):
            raise BatchError(
                f"{where}: a global batch of {n} samples does not divide into {d} replica(s) x "
                f"{m} micro-batches; use a batch size that is a multiple of {m * d}")
        shard = n // d
        r = self.topo.replica
        tensors = [t[r * shard:(r + 1) * shard].to(self.device, non_blocking=True)
                   for t in tensors]
        chunks = [t.chunk(m) for t in tensors]
        was_tuple = isinstance(batch, (tuple, list))
        return [_from_tuple([c[i] for c in chunks], was_tuple) for i in range(m)]

    def _run(self, program: list[sched.Action], sig: Any, in_mbs, tgt_mbs,
             train: bool) -> list[torch.Tensor]:
        """Interpret this stage's instructions for one batch.

        State is keyed by (micro-batch, chunk): an interleaved schedule runs several model
        chunks (virtual stages `chunk · p + stage`) on each rank; the others run one.
        """
        m, d, p = self.config.microbatches, self.config.data, self.stages
        last_virtual = p * self.chunks - 1
        scale = 1.0 / (m * d)          # the mean over m micro-batches and d replicas
        stash: dict[tuple[int, int], tuple] = {}   # -> (inputs, outputs or loss)
        received: dict[tuple[int, int], list[torch.Tensor]] = {}
        grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        acts_out: dict[tuple[int, int], tuple[list[torch.Tensor], bool]] = {}
        grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        sends: list[Request] = []
        losses: list[torch.Tensor] = []
        recv_queue = [a for a in program if a.op in sched.RECVS]
        posted: dict[sched.Action, Request] = {}
        next_post = 0
        peak = 0
        # Neighbours on the ring: with chunks, the last rank feeds the first rank's next chunk.
        prev, nxt = (self.stage - 1) % p, (self.stage + 1) % p
        lookahead = 2   # receives kept in flight ahead of the program
        loss_scale = self.precision.loss_scale
        backwards = [a for a in program if a.op == sched.BACKWARD]
        last_backward = backwards[-1] if backwards else None

        def tag(act: sched.Action, kind: int) -> int:
            return 2 * (act.chunk * m + act.mb) + kind

        def post_receives(limit: int) -> None:
            # Keep up to `limit` receives in flight ahead of the program, so a message lands
            # while this stage still computes. Only once the shapes are known.
            nonlocal next_post
            while next_post < len(recv_queue) and len(posted) < limit:
                act = recv_queue[next_post]
                if act.op == sched.RECV_ACT:
                    if (sig, act.chunk) not in self._act_meta:
                        return
                    _, meta = self._act_meta[(sig, act.chunk)]
                    posted[act] = self.pipe.irecv(meta, prev, tag(act, _ACT), self.device)
                else:
                    if (sig, act.chunk) not in self._sent_meta:
                        return
                    meta = self._grad_meta(sig, act.chunk)
                    posted[act] = self.pipe.irecv(meta, nxt, tag(act, _GRAD), self.device)
                next_post += 1

        timeline = self.timeline = []
        if train:
            self.activation_meter.reset_peak()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        for act in program:
            self._instruction = repr(act)
            t0 = time.perf_counter() if self.trace else 0.0
            key = (act.mb, act.chunk)
            virtual = act.chunk * p + self.stage
            try:
                if act.op == sched.RECV_ACT:
                    if (sig, act.chunk) not in self._act_meta:
                        chunk, was_tuple, meta = self.pipe.recv_object(prev)
                        assert chunk == act.chunk, (chunk, act)
                        self._act_meta[(sig, act.chunk)] = (was_tuple, meta)
                    post_receives(lookahead)
                    ts = posted.pop(act).wait()
                    if train:
                        for t in ts:
                            if t.is_floating_point():
                                t.requires_grad_(True)
                    received[key] = ts
                elif act.op == sched.FORWARD:
                    post_receives(lookahead)
                    if virtual == 0:
                        x = self.precision.cast_input(in_mbs[act.mb])
                        x_tensors: list[torch.Tensor] = []
                    else:
                        x_tensors = received.pop(key)
                        x = _from_tuple(x_tensors, self._act_meta[(sig, act.chunk)][0])
                    layers = self._chunks[act.chunk]
                    if train and self.recompute == "auto":
                        self._resolve_auto(layers, x, tgt_mbs[act.mb]
                                           if virtual == last_virtual else None)
                    with torch.set_grad_enabled(train), (
                            self.activation_meter if train and self.measure_activations
                            else contextlib.nullcontext()):
                        out = stage_forward(layers, x, self.recompute if train else "none")
                        if virtual == last_virtual:
                            # The loss in fp32, whatever the working precision.
                            loss = self.loss_fn(cast_floating(out, torch.float32),
                                                tgt_mbs[act.mb])
                            losses.append(loss.detach())
                            outs: Any = loss
                        else:
                            outs = _as_tuple(out)
                            acts_out[key] = (list(outs), isinstance(out, (tuple, list)))
                    if train:
                        stash[key] = (x_tensors, outs)
                        peak = max(peak, len(stash))
                elif act.op == sched.SEND_ACT:
                    ts, was_tuple = acts_out.pop(key)
                    if (sig, act.chunk) not in self._sent_meta:
                        # Once per batch shape: the receiver caches it and pre-posts buffers.
                        self._sent_meta[(sig, act.chunk)] = meta_of(ts)
                        self.pipe.send_object((act.chunk + (self.stage == p - 1), was_tuple,
                                               meta_of(ts)), nxt)
                    sends.append(self.pipe.isend(ts, nxt, tag(
                        act._replace(chunk=act.chunk + (self.stage == p - 1)), _ACT)))
                elif act.op == sched.RECV_GRAD:
                    post_receives(lookahead)
                    grads_in[key] = posted.pop(act).wait()
                elif act.op == sched.BACKWARD:
                    post_receives(lookahead)
                    x_tensors, outs = stash.pop(key)
                    if self.reducer is not None and act == last_backward:
                        self.reducer.arm()
                    if virtual == last_virtual:
                        (outs * (scale * loss_scale)).backward()
                    else:
                        pairs = [(o, g) for o, g in zip(outs, grads_in.pop(key))
                                 if o.requires_grad]
                        if pairs:
                            torch.autograd.backward([o for o, _ in pairs],
                                                    [g for _, g in pairs])
                    grads_out[key] = [
                        t.grad if t.grad is not None else torch.zeros_like(t)
                        for t in x_tensors if t.is_floating_point()]
                elif act.op == sched.SEND_GRAD:
                    # To the previous virtual stage: on the last rank's previous chunk when
                    # this is the first rank.
                    sends.append(self.pipe.isend(grads_out.pop(key), prev, tag(
                        act._replace(chunk=act.chunk - (self.stage == 0)), _GRAD)))
                # Let MPI move finished messages along without blocking.
                sends = [s for s in sends if not s.test()]
                if self.reducer is not None and self.reducer.armed:
                    self.reducer.poll()
            except Exception as exc:  # noqa: BLE001 - any failure mid-schedule ends the job
                self._fail(exc)
            if self.trace:
                timeline.append((repr(act), t0, time.perf_counter()))
        for s in sends:
            s.wait()
        if train:
            self.peak_stash = peak
            self.peak_activation_bytes = self.activation_meter.peak
            if self.device.type == "cuda":
                self.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device)
        return losses

    def _resolve_auto(self, layers: list[nn.Module], x: Any, target: Any) -> None:
        """Measure this stage (its chunk) on a real micro-batch and pick the cheapest policy
        whose stash (depth from the schedule: min(p - s, m) under 1F1B) fits the budget."""
        budget = int(self.config.activation_budget_mb * 2**20)
        tail = ((lambda out: self.loss_fn(cast_floating(out, torch.float32), target))
                if target is not None else None)
        self.recompute = auto_policy(layers, x, self.expected_peak_stash[self.stage],
                                     budget, where=self.topo.describe(), tail=tail)

    def _grad_meta(self, sig: Any, chunk: int) -> tuple[TensorMeta, ...]:
        """Gradients come back for the floating-point tensors this stage (chunk) sent."""
        return tuple(mt for mt in self._sent_meta[(sig, chunk)] if mt[1].is_floating_point)

    def _step(self) -> None:
        clip = self.config.clip
        if self.reducer is not None:
            self.reducer.finish()       # waits only for the buckets still in flight
        for working, _, comm in self._tied:
            # Sum a tied weight's gradient over the stages that hold it (after the replicas
            # were summed, so each replica's copy ends up with the whole gradient).
            param = self.precision.master_of(working)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            mpi_iallreduce_(comm, param.grad).wait()
        self.precision.unscale_()
        scaler = self.precision.scaler
        if clip > 0 or scaler is not None:
            norm = self._grad_norm()
            self.last_grad_norm = norm
        if scaler is not None:
            # An inf or NaN anywhere reaches every rank's norm: the data all-reduce spreads it
            # over the replicas, the norm's all-reduce over the stages. So every rank takes
            # the same decision and keeps the same scale.
            overflow = not math.isfinite(norm)
            scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                self._zero_grad()
                return
        if clip > 0:
            # As torch.nn.utils.clip_grad_norm_, over the whole model's gradient.
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                for p in self.precision.masters:
                    if p.grad is not None:
                        p.grad.detach().mul_(coef)
        if self.optimizer is not None:
            self.optimizer.step()
            self.precision.refresh_working()
        self._zero_grad()

    def _grad_norm(self) -> float:
        """The whole grid's gradient norm: tied weights once, replicas once (they agree)."""
        grads = [p.grad.detach() for p in self._norm_params if p.grad is not None]
        # Per-tensor norms (no fp64 copy of every gradient), squared and summed in fp64.
        sq = (torch.stack([torch.linalg.vector_norm(g) for g in grads]).double().square().sum()
              if grads else torch.zeros((), dtype=torch.float64))
        sq = sq.reshape(1).to(self.pipe.device)   # NCCL groups take CUDA tensors only
        if self.stages > 1:
            self.pipe.allreduce_(sq)
        return math.sqrt(sq.item())

    def _zero_grad(self) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()    # the master gradients are views of its buckets
            self.precision.zero_grad(masters=False)
        else:
            self.precision.zero_grad()

    def _global_loss(self, losses: list[torch.Tensor]) -> float:
        total = float(torch.stack(losses).double().mean()) if losses else 0.0
        if self.is_last and self.config.data > 1:
            total = self.topo.data_group.allreduce(total) / self.config.data
        return self.pipe.bcast_object(total, root=self.stages - 1)

    # -- failure ------------------------------------------------------------------------
    def _guarded(self, what: str, fn: Callable[[], None]) -> None:
        self._instruction = what
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        if self.trace:
            self.timeline.append((what, t0, time.perf_counter()))

    def _fail(self, exc: BaseException) -> None:
        """Name the rank, stage and instruction, then end the whole job (no rank left hanging)."""
        where = (f"{self.topo.describe()} failed at instruction {self._instruction} of step "
                 f"{self.step_count}")
        if not self.abort_on_error or self.topo.world.size == 1:
            raise RuntimeError(f"pipeflow: {where}: {exc}") from exc
        _abort(where, exc)


def _abort(where: str, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write(f"\npipeflow: {where}:\n{text}pipeflow: aborting all ranks\n")
    _abort_world()


def _abort_world() -> None:
    """End every rank. The launcher forwards a rank's output asynchronously and drops what
    is still in flight when it tears the job down: give the report a moment to get out."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.5)
    MPI.COMM_WORLD.Abort(1)


def _install_abort_hook() -> None:
    """An uncaught exception on any rank ends the whole job instead of leaving it blocked."""
    if sys.excepthook is not sys.__excepthook__:
        return

    def hook(kind, exc, tb):
        sys.__excepthook__(kind, exc, tb)
        sys.stderr.write(f"pipeflow: rank {MPI.COMM_WORLD.rank} raised an uncaught "
                         f"{kind.__name__}; aborting all ranks\n")
        _abort_world()

    sys.excepthook = hook


def _default_device(topo: Topology) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", topo.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _key_order(key: str) -> int:
    # By layer only: the sort is stable, so names keep their order within a layer.
    head = key.partition(".")[0]
    return int(head) if head.isdigit() else sys.maxsize
