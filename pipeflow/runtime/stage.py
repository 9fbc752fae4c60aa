"""`Stage`: what one rank holds — its layers, device, communicators, precision, optimizer.

The runner, the batch splitter and the step closer take a `Stage`, never the `Engine`. The
facts of the pipeline as a whole (schedule, layout, programs, boundaries) are read from
`stage.plan` and `stage.plan.spec`; the settings a stage and its steps read arrive as two
small frozen records made from `Config` by the engine (`StageSettings`, `StepSettings`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import torch
from mpi4py import MPI
from torch import nn

from pipeflow.comm import waiting
from pipeflow.comm.base import Communicator
from pipeflow.comm.topology import (Topology, choose_backend, grid_communicators,
                                    tensor_communicator)
from pipeflow.config import ConfigError
from pipeflow.layers import LayerSpec, build_layer, get_parameter, set_parameter, tie_groups
from pipeflow.runtime.data_parallel import GradReducer
from pipeflow.runtime.precision import DTYPES, LossScaler, Precision, class_matches
from pipeflow.runtime.shard import ShardedOptimizer
from pipeflow.runtime.tensor_parallel import (TensorGroup, check_cut_consistent, in_region,
                                              plan_of, sequence_boundaries, shard_layer,
                                              split_of, vocab_output)
from pipeflow.schedules.ir import Action
from pipeflow.schedules.plan import Plan

__all__ = ["Stage", "StageModule", "StageSettings", "StepSettings", "Tie"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class StageSettings:
    """The `Config` fields building a stage reads (the engine fills them by name)."""

    seed: int                           # layer i is built under (seed, i)
    precision: str
    fp32_modules: Sequence[Any]
    initial_loss_scale: float           # fp16's dynamic loss scale, from here ...
    loss_scale_growth: float
    loss_scale_backoff: float
    loss_scale_interval: int
    loss_scale_min: float               # ... to here
    recompute_modules: Sequence[Any]
    backend: str
    bucket_mb: float
    grad_reduce_dtype: str
    shard_optimizer: bool
    compile: bool | str
    watchdog_s: float                   # the communicators' own timeout
    sequence_parallel: bool             # tensor > 1: planned layers run on sequence slices


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The `Config` fields a step reads of the stage that runs it: the batch splitter
    (`runtime.batch`), the runner and the step closer (`runtime.optim_step`)."""

    microbatches: int
    data: int                           # replicas: the loss's mean is over m · d
    batch: str                          # "global" or "local" inputs on each replica
    free_sent_outputs: bool
    activation_budget_mb: float         # recompute "auto"'s budget
    clip: float
    max_nonfinite_steps: int


class StageModule(nn.Module):
    """The layers one rank owns (one or more model chunks), named by their global indices.

    Parameter names are those of `build_sequential` (`"{layer}.{name}"`), so state dicts of
    all stages together are the sequential model's. It is a container, not a callable: the
    runner calls each chunk's layers in turn (`Stage.chunk_layers`).
    """

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.indices = sorted(layers)
        for i in self.indices:
            self.add_module(str(i), layers[i])


class Tie:
    """A weight shared with other stages: summed over its holders after each backward.

    `comm`: the holders of one replica over MPI; `dist`: the same ranks as a torch.distributed
    group (NCCL or gloo backends), which then sums the gradient on the stage's device.
    """

    def __init__(self, param: nn.Parameter, first: bool, comm: MPI.Comm,
                 dist: Communicator | None = None) -> None:
        self.param, self.first, self.comm, self.dist = param, first, comm, dist


class Stage:
    """One rank's share of the model and the machinery around it.

    Virtual stage `chunk · p + stage` is chunk `chunk` of this rank (one chunk but under the
    interleaved schedule); `chunk_layers[c]` are its layers in order.
    """

    def __init__(self, layers: Sequence[LayerSpec], settings: StageSettings,
                 step_settings: StepSettings, topo: Topology, plan: Plan,
                 optimizer: OptimizerFactory, device: torch.device) -> None:
        """Build this rank's share of `plan` (made by `runtime.arrange.arrange_pipeline`, the
        same on every rank) on `device`: layers, ties, precision, communicators, reducer and
        optimizer. Collective over the world: every rank builds its stage together."""
        self.settings, self.step_settings = settings, step_settings
        self.topo, self.plan, self.device = topo, plan, device
        self.index, self.stages = topo.stage, topo.pipeline
        self.n_layers = len(layers)
        world = topo.world
        ranges = self.plan.layer_ranges(self.index)
        built = {i: build_layer(layers[i], settings.seed, i) for r in ranges for i in r}
        # Ranks finish building at different times: wait for the last one here, by the wait
        # policy, rather than inside the communicator splits below (MPI's own, which spin).
        waiting.barrier(world)
        self.tie_comms: dict[str, MPI.Comm] = {}
        self.tie_stages: list[list[int]] = []    # each spanning tie's stages, alike everywhere
        self.ties = self._tie(layers, built)
        self._build_tensor(built)
        self.module = StageModule(built).to(self.device)
        self.chunk_layers = [[self.module.get_submodule(str(i)) for i in r] for r in ranges]
        if settings.compile:
            _compile_layers(self.module, settings.compile, self.plan.spec.split_backward,
                            self.describe())
        # The distributed optimizer: masters and optimizer state sharded over the replicas.
        self.sharded = settings.shard_optimizer and topo.data > 1
        self.precision = Precision(self.module, settings.precision, settings.fp32_modules,
                                   _scaler(settings), sharded=self.sharded)
        self.recompute = self.plan.recompute[self.index]   # "auto": resolved on first use
        mark_selective(self.module, settings.recompute_modules, self.recompute, self.describe())
        self.backend = choose_backend(settings.backend, topo, self.device)
        self.post_ahead = 1             # receives posted a compute early (NCCL may say 0)
        self.pipe_comm, self.data_comm = self._communicators()
        self.tensor_comm = self.tensor.comm = (
            tensor_communicator(topo, self.backend, self.device) if topo.tensor > 1 else None)
        self._tie_groups()
        self.shards: ShardedOptimizer | None = None
        if self.sharded:
            self._build_sharded(optimizer)
            return
        masters = self.precision.masters
        self.reducer = (GradReducer(self.precision.working, self.data_comm,
                                    int(settings.bucket_mb * 2**20), grad_params=masters,
                                    reduce_dtype=self._reduce_dtype())
                        if self.data_comm is not None and masters else None)
        # A tied weight counts in the gradient norm on the first stage that holds it only.
        # The whole weights the norm leaves to tensor rank 0 are still checked for a
        # non-finite gradient here (an overflow on one tensor rank skips the step on all).
        later = {id(t.param) for t in self.ties if not t.first}
        mine = [p for p in self.precision.working if id(p) not in later]
        self.norm_params = [self.precision.master_of(p) for p in mine if self._counts(p)]
        self.finite_only = [self.precision.master_of(p) for p in mine if not self._counts(p)]
        self.optimizer = _make_optimizer(optimizer, masters, topo.describe())

    def _reduce_dtype(self) -> torch.dtype | None:
        """`Config.grad_reduce_dtype` as the dtype buckets cross the data group in (None: the
        fp32 buckets themselves); bf16 over MPI, which has no bf16 sum, is refused."""
        name = self.settings.grad_reduce_dtype
        if name == "fp32" or self.data_comm is None:
            return None
        if name == "bf16" and self.backend in ("mpi", "strict"):
            raise ConfigError(
                f"{self.describe()}: grad_reduce_dtype = \"bf16\" needs a bf16 sum, which MPI "
                f"(backend {self.backend!r}) does not have; use backend \"nccl\" (GPUs) or "
                f"\"gloo\", or grad_reduce_dtype = \"fp16\" (MPI sums it) or \"fp32\"")
        return DTYPES[name]

    def _build_sharded(self, factory: OptimizerFactory) -> None:
        """Config.shard_optimizer on d > 1 replicas: the reducer, the masters and the optimizer
        are one `ShardedOptimizer` (the norm is summed from its blocks, not `norm_params`)."""
        working = self.precision.working
        self.norm_params, self.finite_only = [], []
        self.reducer = self.optimizer = None
        if not working:
            return
        probe = _make_optimizer(factory, working, self.describe())
        self.shards = ShardedOptimizer(working, self.precision.take_initial(), self.ties,
                                       self.data_comm, int(self.settings.bucket_mb * 2**20),
                                       probe, self.describe(), self._reduce_dtype(),
                                       counts=self._counts)
        # The all-gathers a step launches are waited by the next step's forwards, layer by
        # layer, in the order the stage runs its layers.
        self.shards.watch_layers(list(self.module.children()), bool(self.settings.compile))
        self.reducer, self.optimizer = self.shards, self.shards.optimizer

    def describe(self) -> str:
        return self.topo.describe()

    # -- construction ---------------------------------------------------------------------
    def _tie(self, layers: Sequence[LayerSpec], built: dict[int, nn.Module]) -> list[Tie]:
        """Make tied weights identical; open a communicator per tie that spans stages."""
        stage_of = {i: self.plan.rank_of_layer(i) for i in range(self.n_layers)}
        ties: list[Tie] = []
        for key, holders in tie_groups(layers).items():
            stages = sorted({stage_of[i] for i, _ in holders})
            mine = [(i, attr) for i, attr in holders if i in built]
            member = self.index in stages and len(stages) > 1
            if len(stages) > 1:
                self.tie_stages.append(stages)
            # Collective over the world: every rank takes part, members per pipeline.
            comm = self.topo.world.Split(
                self.topo.grid.index("pipeline", self.topo.rank) if member else MPI.UNDEFINED,
                self.index)
            if member:
                self.tie_comms[key] = comm
            if not mine:
                continue
            first, first_attr = holders[0]
            source = built[first] if first in built else \
                build_layer(layers[first], self.settings.seed, first)   # its initialisation
            shared = get_parameter(source, first_attr)
            for i, attr in mine:
                set_parameter(built[i], attr, shared)
            if member:
                ties.append(Tie(shared, stages[0] == self.index, comm))
        return ties

    def _counts(self, p: nn.Parameter) -> bool:
        """Whether `p`'s gradient counts in the norm on this rank: a slice of a cut weight
        always, a weight every tensor rank holds whole on tensor rank 0 only."""
        return self.topo.tensor_rank == 0 or split_of(p) is not None

    def _build_tensor(self, built: dict[int, nn.Module]) -> None:
        """Tensor parallelism: each layer built whole (by then), cut by its tp_plan."""
        self.tensor = TensorGroup(self.topo.tensor, self.topo.tensor_rank,
                                  self.settings.sequence_parallel)
        self.sequence_params: list[nn.Parameter] = []   # summed over the tensor group
        self.sequence_present = None     # optim_step: their "gradient present" counts
        self.vocab_logits = False        # this stage's logits come cut along the vocabulary
        if self.topo.tensor > 1:
            self._cut(built)

    def _cut(self, built: dict[int, nn.Module]) -> None:
        """Cut this rank's layers by their tp_plans; a plan that does not fit on any rank is
        refused on every rank (with the first rank's reason), before any communicator."""
        problem, planned = None, {}
        try:
            for i, layer in built.items():
                refused = getattr(layer, "tp_refusal", None)
                if refused:
                    raise ConfigError(f"layer {i} ({type(layer).__name__}): {refused}")
                planned[i] = bool(plan_of(layer))
                shard_layer(layer, self.tensor, i)
                planned[i] = planned[i] and (in_region(layer) or "plan only")
            for i, layer in built.items():
                check_cut_consistent(layer, f"layer {i} ({type(layer).__name__})")
            if self.settings.shard_optimizer and self.topo.data > 1:
                _refuse_sharded_partial(built)
        except ConfigError as exc:
            problem = f"{self.describe()}: {exc}"
        views = waiting.allgather(self.topo.world, (problem, planned))
        first = problem or next((p for p, _ in views if p), None)
        if first:
            raise ConfigError(first)
        flags = {i: f for _, mine in views for i, f in mine.items()}
        if not any(flags.values()):
            raise ConfigError(
                f"{self.describe()}: tensor = {self.topo.tensor}, and no layer of the model "
                f"declares a tp_plan, so every tensor rank would compute the whole model; "
                f"give the layer classes a tp_plan (docs/design.md, 'The tensor axis') or "
                f"set tensor = 1")
        for tie in self.ties:     # the holders of a tie across stages cut it alike
            shapes = waiting.allgather(tie.comm, (self.index, tuple(tie.param.shape)))
            if len({s for _, s in shapes}) > 1:
                raise ConfigError(
                    f"{self.describe()}: a weight tied across stages has shapes {shapes} "
                    f"(stage, shape) after the tp_plans cut it; give every holder the same "
                    f"tp_plan style")
        # Whole weights on a slice of the features: their gradients summed over the group.
        self.sequence_params = [p for layer in built.values() for p in layer.parameters()
                                if getattr(p, "pf_partial_gradient", False)]
        last = built.get(self.n_layers - 1)
        self.vocab_logits = last is not None and vocab_output(last)
        if self.settings.sequence_parallel:
            order = [flags[i] is True for i in range(self.n_layers)]
            for i, layer in built.items():
                sequence_boundaries(layer, i, order, self.tensor)
            seen = {id(p) for p in self.sequence_params}
            self.sequence_params += [p for i, layer in built.items() if order[i]
                                     for p in layer.parameters()
                                     if split_of(p) is None and p.requires_grad and
                                     id(p) not in seen]

    def _communicators(self) -> tuple[Communicator, Communicator | None]:
        """The pipeline's communicator and, with replicas, the stage's data group's. Only
        the interleaved schedule needs the ring's wrap-around link (ZBV turns on one rank)."""
        if self.backend == "nccl":
            from pipeflow.comm.torch_dist import check_nccl_launch_order, nccl_post_ahead
            check_nccl_launch_order(self.plan.programs, self.describe())
            self.post_ahead = nccl_post_ahead(self.plan.programs, self.describe(),
                                              reductions=self.topo.data > 1)
        return grid_communicators(self.topo, self.backend, self.device,
                                  ring=self.plan.spec.ring(self.plan.chunks),
                                  timeout_s=self.settings.watchdog_s)

    def _tie_groups(self) -> None:
        """Under torch.distributed, a group per spanning tie and replica, made on every rank
        in the same order, so a tied gradient is summed on the device (not staged through
        the host by MPI). MPI keeps the MPI communicators of `_tie`; under `strict` each is
        wrapped like every other group, so a tie's sum is checked by NCCL's rules too."""
        if self.backend == "mpi":
            return
        if self.backend == "strict":
            from pipeflow.comm.strict import StrictCommunicator
            for tie in self.ties:
                tie.dist = StrictCommunicator(tie.comm, self.device)
            return
        from pipeflow.comm.torch_dist import torch_family_communicators

        mine = iter(self.ties)
        for stages in self.tie_stages:
            ranks = [[line[s] for s in stages] for line in self.topo.grid.groups("pipeline")]
            tie = next(mine) if self.index in stages else None
            dist = torch_family_communicators(tie.comm if tie else None, ranks, self.backend,
                                              self.device, "tie")
            if tie is not None:
                tie.dist = dist

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
        self.pipe_comm.free()
        for comm in (self.data_comm, self.tensor_comm):
            if comm is not None:
                comm.free()
        for tie in self.ties:
            if tie.dist is not None:
                tie.dist.free()
        for comm in self.tie_comms.values():
            comm.Free()
        self.topo.free()


def _refuse_sharded_partial(built: dict[int, nn.Module]) -> None:
    """The sharded optimizer reduce-scatters gradients during the backward, before the step
    sums a `partial_gradient` weight's over the tensor group (a norm over each head of q):
    refused, naming the weights, as sequence parallelism is (`Config`)."""
    partial = [f"layer {i}: {name}" for i, layer in built.items()
               for name, p in layer.named_parameters()
               if getattr(p, "pf_partial_gradient", False)]
    if partial:
        raise ConfigError(
            f"shard_optimizer with data > 1 cannot sum over the tensor group the gradients of "
            f"whole weights that act on a slice of the features (tp_plan "
            f"\"partial_gradient\": {', '.join(partial[:3])}{', ...' if partial[3:] else ''}); "
            f"set shard_optimizer = false, or tensor = 1")


def mark_selective(module: nn.Module, names: Sequence[Any], policy: str, where: str) -> None:
    """Mark the modules `recompute = "selective"` checkpoints: classes named (by suffix) in
    `recompute_modules`; warn when a selective stage has none, which would recompute nothing."""
    found = 0
    for sub in module.modules():
        if class_matches(sub, names):          
            sub.pipeflow_selective = True
        found += getattr(sub, "pipeflow_selective", False) is True
    if policy == "selective" and not found:
        warnings.warn(f"{where}: recompute 'selective' finds no module to recompute on this "
                      f"stage, so it recomputes nothing; list module classes in "
                      f"recompute_modules (e.g. ['Attention']) or mark modules with "
                      f"`pipeflow_selective = True`", stacklevel=2)


def _scaler(settings: StageSettings) -> LossScaler | None:
    if settings.precision != "fp16":
        return None
    return LossScaler(settings.initial_loss_scale, settings.loss_scale_growth,
                      settings.loss_scale_backoff, settings.loss_scale_interval,
                      settings.loss_scale_min)


def _make_optimizer(factory: OptimizerFactory, masters: list[nn.Parameter],
                    where: str) -> torch.optim.Optimizer | None:
    if not masters:
        return None
    opt = factory(masters)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"{where}: the optimizer factory returned {type(opt).__name__}, expected a "
            f"torch.optim.Optimizer over the parameters it is given (e.g. "
            f"`lambda params: torch.optim.AdamW(params, lr=3e-4)`); did it forget `return`?")
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    missing = [p for p in masters if id(p) not in held]
    foreign = len(held - {id(p) for p in masters})
    if missing or foreign:
        raise ConfigError(
            f"{where}: the optimizer must step exactly the parameters its factory is given "
            f"({len(masters)} on this stage); it holds {len(held)}, of which {foreign} are "
            f"other tensors, and misses {len(missing)} (shapes "
            f"{[tuple(p.shape) for p in missing[:4]]}); build it over the `params` argument "
            f"(`lambda params: torch.optim.AdamW(params, ...)`), not over a model of your own")
    return opt


def _compile_layers(module: nn.Module, backend: bool | str, split_backward: bool,
                    where: str) -> None:
    """`Config.compile`: each layer compiled on its own (`nn.Module.compile`, in place, so
    parameter names, state dicts, hooks and the stage's views of the parameters stay as they
    are); a layer compiles when first run. The engine's own machinery (messages, stash,
    recomputation's replays, split backward, buckets) runs around the compiled layers.

    A split backward (B, then W later) walks a compiled layer's backward twice, keeping its
    graph in between; AOT autograd's donated buffers forbid that, so they are turned off for
    this process (`torch._functorch.config.donated_buffer`) under such schedules."""
    name = "inductor" if backend is True else backend
    import torch._dynamo
    import torch._functorch.config
    if split_backward:
        torch._functorch.config.donated_buffer = False
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(
            f"{where}: compile = {backend!r} names no torch.compile backend; found "
            f"{sorted(torch._dynamo.list_backends(exclude_tags=()))}; use true (inductor), "
            f"one of those, or false")
    for layer in module.children():
        layer.compile(backend=name)


def default_device(topo: Topology, requested: torch.device | None = None) -> torch.device:
    """The device this rank runs on: `requested`, where a bare "cuda" (no index) means this
    rank's own GPU (its place among the job's ranks on its node, modulo the node's GPUs),
    not GPU 0 for every rank; by
    default that GPU where there is one, else the CPU."""
    if requested is not None and (requested.type != "cuda" or requested.index is not None):
        return requested
    if torch.cuda.is_available():
        return torch.device("cuda", topo.gpu_slot % torch.cuda.device_count())
    if requested is not None:
        raise ConfigError(f"{topo.describe()}: device 'cuda' asked for, and this rank sees no "
                          f"GPU (torch.cuda.is_available() is False); use device='cpu'")
    return torch.device("cpu")
