"""Tensor-parallel rows of `hf_tensor.FAMILIES` (see there): the families with fused
projections or other blocks than Llama's (GPT-2, GPT-NeoX, Phi-3, Falcon, Bloom, GPT-J, OPT).

Each splits as Megatron splits a block: attention by whole heads, the MLP by its inner
width, the fused projections cut in place, never gathered:

- GPT-2's `c_attn` is a transformers `Conv1D` (weight stored (in, out)) holding q | k | v:
  three blocks, each cut by heads.
- GPT-NeoX's and Bloom's `query_key_value` interleave per head ([h0: q k v][h1: q k v]...),
  Falcon's (`new_decoder_architecture`) per key/value group ([g0: q.. k v][g1: ...]): a
  rank's contiguous run of whole heads (groups) is its q, k and v, a plain cut in units of
  one head's (group's) rows.
- Phi-3's `qkv_proj` is q | k | v of unequal widths (fewer key/value heads): each block cut
  alike, so a rank's query heads meet their own key/value heads; `gate_up_proj` is gate | up,
  each half cut.

After the cut (`localize`), the head counts and widths a block's code reads from attributes
are made this rank's, and Bloom's ALiBi biases are cut to this rank's heads.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from torch import nn

from pipeflow.models.hf_tensor_base import TensorFamily, head_dim
from pipeflow.runtime import tensor_parallel as tp

GATHER = ("gather_sequence",)   # transformers' attention reshapes by its input's length


@functools.cache
def _conv1d() -> None:
    from transformers.pytorch_utils import Conv1D
    tp.register_linear(Conv1D, transposed=True, fields=("nf", "nx"))


@functools.cache
def _falcon_linear() -> None:
    from transformers.models.falcon.modeling_falcon import FalconLinear
    tp.register_linear(FalconLinear)        # x @ W.T + b: nn.Linear's product


def _block_plan(attention: str, fused: dict[str, Any], out: str, hd: int,
                up: str, down: str, up_style: Any = "colwise") -> dict[str, Any]:
    """A block's plan: `fused` (projection -> style) in `attention`, `out` by rows in whole
    heads, the MLP's `up` by columns and `down` by rows."""
    return {attention: GATHER, **{f"{attention}.{n}": s for n, s in fused.items()},
            f"{attention}.{out}": ("rowwise", 1, hd), up: up_style, down: "rowwise"}


def _per_rank(module: nn.Module, names: tuple[str, ...], t: int) -> None:
    """Head counts and widths the module keeps as attributes: this rank's share."""
    for name in names:
        setattr(module, name, getattr(module, name) // t)


# -- GPT-2 ---------------------------------------------------------------------------------

def _gpt2_plan(config: Any) -> dict[str, Any]:
    _conv1d()
    hd = config.n_embd // config.n_head
    return _block_plan("layer.attn", {"c_attn": ("colwise", 3, hd)}, "c_proj", hd,
                       "layer.mlp.c_fc", "layer.mlp.c_proj")


def _gpt2_localize(layer: nn.Module, group: Any) -> None:
    # c_attn's output splits into q, k, v by `split_size`
    _per_rank(layer.layer.attn, ("num_heads", "embed_dim", "split_size"), group.size)


# -- GPT-NeoX ------------------------------------------------------------------------------

def _neox_plan(config: Any) -> dict[str, Any]:
    hd = config.hidden_size // config.num_attention_heads
    return _block_plan("layer.attention", {"query_key_value": ("colwise", 1, 3 * hd)},
                       "dense", hd, "layer.mlp.dense_h_to_4h", "layer.mlp.dense_4h_to_h")


# -- Phi-3 ---------------------------------------------------------------------------------

def _phi3_plan(config: Any) -> dict[str, Any]:
    hd = head_dim(config)
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return _block_plan("layer.self_attn", {"qkv_proj": ("colwise", (q, kv, kv), hd)},
                       "o_proj", hd, "layer.mlp.gate_up_proj", "layer.mlp.down_proj",
                       up_style=("colwise", 2))


def _phi3_localize(layer: nn.Module, group: Any) -> None:
    # Phi3Attention finds where q ends from its config's head count: its own copy, local
    attention = layer.layer.self_attn
    attention.config = copy.copy(attention.config)
    _per_rank(attention.config, ("num_attention_heads", "num_key_value_heads"), group.size)
    _per_rank(attention, ("num_key_value_heads",), group.size)


# -- Falcon --------------------------------------------------------------------------------

def _falcon_check(config: Any) -> str | None:
    if config.multi_query and not config.new_decoder_architecture:
        return ("multi_query=True keeps one key/value head shared by every query head, which "
                "cannot be split by heads (each rank would need it whole, its gradient summed "
                "over the group: not implemented); use new_decoder_architecture=True with "
                "num_kv_heads a multiple of tensor, or multi_query=False")
    return None


def _falcon_plan(config: Any) -> dict[str, Any]:
    _falcon_linear()
    hd = config.hidden_size // config.num_attention_heads
    # new: each key/value group's queries, then its key and value; old: q, k, v per head
    unit = (config.num_attention_heads // config.num_kv_heads + 2) * hd \
        if config.new_decoder_architecture else 3 * hd
    return _block_plan("layer.self_attention", {"query_key_value": ("colwise", 1, unit)},
                       "dense", hd, "layer.mlp.dense_h_to_4h", "layer.mlp.dense_4h_to_h")


def _falcon_localize(layer: nn.Module, group: Any) -> None:
    _per_rank(layer.layer.self_attention,
              ("num_heads", "num_kv_heads", "hidden_size", "split_size"), group.size)


# -- Bloom ---------------------------------------------------------------------------------

def _bloom_check(config: Any) -> str | None:
    if config.pretraining_tp > 1 and config.slow_but_exact:
        return (f"slow_but_exact=True with pretraining_tp={config.pretraining_tp} multiplies "
                f"slices of the whole dense weights itself, past the cut layers; set "
                f"slow_but_exact=False")
    return None


def _bloom_plan(config: Any) -> dict[str, Any]:
    hd = config.hidden_size // config.n_head
    return _block_plan("layer.self_attention", {"query_key_value": ("colwise", 1, 3 * hd)},
                       "dense", hd, "layer.mlp.dense_h_to_4h", "layer.mlp.dense_4h_to_h")


def _bloom_localize(layer: nn.Module, group: Any) -> None:
    attention = layer.layer.self_attention
    whole = attention.num_heads
    _per_rank(attention, ("num_heads", "hidden_size", "split_size"), group.size)
    _per_rank(layer.layer, ("num_heads",), group.size)
    attention.register_forward_pre_hook(
        functools.partial(_local_alibi, whole, group.rank * attention.num_heads,
                          attention.num_heads), with_kwargs=True)


def _local_alibi(whole: int, first: int, count: int, _module: nn.Module, args: tuple,
                 kwargs: dict) -> tuple[tuple, dict]:
    """The block's ALiBi biases (batch x whole heads, 1, T), built for every head (hf's
    `_bloom_inputs`), cut to this rank's heads: rank r's heads keep their own slopes."""
    alibi = kwargs["alibi"]
    local = alibi.unflatten(0, (-1, whole))[:, first:first + count].flatten(0, 1)
    return args, {**kwargs, "alibi": local}


# -- GPT-J and OPT: separate q, k, v --------------------------------------------------------

def _separate(attention: str, out: str, up: str, down: str) -> Any:
    """The plan of a block with separate q, k and v projections."""
    def plan(config: Any) -> dict[str, Any]:
        hd = config.hidden_size // config.num_attention_heads
        heads = ("colwise", 1, hd)
        return _block_plan(attention, {"q_proj": heads, "k_proj": heads, "v_proj": heads},
                           out, hd, up, down)
    return plan


def _gptj_localize(layer: nn.Module, group: Any) -> None:
    _per_rank(layer.layer.attn, ("num_attention_heads", "embed_dim"), group.size)


def _opt_localize(layer: nn.Module, group: Any) -> None:
    # OPTAttention views q, k, v by `num_heads`
    _per_rank(layer.layer.self_attn, ("num_heads", "embed_dim"), group.size)


FAMILIES: dict[str, TensorFamily] = {
    "gpt2": TensorFamily(plan=_gpt2_plan, localize=_gpt2_localize),
    "gpt_neox": TensorFamily(plan=_neox_plan),
    "phi3": TensorFamily(plan=_phi3_plan, localize=_phi3_localize),
    "falcon": TensorFamily(plan=_falcon_plan, localize=_falcon_localize, check=_falcon_check),
    "bloom": TensorFamily(plan=_bloom_plan, localize=_bloom_localize, check=_bloom_check),
    "gptj": TensorFamily(plan=_separate("layer.attn", "out_proj", "layer.mlp.fc_in",
                                        "layer.mlp.fc_out"), localize=_gptj_localize),
    "opt": TensorFamily(plan=_separate("layer.self_attn", "out_proj", "layer.fc1",
                                       "layer.fc2"), localize=_opt_localize),
}
