"""`memory_report`: the bytes one rank holds for its stage, by kind, and per parameter.

    working           the working weights (bf16/fp16/fp32) the layers compute with; sharded,
                      the padded buckets they are views of, and the block cast for sending
    masters           fp32 masters kept beside low-precision working weights (none under fp32
                      unsharded: the weights are the masters); sharded, this replica's blocks
    gradients         the fp32 gradient buffers micro-batches accumulate into: the data-parallel
                      buckets (sharded: whole buckets plus the summed block); on one replica
                      the masters' `.grad`, allocated during each step
    optimizer_state   every tensor the optimizer keeps (allocated at its first step)
    activations_peak  bytes saved for backward at the step's peak (`measure_activations`)
    replicated_working  tensor > 1: the working bytes every tensor rank holds whole (norms,
                      row layers' biases, layers without a tp_plan); the rest is a 1/t slice

`bytes_per_parameter` divides each by the stage's parameter count (trainable and frozen);
its `model_states` is masters + gradients + optimizer state, the part a sharded optimizer
divides (Megatron-Core's 6 + 12/d with bf16 weights counts the 2 bytes of weights too).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["memory_report"]


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _unique(tensors: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _optimizer_bytes(opt: torch.optim.Optimizer | None) -> int:
    if opt is None:
        return 0
    return sum(v.numel() * v.element_size() for state in opt.state.values()
               for v in state.values() if torch.is_tensor(v))


def memory_report(stage: Any, activations_peak: int) -> dict[str, Any]:
    """This rank's bytes by kind (see the module's docstring), with its rank and stage."""
    precision = stage.precision
    params = _unique(stage.module.parameters())
    frozen = [p for p in params if not p.requires_grad]
    shards = stage.shards
    if shards is not None:
        held = shards.memory()
        working = held["working"] + _bytes(frozen)
        # Frozen parameters keep their own fp32 masters (`Precision`), whatever the dtype
        # each works in (bf16, or fp32 inside an fp32 module).
        masters = held["masters"] + (_bytes(_unique(precision.master_of(p) for p in frozen))
                                     if precision.mixed else 0)
        gradients = held["gradients"]
    else:
        working = _bytes(params)
        masters = _bytes(_unique(precision.master_of(p) for p in params)) \
            if precision.mixed else 0
        trainable = _unique(precision.master_of(p) for p in params if p.requires_grad)
        gradients = (sum(b.flat.numel() * b.flat.element_size()
                         for b in stage.reducer.buckets) if stage.reducer is not None
                     else sum(p.numel() * 4 for p in trainable))
    state = _optimizer_bytes(stage.optimizer)
    n = sum(p.numel() for p in params)
    per = {"working": working, "masters": masters, "gradients": gradients,
           "optimizer_state": state}
    per_parameter = {k: v / n if n else 0.0 for k, v in per.items()}
    per_parameter["model_states"] = (masters + gradients + state) / n if n else 0.0
    per_parameter["total"] = (working + masters + gradients + state) / n if n else 0.0
    # Tensor-parallel: the weights every tensor rank holds whole (norms, biases of row layers,
    # layers without a plan), in bytes of working weights; the rest is this rank's 1/t slice.
    from pipeflow.runtime.tensor_parallel import split_of
    replicated = _bytes([p for p in params if split_of(p) is None]) \
        if stage.topo.tensor > 1 else 0
    return {"rank": stage.topo.rank, "stage": stage.index, "replica": stage.topo.replica,
            "sharded": shards is not None, "data": stage.topo.data,
            "tensor": stage.topo.tensor, "tensor_rank": stage.topo.tensor_rank,
            "replicated_working": replicated,
            "precision": precision.name, "parameters": n, **per,
            "activations_peak": int(activations_peak), "bytes_per_parameter": per_parameter}
