"""The cost model of one pipeline × data × tensor grid: memory per stage and time per step."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from pipeflow.models.gpt_shape import layer_parameters
from pipeflow.runtime.balance import partition_balanced
from pipeflow.planner.hardware import GB, Cluster
from pipeflow.planner.shapes import Shape
from pipeflow.runtime.sizes import bytes_per_parameter, itemsize, sharded_bytes_per_parameter
from pipeflow.schedules import registry, simulate
from pipeflow.schedules.plan import Plan
from pipeflow.grid import Grid as RankGrid

__all__ = [
    "PrecisionBytes", "PRECISIONS", "RECOMPUTE", "PLANNED_SCHEDULES", "Grid", "StageCost",
    "Estimate", "tensor_degrees", "tensor_layer_parameters", "tensor_comm_time",
    "activation_bytes_per_layer", "head_activation_bytes", "peak_stash",
    "peak_held", "idle_units", "schedule_chunks", "exposed_allreduce_time", "bubble_fraction",
    "ring_allreduce_time", "ring_half_time", "block_forward_flops", "head_forward_flops",
    "layer_kinds", "time_balanced_boundaries", "stage_memory", "stage_bytes", "stage_compute",
    "layer_times", "optimizer_time", "estimate",
]

RECOMPUTE = ("none", "selective", "full")     # cheapest first: the order the search tries
# The registered schedules the cost model times (`ScheduleSpec.planned`).
PLANNED_SCHEDULES = tuple(name for name, spec in registry.SCHEDULES.items() if spec.planned)
BUCKET_BYTES = 25 * 2**20             # the engine's default gradient bucket (Config.bucket_mb)


def schedule_chunks(schedule: str) -> int:
    """Model chunks per rank the planner runs `schedule` with (a V: 2)."""
    return registry.get(schedule).resolve_chunks(None)


def split_backward(schedule: str) -> bool:
    """Whether `schedule` runs B (input gradient) and W (weight gradient) apart."""
    return registry.get(schedule).split_backward


@dataclasses.dataclass(frozen=True)
class PrecisionBytes:
    """What one numeric recipe of `pipeflow.runtime.precision` costs the cost model.

    Bytes per parameter and per activation come from `pipeflow.runtime.precision`: bf16 keeps a bf16
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

    def state_bytes_on(self, grid: "Grid") -> float:
        """Per parameter on `grid`: with the sharded optimizer, masters, optimizer state
        and the summed gradient's block are divided by the data size."""
        if grid.shard_optimizer:
            return sharded_bytes_per_parameter(self.name, grid.data)
        return self.state_bytes

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
    shard_optimizer: bool = False   # masters and optimizer state over the data group (d > 1)
    tensor: int = 1                 # each stage's matrices cut over t consecutive ranks
    sequence_parallel: bool = False  # t > 1: norms, dropout, residuals on 1/t of the sequence

    @property
    def gpus(self) -> int:
        return self.pipeline * self.data * self.tensor

    @property
    def ranks(self) -> RankGrid:
        """The engine's rank layout of this grid (`pipeflow.grid.Grid`, tensor innermost)."""
        return RankGrid(self.pipeline, self.data, self.tensor)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.data * self.microbatches * self.micro_batch_size

    def describe(self) -> str:
        return (f"p={self.pipeline} d={self.data}"
                + (f" t={self.tensor}{' sp' if self.sequence_parallel else ''}"
                   if self.tensor > 1 else "")
                + f" b={self.micro_batch_size} m={self.microbatches} {self.schedule}"
                + (" sharded" if self.shard_optimizer else ""))


# -- formulas ---------------------------------------------------------------------------

def activation_bytes_per_layer(seq_len: int, micro_batch_size: int, d_model: int, n_heads: int,
                               recompute: str = "none", scale: float = 1.0, tensor: int = 1,
                               sequence_parallel: bool = False) -> float:
    """Bytes one transformer block keeps for its backward, per micro-batch, on one rank.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    section 4, in 16-bit with dropout masks: s·b·h·(34 + 5·a·s/h) without tensor
    parallelism (eq. 1); s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor parallelism over t ranks
    (eq. 2: the layer norms, dropouts and residuals, 10·s·b·h, stay whole on every rank);
    s·b·h·(34 + 5·a·s/h)/t with sequence parallelism too (eq. 4). Selective recomputation
    (recompute the attention core) drops the 5·a·s/h term (eq. 6: 34·s·b·h/t with sequence
    parallelism); full recomputation keeps only the block's input, 2·s·b·h (its 1/t slice
    with sequence parallelism). `scale` is 2 for fp32 activations.
    """
    s, b, h, a, t = seq_len, micro_batch_size, d_model, n_heads, tensor
    sp = sequence_parallel and t > 1
    if recompute == "none":
        per = s * b * h * ((34 + 5 * a * s / h) / t if sp else
                           10 + 24 / t + 5 * a * s / (h * t))
    elif recompute == "selective":
        per = s * b * h * (34 / t if sp else 10 + 24 / t)
    elif recompute == "full":
        per = 2 * s * b * h / (t if sp else 1)
    else:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, found {recompute!r}")
    return per * scale


def head_activation_bytes(seq_len: int, micro_batch_size: int, vocab_size: int,
                          precision: PrecisionBytes, tensor: int = 1) -> float:
    """The output head's logits kept for backward: the logits in the working precision plus
    the fp32 log-softmax the cross-entropy keeps, per micro-batch; 1/t of the vocabulary on
    a tensor rank where t divides it (the vocabulary-parallel loss never joins them)."""
    return seq_len * micro_batch_size * vocab_size * (precision.act_bytes + 4) \
        / _vocab_parts(vocab_size, tensor)


def _vocab_parts(vocab_size: int, tensor: int) -> int:
    """Over how many ranks the GPT's embedding and head cut the vocabulary: t where it
    divides the vocabulary, else 1 (`Split(optional=True)` leaves them whole)."""
    return tensor if vocab_size % tensor == 0 else 1


def tensor_degrees(shape: Shape, gpus_per_node: int, gpus: int) -> list[int]:
    """The tensor degrees the search tries: 1, 2, 4, ... up to the GPUs per node (a tensor
    group stays inside one node: the grid puts it on consecutive ranks) and the cluster,
    each dividing the heads (attention is cut by heads; the MLP's 4·h then divides too)."""
    out, t = [], 1
    while t <= min(gpus_per_node, gpus):
        if shape.n_heads % t == 0 and gpus_per_node % t == 0:
            out.append(t)
        t *= 2
    return out


def tensor_layer_parameters(shape: Shape, tensor: int = 1) -> dict[str, int]:
    """`layer_parameters` as one rank of a tensor group of `tensor` holds them (Megatron's
    split, `pipeflow.models.gpt`'s `tp_plan`): a block's q, k, v, output projection and MLP
    matrices (12·h² weights, 7·h of biases) are cut in t; its two layer norms and the
    row-split layers' biases (4·h) stay whole; the token embedding and the head's matrix
    and bias are cut by the vocabulary where t divides it; the positions and the final norm
    stay whole."""
    per = layer_parameters(shape)
    if tensor == 1:
        return per
    h, V, bias = shape.d_model, shape.vocab_size, int(shape.bias)
    cut_block = 12 * h * h + 7 * bias * h
    parts = _vocab_parts(V, tensor)
    cut_embed, cut_head = V * h, h * V + bias * V
    return {"block": per["block"] - cut_block + cut_block // tensor,
            "embed": per["embed"] - cut_embed + cut_embed // parts,
            "head": per["head"] - cut_head + cut_head // parts}


@functools.lru_cache(maxsize=None)
def _simulated(schedule: str, pipeline: int, microbatches: int,
               chunks: int) -> tuple[tuple[float, ...], ...]:
    """(peak stash per stage, peak held per stage, (idle units,)) of a simulation with
    F = B = W = 1 unit: `pipeflow.schedules.simulate`. Idle units: the makespan less the 3m
    units of one rank's work.

    Simulating m micro-batches costs O(p·m), and the search asks for hundreds of (p, m).
    Past its warm-up, every schedule repeats one pattern, so each figure grows by a fixed
    step each `step` micro-batches (1F1B's stash by 0, GPipe's by 1, every idle time by 0):
    from m0 = chunks·p (every warm-up, ZBV's 2p - 1 too, is shorter) on, two simulations
    give the line. The tests hold it to the full simulation.
    """
    spec = registry.get(schedule)
    known = spec.steady(pipeline, microbatches) if spec.steady else None
    if known is not None:
        return known
    step = spec.microbatch_multiple(pipeline)         # interleaved: groups of p micro-batches
    m0 = chunks * pipeline
    if microbatches <= m0 + step:
        plan = Plan.build(schedule, pipeline, microbatches, chunks)   # what the engine runs
        r = simulate(plan.programs, forward_time=1.0, backward_input_time=1.0, weight_time=1.0)
        return (tuple(r.peak_stash), tuple(r.peak_held), (r.makespan - 3 * microbatches,))
    low = _simulated(schedule, pipeline, m0, chunks)
    high = _simulated(schedule, pipeline, m0 + step, chunks)
    steps = (microbatches - m0) // step
    return tuple(tuple(lo + steps * (hi - lo) for lo, hi in zip(a, b))
                 for a, b in zip(low, high))


@functools.lru_cache(maxsize=4096)
def peak_stash(schedule: str, pipeline: int, microbatches: int,
               chunks: int = 1) -> tuple[int, ...]:
    """Per stage, the most micro-batches (model-chunk forwards, with `chunks` > 1) forwarded
    and not yet through B: `pipeflow.schedules.simulate(...).peak_stash`."""
    return tuple(int(x) for x in _simulated(schedule, pipeline, microbatches, chunks)[0])


@functools.lru_cache(maxsize=4096)
def peak_held(schedule: str, pipeline: int, microbatches: int,
              chunks: int = 1) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once: the stash, and
    under split backward those whose W is still pending (`simulate(...).peak_held`)."""
    return tuple(int(x) for x in _simulated(schedule, pipeline, microbatches, chunks)[1])


def idle_units(schedule: str, pipeline: int, microbatches: int, chunks: int = 1) -> float:
    """A step's idle time with F = B = W = 1 unit: 3(p - 1) for 1F1B and GPipe, p - 1 for
    ZB-H1 once m >= p (Qi et al.'s (p - 1)(F + B - W)), (p - 1)/2 for ZBV once m >= 2p - 1."""
    return _simulated(schedule, pipeline, microbatches, chunks)[2][0]


def bubble_fraction(pipeline: int, microbatches: int) -> float:
    """(p - 1)/(m + p - 1): the idle share of a step for GPipe and 1F1B (Huang et al. 2019)."""
    return (pipeline - 1) / (microbatches + pipeline - 1)


def ring_allreduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce: 2(d-1)/d of the buffer crosses each link, in 2(d-1) steps."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def ring_half_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """A ring reduce-scatter or all-gather: (d-1)/d of the buffer crosses each link, in d-1
    steps (half an all-reduce)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency


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


def _stage_params(shape: Shape, count: dict[str, int], tensor: int = 1) -> int:
    # The head shares the embedding's matrix. When it sits on another stage it holds its own
    # copy (with gradients and optimizer state), so it counts in that stage's memory.
    per = tensor_layer_parameters(shape, tensor)
    params = sum(n * per[k] for k, n in count.items())
    if count["embed"] and count["head"] and shape.tie_embeddings:
        # One tied matrix on a single stage (its slice on a tensor rank).
        params -= shape.vocab_size * shape.d_model // _vocab_parts(shape.vocab_size, tensor)
    return params


def state_floor(shape: Shape, precision: PrecisionBytes, pipeline: int, tensor: int = 1) -> float:
    """The least weight and optimizer-state bytes the fullest stage holds on one rank,
    whatever the partition into `pipeline` stages (data 1, tensor `tensor`): at least 1/p of
    the whole model's, and at least its widest layer's (from two stages on the embedding and
    the head are apart, each with its own copy of a tied matrix)."""
    whole = _stage_params(shape, {"embed": 1, "block": shape.n_layers, "head": 1}, tensor)
    widest = max(tensor_layer_parameters(shape, tensor).values()) if pipeline > 1 else whole
    return max(whole / pipeline, widest) * precision.state_bytes


# -- time per layer ---------------------------------------------------------------------

def _layer_time(shape: Shape, cluster: Cluster, precision: PrecisionBytes, kind: str, phase: str,
                b: int, tensor: int = 1) -> float:
    """A layer's compute on one rank, its tensor group's communication left out.

    At tensor degree t a block's (and, where t divides the vocabulary, the head's) matrix
    products are 1/t as many FLOPs on each rank, at the same fraction of peak: the model
    assumes no matmul efficiency lost to the narrower matrices (the tensor group's
    all-reduces, the cost that grows with t, are costed apart and never hidden, see
    `tensor_comm_time`). Calibrated hardware measures the cut block and head instead
    (`LayerTimes.time_at`)."""
    hw = cluster.hardware
    if hw.layer_times is not None:
        return hw.layer_times.time_at(kind, phase, b, tensor if kind == "block" else
                                      _vocab_parts(shape.vocab_size, tensor)
                                      if kind == "head" else 1)
    rate = hw.peak_flops * precision.peak_scale * hw.efficiency
    if kind == "block":
        flops = block_forward_flops(shape, b) / tensor
    elif kind == "head":
        flops = head_forward_flops(shape, b) / _vocab_parts(shape.vocab_size, tensor)
    else:
        # A lookup: memory-bound, b·s·h values written.
        return b * shape.seq_len * shape.d_model * precision.act_bytes / hw.memory_bandwidth
    return flops / rate * (2.0 if phase == "backward" else 1.0)


def tensor_comm_time(shape: Shape, cluster: Cluster, precision: PrecisionBytes, kind: str,
                     phase: str, b: int, tensor: int, sequence_parallel: bool = False) -> float:
    """Seconds a layer waits for its tensor group per micro-batch (0 at t = 1).

    Megatron's split (Shoeybi et al. 2019): a block all-reduces its b·s·h activations twice
    forward (after attention's and the MLP's row layers) and twice backward (the gradients
    of the column layers' inputs). With sequence parallelism (Korthikanti et al. 2022) each
    becomes an all-gather and a reduce-scatter of the same bytes (half a ring all-reduce
    each), and the backward gathers the column layers' inputs again for their weight
    gradients (as Megatron and pipeflow do): 4 halves forward, 6 backward. The embedding cut
    by the vocabulary all-reduces its output forward; the head copies its input to the group
    (an all-reduce of its gradient backward) and its vocabulary-parallel loss exchanges the
    row maxima and two sums per token. Rings over the tensor link (`Cluster.tensor_link`),
    on the critical path: the engine waits for each before the next matrix product."""
    if tensor == 1:
        return 0.0
    bw, lat = cluster.tensor_link(tensor)
    x = b * shape.seq_len * shape.d_model * precision.act_bytes
    ring = ring_allreduce_time(x, tensor, bw, lat)
    half = ring_half_time(x, tensor, bw, lat)
    backward = phase == "backward"
    if kind == "block":
        if sequence_parallel:
            return (6 if backward else 4) * half
        return 2 * ring
    vocab_cut = _vocab_parts(shape.vocab_size, tensor) > 1
    if kind == "embed":
        return ring if vocab_cut and not backward else 0.0
    tokens = b * shape.seq_len * 4                      # one fp32 value per token
    if backward:
        return ring if vocab_cut else 0.0
    loss = (ring_half_time(tokens * tensor, tensor, bw, lat)
            + ring_allreduce_time(2 * tokens, tensor, bw, lat)) if vocab_cut else 0.0
    return loss + (half if sequence_parallel else 0.0)   # the slices gathered whole


def _recompute_time(shape: Shape, cluster: Cluster, precision: PrecisionBytes, recompute: str,
                    b: int, times: dict[tuple[str, str], float], tensor: int = 1) -> float:
    """Extra time per block per micro-batch that recomputation adds to the backward: the
    block's forward (its all-reduces too) for full, the attention core for selective."""
    if recompute == "none":
        return 0.0
    if recompute == "full":
        return times["block", "forward"]
    # Selective recomputes the attention core: 4·b·s²·h of the block's forward FLOPs.
    s, h = shape.seq_len, shape.d_model
    forward = _layer_time(shape, cluster, precision, "block", "forward", b, tensor)
    return forward * (4 * b * s * s * h) / block_forward_flops(shape, b)


# -- partition --------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _balanced_cached(weights: tuple[float, ...], parts: int) -> tuple[int, ...]:
    return tuple(partition_balanced(weights, parts))


def time_balanced_boundaries(shape: Shape, cluster: Cluster, precision: PrecisionBytes,
                             pipeline: int, b: int, tensor: int = 1,
                             sequence_parallel: bool = False) -> tuple[int, ...]:
    """Stage boundaries in the layer list balancing forward + backward time at micro-batch
    size `b` (without recomputation): `pipeflow.runtime.partition.partition_balanced`, the solver
    the engine's `partition = "time"` uses."""
    # Balance forward + backward time without recomputation; the search evaluates the same
    # (pipeline, micro-batch) split many times, hence the cache on the weights.
    times = layer_times(shape, cluster, precision, b, tensor, sequence_parallel)
    w = {k: times[k, "forward"] + times[k, "backward"] for k in ("embed", "block", "head")}
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


def _p2p_time(cluster: Cluster, stage: int, grid: RankGrid, send_bytes: float) -> float:
    """Per micro-batch: the stage's activation sent forward and gradient sent backward."""
    total = 0.0
    for neighbour in (stage + 1, stage - 1):
        if 0 <= neighbour < grid.pipeline:
            # Every replica (and tensor rank: each has its own pipeline) sends at once; the
            # step waits for the slowest pair.
            total += max(_transfer_time(cluster, [grid.rank(stage, r), grid.rank(neighbour, r)],
                                        send_bytes)
                         for r in _replica_samples(grid.data, cluster.gpus_per_node))
    return total


def exposed_allreduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float,
                           window_s: float, bucket_bytes: float = BUCKET_BYTES) -> float:
    """The part of a bucketed all-reduce the step waits for after its last backward.

    Buckets launch as their gradients become final during the last micro-batch's backward
    (its W under split backward), which takes `window_s`: every bucket but the last (the
    first layers', final at the very end) runs behind it, and the last runs after."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    last = nbytes - bucket_bytes * (math.ceil(nbytes / bucket_bytes) - 1)
    rest = ring_allreduce_time(nbytes - last, ranks, bandwidth, latency) if nbytes > last \
        else 0.0
    return ring_allreduce_time(last, ranks, bandwidth, latency) + max(0.0, rest - window_s)


def _gradient_sync_time(shape: Shape, cluster: Cluster, prec: PrecisionBytes, stage: int,
                        grid: RankGrid, params: int, window_s: float,
                        sharded: bool = False) -> tuple[float, float]:
    """Per step: (the all-reduce over the stage's replicas plus the tied matrix's sum, the
    part of it after the last backward: all but the last bucket overlap the last micro-batch's
    backward, `window_s`; the tied sum follows the replicas' all-reduce).

    Sharded: a reduce-scatter of the fp32 gradients (overlapped as the all-reduce's buckets,
    half its traffic) and an all-gather of the working weights after the step, counted
    whole after it (it overlaps only the step of later buckets, itself 1/d as long).
    `params` are one tensor rank's: each tensor rank's data group reduces its own slices."""
    # A stage's replicas are near ranks (t apart): its first and last span the group's nodes.
    p, d = grid.pipeline, grid.data
    group = grid.group("data", grid.rank(stage))
    bw, lat = cluster.link([group[0], group[-1]])
    nbytes = params * prec.grad_reduce_bytes
    if sharded and d > 1:
        gather = ring_half_time(params * prec.act_bytes, d, bw, lat)
        scatter = ring_half_time(nbytes, d, bw, lat)
        total = scatter + gather
        exposed = exposed_allreduce_time(nbytes, d, bw, lat, window_s) * scatter \
            / ring_allreduce_time(nbytes, d, bw, lat) + gather
    else:
        total = ring_allreduce_time(nbytes, d, bw, lat)
        exposed = exposed_allreduce_time(nbytes, d, bw, lat, window_s)
    if p > 1 and stage in (0, p - 1) and shape.tie_embeddings:
        # The tied embedding / head matrix: its gradient is summed between the first and
        # the last stage after the replicas' all-reduce.
        tie_bytes = shape.vocab_size * shape.d_model * prec.grad_reduce_bytes \
            / _vocab_parts(shape.vocab_size, grid.tensor)
        tie = max(ring_allreduce_time(tie_bytes, 2, *cluster.link([grid.rank(0, r),
                                                                   grid.rank(p - 1, r)]))
                  for r in _replica_samples(d, cluster.gpus_per_node))
        total, exposed = total + tie, exposed + tie
    return total, exposed


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
    backward_s: float               # per micro-batch, recomputation included (B + W)
    p2p_s: float                    # per micro-batch: this stage's sends
    allreduce_s: float              # per step
    optimizer_s: float              # per step
    weight_s: float = 0.0           # of backward_s, W under split backward (0 without)
    allreduce_exposed_s: float = 0.0   # of allreduce_s, what is not hidden behind backward

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
    bubble_s: float = 0.0   # of pipeline_s, the idle time of the slowest stage

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
        """The idle share of the pipeline span: (p - 1)/(m + p - 1) for 1F1B's equal stages."""
        return self.bubble_s / self.pipeline_s if self.pipeline_s else 0.0


def _stage_kinds(shape: Shape, layers: tuple[int, int]) -> dict[str, int]:
    """How many of each layer kind the stage owning layer-list slice `layers` holds."""
    lo, hi = layers
    embed = int(lo == 0)
    head = int(hi == shape.n_layers + 2)
    return {"embed": embed, "block": hi - lo - embed - head, "head": head}


def stage_memory(shape: Shape, precision: PrecisionBytes, grid: Grid, stage: int,
                 layers: tuple[int, int], recompute: str) -> tuple[float, float, float]:
    """(state, activation stash, transient) bytes of one stage.

    The stash is `peak_held` micro-batches of what each of the stage's layers keeps (ZBV's
    in chunks, each half the stage's layers; with split backward those waiting for W count)
    (Korthikanti's per-block formula; the head's logits on the last stage). Under full or
    selective recomputation the dropped activations of one block are rebuilt during its
    backward: that transient, and the fp32 logits gradient on the head's stage, come on top
    once.
    """
    params, per_mb, transient = stage_bytes(shape, precision, grid.micro_batch_size, layers,
                                            recompute, grid.tensor, grid.sequence_parallel)
    chunks = schedule_chunks(grid.schedule)
    held = peak_held(grid.schedule, grid.pipeline, grid.microbatches, chunks)[stage]
    return params * precision.state_bytes_on(grid), held * per_mb / chunks, transient


def stage_bytes(shape: Shape, precision: PrecisionBytes, b: int, layers: tuple[int, int],
                recompute: str, tensor: int = 1,
                sequence_parallel: bool = False) -> tuple[int, float, float]:
    """(parameters, activation bytes one micro-batch of size `b` leaves, transient bytes) on
    one rank of the stage owning layer-list slice `layers`, its tensor group of `tensor`:
    what `stage_memory` scales by the grid."""
    count = _stage_kinds(shape, layers)
    s = shape.seq_len
    acts = functools.partial(activation_bytes_per_layer, s, b, shape.d_model, shape.n_heads,
                             scale=precision.activation_scale, tensor=tensor,
                             sequence_parallel=sequence_parallel)
    per_block = acts(recompute)
    per_mb = count["block"] * per_block
    transient = 0.0
    if count["head"]:
        per_mb += head_activation_bytes(s, b, shape.vocab_size, precision, tensor)
        transient += s * b * shape.vocab_size * 4 / _vocab_parts(shape.vocab_size, tensor)
    if recompute != "none" and count["block"]:
        transient += acts("none") - per_block
    return _stage_params(shape, count, tensor), per_mb, transient


def stage_compute(shape: Shape, cluster: Cluster, prec: PrecisionBytes, b: int,
                  layers: tuple[int, int], mode: str, times: dict[tuple[str, str], float],
                  tensor: int = 1) -> tuple[float, float, float]:
    """(forward, backward with recomputation, plain backward) seconds per micro-batch of the
    stage owning `layers`; `times` are `layer_times`' for micro-batch size `b` at `tensor`."""
    count = _stage_kinds(shape, layers)
    fwd = sum(n * times[k, "forward"] for k, n in count.items())
    plain = sum(n * times[k, "backward"] for k, n in count.items())
    recompute = _recompute_time(shape, cluster, prec, mode, b, times, tensor)
    return fwd, plain + count["block"] * recompute, plain


def layer_times(shape: Shape, cluster: Cluster, prec: PrecisionBytes, b: int, tensor: int = 1,
                sequence_parallel: bool = False) -> dict[tuple[str, str], float]:
    """Seconds per micro-batch of size `b` on one rank of a tensor group of `tensor`, by
    (layer kind, "forward" or "backward"): compute plus the group's communication."""
    return {(k, ph): _layer_time(shape, cluster, prec, k, ph, b, tensor)
            + tensor_comm_time(shape, cluster, prec, k, ph, b, tensor, sequence_parallel)
            for k in ("embed", "block", "head") for ph in ("forward", "backward")}


def optimizer_time(cluster: Cluster, params: int, data: int, sharded: bool) -> float:
    """Seconds of a stage's optimizer step over `params` parameters (1/data of them when
    sharded over `data` replicas)."""
    hw = cluster.hardware
    if hw.layer_times is not None:
        optimizer = params * hw.layer_times.optimizer_s_per_param
    else:
        # Adam reads and writes ~30 bytes per parameter (master, gradient, m, v in fp32;
        # the working copy): memory-bound.
        optimizer = params * 30 / hw.memory_bandwidth
    if sharded:
        optimizer /= data       # each replica steps 1/d of the masters
    return optimizer


def estimate(shape: Shape, cluster: Cluster, grid: Grid, recompute: str | Sequence[str],
             precision: str = "bf16", boundaries: Sequence[int] | None = None) -> Estimate:
    """Memory per stage and step time of `grid` with per-stage `recompute`.

    Step time = m·max_s t_s + bubble + max_s(exposed all-reduce_s + optimizer_s), where t_s
    is stage s's forward + backward + sends for one micro-batch. The bubble is the ramp of
    the other stages: Σ_s t_s - t_slowest for 1F1B and GPipe, so that equal stages take
    (m + p - 1)·t, the bubble (p - 1)/(m + p - 1) of Huang et al. 2019 and Narayanan et al.
    2021. With split backward (ZB-H1, ZBV) each stage's share of the ramp is F + B - W
    instead of F + B + W (Qi et al. 2024: ZB-H1 idles (p - 1)(F + B - W)), scaled by the
    schedule's simulated idle time (`idle_units`: ZBV half ZB-H1's; more when m < p); W is
    half the backward without recomputation (F = B = W, thirds of a layer's time). Of the
    gradient all-reduce, all buckets but the last hide behind the last micro-batch's
    backward (its W under split backward), on GPUs; on calibrated CPU hardware (mpi4py)
    none does. ZBV is costed on the p-stage partition with
    twice the point-to-point messages (each rank sends for both its chunks).
    """
    prec = PRECISIONS[precision]
    p, b = grid.pipeline, grid.micro_batch_size
    t, sp = grid.tensor, grid.sequence_parallel
    if boundaries is None:
        boundaries = time_balanced_boundaries(shape, cluster, prec, p, b, t, sp)
    if len(boundaries) != p + 1:
        raise ValueError(f"{len(boundaries)} boundaries for {p} stages")
    modes = [recompute] * p if isinstance(recompute, str) else list(recompute)
    times = layer_times(shape, cluster, prec, b, t, sp)
    stages = tuple(_stage_cost(shape, cluster, prec, grid, st, (boundaries[st],
                                                                 boundaries[st + 1]),
                               modes[st], times) for st in range(p))
    pipeline_s, bubble_s = _pipeline_time(stages, grid)
    tail_s = max(s.allreduce_exposed_s + s.optimizer_s for s in stages)
    return Estimate(grid, stages, pipeline_s, tail_s, cluster.hardware.usable_memory,
                    precision, bubble_s)


def _stage_cost(shape: Shape, cluster: Cluster, prec: PrecisionBytes, grid: Grid, st: int,
                layers: tuple[int, int], mode: str,
                times: dict[tuple[str, str], float]) -> StageCost:
    p, d, b, t = grid.pipeline, grid.data, grid.micro_batch_size, grid.tensor
    count = _stage_kinds(shape, layers)
    state, acts, transient = stage_memory(shape, prec, grid, st, layers, mode)
    fwd, bwd, plain = stage_compute(shape, cluster, prec, b, layers, mode, times, t)
    # Split backward: W is half the plain backward; B the rest, recomputation included.
    weight = plain / 2 if split_backward(grid.schedule) else 0.0
    params = _stage_params(shape, count, t)
    # Each tensor rank sends to its own peer: the whole activation, or its sequence slice.
    send_bytes = b * shape.seq_len * shape.d_model * prec.act_bytes \
        / (t if grid.sequence_parallel else 1)
    p2p = _p2p_time(cluster, st, grid.ranks, send_bytes) * schedule_chunks(grid.schedule)
    # On calibrated (CPU, mpi4py) hardware MPI moves the buckets mostly when the engine waits
    # for them: nothing hides there.
    window = 0.0 if cluster.hardware.calibrated else weight or bwd
    sharded = grid.shard_optimizer and d > 1
    allreduce, exposed = _gradient_sync_time(shape, cluster, prec, st, grid.ranks, params,
                                             window, sharded)
    optimizer = optimizer_time(cluster, params, d, sharded)
    held = peak_held(grid.schedule, p, grid.microbatches, schedule_chunks(grid.schedule))[st]
    return StageCost(st, layers, count["block"], params, mode, held, state, acts, transient,
                     fwd, bwd, p2p, allreduce, optimizer, weight, exposed)


def _pipeline_time(stages: Sequence[StageCost], grid: Grid) -> tuple[float, float]:
    """(the span of the forwards and backwards, its bubble), see `estimate`."""
    p, m = grid.pipeline, grid.microbatches
    per_mb = [s.microbatch_s for s in stages]
    slowest = max(range(p), key=per_mb.__getitem__)
    if split_backward(grid.schedule):
        # A stage's share of the ramp in units of F = B = W: F + B - W (and its sends).
        gaps = [s.forward_s + (s.backward_s - s.weight_s) - s.weight_s + s.p2p_s
                for s in stages]
    else:
        gaps = [t / 3 for t in per_mb]          # a third of F + B + W
    scale = idle_units(grid.schedule, p, m, schedule_chunks(grid.schedule)) / (p - 1) \
        if p > 1 else 0.0
    bubble = scale * (sum(gaps) - gaps[slowest])
    return m * per_mb[slowest] + bubble, bubble
