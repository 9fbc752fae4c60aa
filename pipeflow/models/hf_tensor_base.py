"""What every tensor-parallel row of `hf_tensor.FAMILIES` is made of (see there)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

from pipeflow.runtime.tensor_parallel import Split


@dataclasses.dataclass(frozen=True)
class TensorFamily:
    plan: Callable[[Any], dict[str, Any]]
    localize: Callable[[nn.Module, Any], None] | None = None
    # why this config cannot split (None: it can); asked before the plan
    check: Callable[[Any], str | None] = lambda config: None


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads


def local_kv_groups(layer: nn.Module, group: Any, attention: str = "self_attn") -> None:
    """After the cut: the query heads each key/value head serves on this rank (transformers'
    attention repeats keys and values by `num_key_value_groups`): the same as the whole
    model's where both are cut, more where key/value heads are replicated."""
    attn = getattr(layer.layer, attention, None)
    q, k = (getattr(attn, n, None) for n in ("q_proj", "k_proj"))
    if attn is None or not hasattr(attn, "num_key_value_groups") or \
            not all(hasattr(m, "out_features") for m in (q, k)):
        return
    attn.num_key_value_groups = q.out_features // k.out_features


def llama_plan(config: Any, attention: str = "layer.self_attn",
               mlp: str = "layer.mlp") -> dict[str, Any]:
    """Megatron's split of a Llama-shaped block: q, k, v by whole heads (grouped key/value
    heads included), o_proj by rows, gate and up by the MLP's inner width, down by rows."""
    heads = ("colwise", 1, head_dim(config))
    # fewer key/value heads than ranks (one for every query head, or 8 at t = 16): each rank
    # computes the one its query heads read
    kv = Split("colwise", 1, head_dim(config), replicate=True)
    # gather_sequence: attention reshapes q, k, v by its input's length (sequence parallelism)
    return {attention: ("gather_sequence",), f"{attention}.q_proj": heads,
            f"{attention}.k_proj": kv, f"{attention}.v_proj": kv,
            f"{attention}.o_proj": ("rowwise", 1, head_dim(config)),
            f"{mlp}.gate_proj": "colwise", f"{mlp}.up_proj": "colwise",
            f"{mlp}.down_proj": "rowwise"}
