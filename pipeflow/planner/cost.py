"""The cost model of one pipeline × data grid: memory per stage and time per step."""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Sequence

from pipeflow.planner.hardware import GB, Cluster
from pipeflow.planner.shapes import Shape

__all__ = [
    "Precision", "PRECISIONS", "RECOMPUTE", "SCHEDULES", "Grid", "StageCost", "Estimate",
    "activation_bytes_per_layer", "head_activation_bytes", "stash_microbatches",
    "bubble_fraction", "ring_allreduce_time", "block_forward_flops", "head_forward_flops",
    "layer_kinds", "balanced_boundaries", "time_balanced_boundaries", "stage_memory",
    "estimate",
]

RECOMPUTE = ("none", "selective", "full")     # cheapest first: the order the search tries
SCHEDULES = ("1f1b", "gpipe")


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes a parameter and an activation take under one numeric recipe."""

    name: str
    state_bytes: int        # per parameter: weights + master + gradient + Adam m and v
    activation_scale: float  # Korthikanti's per-layer formula counts 16-bit activations
    grad_reduce_bytes: int   # per parameter on the wire in the data-parallel all-reduce
    act_bytes: int           # per element sent between stages
    peak_scale: float        # fraction of the bf16 dense peak this recipe's matmuls run at
    note: str


PRECISIONS: dict[str, Precision] = {
    # 2 (bf16 weights) + 4 (fp32 master) + 4 (fp32 gradient accumulator, as Megatron-LM keeps
    # over micro-batches) + 8 (Adam m, v in fp32) = 18 bytes per parameter.
    "bf16": Precision("bf16", 18, 1.0, 4, 2, 1.0,
                      "bf16 working weights and activations, fp32 master weights, "
                      "gradients and Adam state: 18 bytes/parameter"),
    # 4 (weights) + 4 (gradients) + 8 (Adam m, v) = 16 bytes per parameter; activations twice
    # the 16-bit figure; matmuls in TF32, half the bf16 dense peak on A100/H100/H200
    # (datasheets: 156 vs 312, 494 vs 989 TFLOPS dense).
    "fp32": Precision("fp32", 16, 2.0, 4, 4, 0.5,
                      "fp32 weights, gradients, Adam state (16 bytes/parameter) and "
                      "activations; TF32 matmuls at half the bf16 peak"),
}


@dataclasses.dataclass(frozen=True)
class Grid:
    """One point of the search: the grid, the micro-batching and the schedule."""

    pipeline: int
    data: int
    micro_batch_size: int
    microbatches: int
    schedule: str = "1f1b"

    @property
    def gpus(self) -> int:
        return self.pipeline * self.data

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.data * self.microbatches * self.micro_batch_size

    def describe(self) -> str:
        return (f"p={self.pipeline} d={self.data} b={self.micro_batch_size} "
                f"m={self.microbatches} {self.schedule}")


# -- formulas ---------------------------------------------------------------------------

def activation_bytes_per_layer(seq_len: int, micro_batch_size: int, d_model: int, n_heads: int,
                               recompute: str = "none", scale: float = 1.0) -> float:
    """Bytes one transformer block keeps for its backward, per micro-batch.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    section 4 (no tensor or sequence parallelism): s·b·h·(34 + 5·a·s/h) bytes in 16-bit,
    dropout masks included. Selective recomputation (recompute the attention core) keeps
    34·s·b·h; full recomputation keeps only the block's input, 2·s·b·h. `scale` is 2 for
    fp32 activations.
    """
    s, b, h, a = seq_len, micro_batch_size, d_model, n_heads
    if recompute == "none":
        per = s * b * h * (34 + 5 * a * s / h)
    elif recompute == "selective":
        per = 34 * s * b * h
    elif recompute == "full":
        per = 2 * s * b * h
    else:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, found {recompute!r}")
    return per * scale


def head_activation_bytes(seq_len: int, micro_batch_size: int, vocab_size: int,
                          precision: Precision) -> float:
    """The output head's logits kept for backward: the logits in the working precision plus
    the fp32 log-softmax the cross-entropy keeps, per micro-batch."""
    return seq_len * micro_batch_size * vocab_size * (precision.act_bytes + 4)


def stash_microbatches(stage: int, pipeline: int, microbatches: int, schedule: str) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak.

    1F1B: min(p - s, m), the warm-up depth (Narayanan et al. 2021); GPipe: all m.
    """
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pipeline - stage, microbatches)
    raise ValueError(f"schedule must be one of {SCHEDULES}, found {schedule!r}")


def bubble_fraction(pipeline: int, microbatches: int) -> float:
    """(p - 1)/(m + p - 1): the idle share of a step for GPipe and 1F1B (Huang et al. 2019)."""
    return (pipeline - 1) / (microbatches + pipeline - 1)


def ring_allreduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce: 2(d-1)/d of the buffer crosses each link, in 2(d-1) steps."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def block_forward_flops(shape: Shape, micro_batch_size: int) -> float:
    """24·b·s·h² + 4·b·s²·h: a block's matmuls forward (Narayanan et al. 2021, eq. 2/3)."""
    b, s, h = micro_batch_size, shape.seq_len, shape.d_model
    return 24 * b * s * h * h + 4 * b * s * s * h


def head_forward_flops(shape: Shape, micro_batch_size: int) -> float:
    """2·b·s·h·V: the output projection to the vocabulary."""
    return 2 * micro_batch_size * shape.seq_len * shape.d_model * shape.vocab_size


def layer_kinds(shape: Shape) -> list[str]:
    """The layer list `pipeflow.models.gpt.gpt_layers` builds: embedding, blocks, head."""
    return ["embed"] + ["block"] * shape.n_layers + ["head"]


def _layer_params(shape: Shape, kind: str) -> int:
    h = shape.d_model
    if kind == "embed":
        return shape.vocab_size * h + shape.seq_len * h
    if kind == "block":
        return 12 * h * h
    # The head shares the embedding's matrix. When it sits on another stage it holds its own
    # copy (with gradients and optimizer state), so it counts in that stage's memory.
    return shape.vocab_size * h


def _stage_params(shape: Shape, count: dict[str, int]) -> int:
    params = sum(n * _layer_params(shape, k) for k, n in count.items())
    if count["embed"] and count["head"]:
        params -= shape.vocab_size * shape.d_model     # one tied matrix on a single stage
    return params


# -- time per layer ---------------------------------------------------------------------

def _layer_time(shape: Shape, cluster: Cluster, precision: Precision, kind: str, phase: str,
                b: int) -> float:
    hw = cluster.hardware
    if hw.layer_times is not None:
        return hw.layer_times.time(kind, phase, b)
    rate = hw.peak_flops * precision.peak_scale * hw.efficiency
    if kind == "block":
        flops = block_forward_flops(shape, b)
    elif kind == "head":
        flops = head_forward_flops(shape, b)
    else:
        # A lookup: memory-bound, b·s·h values written.
        return b * shape.seq_len * shape.d_model * precision.act_bytes / hw.memory_bandwidth
    return flops / rate * (2.0 if phase == "backward" else 1.0)


def _recompute_time(shape: Shape, cluster: Cluster, precision: Precision, recompute: str,
                    b: int) -> float:
    """Extra time per block per micro-batch that recomputation adds to the backward."""
    if recompute == "none":
        return 0.0
    forward = _layer_time(shape, cluster, precision, "block", "forward", b)
    if recompute == "full":
        return forward
    # Selective recomputes the attention core: 4·b·s²·h of the block's forward FLOPs.
    s, h = shape.seq_len, shape.d_model
    return forward * (4 * b * s * s * h) / block_forward_flops(shape, b)


# -- partition --------------------------------------------------------------------------

def balanced_boundaries(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous split of `weights` into `parts` non-empty parts minimising the heaviest.

    Bisection on the bottleneck with a greedy check (exact up to float tolerance), then
    any part short of `parts` is made by splitting the heaviest multi-item part where its
    halves are most even, which can only lower the heaviest.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def greedy(limit: float) -> list[int]:
        # Fill each part as far as `limit` allows (at least one item): a bisection on the
        # prefix sums per part rather than a walk over every item.
        bounds, i = [0], 0
        while i < n:
            i = max(i + 1, bisect.bisect_right(prefix, prefix[i] + limit * (1 + 1e-12)) - 1)
            bounds.append(i)
        return bounds

    lo, hi = max(max(weights), prefix[-1] / parts), prefix[-1]
    for _ in range(100):
        if hi - lo <= 1e-10 * hi:
            break
        mid = (lo + hi) / 2
        if len(greedy(mid)) - 1 <= parts:
            hi = mid
        else:
            lo = mid
    bounds = greedy(hi)
    while len(bounds) - 1 < parts:
        _, i = max((prefix[bounds[i + 1]] - prefix[bounds[i]], i)
                   for i in range(len(bounds) - 1) if bounds[i + 1] - bounds[i] > 1)
        lo_i, hi_i = bounds[i], bounds[i + 1]
        best = min(range(lo_i + 1, hi_i),
                   key=lambda k: abs((prefix[k] - prefix[lo_i]) - (prefix[hi_i] - prefix[k])))
        bounds.insert(i + 1, best)
    return bounds


@functools.lru_cache(maxsize=4096)
def _balanced_cached(weights: tuple[float, ...], parts: int) -> tuple[int, ...]:
    return tuple(balanced_boundaries(weights, parts))


def time_balanced_boundaries(shape: Shape, cluster: Cluster, precision: Precision,
                             pipeline: int, b: int) -> tuple[int, ...]:
    """Stage boundaries in the layer list balancing forward + backward time at micro-batch
    size `b` (without recomputation)."""
    # Balance forward + backward time without recomputation; the search evaluates the same
    # (pipeline, micro-batch) split many times, hence the cache on the weights.
    w = {k: _layer_time(shape, cluster, precision, k, "forward", b)
         + _layer_time(shape, cluster, precision, k, "backward", b)
         for k in ("embed", "block", "head")}
    # Normalised so that micro-batch sizes whose times scale alike share a cache entry.
    unit = max(w.values()) or 1.0
    w = {k: float(f"{v / unit:.12g}") for k, v in w.items()}
    weights = (w["embed"],) + (w["block"],) * shape.n_layers + (w["head"],)
    return _balanced_cached(weights, pipeline)


def _transfer_time(cluster: Cluster, ranks: list[int], nbytes: float) -> float:
    bw, lat = cluster.link(ranks)
    return lat + nbytes / bw


def _replica_samples(data: int, gpus_per_node: int) -> range:
    # Replica r of neighbouring stages sits `data` ranks apart: with data >= gpus_per_node
    # every pair crosses nodes (replica 0 shows it); below that, check each replica.
    return range(min(data, gpus_per_node))


# -- estimate ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StageCost:
    """Memory and time of one pipeline stage (every replica of it costs the same)."""

    stage: int
    layers: tuple[int, int]         # [first, last + 1) in the layer list
    blocks: int
    params: int
    recompute: str
    stash: int                      # micro-batches of activations held at the peak
    state_bytes: float              # weights, master weights, gradients, optimizer state
    activation_bytes: float         # the stash
    transient_bytes: float          # one micro-batch's recomputed block / logits gradient
    forward_s: float                # per micro-batch
    backward_s: float               # per micro-batch, recomputation included
    p2p_s: float                    # per micro-batch: this stage's sends
    allreduce_s: float              # per step
    optimizer_s: float              # per step

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes + self.transient_bytes

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    @property
    def microbatch_s(self) -> float:
        return self.forward_s + self.backward_s + self.p2p_s


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The cost of running one `Grid` on a cluster: per stage and for the whole step."""

    grid: Grid
    stages: tuple[StageCost, ...]
    pipeline_s: float       # the schedule's forward/backward span, bubble included
    tail_s: float           # all-reduce and optimizer step after the last backward
    usable_memory: float
    precision: str

    @property
    def step_time_s(self) -> float:
        return self.pipeline_s + self.tail_s

    @property
    def boundaries(self) -> list[int]:
        return [s.layers[0] for s in self.stages] + [self.stages[-1].layers[1]]

    @property
    def recompute(self) -> list[str]:
        return [s.recompute for s in self.stages]

    @property
    def memory_gb(self) -> list[float]:
        return [s.memory_gb for s in self.stages]

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.memory_bytes for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.usable_memory

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.grid.pipeline, self.grid.microbatches)


def _stage_kinds(shape: Shape, layers: tuple[int, int]) -> dict[str, int]:
    """How many of each layer kind the stage owning layer-list slice `layers` holds."""
    lo, hi = layers
    embed = int(lo == 0)
    head = int(hi == shape.n_layers + 2)
    return {"embed": embed, "block": hi - lo - embed - head, "head": head}


def stage_memory(shape: Shape, precision: Precision, grid: Grid, stage: int,
                 layers: tuple[int, int], recompute: str) -> tuple[float, float, float]:
    """(state, activation stash, transient) bytes of one stage.

    The stash is `stash_microbatches` micro-batches of what each of the stage's layers keeps
    (Korthikanti's per-block formula; the head's logits on the last stage). Under full or
    selective recomputation the dropped activations of one block are rebuilt during its
    backward: that transient, and the fp32 logits gradient on the head's stage, come on top
    once.
    """
    count = _stage_kinds(shape, layers)
    b, s = grid.micro_batch_size, shape.seq_len
    params = _stage_params(shape, count)
    per_block = activation_bytes_per_layer(s, b, shape.d_model, shape.n_heads, recompute,
                                           precision.activation_scale)
    per_mb = count["block"] * per_block
    transient = 0.0
    if count["head"]:
        per_mb += head_activation_bytes(s, b, shape.vocab_size, precision)
        transient += s * b * shape.vocab_size * 4
    if recompute != "none" and count["block"]:
        transient += activation_bytes_per_layer(s, b, shape.d_model, shape.n_heads, "none",
                                                precision.activation_scale) - per_block
    stash = stash_microbatches(stage, grid.pipeline, grid.microbatches, grid.schedule)
    return params * precision.state_bytes, stash * per_mb, transient


def estimate(shape: Shape, cluster: Cluster, grid: Grid, recompute: str | Sequence[str],
             precision: str = "bf16", boundaries: Sequence[int] | None = None) -> Estimate:
    """Memory per stage and step time of `grid` with per-stage `recompute`.

    Step time = Σ_s t_s + (m - 1)·max_s t_s + max_s(all-reduce_s + optimizer_s), where t_s is
    stage s's forward + backward + sends for one micro-batch. The first term is the critical
    path of one micro-batch through every stage and back; the second is the slowest stage
    working through the other m - 1. For equal stages it is (m + p - 1)·t: the bubble
    (p - 1)/(m + p - 1) of Huang et al. 2019 and Narayanan et al. 2021. Point-to-point and
    all-reduce are not overlapped with compute: the estimate leans slow.
    """
    prec = PRECISIONS[precision]
    p, d, b, m = grid.pipeline, grid.data, grid.micro_batch_size, grid.microbatches
    if boundaries is None:
        boundaries = time_balanced_boundaries(shape, cluster, prec, p, b)
    if len(boundaries) != p + 1:
        raise ValueError(f"{len(boundaries)} boundaries for {p} stages")
    modes = [recompute] * p if isinstance(recompute, str) else list(recompute)
    hw = cluster.hardware
    times = {(k, ph): _layer_time(shape, cluster, prec, k, ph, b)
             for k in ("embed", "block", "head") for ph in ("forward", "backward")}
    send_bytes = b * shape.seq_len * shape.d_model * prec.act_bytes
    stages = []
    for st in range(p):
        layers = (boundaries[st], boundaries[st + 1])
        count = _stage_kinds(shape, layers)
        state, acts, transient = stage_memory(shape, prec, grid, st, layers, modes[st])
        fwd = sum(n * times[k, "forward"] for k, n in count.items())
        bwd = sum(n * times[k, "backward"] for k, n in count.items())
        bwd += count["block"] * _recompute_time(shape, cluster, prec, modes[st], b)
        p2p = 0.0
        for neighbour in (st + 1, st - 1):        # activation forward, gradient backward
            if 0 <= neighbour < p:
                # Every replica sends at once; the step waits for the slowest pair.
                p2p += max(_transfer_time(cluster, [cluster.rank(st, r, d),
                                                    cluster.rank(neighbour, r, d)], send_bytes)
                           for r in _replica_samples(d, cluster.gpus_per_node))
        params = _stage_params(shape, count)
        group = [cluster.rank(st, r, d) for r in range(d)]
        bw, lat = cluster.link(group)
        allreduce = ring_allreduce_time(params * prec.grad_reduce_bytes, d, bw, lat)
        if p > 1 and st in (0, p - 1):
            # The tied embedding / head matrix: its gradient is summed between the first and
            # the last stage after the replicas' all-reduce.
            tie_bytes = shape.vocab_size * shape.d_model * prec.grad_reduce_bytes
            allreduce += max(
                ring_allreduce_time(tie_bytes, 2, *cluster.link([cluster.rank(0, r, d),
                                                                 cluster.rank(p - 1, r, d)]))
                for r in _replica_samples(d, cluster.gpus_per_node))
        if hw.layer_times is not None:
            optimizer = params * hw.layer_times.optimizer_s_per_param
        else:
            # Adam reads and writes ~30 bytes per parameter (master, gradient, m, v in fp32;
            # the working copy): memory-bound.
            optimizer = params * 30 / hw.memory_bandwidth
        stages.append(StageCost(st, layers, count["block"], params, modes[st],
                                stash_microbatches(st, p, m, grid.schedule), state, acts,
                                transient, fwd, bwd, p2p, allreduce, optimizer))
    per_mb = [s.microbatch_s for s in stages]
    pipeline_s = sum(per_mb) + (m - 1) * max(per_mb)
    tail_s = max(s.allreduce_s + s.optimizer_s for s in stages)
    return Estimate(grid, tuple(stages), pipeline_s, tail_s, hw.usable_memory, precision)
