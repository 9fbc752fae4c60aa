"""The global batch (and its side inputs) into micro-batches, agreed across every rank.

Every call of `train_step` / `eval_step` (and `save`, `load`, `gather_state_dict`, `close`)
starts with one agreement over the engine's ranks, through rank 0 (`waiting.agree`): each rank
says which call it is making, at which step, what batch it was given (the global batch's
structure, shapes and dtypes) and whether splitting it failed. A bad batch anywhere, replicas
given batches of different shapes, or ranks in different calls (one in `eval_step` while
another trains, one a step ahead) fail at once on every rank with both sides named; a rank
that does not come within the deadline is named by rank 0 (`waiting.NotJoined`).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Mapping, Protocol

import torch
from mpi4py import MPI

from pipeflow import tree
from pipeflow.comm import waiting
from pipeflow.comm.topology import Topology
from pipeflow.config import ConfigError
from pipeflow.runtime.stage import StepSettings
from pipeflow.schedules.plan import Plan

__all__ = ["BatchError", "MicroBatch", "StepBatches", "BatchStage", "split_step", "agree",
           "agree_call", "SummedLossCheck"]


class BatchError(ConfigError):
    """A batch the engine cannot split or use; raised on every rank alike."""


@dataclasses.dataclass
class MicroBatch:
    inputs: Any = None                 # on the rank holding the first virtual stage
    targets: Any = None                # on the rank holding the last one
    side: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StepBatches:
    """One step's micro-batches on this rank, and what all ranks agreed on."""

    micro: list[MicroBatch]
    items: int | None = None           # valid items (tokens) in the global batch, if counted
    has_targets: bool = False          # a rank holding the last stage was given targets
    # The call and the batch's shapes as every rank agreed them (the same text on every
    # rank): what the messages' shapes between stages follow from, so that a receiver that
    # cannot probe knows them again without a message while this stays the same.
    shapes: str | None = None


def _signature(batch: Any) -> Any:
    """What must match across ranks: structure, shapes and dtypes (not values)."""
    if batch is None:
        return None
    header, _ = tree.header_of(batch)
    return str(header.spec), [(m.shape, str(m.dtype)) for m in header.metas]


def split(what: str, batch: Any, m: int, d: int, replica: int, device: torch.device,
          where: str, local: bool = False) -> list[Any]:
    """This replica's shard of `batch`, as `m` micro-batches on `device`.

    Any structure of tensors, every tensor with the batch dimension first; other leaves (None,
    numbers) are given to every micro-batch as they are.
    """
    leaves, spec = tree.flatten(batch)
    ts = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not ts:
        raise BatchError(f"{where}: {what} holds no tensor (found "
                         f"{type(batch).__name__}); pass a tensor or a structure of tensors "
                         f"with the batch dimension first")
    n = ts[0].shape[0] if ts[0].dim() else 0
    if any(t.dim() == 0 or t.shape[0] != n for t in ts):
        raise BatchError(f"{where}: every tensor of {what} needs the same batch dimension "
                         f"first; found shapes {[tuple(t.shape) for t in ts]}")
    empty = next((t for t in ts if t.numel() == 0 and n > 0), None)
    if empty is not None:               # a mean over no positions is NaN, not a loss
        raise BatchError(f"{where}: {what} has a tensor of shape {tuple(empty.shape)}: an "
                         f"empty dimension after the batch's (a sequence of length 0?) leaves "
                         f"nothing to compute, and a mean-reduced loss would be NaN; pass at "
                         f"least one position in every dimension")
    if local:                           # this replica's own rows: nothing to slice
        d, replica = 1, 0
    if n == 0 or n % (m * d):
        which = "this replica's local batch (Config.batch = \"local\")" if local else \
            "a global batch"
        raise BatchError(
            f"{where}: {which} of {n} samples does not divide into {d} replica(s) x "
            f"{m} micro-batches; use a batch size that is a multiple of {m * d}")
    shard = n // d
    parts = [x[replica * shard:(replica + 1) * shard].to(device, non_blocking=True).chunk(m)
             if isinstance(x, torch.Tensor) else [x] * m for x in leaves]
    return [tree.unflatten([p[i] for p in parts], spec) for i in range(m)]


class BatchStage(Protocol):
    """What splitting a step's batch reads of a rank's stage (`runtime.stage.Stage` is one)."""

    step_settings: StepSettings
    topo: Topology
    device: torch.device
    plan: Plan                          # which rank runs the first and the last virtual stage
    index: int                          # this rank's pipeline stage

    def describe(self) -> str: ...


def split_step(call: str, step: int, inputs: Any, targets: Any, side: Mapping[str, Any], *,
            stage: BatchStage, control: MPI.Comm, needs_targets: bool,
            count_items: Callable[[Any], Any] | None, deadline_s: float = 0.0) -> StepBatches:
    """Split this rank's share of the batch and agree with every other rank on the call."""
    settings, topo = stage.step_settings, stage.topo
    holds_first = stage.plan.holds_first(stage.index)
    holds_last = stage.plan.holds_last(stage.index)
    m, d, where = settings.microbatches, settings.data, stage.describe()
    local = settings.batch == "local"
    micro = [MicroBatch() for _ in range(m)]
    problem, items = None, None
    try:
        if holds_first:
            _fill(micro, "inputs", _need(call, "inputs", inputs, where, "first"),
                  m, d, topo.replica, stage.device, where, local)
        if holds_last and (targets is not None or needs_targets):
            _fill(micro, "targets", _need(call, "targets", targets, where, "last"),
                  m, d, topo.replica, stage.device, where, local)
            if count_items is not None and topo.tensor_rank == 0:   # a tensor group once
                items = int(sum(int(count_items(mb.targets)) for mb in micro))
        rows = _rows(inputs if holds_first else None) or \
            _rows(targets if holds_last else None)
        for name, value in side.items():
            found = _rows(value)
            if rows is not None and found not in (None, rows):
                raise BatchError(
                    f"{where}: side input {name!r} has {found} rows, the batch has "
                    f"{rows}; a side input holds one row per sample of the global batch "
                    f"(it is split like the inputs, never broadcast)")
            for mb, part in zip(micro, split(f"side input {name!r}", value, m, d,
                                             topo.replica, stage.device, where, local)):
                mb.side[name] = part
    except BatchError as exc:
        problem = str(exc)
    mine = {"rank": topo.rank, "call": call, "step": step, "problem": problem, "items": items,
            "inputs": _signature(inputs) if holds_first else None,
            "targets": _signature(targets) if holds_last else None,
            "side": sorted((k, _signature(v)) for k, v in side.items()),
            "replica": topo.replica, "local": local,
            "values": None if local or d == 1 or problem else _values(
                inputs if holds_first else None,
                targets if holds_last else None, side, first=step == 0)}
    verdict = agree(control, mine, deadline_s)
    return StepBatches(micro, verdict["items"], has_targets=verdict["has_targets"],
                       shapes=verdict["shapes"])


def _values(inputs: Any, targets: Any, side: Mapping[str, Any], first: bool
            ) -> dict[str, int] | None:
    """A checksum of each batch's values (CRC-32 of its bytes), so that replicas given their
    own batches under Config.batch = "global" are found: every rank must pass the same global
    batch there. Tensors on the host every call; on a device only in the first step (the copy
    to the host would cost each step a synchronisation)."""
    sums: dict[str, int] = {}
    for name, batch in (("inputs", inputs), ("targets", targets), *sorted(side.items())):
        if batch is None:
            continue
        leaves = [x for x in tree.flatten(batch)[0] if isinstance(x, torch.Tensor)]
        if not first and any(t.device.type != "cpu" for t in leaves):
            continue
        crc = 0
        for t in leaves:
            flat = t.detach().to("cpu").contiguous().reshape(-1)
            crc = zlib.crc32(flat.view(torch.uint8).numpy().data if flat.numel() else b"", crc)
        sums[name] = crc
    return sums


def agree_call(control: MPI.Comm, call: str, step: int, deadline_s: float) -> dict:
    """The agreement of a call without a batch (save, load, gather_state_dict, close)."""
    mine = {"rank": control.rank, "call": call, "step": step, "problem": None, "items": None,
            "inputs": None, "targets": None, "side": [], "replica": 0, "values": None}
    return agree(control, mine, deadline_s)


def agree(control: MPI.Comm, mine: dict, deadline_s: float) -> dict:
    """The agreement on a call (`mine`: rank, call, step, problem, items, batch signatures)
    with every rank of `control`; a `BatchError` on every rank where they differ, and
    `waiting.NotJoined` where not every rank came within `deadline_s` (0: no limit)."""
    verdict = waiting.agree(control, mine, _verdict, deadline_s)
    if verdict["problem"]:
        raise BatchError(verdict["problem"])
    return verdict


def _verdict(views: list[dict]) -> dict:
    """On the collecting rank: the first disagreement as a message, the global item count
    and whether targets were given (the ranks holding the last stage say)."""
    counted = [v["items"] for v in views if v["items"] is not None]
    return {"problem": _disagreement(views), "items": sum(counted) if counted else None,
            "has_targets": any(v["targets"] is not None for v in views),
            "shapes": _shapes(views)}


def _shapes(views: list[dict]) -> str:
    """The call and the batch's signatures (structure, shapes, dtypes) as one text: the
    first rank's that gave each (where they differ, the agreement fails anyway)."""
    first = {key: next((v[key] for v in views if v[key] is not None), None)
             for key in ("inputs", "targets")}
    return repr((views[0]["call"], first["inputs"], first["targets"], views[0]["side"]))


def _rows(batch: Any) -> int | None:
    """The batch dimension of the first tensor in `batch` (None: no tensor, or a scalar)."""
    if batch is None:
        return None
    t = next((x for x in tree.flatten(batch)[0] if isinstance(x, torch.Tensor)), None)
    return int(t.shape[0]) if t is not None and t.dim() else None


def _need(call: str, what: str, batch: Any, where: str, which: str) -> Any:
    if batch is None:
        raise BatchError(
            f"{where}: {call} got {what}=None, but the {which} stage needs the {what}; pass "
            f"the global batch's {what} on every rank (or at least on this one)")
    return batch


def _fill(micro: list[MicroBatch], field: str, batch: Any, m: int, d: int, replica: int,
          device: torch.device, where: str, local: bool) -> None:
    for mb, part in zip(micro, split(field, batch, m, d, replica, device, where, local)):
        setattr(mb, field, part)


def _disagreement(views: list[dict]) -> str | None:
    problems = [v["problem"] for v in views if v["problem"]]
    if problems:
        return problems[0]
    first = views[0]
    for key, what in (("call", "call"), ("step", "step number")):
        other = next((v for v in views if v[key] != first[key]), None)
        if other is not None:
            return (f"ranks disagree on the {what}: rank {first['rank']} is in {first['call']} "
                    f"of step {first['step']}, rank {other['rank']} in {other['call']} of step "
                    f"{other['step']}; every rank must make the same engine calls in the same "
                    f"order (train_step/eval_step on all ranks alike)")
    for key in ("inputs", "targets", "side"):
        seen = [v for v in views if key == "side" or v[key] is not None]
        for v in seen[1:]:
            if v[key] != seen[0][key] and v.get("local") and \
                    v["replica"] != seen[0]["replica"]:
                return (f"replicas were given {key} of different shapes under Config.batch = "
                        f"\"local\": rank {seen[0]['rank']} (replica {seen[0]['replica']}) "
                        f"has {seen[0][key]}, rank {v['rank']} (replica {v['replica']}) has "
                        f"{v[key]}; each replica passes its own rows, but every replica the "
                        f"same number of them (and the same shapes and dtypes): give each the "
                        f"same local batch size (pad or drop the rows left over)")
            if v[key] != seen[0][key]:
                which = "replica's batch (shapes, dtypes, structure) on every rank of the " \
                    "replica" if v.get("local") else \
                    "global batch (shapes, dtypes, structure) on every rank"
                return (f"ranks were given different {key}: rank {seen[0]['rank']} has "
                        f"{seen[0][key]}, rank {v['rank']} has {v[key]}; pass the same {which}")
    return _local_batches(views)


def _local_batches(views: list[dict]) -> str | None:
    """Under Config.batch = "global": ranks of different replicas given batches of the same
    shapes but other values (the DDP habit of a local batch each), which would train each
    replica on a slice of its own batch."""
    first: dict[str, dict] = {}
    for v in views:
        for name, crc in (v.get("values") or {}).items():
            seen = first.setdefault(name, v)
            if seen["values"][name] != crc:
                return (f"ranks were given different values for the {name} "
                        f"(same shapes): rank {seen['rank']} (replica {seen['replica']}) and "
                        f"rank {v['rank']} (replica {v['replica']}); with Config.batch = "
                        f"\"global\" (the default) every rank passes the same global batch "
                        f"and each replica trains on its 1/data of the rows. To give each "
                        f"replica its own batch of B/data rows (as with "
                        f"DistributedDataParallel), set Config(batch=\"local\")")
    return None


class SummedLossCheck:
    """The loss function as the runner calls it, checking once the contract of `count_items`:
    the loss of a micro-batch is a sum over its items, which the engine divides by the
    global batch's count. A mean-reduced loss (`causal_lm_loss` for `causal_lm_loss_sum`)
    would train with a loss as many times too small as a micro-batch has items.

    When `armed` (the first training step), the next call also evaluates the loss on one
    row of the micro-batch, alone and taken twice (concatenated with itself along dim 0): a
    sum doubles, a mean stays. One row, not the whole micro-batch twice over: the check's
    extra logits are those of two rows, so the first step's peak memory is the others'.
    `problem` then holds the text to raise on every rank (the engine agrees on it with the
    step's loss), or None.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.count_items: Callable[[Any], Any] | None = None    # set: the check is armed
        self.problem: str | None = None

    def arm(self, count_items: Callable[[Any], Any]) -> None:
        self.count_items, self.problem = count_items, None

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        loss = self.loss_fn(outputs, targets)
        if self.count_items is not None:
            self._check(outputs, targets)
        return loss

    def _check(self, outputs: Any, targets: Any) -> None:
        """Compare the loss of a row taken twice over with its loss alone, on the first row
        with a loss (a row with every item ignored is inconclusive); a micro-batch without
        one leaves the check to the next."""
        rows = _rows(targets)
        if not rows:
            return
        def cut(x: Any, index: list[int]) -> Any:    # rows `index` of the batch-sized leaves
            return tree.map_tensors(
                lambda t: t[index] if t.dim() and t.shape[0] == rows else t, x)
        with torch.no_grad():
            for r in range(rows):
                alone = self.loss_fn(cut(outputs, [r]), cut(targets, [r])).detach()
                single = float(alone.double())
                if single != 0.0 and bool(torch.isfinite(alone).all()):
                    break
            else:
                return
            doubled = float(self.loss_fn(cut(outputs, [r, r]), cut(targets, [r, r])).double())
        items, self.count_items = int(self.count_items(targets)), None
        ratio = doubled / single
        if abs(ratio - 2.0) <= 0.02:
            return
        name = getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__name__)
        self.problem = (
            f"count_items is set, so loss_fn must return each micro-batch's summed loss (the "
            f"engine divides the sum over the global batch by its item count), but {name} "
            f"does not grow with the items: on a row of the first micro-batch taken twice over "
            f"it gave {doubled:.6g}, on the row once {single:.6g} (ratio {ratio:.3g}; a sum "
            f"gives 2). A mean-reduced loss trains with a loss about {items}x too small (the "
            f"micro-batch's {items} items): pass the summed form (hf.causal_lm_loss_sum, "
            f"cross_entropy(..., reduction=\"sum\")), or drop count_items to keep a mean loss")
