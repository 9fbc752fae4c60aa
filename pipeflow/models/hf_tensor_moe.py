"""Tensor-parallel rows of `hf_tensor.FAMILIES` (see there): the mixture-of-experts families.

Megatron's split of a mixture without expert parallelism: attention by heads (as the Llama
row: `hf_tensor_base.llama_plan`), every routed expert by its inner width, the router whole.
transformers 5 keeps the experts of a block as one bank of fused 3-D parameters
(`gate_up_proj` (experts, 2 x inner, hidden), `down_proj` (experts, hidden, inner); GPT-OSS
transposed, gate and up interleaved, with biases), so the bank is cut by
`tensor_parallel.Shard` entries and runs `tokenwise`: each rank computes every token with
its slice of every expert, and the group sums. A shared expert (Qwen2-MoE, DeepSeek-V3) is
cut the same way (a dense MLP by its inner width).

The router stays whole and routes identically on every tensor rank: the bank's routing
weights are copied to the group like its tokens, so their gradient is summed before it
reaches the router, and the router's gradient is whole on every rank, as is the
load-balancing loss's (`hf_moe`; under sequence parallelism each rank routes its own tokens,
the bank gathers them, and the loss's sums gather the router's logits).

DeepSeek-V3's multi-head latent attention splits by heads too: the up-projections from the
latents (`q_b_proj`, `kv_b_proj`) by heads, `o_proj` by rows; the low-rank down-projections
(`q_a_proj`, `kv_a_proj_with_mqa`) and their norms whole.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from pipeflow.config import ConfigError
from pipeflow.models.hf_tensor_base import TensorFamily, head_dim, llama_plan
from pipeflow.runtime.tensor_parallel import Once, Shard, Split, copy_to, reduce_from, split_of


def _attention(config: Any) -> dict[str, Any]:
    """The Llama row's attention entries (q, k, v by heads, o_proj by rows)."""
    return {k: v for k, v in llama_plan(config).items() if k.startswith("layer.self_attn")}


def _bank(path: str, *, transposed: bool = False, interleaved: bool = False,
          bias: bool = False, if_present: bool = False) -> dict[str, Any]:
    """An expert bank (transformers' `@use_experts_implementation` layout) cut by its inner
    width: gate and up by output features (two fused blocks, or pairs where interleaved),
    down by input features; gate/up biases with their features, the down bias added once."""
    gate_up, down = (2, 1) if transposed else (1, 2)
    fused = Shard(gate_up, 1, 2, if_present) if interleaved else Shard(gate_up, 2, 1, if_present)
    plan = {path: Split("tokenwise", if_present=if_present), f"{path}.gate_up_proj": fused,
            f"{path}.down_proj": Shard(down, if_present=if_present)}
    if bias:
        plan[f"{path}.gate_up_proj_bias"] = Shard(1, fused.parts, fused.unit, if_present)
        plan[f"{path}.down_proj_bias"] = Once(if_present)
    return plan


def _shared(path: str, if_present: bool = False) -> dict[str, Any]:
    """A shared expert (a gated MLP of `nn.Linear`s) cut like a dense MLP, run `tokenwise`:
    Qwen2-MoE flattens its tokens before it, which a column layer's sequence gather does not
    take."""
    return {path: Split("tokenwise", if_present=if_present),
            f"{path}.gate_proj.weight": Shard(0, if_present=if_present),
            f"{path}.up_proj.weight": Shard(0, if_present=if_present),
            f"{path}.down_proj.weight": Shard(1, if_present=if_present)}


def _dense(if_present: bool) -> dict[str, Any]:
    """The Llama row's MLP entries, for the dense blocks of a model that mixes both."""
    return {k: Split(v, if_present=if_present) for k, v in
            (("layer.mlp.gate_proj", "colwise"), ("layer.mlp.up_proj", "colwise"),
             ("layer.mlp.down_proj", "rowwise"))}


def _mixtral_plan(config: Any) -> dict[str, Any]:      # mixtral, phimoe, olmoe's MLP
    return {**_attention(config), **_bank("layer.mlp.experts")}


def _qwen3_moe_plan(config: Any) -> dict[str, Any]:
    # dense blocks where mlp_only_layers or decoder_sparse_step say so
    mixed = _qwen_mixed(config)
    plan = {**_attention(config), "layer.self_attn.[qk]_norm": ("partial_gradient",),
            **_bank("layer.mlp.experts", if_present=mixed)}
    return {**plan, **_dense(True)} if mixed else plan


def _qwen2_moe_plan(config: Any) -> dict[str, Any]:
    mixed = _qwen_mixed(config)
    plan = {**_attention(config), **_bank("layer.mlp.experts", if_present=mixed),
            **_shared("layer.mlp.shared_expert", if_present=mixed)}
    return {**plan, **_dense(True)} if mixed else plan


def _qwen_mixed(config: Any) -> bool:
    return bool(getattr(config, "mlp_only_layers", None)) or \
        getattr(config, "decoder_sparse_step", 1) != 1


def _gpt_oss_plan(config: Any) -> dict[str, Any]:
    # each rank keeps the sinks of its own heads
    return {**_attention(config), "layer.self_attn.sinks": Shard(0),
            **_bank("layer.mlp.experts", transposed=True, interleaved=True, bias=True)}


def _olmoe_plan(config: Any) -> dict[str, Any]:
    # q_norm and k_norm span the whole q and k widths: each rank keeps its heads' weights and
    # the group sums the squares (`_localize_olmoe`)
    unit = head_dim(config)
    return {**_attention(config), "layer.self_attn.q_norm.weight": Shard(0, 1, unit),
            "layer.self_attn.k_norm.weight": Shard(0, 1, unit), **_bank("layer.mlp.experts")}


def _olmoe_check(config: Any) -> str | None:
    width = config.num_attention_heads * head_dim(config)
    if width != config.hidden_size:
        return (f"its q_norm spans hidden_size = {config.hidden_size} while q_proj gives "
                f"num_attention_heads x head_dim = {width}; the norm cannot follow the heads")
    return None


def _deepseek_plan(config: Any) -> dict[str, Any]:
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    query = "q_proj" if config.q_lora_rank is None else "q_b_proj"
    mixed = config.first_k_dense_replace > 0
    return {"layer.self_attn": ("gather_sequence",),
            f"layer.self_attn.{query}": ("colwise", 1, qk),
            "layer.self_attn.kv_b_proj": ("colwise", 1, config.qk_nope_head_dim +
                                          config.v_head_dim),
            "layer.self_attn.o_proj": ("rowwise", 1, config.v_head_dim),
            **_bank("layer.mlp.experts", if_present=mixed),
            **_shared("layer.mlp.shared_experts", if_present=mixed),
            **(_dense(True) if mixed else {})}


# -- after the cut --------------------------------------------------------------------------

def _localize(layer: nn.Module, group: Any) -> None:
    """Checks every row makes once its block is cut: its MLP was cut (a plan whose entries
    may be absent still cut something), its bank in the layout the plan assumed, and no
    randomness that sequence parallelism would draw per slice."""
    where = f"layer {layer.index + 1} ({layer.config.model_type} block {layer.index})"
    mlp = layer.layer.mlp
    if not any(split_of(p) is not None for p in mlp.parameters()):
        raise ConfigError(f"{where}: the tensor plan cut nothing of its MLP "
                          f"({type(mlp).__name__}); its plan does not fit this block")
    bank = getattr(mlp, "experts", None)
    if bank is not None and getattr(bank, "is_transposed", False) != \
            (layer.config.model_type == "gpt_oss"):
        raise ConfigError(f"{where}: expected {type(bank).__name__} with its weights "
                          f"{'(in, out)' if layer.config.model_type == 'gpt_oss' else '(out, in)'}"
                          f"; this transformers version stores them otherwise")
    random = _random_in_training(layer.config)
    if group.sequence_parallel and random:
        raise ConfigError(
            f"{where}: {random}, so under sequence parallelism each tensor rank would draw "
            f"for its own slice of the tokens, unlike one process; set sequence_parallel = "
            f"false (tensor parallelism alone routes alike on every rank)")


def _random_in_training(config: Any) -> str | None:
    """What draws random numbers per token in training, if anything does."""
    if config.model_type == "phimoe":
        return "its router samples experts at random in training (sparsemixer)"
    if getattr(config, "router_jitter_noise", 0):
        return "its router multiplies its input by random jitter (router_jitter_noise > 0)"
    return None


def _localize_deepseek(layer: nn.Module, group: Any) -> None:
    """Latent attention feeds every head from whole low-rank projections, and the shared
    rotary key (`k_rot`, from `kv_a_proj_with_mqa`) joins each head without a column layer
    between: its gradient on a rank comes from that rank's heads only. So the attention's
    input is copied to the group once, at its entry (its column layers then take it as it
    is, as inside `gather_sequence`), and the whole weights in it get partial gradients,
    summed over the group. Under sequence parallelism `gather_sequence` does both."""
    _localize(layer, group)
    attention = layer.layer.self_attn
    for name, param in attention.named_parameters():
        if split_of(param) is None and not name.startswith("o_proj."):
            param.pf_partial_gradient = True
    entered: list[bool] = []
    key = f"tensor group: layer {layer.index}.self_attn (input)"

    def enter(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        entered.append(not group.sequence_parallel)
        if not entered[-1]:
            return None
        group.gathered += 1
        if args:
            return (copy_to(args[0], group, key), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to(kwargs["hidden_states"], group, key)}

    def leave(_m: nn.Module, _args: tuple, _out: Any) -> None:
        if entered.pop():
            group.gathered -= 1

    attention.register_forward_pre_hook(enter, with_kwargs=True)
    attention.register_forward_hook(leave)


def _localize_olmoe(layer: nn.Module, group: Any) -> None:
    _localize(layer, group)
    attention = layer.layer.self_attn
    for norm in (attention.q_norm, attention.k_norm):
        norm.__class__ = _group_norm(type(norm))
        norm.pf_tensor, norm.pf_width = group, norm.weight.shape[0] * group.size


@functools.cache
def _group_norm(cls: type) -> type:
    return type("Group" + cls.__name__, (_GroupRMSNorm, cls), {})


class _GroupRMSNorm(nn.Module):
    """An RMS norm (OLMoE's: fp32, weight after the cast back) over features cut across the
    tensor group: each rank's sum of squares, summed over the group (all-reduce forward and
    backward: every rank's output depends on every rank's features)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        squares = x.pow(2).sum(-1, keepdim=True)
        key = "tensor group: the norm's sum of squares"
        total = reduce_from(copy_to(squares, self.pf_tensor, key), self.pf_tensor, key)
        x = x * torch.rsqrt(total / self.pf_width + self.variance_epsilon)
        return self.weight * x.to(dtype)


_MIXTRAL = TensorFamily(plan=_mixtral_plan, localize=_localize)

FAMILIES: dict[str, TensorFamily] = {
    "mixtral": _MIXTRAL, "phimoe": _MIXTRAL,
    "qwen2_moe": TensorFamily(plan=_qwen2_moe_plan, localize=_localize),
    "qwen3_moe": TensorFamily(plan=_qwen3_moe_plan, localize=_localize),
    "olmoe": TensorFamily(plan=_olmoe_plan, localize=_localize_olmoe, check=_olmoe_check),
    "gpt_oss": TensorFamily(plan=_gpt_oss_plan, localize=_localize),
    "deepseek_v3": TensorFamily(plan=_deepseek_plan, localize=_localize_deepseek),
}
