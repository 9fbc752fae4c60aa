"""`schedule = "auto"`: the fastest schedule that fits the memory budget, by the simulator.

World rank 0 measures each layer on a sample micro-batch
(`runtime.arrange.measure_layer_costs`): its forward (F), whole backward, input gradient
(B) and weight gradient (W) times, and the bytes one micro-batch keeps for backward. Every
rank then runs the same pure `choose_schedule` on those broadcast numbers, so all choose
alike: for each candidate schedule the engine's stage boundaries, each virtual stage's sums,
the simulated step (`simulate(stage_times=...)`) and each rank's activation peak against
`Config.activation_budget_mb`.

Like all of `schedules/`, this module imports nothing of pipeflow outside the package: the
caller passes in the measured costs and its partition solver (`boundaries`), and a run that
no schedule can serve is a `ScheduleError` (the engine raises it as its `ConfigError`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from pipeflow.schedules import registry
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, Programs, ScheduleError
from pipeflow.schedules.plan import Plan
from pipeflow.schedules.simulate import simulate

__all__ = ["LayerCosts", "Candidate", "Choice", "candidates", "choose_schedule",
           "peak_activation_bytes", "format_bytes"]


def format_bytes(nbytes: float) -> str:
    """`1.5 MiB`, `300 B`: a byte count as the activation figures and budgets show it."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


@dataclasses.dataclass
class LayerCosts:
    """Per layer, one micro-batch: seconds of F, whole backward, B and W; bytes saved."""

    forward: list[float]
    backward: list[float]           # the whole backward (schedules without W)
    backward_input: list[float]     # B: the input gradient alone
    weight: list[float]             # W: the weight gradient alone
    saved_bytes: list[int]          # kept for backward from F until the backward completes

    @property
    def totals(self) -> list[float]:
        """Forward + backward per layer: what `partition = "time"` balances."""
        return [f + b for f, b in zip(self.forward, self.backward)]


@dataclasses.dataclass
class Candidate:
    """One schedule as `choose_schedule` weighed it."""

    schedule: str
    chunks: int
    skipped: str = ""                       # why it was not simulated
    boundaries: list[int] = dataclasses.field(default_factory=list)
    step_time: float = math.inf             # simulated seconds a step
    peak_bytes: list[int] = dataclasses.field(default_factory=list)   # per rank
    fits: bool = True


@dataclasses.dataclass
class Choice:
    """The schedule to run and every candidate's figures, for the training log."""

    schedule: str
    chunks: int
    candidates: list[Candidate]
    budget_bytes: int
    note: str = ""

    def describe(self) -> str:
        parts = []
        for c in self.candidates:
            if c.skipped:
                parts.append(f"{c.schedule} skipped ({c.skipped})")
                continue
            need = f", activations {format_bytes(max(c.peak_bytes))}"
            if not c.fits:
                need += f" > budget {format_bytes(self.budget_bytes)}"
            took = f"{c.step_time:.3g} s" if c.step_time >= 1 else f"{c.step_time * 1e3:.3g} ms"
            parts.append(f"{c.schedule} {took}{need}")
        return (f"pipeflow: schedule 'auto' chose {self.schedule!r}{self.note}; simulated step "
                f"from F, B, W measured per layer: " + "; ".join(parts))


def candidates(stages: int, microbatches: int, n_layers: int) -> list[Candidate]:
    """Every registered schedule, simplest first (the registry's order: among schedules
    within `margin` of the fastest the earliest wins, so noise never buys complexity), with
    the reason where one cannot run here."""
    out = []
    for spec in registry.SCHEDULES.values():
        chunks = spec.resolve_chunks(None)
        skipped = spec.problem(stages, microbatches, chunks)
        if not skipped and chunks > 1 and stages < 2:
            skipped = "needs pipeline >= 2"
        elif not skipped and n_layers < stages * chunks:
            skipped = f"needs {stages * chunks} layers, has {n_layers}"
        out.append(Candidate(spec.name, chunks, skipped))
    return out


def peak_activation_bytes(programs: Programs, virtual_bytes: Sequence[int]) -> list[int]:
    """Each rank's most activation bytes held at once: a forward of virtual stage v adds
    `virtual_bytes[v]` until its backward completes (its W, under split backward), in the
    order the simulator counts `peak_held`."""
    split = any(a.op == WEIGHT for prog in programs for a in prog)
    done = WEIGHT if split else BACKWARD
    peaks = []
    for rank, prog in enumerate(programs):
        held = peak = 0
        for act in prog:
            nbytes = virtual_bytes[programs.layout[rank][act.chunk]]
            held += nbytes if act.op == FORWARD else -nbytes if act.op == done else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _weigh(c: Candidate, costs: LayerCosts, stages: int, microbatches: int,
           boundaries: Callable[[int], list[int]]) -> None:
    """Fill in a candidate's boundaries, simulated step and per-rank peak bytes, from the
    `Plan` the engine would run."""
    try:
        c.boundaries = list(boundaries(stages * c.chunks))
    except ValueError:           # the caller's solver refuses k (ConfigError is a ValueError)
        c.skipped = f"the partition does not give {stages * c.chunks} virtual stages"
        return
    plan = Plan.build(c.schedule, stages, microbatches, c.chunks, c.boundaries)
    spans = [range(a, b) for a, b in zip(plan.boundaries, plan.boundaries[1:])]

    def total(values: Sequence[float]) -> list[float]:
        return [sum(values[i] for i in span) for span in spans]

    f = total(costs.forward)
    if plan.spec.split_backward:
        times = list(zip(f, total(costs.backward_input), total(costs.weight)))
    else:
        times = [(x, b, 0.0) for x, b in zip(f, total(costs.backward))]
    c.step_time = simulate(plan.programs, stage_times=times).makespan
    c.peak_bytes = peak_activation_bytes(plan.programs,
                                         [int(b) for b in total(costs.saved_bytes)])


def choose_schedule(costs: LayerCosts, stages: int, microbatches: int, budget_bytes: int = 0,
                    *, boundaries: Callable[[int], Sequence[int]],
                    margin: float = 0.01) -> Choice:
    """The fastest candidate whose every rank's activations fit `budget_bytes` (0: no
    budget); among those within `margin` of the fastest, the simplest (the registry's order).
    `boundaries(k)`: the engine's stage boundaries for k virtual stages (its partition
    solver), raising `ValueError` where the partition cannot give k. When none fits, the one
    needing least memory, said in the note; a `ScheduleError` when no candidate can run."""
    n = len(costs.forward)
    weighed = candidates(stages, microbatches, n)
    for c in weighed:
        if not c.skipped:
            _weigh(c, costs, stages, microbatches, boundaries)
            c.fits = budget_bytes <= 0 or max(c.peak_bytes) <= budget_bytes
    ran = [c for c in weighed if not c.skipped]
    if not ran:
        raise ScheduleError(
            f"schedule 'auto' found no schedule to run {n} layers on {stages} stages: "
            + "; ".join(f"{c.schedule}: {c.skipped}" for c in weighed)
            + "; give partition p + 1 (or 2p + 1) boundaries, or name a schedule")
    pool, note = [c for c in ran if c.fits], ""
    if not pool:
        least = min(max(c.peak_bytes) for c in ran)
        pool = [c for c in ran if max(c.peak_bytes) == least]
        note = f" (none fits the budget of {format_bytes(budget_bytes)}: the least memory)"
    fastest = min(c.step_time for c in pool)
    chosen = next(c for c in pool if c.step_time <= fastest * (1 + margin))
    if chosen.step_time > fastest:
        note += f" (within {margin:.0%} of the fastest, the simplest)"
    return Choice(chosen.schedule, chosen.chunks, weighed, budget_bytes, note)
