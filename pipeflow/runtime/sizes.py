"""Bytes a parameter and a value hold under each precision: the formulas `Precision` and the
sharded optimizer lay memory out by, and the planner's cost model reads (plain arithmetic, no
torch)."""

from __future__ import annotations

__all__ = ["ITEMSIZE", "OPTIMIZER_STATES", "itemsize", "bytes_per_parameter",
           "sharded_bytes_per_parameter"]

# Bytes of one working value under each precision (torch's float32, bfloat16, float16).
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
# fp32 values the optimizer keeps per parameter: AdamW's first and second moments.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}


def itemsize(precision: str) -> int:
    """Bytes of one working value (weight, activation) under `precision`."""
    return ITEMSIZE[precision]


def bytes_per_parameter(precision: str, optimizer: str = "adamw") -> int:
    """Bytes one parameter holds under `Precision`: the working weight; under mixed precision
    an fp32 master too; the fp32 gradient the micro-batches accumulate into (the master's, the
    low-precision one is freed as soon as it is added); and the optimizer's fp32 state.

    bf16/fp16 with AdamW: 2 + 4 + 4 + 8 = 18 bytes; fp32: 4 + 4 + 8 = 16.
    """
    work = itemsize(precision)
    master = 4 if work != 4 else 0
    return work + master + 4 + 4 * OPTIMIZER_STATES[optimizer]


def sharded_bytes_per_parameter(precision: str, data: int, optimizer: str = "adamw") -> float:
    """Bytes one parameter holds with `Config.shard_optimizer` over `data` replicas, as
    `runtime.shard` lays them out: the working weight and the whole fp32 gradient (micro-
    batches accumulate into it) on every replica; the fp32 master, the block of the summed
    gradient and the optimizer state 1/data each.

    bf16 with AdamW: 2 + 4 + (4 + 4 + 8)/d = 6 + 16/d (Megatron-Core's 6 + 12/d has no
    separate gradient block); fp32: 8 + 16/d. d = 1 is unsharded: `bytes_per_parameter`.
    """
    if data <= 1:
        return float(bytes_per_parameter(precision, optimizer))
    return itemsize(precision) + 4 + (4 + 4 + 4 * OPTIMIZER_STATES[optimizer]) / data
