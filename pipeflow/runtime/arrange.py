"""Arranging a pipeline: the schedule (`auto` resolved by measuring), the partition, and the
`schedules.plan.Plan` they make (what every rank runs; the planner's sizing result is another
thing, in `pipeflow.planner`).

World rank 0 measures what needs measuring (`partition = "time"`, `schedule = "auto"`) on a
sample micro-batch and broadcasts it; every rank then computes the same pure `Plan` from the
same numbers. Nothing here builds a layer for training or opens a communicator.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow.config import SCHEDULES, ConfigError, parse_policy
from pipeflow.layers import LayerSpec
from pipeflow.logs import get_logger
from pipeflow import tree
from pipeflow.runtime.partition import (clock, each_layer, grad_outputs, leaf_input,
                                        measure_layer_times, partition_layers)
from pipeflow.runtime.recompute import SavedTensorMeter
from pipeflow.schedules.auto import LayerCosts, choose_schedule
from pipeflow.schedules.ir import ScheduleError
from pipeflow.schedules.plan import Plan
from pipeflow.schedules.split_backward import backward_input, backward_weight

__all__ = ["ArrangeSettings", "Arrangement", "arrange_pipeline", "measure_layer_costs"]

_log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class ArrangeSettings:
    """The `Config` fields arranging a pipeline reads (the engine fills them by name)."""

    schedule: str                       # a name, or "auto"
    virtual_stages: int
    partition: str | Sequence[int]
    microbatches: int
    recompute: str | Sequence[str]
    activation_budget_mb: float         # "auto"'s activation budget
    seed: int                           # the layers measured are built as for training
    precision: str
    fp32_modules: Sequence[Any]


@dataclasses.dataclass(frozen=True)
class Arrangement:
    """The `Plan` every rank runs and why: the text of `auto`'s choice ("" when a schedule
    was named)."""

    plan: Plan
    choice: str = ""


def arrange_pipeline(layers: Sequence[LayerSpec], settings: ArrangeSettings, world: MPI.Comm,
                     stages: int, sample: Any, device: torch.device) -> Arrangement:
    """The same `Plan` on every rank of `world` for `layers` under `settings`."""
    schedule, chunks, times, choice = _resolve_schedule(layers, settings, world, sample, device,
                                                        stages)
    boundaries = partition_layers(layers, stages * chunks, settings.partition, times)
    plan = Plan.build(schedule, stages, settings.microbatches, chunks, boundaries,
                      parse_policy(settings.recompute, stages))
    return Arrangement(plan, choice)


def _measure_times(layers: Sequence[LayerSpec], settings: ArrangeSettings, world: MPI.Comm,
                   sample: Any, device: torch.device) -> list[float] | None:
    """`partition = "time"`: measured once, on world rank 0, so every rank splits alike."""
    if settings.partition != "time":
        return None
    times = None
    if world.rank == 0 and sample is not None:
        times = measure_layer_times(layers, sample, settings.seed, device=device,
                                    precision=settings.precision,
                                    fp32_modules=settings.fp32_modules)
    return waiting.bcast(world, times, 0)


def _resolve_schedule(layers: Sequence[LayerSpec], settings: ArrangeSettings, world: MPI.Comm,
                      sample: Any, device: torch.device, stages: int
                      ) -> tuple[str, int, list[float] | None, str]:
    """(schedule, model chunks per rank, layer times for partition 'time', the text of
    schedule 'auto''s choice). 'auto' measures on world rank 0 and broadcasts, then every
    rank chooses alike from the same numbers; rank 0 prints the choice."""
    if settings.schedule != "auto":
        return (settings.schedule, settings.virtual_stages,
                _measure_times(layers, settings, world, sample, device), "")
    costs = None
    if world.rank == 0 and sample is not None:
        costs = measure_layer_costs(layers, sample, settings.seed, device=device,
                                    precision=settings.precision,
                                    fp32_modules=settings.fp32_modules)
    costs = waiting.bcast(world, costs, 0)
    if costs is None:
        raise ConfigError(
            f"Config.schedule 'auto' measures each layer's forward, input- and weight-gradient "
            f"times on a sample micro-batch, and world rank 0 was given none: pass "
            f"Engine(..., sample=inputs[:micro_batch_size]) (a micro-batch of the inputs), or "
            f"name a schedule (one of {[s for s in SCHEDULES if s != 'auto']})")
    times = costs.totals if settings.partition == "time" else None
    try:
        choice = choose_schedule(
            costs, stages, settings.microbatches, int(settings.activation_budget_mb * 2**20),
            boundaries=lambda k: partition_layers(layers, k, settings.partition, times))
    except ScheduleError as exc:          # alike on every rank: the run's configuration
        raise ConfigError(str(exc)) from None
    if world.rank == 0:
        _log.info("%s", choice.describe().removeprefix("pipeflow: "))
    return choice.schedule, choice.chunks, times, choice.describe()


def _time_layer(layer: torch.nn.Module, x: Any, device: Any) -> tuple[list[float], int, Any]:
    """([F, whole backward, B, W] seconds, bytes saved for backward, output) of one run."""
    inputs = tree.map_tensors(lambda t: leaf_input(t, device), x)
    start = clock(device)
    out = layer(inputs)
    f = clock(device) - start
    floats, grads = grad_outputs(out)
    if not floats:
        return [f, 0.0, 0.0, 0.0], 0, out
    start = clock(device)
    torch.autograd.backward(floats, grads)
    full = clock(device) - start
    inputs = tree.map_tensors(lambda t: leaf_input(t, device), x)
    with SavedTensorMeter() as meter:
        floats, grads = grad_outputs(layer(inputs))
    saved = meter.current
    params = [p for p in layer.parameters() if p.requires_grad]
    start = clock(device)
    _, pending = backward_input(floats, grads, inputs, params)
    b = clock(device) - start
    if not pending.done:
        backward_weight(pending)
    w = clock(device) - start - b
    return [f, full, b, w], saved, out


def measure_layer_costs(layers: Sequence, sample: Any, seed: int = 0, repeats: int = 3,
                        device: torch.device | str = "cpu", precision: str = "fp32",
                        fp32_modules: Sequence[Any] = ()) -> LayerCosts:
    """F, whole backward, B and W seconds and saved bytes of each layer on `sample` (a
    micro-batch of inputs), layer by layer as `partition.each_layer` runs them, in the run's
    `precision` (bf16 halves the bytes a layer saves, and changes its times)."""
    rows = each_layer(layers, sample, lambda layer, x: _time_layer(layer, x, device), seed,
                      repeats, device, precision, fp32_modules)
    columns = [[seconds[k] for seconds, _ in rows] for k in range(4)]
    return LayerCosts(*columns, saved_bytes=[saved for _, saved in rows])
