"""From a budget and a cluster to a `Sizing`: model size, tokens, grid, the files that run it."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

from pipeflow.config import Config
from pipeflow.planner.cost import Estimate, schedule_chunks
from pipeflow.planner.hardware import GB, Cluster
from pipeflow.planner.scaling import (METHODS, SECONDS_PER_DAY, Allocation, allocate,
                                      allocate_for_params)
from pipeflow.planner.search import PlanError, SearchOptions, SearchResult, search
from pipeflow.planner.shapes import (DEFAULT_SEQ_LEN, DEFAULT_VOCAB, Shape, ShapeError,
                                     shape_for_params, smallest_shape)

__all__ = ["Sizing", "size_run", "default_batch_tokens", "default_lr", "nice_batch",
           "render_table", "to_json", "train_toml", "DEFAULT_MFU"]

# The model FLOPs utilisation assumed to turn GPU-days into FLOPs before a plan exists;
# afterwards the plan's own predicted utilisation replaces it.
DEFAULT_MFU = 0.40

# Hoffmann et al. 2022 trained over 400 models "ranging from 70 million to over 16 billion
# parameters" to fit their laws.
FIT_RANGE = (70e6, 16e9)

# Brown et al. 2020 (GPT-3), Table 2.1: (parameters, batch tokens, learning rate).
GPT3_TABLE = ((125e6, 0.5e6, 6.0e-4), (350e6, 0.5e6, 3.0e-4), (760e6, 0.5e6, 2.5e-4),
              (1.3e9, 1e6, 2.0e-4), (2.7e9, 1e6, 1.6e-4), (6.7e9, 2e6, 1.2e-4),
              (13e9, 2e6, 1.0e-4), (175e9, 3.2e6, 0.6e-4))


def _nearest_gpt3(params: float) -> tuple[float, float, float]:
    return min(GPT3_TABLE, key=lambda row: abs(math.log(row[0] / params)))


def default_batch_tokens(params: float) -> float:
    """The GPT-3 batch size of the nearest GPT-3 model (Brown et al. 2020, Table 2.1)."""
    return _nearest_gpt3(params)[1]


def default_lr(params: float) -> float:
    """The GPT-3 learning rate of the nearest GPT-3 model (Brown et al. 2020, Table 2.1)."""
    return _nearest_gpt3(params)[2]


def nice_batch(sequences: float) -> int:
    """The nearest 2^k or 3·2^k (GPT-3's 1536): numbers with many divisors give the search
    many data × micro-batch splits."""
    target = max(1.0, sequences)
    nice = sorted({c * 2 ** k for k in range(0, 40) for c in (1, 3)})
    return min(nice, key=lambda n: (abs(math.log(n / target)), n))


@dataclasses.dataclass(frozen=True)
class Sizing:
    """The planner's answer for a training run: what to train, for how long, and on which
    grid (the fastest the search found). Not the schedule `Plan` an engine runs."""

    allocation: Allocation      # N and D as trained (the shaped model's N)
    optimal_params: float       # N_opt before shaping
    budget_source: str
    shape: Shape
    cluster: Cluster
    global_batch: int           # sequences per step
    result: SearchResult
    precision: str
    mfu_assumed: float | None   # set when the budget came from GPU-days
    notes: tuple[str, ...] = ()
    # The fastest plan without a tensor axis (t = 1), what the best plan is compared with;
    # None when nothing fits without one.
    without_tensor: Estimate | None = None
    tensor_tried: tuple[int, ...] = (1,)    # the tensor degrees the search considered

    @property
    def best(self) -> Estimate:
        return self.result.best

    @property
    def batch_tokens(self) -> int:
        return self.global_batch * self.shape.seq_len

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.allocation.tokens / self.batch_tokens))

    @property
    def train_days(self) -> float:
        return self.steps * self.best.step_time_s / SECONDS_PER_DAY

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (6·N per token) over the GPUs the plan uses."""
        return self.mfu_of(self.best)

    def mfu_of(self, est: Estimate) -> float:
        """`mfu` of another plan for the same model and batch (a runner-up, `without_tensor`)."""
        achieved = 6.0 * self.shape.params * self.batch_tokens / est.step_time_s
        return achieved / (est.grid.gpus * self.cluster.hardware.peak_flops)

    def command(self, config_path: str = "plan.toml") -> str:
        return f"mpirun -n {self.best.grid.gpus} pipeflow train {config_path}"


def size_run(cluster: Cluster, *, compute: float | None = None, days: float | None = None,
             params: float | None = None, shape: Shape | None = None,
             tokens: float | None = None, method: str = "hoffmann",
             seq_len: int = DEFAULT_SEQ_LEN, vocab_size: int = DEFAULT_VOCAB,
             global_batch: int | None = None, global_batch_tokens: float | None = None,
             mfu: float | None = None, options: SearchOptions = SearchOptions()) -> Sizing:
    """Size the model for the budget (or take the user's), then search the grid.

    The budget is `compute` FLOPs, or `days` on the whole cluster at `mfu` (when `mfu` is
    None: at the utilisation the plan itself predicts, found by a few rounds of sizing and
    planning). With a fixed model (`shape` or `params`) and no budget, tokens are the
    compute-optimal count for that size, or `tokens`. `options` are the grid search's.
    """
    _check_budget(method, compute, days, tokens, shape is not None or params is not None, mfu)
    if shape is None and params is not None:
        shape = shape_for_params(params, seq_len, vocab_size)
    size = functools.partial(_size, shape=shape, tokens=tokens, method=method,
                             seq_len=seq_len, vocab_size=vocab_size)

    def plan_for(s: Shape) -> tuple[int, SearchResult]:
        if global_batch is not None:
            batch = global_batch
        else:
            want = global_batch_tokens or default_batch_tokens(s.params)
            batch = nice_batch(want / s.seq_len)
        return batch, search(s, cluster, batch, options)

    if days is None:
        alloc, optimal, shaped = size(compute)
        batch, result = plan_for(shaped)
        source = ("given" if compute is not None else
                  "6·N·D at the given tokens" if tokens is not None else
                  "compute-optimal for the given model")
        mfu_used = None
    else:
        (alloc, optimal, shaped, batch, result, mfu_used,
         source) = _size_for_days(cluster, days, mfu, method, size, plan_for)
    if global_batch is None and result.best.grid.global_batch != batch:  # pragma: no cover
        raise AssertionError("search returned a grid for another batch")
    return Sizing(alloc, optimal, source, shaped, cluster, batch, result, options.precision,
                  mfu_used, _notes(shaped, result, cluster, batch),
                  _without_tensor(shaped, cluster, batch, options, result),
                  options.tensors(shaped, cluster))


def _without_tensor(shape: Shape, cluster: Cluster, batch: int, options: SearchOptions,
                    result: SearchResult) -> Estimate | None:
    """The fastest plan at tensor degree 1: the search's own best where it chose t = 1, else
    the same search without a tensor axis (None when nothing fits that way)."""
    if result.best.grid.tensor == 1:
        return result.best
    try:
        return search(shape, cluster, batch,
                      dataclasses.replace(options, tensor=(1,), rank=1)).best
    except PlanError:
        return None


def _check_budget(method: str, compute: float | None, days: float | None,
                  tokens: float | None, fixed_model: bool, mfu: float | None) -> None:
    if method not in METHODS:
        raise PlanError(f"unknown --method {method!r}; expected one of {list(METHODS)}")
    given = [name for name, v in (("--compute", compute), ("--days", days), ("--tokens", tokens))
             if v is not None]
    if len(given) > 1:
        raise PlanError(f"give one budget, found {' and '.join(given)}: --compute FLOPs, "
                        f"--days on the cluster, or --tokens for a fixed model")
    if compute is not None and not (math.isfinite(compute) and compute > 0):
        raise PlanError(f"--compute must be a positive number of FLOPs, found {compute!r}")
    if days is not None and not (math.isfinite(days) and days > 0):
        raise PlanError(f"--days must be positive, found {days!r}")
    if tokens is not None and not tokens > 0:
        raise PlanError(f"--tokens must be positive, found {tokens!r}")
    if tokens is not None and not fixed_model:
        raise PlanError("--tokens needs a fixed model: give --params or --layers/--width too")
    if mfu is not None and not 0 < mfu <= 1:
        raise PlanError(f"--mfu must be in (0, 1], found {mfu!r}")


def _size(budget: float | None, shape: Shape | None, tokens: float | None, method: str,
          seq_len: int, vocab_size: int) -> tuple[Allocation, float, Shape]:
    """(N and D as trained, N before shaping, the shape) for `budget` FLOPs: the given
    model's tokens, or the compute-optimal model shaped."""
    if shape is not None:
        if budget is None and tokens is not None:
            budget = 6.0 * shape.params * tokens
        return allocate_for_params(shape.params, method, budget), shape.params, shape
    assert budget is not None
    optimal = allocate(budget, method).params
    try:
        shaped = shape_for_params(optimal, seq_len, vocab_size)
    except ShapeError:
        small = smallest_shape(seq_len, vocab_size)
        least = _least_budget(method, small.params)
        raise PlanError(
            f"a budget of {budget:.3g} FLOPs is too small for any GPT with a "
            f"{vocab_size}-token vocabulary: its compute-optimal size is {optimal:.3g} "
            f"parameters, and the smallest shape ({small.describe()}) has "
            f"{small.params:.3g}. Give at least --compute {least:.2g}, or shrink "
            f"--vocab/--seq-len") from None
    return allocate_for_params(shaped.params, method, budget), optimal, shaped


def _size_for_days(cluster: Cluster, days: float, mfu: float | None, method: str,
                   size: Callable[[float], tuple[Allocation, float, Shape]],
                   plan_for: Callable[[Shape], tuple[int, SearchResult]]) -> tuple:
    """GPU-days to FLOPs needs the utilisation, which needs a plan, which needs the model
    size: iterate from an assumed utilisation until the shape settles."""
    hw = cluster.hardware
    mfu_used = mfu if mfu is not None else DEFAULT_MFU
    seen: list[Shape] = []
    for _ in range(6):
        budget = cluster.gpus * days * SECONDS_PER_DAY * hw.peak_flops * mfu_used
        alloc, optimal, shaped = size(budget)
        batch, result = plan_for(shaped)
        if mfu is not None:
            break
        achieved = 6.0 * shaped.params * batch * shaped.seq_len / result.best.step_time_s
        # The budget counts every GPU of the cluster, used by the plan or not.
        mfu_used = achieved / (cluster.gpus * hw.peak_flops)
        if shaped in seen:
            break
        seen.append(shaped)
    if mfu is None:
        # Tokens for exactly `days` at this plan's predicted throughput (the shape is
        # discrete, so sizing alone can only come close).
        budget = cluster.gpus * days * SECONDS_PER_DAY * hw.peak_flops * mfu_used
        alloc = allocate_for_params(shaped.params, method, budget)
    source = (f"{cluster.gpus} GPUs × {days:g} days × {hw.peak_flops / 1e12:.0f} TFLOP/s "
              f"× {mfu_used:.1%} utilisation"
              + (" (given)" if mfu is not None else " (predicted by the plan)"))
    return alloc, optimal, shaped, batch, result, mfu_used, source


def _notes(shaped: Shape, result: SearchResult, cluster: Cluster, batch: int) -> tuple[str, ...]:
    notes = []
    if not FIT_RANGE[0] <= shaped.params <= FIT_RANGE[1]:
        notes.append(f"the scaling laws were fitted on models of {FIT_RANGE[0] / 1e6:.0f}M to "
                     f"{FIT_RANGE[1] / 1e9:.0f}B parameters (Hoffmann et al. 2022); "
                     f"{_si(shaped.params)} is an extrapolation, its predicted loss a rough guide")
    if result.best.grid.gpus < cluster.gpus:
        notes.append(f"the fastest plan uses {result.best.grid.gpus} of the {cluster.gpus} "
                     f"GPUs: no faster grid divides the batch of {batch} sequences")
    return tuple(notes)


def _least_budget(method: str, params: float) -> float:
    """The smallest budget, rounded up to two digits, whose compute-optimal model
    `shape_for_params` can shape (at least half of `params`, the smallest shape's)."""
    lo, hi = 1.0, 1e40
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if allocate(mid, method).params >= 0.5 * params:
            hi = mid
        else:
            lo = mid
    unit = 10.0 ** (math.floor(math.log10(hi)) - 1)
    return math.ceil(hi / unit) * unit


# -- output -----------------------------------------------------------------------------

def _stage_rows(est: Estimate) -> list[dict[str, Any]]:
    return [{"stage": s.stage, "layers": list(s.layers), "blocks": s.blocks,
             "params": s.params, "recompute": s.recompute, "stash": s.stash,
             "memory_gb": round(s.memory_gb, 3),
             "memory_breakdown_gb": {"weights_grads_optimizer": round(s.state_bytes / GB, 3),
                                     "activation_stash": round(s.activation_bytes / GB, 3),
                                     "transient": round(s.transient_bytes / GB, 3)},
             "microbatch_s": s.microbatch_s, "p2p_s": s.p2p_s,
             "allreduce_s": s.allreduce_s, "optimizer_s": s.optimizer_s}
            for s in est.stages]


def _grid_row(est: Estimate, best: Estimate) -> dict[str, Any]:
    g = est.grid
    return {"pipeline": g.pipeline, "data": g.data, "tensor": g.tensor,
            "sequence_parallel": g.sequence_parallel, "microbatches": g.microbatches,
            "micro_batch_size": g.micro_batch_size, "schedule": g.schedule,
            "recompute": est.recompute, "step_time_s": est.step_time_s,
            "slower_than_best": est.step_time_s / best.step_time_s - 1.0,
            "memory_gb": [round(x, 3) for x in est.memory_gb]}


def to_json(sizing: Sizing, config_path: str = "plan.toml", top: int = 5) -> dict[str, Any]:
    """The sizing as one JSON-able object."""
    best, g, a, hw = sizing.best, sizing.best.grid, sizing.allocation, sizing.cluster.hardware
    reasons: dict[str, int] = {}
    for r in sizing.result.rejected:
        reasons["memory"] = reasons.get("memory", 0) + 1
    return {
        "method": a.method, "method_description": a.description, "loss_fit": a.loss_fit,
        "compute": a.compute, "compute_source": sizing.budget_source,
        "params": sizing.shape.params, "params_optimal": sizing.optimal_params,
        "tokens": a.tokens, "tokens_per_param": a.tokens_per_param, "loss": a.loss,
        "model": sizing.shape.to_dict(),
        "gpu": hw.name, "calibrated": hw.calibrated, "gpus": sizing.cluster.gpus,
        "gpus_per_node": sizing.cluster.gpus_per_node, "gpus_used": g.gpus,
        "pipeline": g.pipeline, "data": g.data, "tensor": g.tensor,
        "sequence_parallel": g.sequence_parallel, "microbatches": g.microbatches,
        "micro_batch_size": g.micro_batch_size, "schedule": g.schedule,
        "tensor_tried": list(sizing.tensor_tried),
        "partition": best.boundaries, "recompute": best.recompute,
        "precision": sizing.precision, "global_batch": sizing.global_batch,
        "global_batch_tokens": sizing.batch_tokens, "steps": sizing.steps,
        "step_time_s": best.step_time_s, "bubble": best.bubble,
        "mfu": None if hw.calibrated else sizing.mfu, "train_days": sizing.train_days,
        "memory_gb": [round(x, 3) for x in best.memory_gb],
        "usable_memory_gb": hw.usable_memory / GB,
        "stages": _stage_rows(best),
        "command": sizing.command(config_path),
        "runners_up": [_grid_row(e, best) for e in sizing.result.ranked[1:1 + top]],
        "without_tensor": None if sizing.without_tensor is None else
        dict(_grid_row(sizing.without_tensor, best),
             mfu=None if hw.calibrated else sizing.mfu_of(sizing.without_tensor),
             peak_memory_gb=round(sizing.without_tensor.peak_memory_bytes / GB, 3)),
        "considered": sizing.result.considered, "fitting": sizing.result.fitting,
        "pruned": sizing.result.pruned,
        "rejected": reasons,
        "rejected_examples": [{"grid": r.grid.describe(), "reason": r.reason}
                              for r in _examples(sizing.result.rejected, 3)],
        "notes": list(sizing.notes),
    }


def _examples(rejected: Sequence[Any], k: int) -> list[Any]:
    # The rejections closest to fitting say most about what the memory allows.
    return sorted(rejected, key=lambda r: (r.peak_memory_gb, r.grid.gpus))[:k]


def _si(x: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def render_table(sizing: Sizing, config_path: str = "plan.toml", top: int = 5) -> str:
    """The sizing as plain text: budget, model, cluster, the best grid stage by stage,
    runners-up, rejections and the command."""
    best, g, a, hw, sh = (sizing.best, sizing.best.grid, sizing.allocation,
                          sizing.cluster.hardware, sizing.shape)
    lines = [f"pipeflow plan — method: {a.method}", f"  {a.description}", ""]
    kv = [
        ("budget", f"{a.compute:.3g} FLOPs ({sizing.budget_source})"),
        ("model", f"{_si(sh.params)} parameters (optimum {_si(sizing.optimal_params)}): "
                  f"{sh.describe()}"),
        ("tokens", f"{_si(a.tokens)} ({a.tokens_per_param:.1f} per parameter); predicted "
                   f"loss {a.loss:.3f} ({a.loss_fit})"),
        ("cluster", f"{sizing.cluster.gpus} × {hw.name}, {sizing.cluster.gpus_per_node} per node, "
                    f"{hw.usable_memory / GB:.1f} GB usable each"
                    + (" (calibrated on this machine)" if hw.calibrated else
                       f", {hw.efficiency:.0%} of peak assumed")),
        ("batch", f"{sizing.global_batch} sequences × {sh.seq_len} = {_si(sizing.batch_tokens)} "
                  f"tokens per step, {sizing.steps:,} steps, precision {sizing.precision}"),
    ]
    lines += [f"{k:<9}{v}" for k, v in kv]
    lines += ["", f"best plan: {_grid_words(g)} = {g.gpus} GPUs, "
                  f"{g.microbatches} micro-batch{'es' if g.microbatches > 1 else ''} of "
                  f"{g.micro_batch_size}, {g.schedule}"
                  + (", sharded optimizer" if g.shard_optimizer else "")]
    util = "" if hw.calibrated else f", MFU {sizing.mfu:.0%}"
    lines.append(f"  step {best.step_time_s:.4g} s (bubble {best.bubble:.1%}, all-reduce + "
                 f"optimizer {best.tail_s:.3g} s){util}, {sizing.train_days:.3g} days")
    lines.append(_tensor_line(sizing))
    lines.append(f"  {'stage':>5} {'layers':>9} {'params':>8} {'recompute':>9} {'stash':>5} "
                 f"{'state GB':>8} {'acts GB':>8} {'total GB':>8} {'ms/micro':>9}")
    for s in best.stages:
        lines.append(f"  {s.stage:>5} {f'{s.layers[0]}-{s.layers[1] - 1}':>9} "
                     f"{_si(s.params):>8} {s.recompute:>9} {s.stash:>5} "
                     f"{s.state_bytes / GB:>8.2f} {s.activation_bytes / GB:>8.2f} "
                     f"{s.memory_gb:>8.2f} {s.microbatch_s * 1e3:>9.3g}")
    ranked = sizing.result.ranked
    if len(ranked) > 1:
        shown = ranked[1:1 + top]
        width = max([28] + [len(e.grid.describe()) for e in shown])   # "t=2 sp" widens it
        lines += ["", f"runners-up ({sizing.result.fitting - 1} other plans fit"
                  + (f"; {sizing.result.pruned} not timed, a bound shows them slower"
                     if sizing.result.pruned else "") + "):",
                  f"  {'grid':<{width}} {'step s':>9} {'vs best':>8} {'peak GB':>8}  recompute"]
        for e in shown:
            lines.append(f"  {e.grid.describe():<{width}} {e.step_time_s:>9.4g} "
                         f"{e.step_time_s / best.step_time_s - 1:>+8.1%} "
                         f"{e.peak_memory_bytes / GB:>8.2f}  {_compact(e.recompute)}")
    rej = sizing.result.rejected
    lines += ["", f"rejected: {len(rej)} of {sizing.result.considered} grids do not fit memory"]
    for r in _examples(rej, 3):
        lines.append(f"  {r.grid.describe():<28} {r.reason}")
    for note in sizing.notes:
        lines.append(f"note: {note}")
    lines += ["", f"command: {sizing.command(config_path)}"]
    return "\n".join(lines)


def _grid_words(g: Any) -> str:
    """'pipeline 16 × data 2 × tensor 2 (sequence parallel)'."""
    return (f"pipeline {g.pipeline} × data {g.data}"
            + (f" × tensor {g.tensor}" + (" (sequence parallel)" if g.sequence_parallel else "")
               if g.tensor > 1 else ""))


def _tensor_line(sizing: Sizing) -> str:
    """One line: the tensor degree chosen, its memory per GPU and predicted MFU, against the
    fastest plan without a tensor axis."""
    best, other, hw = sizing.best, sizing.without_tensor, sizing.cluster.hardware

    def figures(est: Estimate) -> str:
        util = "" if hw.calibrated else f", MFU {sizing.mfu_of(est):.0%}"
        modes = _compact(est.recompute)
        return (f"{est.peak_memory_bytes / GB:.1f} GB per GPU, "
                f"{'no' if modes == 'none' else modes} recomputation{util}")

    chosen = (f"  tensor {best.grid.tensor}"
              + (" (sequence parallel)" if best.grid.sequence_parallel else "")
              + f": {figures(best)}")
    if best.grid.tensor == 1:
        tried = sizing.tensor_tried
        return chosen + ("; no tensor axis asked for" if tried == (1,) else
                         f"; tensor degrees {', '.join(map(str, tried))} tried, none faster")
    if other is None:
        return chosen + "; without a tensor axis no plan fits"
    return (chosen + f"; without a tensor axis: {_grid_words(other.grid)}, {figures(other)}, "
            f"{other.step_time_s / best.step_time_s - 1:+.0%} step time")


def _compact(modes: Sequence[str]) -> str:
    return modes[0] if len(set(modes)) == 1 else ",".join(modes)


def train_toml(sizing: Sizing, command_line: str = "pipeflow plan") -> str:
    """The TOML `pipeflow train` runs: the planned `Config` written by `Config.to_toml` with
    the `[model]` and `[train]` tables, under comments saying where the values come from."""
    best, g, sh, hw = sizing.best, sizing.best.grid, sizing.shape, sizing.cluster.hardware
    modes = best.recompute
    # ZBV cuts the model into 2p virtual stages (a V): the engine balances them by time
    # measured on a micro-batch, where the plan costed the p-stage cut.
    v = schedule_chunks(g.schedule) > 1
    config = Config(pipeline=g.pipeline, data=g.data, tensor=g.tensor,
                    sequence_parallel=g.sequence_parallel, microbatches=g.microbatches,
                    schedule=g.schedule, partition="time" if v else best.boundaries,
                    precision=sizing.precision,
                    recompute=modes[0] if len(set(modes)) == 1 else list(modes),
                    backend="mpi" if hw.calibrated else "auto", clip=1.0, seed=0,
                    shard_optimizer=g.shard_optimizer)
    train = {"steps": sizing.steps, "batch_size": sizing.global_batch,
             "lr": float(f"{default_lr(sh.params):.2g}")}
    a = sizing.allocation
    header = [
        f"# Written by `{command_line}`.",
        f"# {a.method}: {_si(sh.params)} parameters, {_si(a.tokens)} tokens, {a.compute:.3g} "
        f"FLOPs; predicted loss {a.loss:.3f}.",
        f"# Predicted on {g.gpus} × {hw.name}: {best.step_time_s:.4g} s per step, "
        f"{sizing.train_days:.3g} days; memory per stage (GB): "
        f"{', '.join(f'{x:.1f}' for x in best.memory_gb)}.",
        f"# Run: {sizing.command('<this file>')}",
        f"# engine: {_grid_words(g)}; {g.microbatches} micro-batches of {g.micro_batch_size} "
        f"sequence(s); "
        + (f"partition: 'time', the {2 * g.pipeline} virtual stages of {g.schedule} balanced "
           f"by time measured on a micro-batch" if v else
           f"partition: stage boundaries in the layer list (embedding, {sh.n_layers} blocks, "
           f"head), balanced by predicted time")
        + ("; backend auto: NCCL on GPUs (the bandwidths planned for), MPI elsewhere."
           if config.backend == "auto" else "."),
        f"# train: batch_size is the global batch in sequences ({_si(sizing.batch_tokens)} "
        f"tokens); lr GPT-3's for the nearest size (Brown et al. 2020, Table 2.1).",
        f"# data: fill in the token files of a corpus of at least {_si(a.tokens)} tokens, "
        f"e.g. `pipeflow prepare docs.jsonl --tokenizer tiktoken:gpt2 --out data`; "
        f"`pipeflow train` refuses a run of this size on the built-in byte corpus.",
    ]
    data = {"train": "data/train.bin", "val": "data/val.bin",
            "dtype": "uint16" if sh.vocab_size <= 2**16 else "uint32"}
    return "\n".join(header) + "\n\n" + config.to_toml(model=sh.to_dict(), train=train,
                                                         data=data)
