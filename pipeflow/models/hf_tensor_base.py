"""What every tensor-parallel row of `hf_tensor.FAMILIES` is made of (see there)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn


@dataclasses.dataclass(frozen=True)
class TensorFamily:
    plan: Callable[[Any], dict[str, Any]]
    localize: Callable[[nn.Module, Any], None] | None = None
    # why this config cannot split (None: it can); asked before the plan
    check: Callable[[Any], str | None] = lambda config: None


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads


def llama_plan(config: Any, attention: str = "layer.self_attn",
               mlp: str = "layer.mlp") -> dict[str, Any]:
    """Megatron's split of a Llama-shaped block: q, k, v by whole heads (grouped key/value
    heads included), o_proj by rows, gate and up by the MLP's inner width, down by rows."""
    heads = ("colwise", 1, head_dim(config))
    # gather_sequence: attention reshapes q, k, v by its input's length (sequence parallelism)
    return {attention: ("gather_sequence",), f"{attention}.q_proj": heads,
            f"{attention}.k_proj": heads, f"{attention}.v_proj": heads,
            f"{attention}.o_proj": ("rowwise", 1, head_dim(config)),
            f"{mlp}.gate_proj": "colwise", f"{mlp}.up_proj": "colwise",
            f"{mlp}.down_proj": "rowwise"}
