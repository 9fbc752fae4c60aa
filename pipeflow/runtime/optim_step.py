"""Closing a step: gradient sums, norm, the non-finite verdict, clipping, the optimizer.

Every decision here is taken from values that are identical on every rank (the global
gradient norm and the global loss), so all ranks step or skip together and keep the same
loss scale.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import nn

from pipeflow.comm.base import Communicator
from pipeflow.comm.mpi import mpi_iallreduce_
from pipeflow.comm.topology import Topology
from pipeflow.config import ConfigError
from pipeflow.logs import get_logger
from pipeflow.runtime.data_parallel import GradReducer
from pipeflow.runtime.precision import Precision
from pipeflow.runtime.stage import StepSettings

__all__ = ["close_step", "NonFiniteError", "StepStage"]

_log = get_logger(__name__)


class NonFiniteError(ConfigError):
    """Too many steps in a row had a non-finite loss or gradient; raised on every rank."""


class StepStage(Protocol):
    """What closing a step reads of a rank's stage (`runtime.stage.Stage` is one)."""

    step_settings: StepSettings
    topo: Topology
    stages: int                         # pipeline size
    device: torch.device
    precision: Precision
    optimizer: torch.optim.Optimizer | None
    reducer: GradReducer | None
    shards: Any                         # `runtime.shard.ShardedOptimizer` (sharded) or None
    data_comm: Communicator | None
    pipe_comm: Communicator
    tensor_comm: Communicator | None    # tensor > 1: the stage's tensor group
    sequence_params: list[nn.Parameter] # sequence parallelism: summed over the tensor group
    ties: list[Any]                     # `runtime.stage.Tie`: weights shared across stages
    norm_params: list[nn.Parameter]     # the masters the gradient norm counts (ties once)
    finite_only: list[nn.Parameter]     # masters it only checks for a non-finite gradient
    # (masters, their "gradient present" counts over the tensor group), read with the norm
    sequence_present: tuple[list[nn.Parameter], torch.Tensor] | None

    def describe(self) -> str: ...


def close_step(stage: StepStage, loss: float, stats: Any) -> None:
    """Sum, check, clip and apply this step's gradients; record the verdict in `stats`."""
    precision = stage.precision
    if stage.shards is not None:
        stage.shards.finish()           # reduce-scatters (ties summed over stages first)
        stage.shards.unscale_(1.0 / precision.loss_scale)
        norm = grad_norm(stage)
    else:
        if stage.reducer is not None:
            stage.reducer.finish()      # waits only for the buckets still in flight
        _sum_sequence_parallel(stage)
        _sum_ties(stage)
        precision.unscale_()
        norm = grad_norm(stage)
    stats.grad_norm = norm
    finite = math.isfinite(norm) and math.isfinite(loss)
    stats.skipped = not finite          # this step's verdict, not the last overflow's
    if precision.scaler is not None:
        precision.scaler.update(not finite)   # the same verdict and scale on every rank
    if not finite:
        _skip(stage, stats, loss, norm)
        return
    stats.nonfinite_in_row = 0
    clip = stage.step_settings.clip
    # As torch.nn.utils.clip_grad_norm_, over the whole model.
    coef = clip / (norm + 1e-6) if clip > 0 else 1.0
    if stage.shards is not None:
        stage.shards.step(coef)         # steps the blocks, all-gathers the working weights
    else:
        _step(stage, coef)
    zero_grad(stage)


def _step(stage: StepStage, coef: float) -> None:
    """Unsharded: clip the masters' gradients by `coef` (< 1), step, refresh the working
    copies."""
    precision = stage.precision
    if coef < 1.0:
        grads = [p.grad for p in precision.masters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)        # one launch, as clip_grad_norm_ does
    if stage.optimizer is not None:
        # A parameter no replica had a gradient for is skipped, as torch.optim skips a
        # `.grad` of None (the buckets' views never are); `zero_grad` binds them again.
        for master in stage.reducer.untouched() if stage.reducer is not None else ():
            master.grad = None
        stage.optimizer.step()
        precision.refresh_working()


def _sum_sequence_parallel(stage: StepStage) -> None:
    """Sequence parallelism: a whole weight inside a cut layer (a norm, a row layer's bias)
    saw only this rank's slice of the sequence; its gradient is the sum over the tensor
    group (one all-reduce of them all). Every rank sends every such weight, zeros where it
    has no gradient (a norm over heads it does not hold, an expert bias no token of its
    slice picked), so the sums line up, and a "gradient present" count each, read with the
    norm: a weight no rank reached stays without a gradient, as torch.optim needs."""
    stage.sequence_present = None
    pairs = [(p, stage.precision.master_of(p)) for p in stage.sequence_params
             if p.requires_grad]
    if stage.tensor_comm is None or not pairs:
        return
    masters = [m for _, m in pairs]
    present = [m.grad is not None for m in masters]
    grads = [m.grad if m.grad is not None else torch.zeros_like(m) for m in masters]
    flags = torch.tensor(present, dtype=grads[0].dtype).to(grads[0].device, non_blocking=True)
    flat = torch.cat([g.reshape(-1) for g in grads] + [flags])
    stage.tensor_comm.allreduce_(flat)
    sums = flat.split([g.numel() for g in grads] + [len(masters)])
    torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(sums, grads)])
    for master, grad in zip(masters, grads):
        master.grad = grad
    stage.sequence_present = (masters, flat[-len(masters):])


def _sum_ties(stage: StepStage) -> None:
    """A tied weight's gradient summed over the stages that hold it (after the replicas were
    summed, so each replica's copy ends up with the whole gradient)."""
    for tie in stage.ties:
        param = stage.precision.master_of(tie.param)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if tie.dist is None:
            mpi_iallreduce_(tie.comm, param.grad).wait()
            continue
        # torch.distributed sums contiguous tensors on the group's device, in place.
        grad = param.grad.detach()
        flat = grad if grad.is_contiguous() else grad.contiguous()
        tie.dist.allreduce_(flat)
        if flat is not grad:
            grad.copy_(flat)


def _skip(stage: StepStage, stats: Any, loss: float, norm: float) -> None:
    stats.skipped_steps += 1
    zero_grad(stage)
    if stage.precision.scaler is not None:
        return                          # fp16: the loss scaler's business
    stats.nonfinite_in_row += 1
    limit = stage.step_settings.max_nonfinite_steps
    if stage.topo.rank == 0:
        _log.warning("step %d: non-finite loss %s or gradient norm %s; step skipped on every "
                     "rank (%d in a row, at most %d)", stats.step, loss, norm,
                     stats.nonfinite_in_row, limit)
    if stats.nonfinite_in_row > limit:
        raise NonFiniteError(
            f"{stage.describe()}: {stats.nonfinite_in_row} steps in a row had a non-finite "
            f"loss or gradient norm (last: loss {loss}, norm {norm}); the run has diverged. "
            f"Lower the learning rate, enable clipping, check the data, or raise "
            f"max_nonfinite_steps")


def grad_norm(stage: StepStage) -> float:
    """The whole grid's gradient norm: tied weights once, replicas once (they agree), a tensor
    group's slices each once and its whole weights once (`Stage.norm_params`). Sharded,
    each replica holds a block of the summed gradient: the blocks' squares are summed over
    the data group first, each element counted once."""
    if stage.shards is not None:
        sq = stage.shards.square_sum().to(stage.data_comm.device)
        stage.data_comm.allreduce_(sq)
    else:
        grads = [p.grad for p in stage.norm_params if p.grad is not None]
        # Per-tensor norms in one foreach launch (no fp64 copy of every gradient), squared
        # and summed in fp64.
        sq = (torch.stack(torch._foreach_norm(grads)).double().square().sum() if grads
              else torch.zeros((), dtype=torch.float64, device=stage.device))
        checked = [p.grad for p in stage.finite_only if p.grad is not None]
        if checked:          # 0 · their norm: 0, or NaN where one is not finite
            sq = sq + 0.0 * torch.stack(torch._foreach_norm(checked)).double().sum()
    sq = sq.reshape(1).to(stage.pipe_comm.device)    # NCCL groups take CUDA tensors only
    if stage.tensor_comm is not None:     # slices of the tensor group (replicated ones once)
        stage.tensor_comm.allreduce_(sq)
    if stage.stages > 1:
        stage.pipe_comm.allreduce_(sq)
    return math.sqrt(_read_with_flags(stage, sq))


def _read_with_flags(stage: StepStage, sq: torch.Tensor) -> float:
    """`sq`'s value, read in one host synchronisation with the replicas' "gradient present"
    counts and the tensor group's (which the optimizer's step needs on the host), not one
    each."""
    holder = stage.shards if stage.shards is not None else stage.reducer
    flags = holder.flag_buffer if holder is not None else None
    flags = flags if flags is not None and flags.numel() else None
    tensor = stage.sequence_present
    if flags is None and tensor is None:
        return sq.item()
    counts = [c for c in (flags, tensor and tensor[1]) if c is not None]
    values = torch.cat([sq.double()] + [c.to(sq.device, torch.float64) for c in counts]).tolist()
    n = 0 if flags is None else flags.numel()
    if flags is not None:
        holder.present = values[1:1 + n]
    if tensor is not None:
        # a whole weight no tensor rank reached: no gradient, as torch.optim skips it
        for master, count in zip(tensor[0], values[1 + n:]):
            if count == 0:
                master.grad = None
        stage.sequence_present = None
    return values[0]


def zero_grad(stage: StepStage) -> None:
    if stage.shards is not None:
        # The working grads first: fp32 parameters' `.grad` are views the shards then rebind.
        stage.precision.zero_grad(masters=False)
        stage.shards.zero_grad()
    elif stage.reducer is not None:
        stage.reducer.zero_grad()       # the master gradients are views of its buckets
        stage.precision.zero_grad(masters=False)
    else:
        stage.precision.zero_grad()
