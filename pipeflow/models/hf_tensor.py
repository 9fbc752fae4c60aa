"""Tensor-parallel plans of the transformers families: how each family's decoder block
splits over the tensor group (`runtime.tensor_parallel` cuts it), and what a block must
change after the cut (its per-rank head counts, ALiBi slopes, sinks).

One row per family in `FAMILIES` (a `hf_tensor_base.TensorFamily`); the rows live beside
the kind of block they split (`hf_tensor_dense`, `hf_tensor_fused`, `hf_tensor_moe`) and
are gathered here. A family without a row is refused at `tensor > 1` with `refusal`'s
reason.

A row's `plan(config)` returns the block's `tp_plan` (names inside `hf.DecoderLayer`, so
they start with `layer.`); `localize(layer, group)`, when given, runs once after the cut on
each rank (the `hf.DecoderLayer`, the `TensorGroup`): it sets what the block's code reads
from its whole shape (a head count kept as an attribute, slopes per head).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pipeflow.models import hf_tensor_dense, hf_tensor_fused, hf_tensor_moe
from pipeflow.models.hf_tensor_base import TensorFamily, llama_plan, local_kv_groups


def _qwen3_plan(config: Any) -> dict[str, Any]:
    # qwen3's norms over each head of q and k see this rank's heads only
    return {**llama_plan(config), "layer.self_attn.[qk]_norm": ("partial_gradient",)}


_LLAMA = TensorFamily(plan=llama_plan)

FAMILIES: dict[str, TensorFamily] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA,
    "qwen3": TensorFamily(plan=_qwen3_plan),
}


for _module in (hf_tensor_dense, hf_tensor_fused, hf_tensor_moe):
    assert not set(FAMILIES) & set(_module.FAMILIES), _module.__name__
    FAMILIES.update(_module.FAMILIES)


def row(config: Any) -> TensorFamily | None:
    return FAMILIES.get(getattr(config, "model_type", None))


def plan(config: Any) -> dict[str, Any] | None:
    """A decoder block's `tp_plan`, or None where its family has none or this config
    cannot split (`refusal` says why)."""
    found = row(config)
    if found is None or found.check(config) is not None:
        return None
    return found.plan(config)


def refusal(config: Any) -> str:
    model_type = getattr(config, "model_type", type(config).__name__)
    found = row(config)
    if found is not None:
        return (f"model_type {model_type!r} splits over a tensor group, but not this config: "
                f"{found.check(config)}; change it or set tensor = 1")
    return (f"model_type {model_type!r} has no tensor-parallel plan in pipeflow.models.hf "
            f"(the families that split: {', '.join(sorted(FAMILIES))}); set tensor = 1 for it")


def localize(layer: nn.Module, group: Any) -> None:
    """After the cut, on each rank: the family's own fix-ups of what its block reads."""
    local_kv_groups(layer, group)
    found = row(layer.config)
    if found is not None and found.localize is not None:
        found.localize(layer, group)
