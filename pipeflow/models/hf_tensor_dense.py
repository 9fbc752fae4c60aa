"""Tensor-parallel rows of `hf_tensor.FAMILIES` (see there): the dense families.

Every block here is Llama-shaped at heart (`llama_plan`: q, k and v by whole heads, o by
rows, the MLP by its inner width); a row says only what its family adds, read from its
modeling file:

- gemma, gemma2, granite, smollm3: nothing inside the block. The embedding's sqrt(hidden)
  scale, Granite's multipliers, the soft-caps (per score, per logit), the sliding windows
  (the mask) and SmolLM3's blocks without rotary all act per element or outside the block.
- gemma3_text: q_norm and k_norm over each head (`partial_gradient`, as Qwen3's).
- starcoder2: the MLP is `c_fc` / `c_proj` with biases (the row layer adds its bias once).
- glm4: `gate_up_proj` is gate and up fused: cut as 2 blocks, so a rank's slice of the
  output still splits into its gate and its up halves by `chunk(2)`.
- stablelm: its attention views q, k and v by `self.num_heads` (localized); with
  `qk_layernorm` a LayerNorm per head in a ModuleList: a rank runs its own heads' norms.
- cohere: attention and MLP in parallel from one norm (one input, one all-reduce of its
  gradient); with `use_qk_norm` one weight row per head: a rank uses its heads' rows.
- olmo2: q_norm and k_norm are RMSNorms over the whole projection width (every head), so a
  rank's mean of squares is summed over the tensor group (`_GroupRMSNorm`).

Whole weights a rank uses only a slice of (its heads' norms) stay whole on every rank and
are marked `partial_gradient`: each rank's gradient is its slice's, the sum over the group
the whole one, and every rank steps the same whole weight.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeflow.config import ConfigError
from pipeflow.models.hf_tensor_base import TensorFamily, llama_plan
from pipeflow.runtime.tensor_parallel import ReplicatedHeads

__all__ = ["FAMILIES"]

_PARTIAL = ("partial_gradient",)


def _attention_plan(config: Any) -> dict[str, Any]:
    """`llama_plan`'s attention entries alone (for blocks whose MLP is named otherwise)."""
    return {k: v for k, v in llama_plan(config).items() if not k.startswith("layer.mlp.")}


def _share(group: Any, total: int) -> slice:
    """This rank's rows of `total` (heads, or features of whole heads), as the column cut of
    q, k and v keeps them: the rank's contiguous `1/t`."""
    n = total // group.size
    return slice(group.rank * n, (group.rank + 1) * n)


@functools.cache
def _local_class(cls: type, local: type) -> type:
    return type(f"Local{cls.__name__}", (local, cls), {})


def _localize_module(module: nn.Module, local: type, **fields: Any) -> None:
    """`module` runs `local.forward` from now on, with `fields` set: its class becomes a
    subclass of its own, so its weights, their names and `isinstance` stay the family's."""
    for name, value in fields.items():
        setattr(module, name, value)
    module.__class__ = _local_class(type(module), local)


# -- gemma3_text (and olmo2): whole q/k norm weights a rank uses a slice of ---------------

def _qk_norm_plan(config: Any) -> dict[str, Any]:
    return {**llama_plan(config), "layer.self_attn.[qk]_norm": _PARTIAL}


# -- starcoder2, glm4: their own MLP names ------------------------------------------------

def _starcoder2_plan(config: Any) -> dict[str, Any]:
    return {**_attention_plan(config), "layer.mlp.c_fc": "colwise",
            "layer.mlp.c_proj": "rowwise"}


def _glm4_plan(config: Any) -> dict[str, Any]:
    return {**_attention_plan(config), "layer.mlp.gate_up_proj": ("colwise", 2),
            "layer.mlp.down_proj": "rowwise"}


# -- stablelm: head counts read in forward, a LayerNorm per head ---------------------------

def _stablelm_plan(config: Any) -> dict[str, Any]:
    plan = llama_plan(config)
    if config.qk_layernorm:
        plan["layer.self_attn.[qk]_layernorm"] = _PARTIAL
    return plan


class _LocalNormPerHead(nn.Module):
    """StableLM's `StableLmLayerNormPerHead` on this rank's heads (`norms[first:]`). Every
    head's norm enters the graph (its weights stacked, then this rank's rows taken), so each
    rank has a gradient, zero for the other ranks' heads, for every weight the group sums."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [batch, heads, seq, head_dim]: this rank's heads
        rows = slice(self.pf_first, self.pf_first + hidden_states.shape[1])
        first = self.norms[0]
        out = F.layer_norm(hidden_states, first.normalized_shape, eps=first.eps)
        out = out * torch.stack([n.weight for n in self.norms])[rows, None]
        if first.bias is not None:
            out = out + torch.stack([n.bias for n in self.norms])[rows, None]
        return out


def _key_heads_cut(layer: nn.Module, group: Any, why: str) -> None:
    """A norm over the key heads is cut with them: refused where there are fewer key/value
    heads than ranks (`ReplicatedHeads`: each rank computes a whole one)."""
    if isinstance(layer.layer.self_attn.k_proj, ReplicatedHeads):
        kv = layer.config.num_key_value_heads
        raise ConfigError(
            f"{layer.config.model_type}'s {why}, and its {kv} key/value heads do not cut over "
            f"tensor = {group.size} (fewer heads than ranks are computed replicated); use a "
            f"tensor degree dividing num_key_value_heads = {kv}")


def _stablelm_localize(layer: nn.Module, group: Any) -> None:
    attn = layer.layer.self_attn
    for norm in (getattr(attn, "q_layernorm", None), getattr(attn, "k_layernorm", None)):
        if norm is None:
            continue
        _key_heads_cut(layer, group, "qk_layernorm keeps a LayerNorm per head")
        _localize_module(norm, _LocalNormPerHead, pf_first=_share(group, norm.num_heads).start,
                         num_heads=norm.num_heads // group.size)
    # forward views q, k, v as (batch, seq, self.num_heads, head_dim): the heads this rank's
    # projections give (key/value heads replicated where fewer than ranks: one each)
    attn.num_heads = attn.q_proj.out_features // attn.head_dim
    attn.num_key_value_heads = attn.k_proj.out_features // attn.head_dim


# -- cohere: one weight row per head in its q/k LayerNorms ---------------------------------

def _cohere_plan(config: Any) -> dict[str, Any]:
    plan = llama_plan(config)
    if config.use_qk_norm:
        plan["layer.self_attn.[qk]_norm"] = _PARTIAL
    return plan


class _LocalHeadsLayerNorm(nn.Module):
    """Cohere's `CohereLayerNorm` over each head (weight [heads, head_dim]) on this rank's
    heads: the same arithmetic with the weight's rows `pf_rows`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight[self.pf_rows].to(torch.float32) * x).to(dtype)


def _cohere_localize(layer: nn.Module, group: Any) -> None:
    attn = layer.layer.self_attn
    if attn.use_qk_norm:
        _key_heads_cut(layer, group, "use_qk_norm keeps a weight row per head")
        for norm in (attn.q_norm, attn.k_norm):
            _localize_module(norm, _LocalHeadsLayerNorm,
                             pf_rows=_share(group, norm.weight.shape[0]))


# -- olmo2: q/k RMSNorms over every head's width -------------------------------------------

class _SumOverGroup(torch.autograd.Function):
    """A sum over the tensor group whose result every rank uses on its own slice: all-reduce
    forward, and all-reduce backward (each rank's gradient is its slice's share)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, key: str) -> torch.Tensor:
        ctx.group, ctx.key = group, key
        return group.allreduce(x, key)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.group.allreduce(grad, f"{ctx.key} (gradient)"), None, None


class _GroupRMSNorm(nn.Module):
    """OLMo2's `Olmo2RMSNorm` over the whole q (or k) width, run on this rank's slice of it:
    the squares summed over the tensor group, divided by the whole width; this rank's slice
    of the weight."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        squares = _SumOverGroup.apply(x.pow(2).sum(-1, keepdim=True), self.pf_group,
                                      self.pf_key)
        x = x * torch.rsqrt(squares / self.weight.shape[0] + self.variance_epsilon)
        return (self.weight[self.pf_rows] * x).to(dtype)


def _olmo2_localize(layer: nn.Module, group: Any) -> None:
    _key_heads_cut(layer, group, "k_norm spans the key heads' whole width")
    attn = layer.layer.self_attn
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name)
        _localize_module(norm, _GroupRMSNorm, pf_group=group,
                         pf_rows=_share(group, norm.weight.shape[0]),
                         pf_key=f"tensor group: layer {layer.index + 1}.layer.self_attn."
                                f"{name} (squares over the whole width)")


_LLAMA = TensorFamily(plan=llama_plan)

FAMILIES: dict[str, TensorFamily] = {
    "gemma": _LLAMA, "gemma2": _LLAMA, "granite": _LLAMA, "smollm3": _LLAMA,
    "gemma3_text": TensorFamily(plan=_qk_norm_plan),
    "starcoder2": TensorFamily(plan=_starcoder2_plan),
    "glm4": TensorFamily(plan=_glm4_plan),
    "stablelm": TensorFamily(plan=_stablelm_plan, localize=_stablelm_localize),
    "cohere": TensorFamily(plan=_cohere_plan, localize=_cohere_localize),
    "olmo2": TensorFamily(plan=_qk_norm_plan, localize=_olmo2_localize),
}
