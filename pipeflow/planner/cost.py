"""The cost model of one pipeline × data grid: memory per stage and time per step."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from pipeflow.config import SCHEDULES
from pipeflow.models.gpt import layer_parameters
from pipeflow.partition import partition_balanced
from pipeflow.planner.hardware import GB, Cluster
from pipeflow.planner.shapes import Shape
from pipeflow.precision import bytes_per_parameter, itemsize
from pipeflow.schedule import build_schedule, simulate
from pipeflow.topology import rank_of

__all__ = [
    "PrecisionBytes", "PRECISIONS", "RECOMPUTE", "PLANNED_SCHEDULES", "Grid", "StageCost",
    "Estimate", "activation_bytes_per_layer", "head_activation_bytes", "peak_stash",
    "bubble_fraction", "ring_allreduce_time", "block_forward_flops", "head_forward_flops",
    "layer_kinds", "time_balanced_boundaries", "stage_memory", "estimate",
]

RECOMPUTE = ("none", "selective", "full")     # cheapest first: the order the search tries
# The schedules of `pipeflow.config.SCHEDULES` the cost model times.
PLANNED_SCHEDULES = tuple(s for s in SCHEDULES if s in ("1f1b", "gpipe"))


@dataclasses.dataclass(frozen=True)
class PrecisionBytes:
    """What one numeric recipe of `pipeflow.precision` costs the cost model.

    Bytes per parameter and per activation come from `pipeflow.precision`: bf16 keeps a bf16
    working weight, an fp32 master, the fp32 gradient accumulated over micro-batches (as
    Megatron-LM does) and AdamW's two fp32 moments, 18 bytes; fp32 keeps 16.
    """

    name: str
    peak_scale: float        # fraction of the bf16 dense peak this recipe's matmuls run at
    note: str
    grad_reduce_bytes: int = 4   # per parameter on the wire: the fp32 master gradients

    @property
    def state_bytes(self) -> int:
        """Per parameter: weights, master, gradient, optimizer state."""
        return bytes_per_parameter(self.name)

    @property
    def act_bytes(self) -> int:
        """Per activation element kept or sent between stages."""
        return itemsize(self.name)

    @property
    def activation_scale(self) -> float:
        """Korthikanti's per-layer formula counts 16-bit activations."""
        return self.act_bytes / 2


PRECISIONS: dict[str, PrecisionBytes] = {
    "bf16": PrecisionBytes("bf16", 1.0, f"bf16 working weights and activations, fp32 master "
                           f"weights, gradients and Adam state: {bytes_per_parameter('bf16')} "
                           f"bytes/parameter"),
    # TF32 matmuls run at half the bf16 dense peak on A100/H100/H200 (datasheets: 156 vs 312,
    # 494 vs 989 TFLOPS dense).
    "fp32": PrecisionBytes("fp32", 0.5, f"fp32 weights, gradients, Adam state "
                           f"({bytes_per_parameter('fp32')} bytes/parameter) and activations; "
                           f"TF32 matmuls at half the bf16 peak"),
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
                          precision: PrecisionBytes) -> float:
    """The output head's logits kept for backward: the logits in the working precision plus
    the fp32 log-softmax the cross-entropy keeps, per micro-batch."""
    return seq_len * micro_batch_size * vocab_size * (precision.act_bytes + 4)


@functools.lru_cache(maxsize=None)
def peak_stash(schedule: str, pipeline: int, microbatches: int,
               chunks: int = 1) -> tuple[int, ...]:
    """Per stage, the most micro-batches (model-chunk forwards, with `chunks` > 1) whose
    activations it holds at once: `pipeflow.schedule.simulate(...).peak_stash`.

    Simulating m micro-batches costs O(p·m), and the search asks for hundreds of (p, m).
    Past its warm-up, every schedule repeats one pattern, so its stash grows by a fixed step
    each `step` micro-batches (1F1B and interleaved by 0, GPipe by 1): from m0 = chunks·p
    (every warm-up is shorter) on, two simulations give the line. The tests hold it to the
    full simulation.
    """
    step = pipeline if chunks > 1 else 1       # interleaved runs groups of p micro-batches
    m0 = chunks * pipeline
    if microbatches <= m0 + step:
        programs = build_schedule(schedule, pipeline, microbatches, chunks)
        return tuple(simulate(programs).peak_stash)
    low = peak_stash(schedule, pipeline, m0, chunks)
    high = peak_stash(schedule, pipeline, m0 + step, chunks)
    steps = (microbatches - m0) // step
    return tuple(lo + steps * (hi - lo) for lo, hi in zip(low, high))


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


def _stage_params(shape: Shape, count: dict[str, int]) -> int:
    # The head shares the embedding's matrix. When it sits on another stage it holds its own
    # copy (with gradients and optimizer state), so it counts in that stage's memory.
    per = layer_parameters(shape)
    params = sum(n * per[k] for k, n in count.items())
    if count["embed"] and count["head"] and shape.tie_embeddings:
        params -= shape.vocab_size * shape.d_model     # one tied matrix on a single stage
    return params


# -- time per layer ---------------------------------------------------------------------

def _layer_time(shape: Shape, cluster: Cluster, precision: PrecisionBytes, kind: str, phase: str,
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


def _recompute_time(shape: Shape, cluster: Cluster, precision: PrecisionBytes, recompute: str,
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

@functools.lru_cache(maxsize=4096)
def _balanced_cached(weights: tuple[float, ...], parts: int) -> tuple[int, ...]:
    return tuple(partition_balanced(weights, parts))


def time_balanced_boundaries(shape: Shape, cluster: Cluster, precision: PrecisionBytes,
                             pipeline: int, b: int) -> tuple[int, ...]:
    """Stage boundaries in the layer list balancing forward + backward time at micro-batch
    size `b` (without recomputation): `pipeflow.partition.partition_balanced`, the solver
    the engine's `partition = "time"` uses."""
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


def _p2p_time(cluster: Cluster, stage: int, p: int, d: int, send_bytes: float) -> float:
    """Per micro-batch: the stage's activation sent forward and gradient sent backward."""
    total = 0.0
    for neighbour in (stage + 1, stage - 1):
        if 0 <= neighbour < p:
            # Every replica sends at once; the step waits for the slowest pair.
            total += max(_transfer_time(cluster, [rank_of(stage, r, d),
                                                  rank_of(neighbour, r, d)], send_bytes)
                         for r in _replica_samples(d, cluster.gpus_per_node))
    return total


def _gradient_sync_time(shape: Shape, cluster: Cluster, prec: PrecisionBytes, stage: int,
                        p: int, d: int, params: int) -> float:
    """Per step: the all-reduce over the stage's replicas, and the tied matrix's sum."""
    bw, lat = cluster.link([rank_of(stage, r, d) for r in range(d)])
    total = ring_allreduce_time(params * prec.grad_reduce_bytes, d, bw, lat)
    if p > 1 and stage in (0, p - 1) and shape.tie_embeddings:
        # The tied embedding / head matrix: its gradient is summed between the first and
        # the last stage after the replicas' all-reduce.
        tie_bytes = shape.vocab_size * shape.d_model * prec.grad_reduce_bytes
        total += max(ring_allreduce_time(tie_bytes, 2, *cluster.link([rank_of(0, r, d),
                                                                      rank_of(p - 1, r, d)]))
                     for r in _replica_samples(d, cluster.gpus_per_node))
    return total


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


def stage_memory(shape: Shape, precision: PrecisionBytes, grid: Grid, stage: int,
                 layers: tuple[int, int], recompute: str) -> tuple[float, float, float]:
    """(state, activation stash, transient) bytes of one stage.

    The stash is `peak_stash` micro-batches of what each of the stage's layers keeps
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
    stash = peak_stash(grid.schedule, grid.pipeline, grid.microbatches)[stage]
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
        params = _stage_params(shape, count)
        p2p = _p2p_time(cluster, st, p, d, send_bytes)
        allreduce = _gradient_sync_time(shape, cluster, prec, st, p, d, params)
        if hw.layer_times is not None:
            optimizer = params * hw.layer_times.optimizer_s_per_param
        else:
            # Adam reads and writes ~30 bytes per parameter (master, gradient, m, v in fp32;
            # the working copy): memory-bound.
            optimizer = params * 30 / hw.memory_bandwidth
        stages.append(StageCost(st, layers, count["block"], params, modes[st],
                                peak_stash(grid.schedule, p, m)[st], state, acts,
                                transient, fwd, bwd, p2p, allreduce, optimizer))
    per_mb = [s.microbatch_s for s in stages]
    pipeline_s = sum(per_mb) + (m - 1) * max(per_mb)
    tail_s = max(s.allreduce_s + s.optimizer_s for s in stages)
    return Estimate(grid, tuple(stages), pipeline_s, tail_s, hw.usable_memory, precision)
