"""The search: every pipeline × data × tensor grid, micro-batching, schedule and per-stage
recomputation; fastest fit."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Iterator, Sequence

from pipeflow.config import SCHEDULES
from pipeflow.schedules import registry
from pipeflow.planner.cost import (PLANNED_SCHEDULES, PRECISIONS, RECOMPUTE, Estimate, Grid,
                                   PrecisionBytes, estimate, layer_kinds, state_floor,
                                   tensor_degrees, time_balanced_boundaries)
from pipeflow.planner.hardware import GB, Cluster
from pipeflow.planner.shapes import Shape
from pipeflow.planner.table import StageTable, stage_table

__all__ = ["PlanError", "Rejection", "SearchOptions", "SearchResult", "divisors",
           "enumerate_grids", "choose_recompute", "search", "minimum_gpus", "minimum_grid"]


class PlanError(ValueError):
    """No plan fits; the message says what would (more GPUs, more memory, a smaller model)."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A grid the search threw out, and why."""

    grid: Grid
    reason: str
    peak_memory_gb: float   # the least its fullest stage needs, every recomputation allowed


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The fastest plans that fit, fastest first, and the grids that did not."""

    ranked: tuple[Estimate, ...]    # `SearchOptions.rank` of them (all without pruning)
    rejected: tuple[Rejection, ...]
    considered: int
    fitting: int                    # grids that fit memory, ranked or not
    estimated: int                  # of those, how many were estimated (the rest pruned)

    @property
    def best(self) -> Estimate:
        return self.ranked[0]

    @property
    def pruned(self) -> int:
        """Grids that fit but whose step-time bound could not place them among the ranked."""
        return self.fitting - self.estimated


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_grids(shape: Shape, gpus: int, global_batch: int,
                    schedules: Sequence[str] = PLANNED_SCHEDULES,
                    max_micro_batch: int = 16, tensors: Sequence[int] = (1,),
                    sequence_parallel: bool | None = None) -> Iterator[Grid]:
    """Every (tensor, pipeline, data, micro-batch size, micro-batch count, schedule) with
    pipeline·data·tensor ≤ gpus and data·count·size = global_batch sequences; at t > 1 with
    and without sequence parallelism (`sequence_parallel` None; only one where it is a
    bool), with it only where t divides the sequence.

    Grids using fewer GPUs than the cluster has stay in: when the batch does not divide
    evenly they may be the fastest, and it makes the search's answer never slower with more
    GPUs. A stage holds at least one layer of the n_layers + 2 (embedding, blocks, head).
    """
    n_items = len(layer_kinds(shape))
    for t in tensors:
        sps = (False,) if t == 1 else tuple(
            sp for sp in (False, True) if sequence_parallel in (None, sp)
            and (not sp or shape.seq_len % t == 0))
        for p in range(1, min(gpus // t, n_items) + 1):
            for d in divisors(global_batch):
                if p * d * t > gpus:
                    break
                for b in divisors(global_batch // d):
                    if b > max_micro_batch:
                        break
                    m = global_batch // (d * b)
                    # One stage runs every schedule alike: keep only the first. A schedule
                    # only from its `planner_min_microbatches` (a V where it fills,
                    # m >= 2p - 1: below, ZB-H1 is as near at less memory and half the
                    # messages, and simulating every short V of a deep pipeline would cost
                    # the search minutes).
                    for schedule in (schedules if p > 1 else schedules[:1]):
                        if m >= registry.get(schedule).planner_min_microbatches(p):
                            for sp in sps:
                                yield Grid(p, d, b, m, schedule, tensor=t,
                                           sequence_parallel=sp)


def choose_recompute(shape: Shape, cluster: Cluster, grid: Grid, precision: str,
                     boundaries: Sequence[int],
                     modes: Sequence[str] = RECOMPUTE) -> tuple[list[str] | None, float]:
    """Per stage, the cheapest recomputation (in `modes` order) whose memory fits.

    Stages are independent in memory, so choosing each stage's cheapest fit is the
    cheapest fit overall. Returns (modes per stage or None, the least peak memory any
    choice reaches, in bytes).
    """
    prec = PRECISIONS[precision]
    table = stage_table(shape, cluster, prec, boundaries, grid.micro_batch_size, modes,
                        grid.tensor, grid.sequence_parallel)
    picks, least = table.fit(grid, prec, cluster.hardware.usable_memory)
    return (None if picks is None else [modes[i] for i in picks]), least


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """What the search may choose from, and how it ranks.

    `shard_optimizer` for grids with data > 1: True shards every one
    (`Config.shard_optimizer`), False none; None lets the search choose: it shards a grid
    only where the unsharded one does not fit any stage's memory with any recomputation
    allowed, so a plan that fits as it is keeps the simpler all-reduce, and a plan that fits
    only sharded is not thrown away.

    `tensor`: the tensor degrees to try (None: every power of 2 up to the GPUs per node
    that divides the heads, `cost.tensor_degrees`); `sequence_parallel` at t > 1: True or
    False only, None both (the engine refuses it with a sharded optimizer at d > 1, so a
    sequence-parallel grid is never sharded).

    `rank`: how many of the fastest plans `SearchResult.ranked` holds (the best and its
    runners-up). With `prune`, a grid that fits is estimated only when a lower bound on its
    step time (`StageTable.step_time_bound`) could still place it among them; without, every
    grid that fits is estimated and ranked (the exhaustive search the pruned one is held to).
    """

    precision: str = "bf16"
    schedules: tuple[str, ...] = PLANNED_SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE
    max_micro_batch: int = 16
    shard_optimizer: bool | None = None
    grid_filter: Callable[[Grid], bool] | None = None
    prune: bool = True
    rank: int = 6
    tensor: tuple[int, ...] | None = None
    sequence_parallel: bool | None = None

    def __post_init__(self) -> None:
        # Lists from a command line or a caller: kept as tuples (hashable, immutable).
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "recompute", tuple(self.recompute))
        if self.tensor is not None:
            object.__setattr__(self, "tensor", tuple(self.tensor))

    def tensors(self, shape: Shape, cluster: Cluster) -> tuple[int, ...]:
        """The tensor degrees this search tries on `cluster` (checked by `search`)."""
        if self.tensor is not None:
            return self.tensor
        return tuple(tensor_degrees(shape, cluster.gpus_per_node, cluster.gpus))


def search(shape: Shape, cluster: Cluster, global_batch: int,
           options: SearchOptions = SearchOptions()) -> SearchResult:
    """Evaluate every grid of `enumerate_grids` (those `options.grid_filter` keeps); rank
    the fastest that fit by step time (`SearchOptions`).

    Raises PlanError, naming what would fit, when none does.
    """
    _check_search(global_batch, options)
    _check_tensor(shape, cluster, options)
    prec = PRECISIONS[options.precision]
    usable = cluster.hardware.usable_memory
    tables: dict[tuple[int, int, int, bool], StageTable] = {}
    fitting: list[tuple[float, int, Grid, StageTable, list[int]]] = []
    rejected: list[Rejection] = []
    considered = 0
    for grid in enumerate_grids(shape, cluster.gpus, global_batch, options.schedules,
                                options.max_micro_batch, options.tensors(shape, cluster),
                                options.sequence_parallel):
        if options.grid_filter is not None and not options.grid_filter(grid):
            continue
        if options.shard_optimizer and grid.sequence_parallel and grid.data > 1:
            continue                # sharding asked for everywhere: the engine refuses this
        considered += 1
        key = (grid.pipeline, grid.micro_batch_size, grid.tensor, grid.sequence_parallel)
        if key not in tables:
            bounds = time_balanced_boundaries(shape, cluster, prec, *key)
            tables[key] = stage_table(shape, cluster, prec, bounds, grid.micro_batch_size,
                                      options.recompute, grid.tensor, grid.sequence_parallel)
        table = tables[key]
        grid, picks, least = _fit(table, grid, prec, usable, options.shard_optimizer)
        if picks is None:
            rejected.append(Rejection(grid, _memory_reason(least, cluster, options.recompute),
                                      least / GB))
            continue
        bound = table.step_time_bound(cluster, grid, picks) if options.prune else 0.0
        fitting.append((bound, len(fitting), grid, table, picks))
    if not fitting and considered == 0:
        raise PlanError(f"no grid to consider: {global_batch} sequences on {cluster.gpus} GPU(s) "
                        f"with micro-batches of at most {options.max_micro_batch}"
                        + (" and the grid filter given" if options.grid_filter is not None
                           else ""))
    if not fitting:
        raise PlanError(_nothing_fits(shape, cluster, global_batch, options, rejected))
    ranked, estimated = _rank(shape, cluster, fitting, options)
    return SearchResult(tuple(ranked), tuple(rejected), considered, len(fitting), estimated)


def _rank_key(est: Estimate, index: int) -> tuple:
    # Fastest first. Among equals (to 9 digits): fewer GPUs; then fewer, larger micro-batches
    # (the model keeps efficiency constant in the micro-batch size, while real kernels only
    # gain from larger ones); then less memory; then the schedule's and the grid's order.
    return (float(f"{est.step_time_s:.9g}"), est.grid.gpus, est.grid.microbatches,
            est.peak_memory_bytes, SCHEDULES.index(est.grid.schedule), index)


def _rank(shape: Shape, cluster: Cluster,
          fitting: list[tuple[float, int, Grid, StageTable, list[int]]],
          options: SearchOptions) -> tuple[list[Estimate], int]:
    """(the fastest plans, `options.rank` of them when pruning, else all; how many grids
    were estimated). Pruning takes the grids by their step-time bound, lowest first, and
    stops where the bound, to the ranking's 9 digits, exceeds the slowest of the ranked."""
    def est(grid: Grid, table: StageTable, picks: list[int]) -> Estimate:
        return estimate(shape, cluster, grid, [table.modes[i] for i in picks],
                        options.precision, table.boundaries)

    if not options.prune:
        keyed = [(_rank_key(e, i), e) for _, i, g, t, p in fitting for e in [est(g, t, p)]]
        return [e for _, e in sorted(keyed, key=lambda x: x[0])], len(fitting)
    kept: list[tuple[tuple, Estimate]] = []
    estimated = 0
    for bound, index, grid, table, picks in sorted(fitting, key=lambda x: x[:2]):
        if len(kept) >= options.rank and float(f"{bound:.9g}") > kept[-1][0][0]:
            break
        e = est(grid, table, picks)
        estimated += 1
        bisect.insort(kept, (_rank_key(e, index), e), key=lambda x: x[0])
        del kept[options.rank:]
    return [e for _, e in kept], estimated


def _check_search(global_batch: int, options: SearchOptions) -> None:
    """`search`'s arguments, each refused with what is expected."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"the global batch must be a positive number of sequences, found "
                        f"{global_batch!r}")
    for s in options.schedules:
        if s not in PLANNED_SCHEDULES:
            known = "the cost model does not time it yet" if s in SCHEDULES else "unknown"
            raise PlanError(f"schedule {s!r}: {known}; expected some of "
                            f"{list(PLANNED_SCHEDULES)}")
    for r in options.recompute:
        if r not in RECOMPUTE:
            raise PlanError(f"unknown recomputation {r!r}; expected some of {list(RECOMPUTE)}")
    if options.precision not in PRECISIONS:
        raise PlanError(f"unknown precision {options.precision!r}; expected one of "
                        f"{list(PRECISIONS)}")
    if not (options.shard_optimizer is None or isinstance(options.shard_optimizer, bool)):
        raise PlanError(f"shard_optimizer must be True, False or None (the search chooses), "
                        f"found {options.shard_optimizer!r}")
    if not isinstance(options.rank, int) or options.rank < 1:
        raise PlanError(f"rank must be a positive number of plans, found {options.rank!r}")
    if not (options.sequence_parallel is None or isinstance(options.sequence_parallel, bool)):
        raise PlanError(f"sequence_parallel must be True, False or None (the search tries "
                        f"both), found {options.sequence_parallel!r}")


def _check_tensor(shape: Shape, cluster: Cluster, options: SearchOptions) -> None:
    """The tensor degrees asked for: each a whole number that divides the heads and the
    GPUs per node (a tensor group inside one node), refused with the degrees that would."""
    if options.tensor is None:
        return
    allowed = tensor_degrees(shape, cluster.gpus_per_node, cluster.gpus_per_node)
    for t in options.tensor:
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise PlanError(f"tensor degrees must be whole numbers >= 1, found {t!r}")
        if t > 1 and t not in allowed:
            raise PlanError(
                f"tensor degree {t}: a tensor group cuts attention by heads and stays inside "
                f"a node, so t must be a power of 2 dividing the {shape.n_heads} heads and "
                f"the {cluster.gpus_per_node} GPUs per node; possible here: {allowed}")
    if not options.tensor:
        raise PlanError("tensor: give at least one degree, e.g. 1")


def _fit(table: StageTable, grid: Grid, prec: PrecisionBytes, usable: float,
         shard_optimizer: bool | None) -> tuple[Grid, list[int] | None, float]:
    """(the grid as planned, its recomputation per stage, as indices in `table.modes`, or
    None when nothing fits, the least peak memory any choice reaches), sharding the
    optimizer as `SearchOptions.shard_optimizer` says."""
    # The engine refuses a sharded optimizer with sequence parallelism at d > 1.
    can_shard = grid.data > 1 and not grid.sequence_parallel
    if shard_optimizer and can_shard:
        grid = dataclasses.replace(grid, shard_optimizer=True)
    picks, least = table.fit(grid, prec, usable)
    if picks is None and shard_optimizer is None and can_shard:
        sharded = dataclasses.replace(grid, shard_optimizer=True)
        picks, least_sharded = table.fit(sharded, prec, usable)
        if picks is not None:
            return sharded, picks, least_sharded
        least = least_sharded               # the least any choice reaches
    return grid, picks, least


def _memory_reason(least: float, cluster: Cluster, recompute: Sequence[str]) -> str:
    usable = cluster.hardware.usable_memory
    return (f"a stage needs {least / GB:.1f} GB even with {recompute[-1]} recomputation; "
            f"{usable / GB:.1f} GB usable per GPU")


def minimum_gpus(shape: Shape, cluster: Cluster, global_batch: int,
                 options: SearchOptions = SearchOptions()) -> tuple[int | None, float]:
    """(The fewest GPUs on which some plan fits this GPU's memory, or None when no pipeline
    depth and tensor degree does; the least memory in bytes the fullest stage needs at the
    deepest pipeline and the widest tensor group).

    Only pipeline stages and tensor groups divide the memory (data replicas each hold a whole
    stage), so the fewest GPUs is the least pipeline depth × tensor degree that fits: for
    each degree `minimum_grid` bisects the depth. Of `options`, the precision, schedules,
    recomputation, micro-batch limit, tensor degrees and sequence parallelism count.
    """
    best, least = None, float("inf")
    for t in _degrees_for_minimum(shape, cluster, options):
        depth, need = minimum_grid(shape, cluster, global_batch, options, t)
        least = min(least, need)
        if depth is not None and (best is None or depth * t < best):
            best = depth * t
    return best, least


def _degrees_for_minimum(shape: Shape, cluster: Cluster, options: SearchOptions) -> list[int]:
    # Any cluster of this GPU could be larger: degrees up to the GPUs per node.
    if options.tensor is not None:
        return list(options.tensor)
    return tensor_degrees(shape, cluster.gpus_per_node, cluster.gpus_per_node)


def minimum_grid(shape: Shape, cluster: Cluster, global_batch: int, options: SearchOptions,
                 tensor: int = 1) -> tuple[int | None, float]:
    """(The shallowest pipeline that fits at tensor degree `tensor`, data 1, or None; the
    least memory its fullest stage needs at the deepest pipeline).

    A stage's memory falls with depth (it holds fewer layers; 1F1B's stage s stashes p - s
    micro-batches of about n/p layers each), so the depth is found by bisection, about
    log2(n) depths evaluated, not all n + 2: a model of hundreds of layers is answered in
    seconds. The depth returned was evaluated and fits. Sequence parallelism (the leaner
    choice) is taken wherever the options and the sequence allow it."""
    precision, recompute, schedules = options.precision, options.recompute, options.schedules
    n_items = len(layer_kinds(shape))
    big = dataclasses.replace(cluster, gpus=n_items * tensor)
    # GPipe stashes m ≥ min(p - s, m) micro-batches: 1F1B never needs more memory.
    lean = ["1f1b"] if "1f1b" in schedules else list(schedules)
    sp = options.sequence_parallel if options.sequence_parallel is not None else True
    by_depth: dict[int, list[Grid]] = {}
    for grid in enumerate_grids(shape, n_items * tensor, global_batch, lean,
                                options.max_micro_batch, (tensor,), sp if tensor > 1 else None):
        if grid.data == 1:
            by_depth.setdefault(grid.pipeline, []).append(grid)
    depths = sorted(by_depth)
    if not depths:
        return None, float("inf")

    def fits(depth: int) -> tuple[bool, float]:
        return _fits_at_depth(shape, big, by_depth[depth], precision, recompute)

    deepest_fits, least = _fits_at_depth(shape, big, by_depth[depths[-1]], precision,
                                         recompute, exact=True)
    if not deepest_fits:
        return None, least
    lo, hi = 0, len(depths) - 1          # depths[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(depths[mid])[0]:
            hi = mid
        else:
            lo = mid + 1
    return depths[hi], least


def _fits_at_depth(shape: Shape, cluster: Cluster, grids: Sequence[Grid], precision: str,
                   recompute: Sequence[str], exact: bool = False) -> tuple[bool, float]:
    """Whether one of `grids` (one pipeline depth and tensor degree, data 1) fits; else the
    least peak bytes of its fullest stage. Unless `exact`, a depth whose fullest stage's
    weights and optimizer state alone exceed the memory is answered without partitioning it
    (peak: that floor)."""
    prec = PRECISIONS[precision]
    floor = state_floor(shape, prec, grids[0].pipeline, grids[0].tensor)
    if not exact and floor > cluster.hardware.usable_memory:
        return False, floor
    least = float("inf")
    for grid in grids:
        bounds = time_balanced_boundaries(shape, cluster, prec, grid.pipeline,
                                          grid.micro_batch_size, grid.tensor,
                                          grid.sequence_parallel)
        modes, peak = choose_recompute(shape, cluster, grid, precision, bounds, recompute)
        if modes is not None:
            return True, peak
        least = min(least, peak)
    return False, least


def _nothing_fits(shape: Shape, cluster: Cluster, global_batch: int, options: SearchOptions,
                  rejected: list[Rejection]) -> str:
    hw = cluster.hardware
    recompute = options.recompute
    least = min(r.peak_memory_gb for r in rejected) if rejected else float("nan")
    head = (f"no plan fits: the {shape.params / 1e9:.2f}B-parameter model ({shape.describe()}) "
            f"needs at least {least:.1f} GB on its fullest stage on {cluster.gpus} GPU(s), with "
            f"every recomputation allowed ({', '.join(recompute)}); a {hw.name} has "
            f"{hw.usable_memory / GB:.1f} GB usable ({hw.memory_reserve_fraction:.0%} of "
            f"{hw.memory_bytes / GB:.0f} GB kept for the runtime).")
    reserve = 1 - hw.memory_reserve_fraction
    more, deepest = minimum_gpus(shape, cluster, global_batch, options)
    if more is not None and more > cluster.gpus:
        return (f"{head} It fits on {more} GPUs (pipeline × tensor): use --gpus {more} "
                f"or more, or a smaller model; on {cluster.gpus} GPU(s) it needs GPUs with at "
                f"least {least / reserve:.0f} GB.")
    advice = ("a shorter --seq-len, a smaller --global-batch-tokens, allowing full "
              "recomputation" if "full" not in recompute else "a shorter --seq-len")
    widest = max(_degrees_for_minimum(shape, cluster, options))
    return (f"{head} No pipeline depth fits it on this GPU (with tensor groups of up to "
            f"{widest} GPUs, as many as a node holds and the {shape.n_heads} heads allow, the "
            f"deepest pipeline still needs {deepest / GB:.1f} GB on a stage): use "
            f"GPUs with at least {deepest / GB / reserve:.0f} GB, a smaller model, or {advice}.")
