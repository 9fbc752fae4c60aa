"""What each supported transformers family does outside its decoder blocks, one row a family.

A causal LM's base model runs a few steps of its own around the blocks: Granite multiplies its
embedding, OPT adds learned positions counted from the padding mask, Bloom builds ALiBi
biases for every block, Cohere scales its logits, Gemma2 soft-caps them; each chooses the mask
of its blocks by its own rule (Llama: always full, Mistral: sliding when `sliding_window` is
set, Qwen2: by `layer_types`), and only some causal LMs add a load-balancing loss. A pipeline
plan names the submodules, not these steps, so each family is a `Family` row here: its plan
where its config carries none, its attention implementation, its mask rule, its expert count,
and the step functions that differ from the default. A key another family reads changes
nothing here unless this family's own transformers model reads it. A model type with no row
is refused (`refusal`): pipeflow.models.hf builds only what tests/test_hf.py compares with
transformers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Family", "FAMILIES", "family", "refusal", "positions"]


def positions(x: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """`position_ids`, or 0..T-1 (1, T) for the sequence dimension of `x` when not given."""
    if position_ids is not None:
        return position_ids
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


# -- embedding steps: (layer, input_ids, attention_mask, position_ids) -> hidden -------------

def embed_in_order(layer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor | None) -> torch.Tensor:
    """The plan's modules before the blocks, one after the other (Llama: `embed_tokens`)."""
    return layer.run(input_ids, layer.names)


def _embed_gpt2(layer, input_ids, attention_mask, position_ids):
    # Token plus learned absolute position, then dropout.
    return layer.drop(layer.wte(input_ids) + layer.wpe(positions(input_ids, position_ids)))


def _embed_granite(layer, input_ids, attention_mask, position_ids):
    return layer.embed_tokens(input_ids) * layer.config.embedding_multiplier


def _embed_starcoder2(layer, input_ids, attention_mask, position_ids):
    # A functional dropout in StarCoder2's base forward, not a module the plan could name.
    return F.dropout(layer.embed_tokens(input_ids), p=layer.config.embedding_dropout,
                     training=layer.training)


def _embed_opt(layer, input_ids, attention_mask, position_ids):
    # OPT counts positions over the tokens the mask keeps (left padding shifts them), and
    # its learned table is offset by 2; `project_in` maps a narrower word embedding up.
    hidden = layer.embed_tokens(input_ids)
    if hasattr(layer, "project_in"):
        hidden = layer.project_in(hidden)
    mask = attention_mask
    if mask is None:
        mask = torch.ones(input_ids.shape, dtype=torch.long, device=input_ids.device)
    return hidden + layer.embed_positions(mask, 0, position_ids=position_ids)


# -- extra block inputs: (layer, hidden, attention_mask, position_ids) -> kwargs -------------

def rotary_inputs(layer: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor) -> dict[str, Any]:
    """The rotary cos/sin (`position_embeddings`) where the family has a rotary embedding."""
    if layer.rotary is None:
        return {}
    return {"position_embeddings": layer.rotary_embeddings(hidden, position_ids)}


def _gemma3_inputs(layer, hidden, attention_mask, position_ids):
    # Gemma3 keeps one rotary table per attention kind (local base for sliding layers).
    return {"position_embeddings": layer.rotary_embeddings(hidden, position_ids, layer.kind)}


def _no_inputs(layer, hidden, attention_mask, position_ids):
    return {}     # OPT: learned positions, added in the embedding layer


def _falcon_inputs(layer, hidden, attention_mask, position_ids):
    # Falcon's block takes `alibi` positionally; with rotary positions (alibi=False) it is None.
    return {"alibi": None, **rotary_inputs(layer, hidden, attention_mask, position_ids)}


def _bloom_inputs(layer, hidden, attention_mask, position_ids):
    """Bloom's ALiBi biases (batch x heads, 1, T), built as BloomModel.forward builds them."""
    bloom = layer.modeling      # transformers.models.bloom.modeling_bloom
    heads = layer.config.n_head
    if attention_mask is None:
        batch, length = hidden.shape[:2]
        slopes = bloom._get_alibi_slopes(heads, hidden.device)
        alibi = slopes[:, None, None] * torch.arange(length, device=hidden.device)
        return {"alibi": alibi.repeat(batch, 1, 1).to(hidden.dtype)}
    return {"alibi": bloom.build_alibi_tensor(attention_mask.to(hidden.device), heads,
                                              hidden.dtype)}


# -- logits steps: (config, logits) -> logits ------------------------------------------------

def _cohere_logits(config, logits):
    return logits * config.logit_scale


def _granite_logits(config, logits):
    return logits / config.logits_scaling


def _gemma2_logits(config, logits):
    cap = config.final_logit_softcapping
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


# -- attention kinds: (config, block index) -> "full_attention" | "sliding_attention" ----------
# As each family's base model forward chooses the mask: a key another family reads (a Llama
# config carrying `sliding_window` or `layer_types`) changes nothing where this family's
# forward does not read it.

def full_attention(config: Any, index: int) -> str:
    """Llama, GPT-2, ...: every block causal over the whole row, whatever the config carries."""
    return "full_attention"


def _window_when_set(config, index):
    # Mistral, Mixtral, Phi3, StarCoder2, Qwen3-MoE, PhiMoE: `create_sliding_window_causal_mask
    # if config.sliding_window is not None`, for every block.
    if getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _by_layer_types(config, index):
    # Qwen2, Qwen3, Qwen2-MoE, Gemma2, Gemma3, GPT-OSS, SmolLM3: the mask of
    # `config.layer_types[i]` (the config class derives it from its own switches).
    return config.layer_types[index]


# -- per-config refusals: config -> reason or None ------------------------------------------

def _falcon_check(config):
    if getattr(config, "alibi", False):
        return ("Falcon with alibi=True adds its ALiBi bias into the mask inside FalconModel's "
                "forward, which pipeflow does not reproduce; use a Falcon config with "
                "alibi=False (rotary positions)")
    return None


def _opt_check(config):
    if getattr(config, "layerdrop", 0.0):
        return (f"OPT with layerdrop={config.layerdrop} skips whole blocks at random inside "
                f"OPTDecoder's loop; set layerdrop=0.0")
    return None


def _no_check(config):
    return None


def _gemma3_check(config):
    if getattr(config, "use_bidirectional_attention", False):
        return ("Gemma3 with use_bidirectional_attention=True (EmbeddingGemma) is an encoder: "
                "pipeflow.models.hf trains causal LMs; set use_bidirectional_attention=False")
    return None


def _gemma3_attention(config):
    # SDPA cannot soft-cap attention scores: transformers' eager path applies the cap.
    return "sdpa" if getattr(config, "attn_logit_softcapping", None) is None else "eager"


@dataclasses.dataclass(frozen=True)
class Family:
    """One transformers family: what its base model does besides running the blocks.

    plan: base-model submodules in order (dotted paths; the one `ModuleList` is the blocks),
        for configs without a `base_model_pp_plan`; None to take the config's.
    attention: the attention implementation the blocks are built with ("sdpa", or "eager"
        where the family refuses SDPA), or a function of the config that says which.
    kind: which mask each block attends under (`full_attention` and the rules above).
    experts: the config field the causal LM's load-balancing loss counts experts by
        (`num_local_experts`, `num_experts`); None where it adds no such loss.
    embed / block_inputs / logits / check: the steps above.
    cache: the keyword its blocks take a key/value cache by, for generation
        (`DecoderLayer.decode`, checked against transformers' generate in
        tests/test_generate.py); None: generation recomputes the whole sequence each step.
    """

    plan: tuple[str, ...] | None = None
    attention: str | Callable[[Any], str] = "sdpa"
    kind: Callable[[Any, int], str] = full_attention
    experts: str | None = None
    embed: Callable[..., torch.Tensor] = embed_in_order
    block_inputs: Callable[..., dict[str, Any]] = rotary_inputs
    logits: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    check: Callable[[Any], str | None] = _no_check
    cache: str | None = "cache"

    def attention_for(self, config: Any) -> str:
        """The attention implementation for `config`'s blocks."""
        return self.attention if isinstance(self.attention, str) else self.attention(config)


_LLAMA_LIKE = Family()
_WINDOWED = Family(kind=_window_when_set)
_TYPED = Family(kind=_by_layer_types)
_PLAN = ("embed_tokens", "layers", "norm")      # for configs that carry no pipeline plan

FAMILIES: dict[str, Family] = {
    "gpt2": Family(plan=("wte", "wpe", "drop", "h", "ln_f"), embed=_embed_gpt2),
    "llama": _LLAMA_LIKE,
    "mistral": _WINDOWED,
    "qwen2": _TYPED,
    "qwen3": _TYPED,
    "gemma": _LLAMA_LIKE,       # its embedding module scales by sqrt(hidden) itself
    "olmo2": _LLAMA_LIKE,
    "phi3": _WINDOWED,
    "gpt_neox": Family(cache="layer_past"),
    "mixtral": Family(kind=_window_when_set, experts="num_local_experts"),
    "qwen2_moe": Family(kind=_by_layer_types, experts="num_experts"),
    "cohere": Family(logits=_cohere_logits),
    "granite": Family(embed=_embed_granite, logits=_granite_logits),
    "starcoder2": Family(kind=_window_when_set, embed=_embed_starcoder2),
    "gptj": Family(),           # plan: wte, drop, h, ln_f; rotary table applied in attention
    "gemma2": Family(attention="eager", kind=_by_layer_types, logits=_gemma2_logits),
    "stablelm": Family(plan=_PLAN),
    "opt": Family(plan=("decoder.embed_tokens", "decoder.embed_positions", "decoder.project_in",
                        "decoder.layers", "decoder.final_layer_norm", "decoder.project_out"),
                  embed=_embed_opt, block_inputs=_no_inputs, check=_opt_check),
    "falcon": Family(plan=("word_embeddings", "h", "ln_f"), block_inputs=_falcon_inputs,
                     check=_falcon_check, cache="layer_past"),
    "bloom": Family(plan=("word_embeddings", "word_embeddings_layernorm", "h", "ln_f"),
                    attention="eager", block_inputs=_bloom_inputs, cache="layer_past"),
    "gemma3_text": Family(attention=_gemma3_attention, kind=_by_layer_types,
                          block_inputs=_gemma3_inputs, logits=_gemma2_logits,
                          check=_gemma3_check),
    "smollm3": _TYPED,          # its blocks skip rotary where config.no_rope_layers says
    "glm4": _LLAMA_LIKE,        # partial rotary and post-norms inside its blocks
    "qwen3_moe": Family(kind=_window_when_set, experts="num_experts"),
    "olmoe": Family(plan=_PLAN, experts="num_experts"),
    "phimoe": Family(plan=_PLAN, kind=_window_when_set, experts="num_local_experts"),
    "gpt_oss": Family(attention="eager", kind=_by_layer_types, experts="num_local_experts"),
    "deepseek_v3": Family(),    # MLA and routed + shared experts inside its blocks; no aux loss
}

def refusal(config: Any) -> str | None:
    """Why pipeflow.models.hf does not build `config`'s model, or None when it does."""
    model_type = getattr(config, "model_type", type(config).__name__)
    supported = ", ".join(sorted(FAMILIES))
    if model_type not in FAMILIES:
        return (f"model_type {model_type!r} ({type(config).__name__}) is not supported by "
                f"pipeflow.models.hf: only families whose layers are checked against "
                f"transformers build (tests/test_hf.py), and {model_type!r} is not one of "
                f"them. Supported: {supported}. To add one, give it a row in "
                f"pipeflow/models/hf_families.py and a row in tests/test_hf.py")
    reason = FAMILIES[model_type].check(config)
    if reason is not None:
        return f"model_type {model_type!r}: this config is not supported: {reason}"
    return None


def family(config: Any) -> Family:
    """`config`'s row of FAMILIES; a ValueError saying why for a model it does not build."""
    reason = refusal(config)
    if reason is not None:
        raise ValueError(reason)
    return FAMILIES[config.model_type]


def submodule(module: nn.Module, dotted: str) -> nn.Module | None:
    """`module`'s submodule at the dotted path, or None where the path holds none
    (OPT's `project_in` when the embedding is already as wide as the blocks)."""
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module if isinstance(module, nn.Module) else None


def local_name(dotted: str) -> str:
    """A plan entry's name inside a pipeflow layer: its last component."""
    return dotted.rsplit(".", 1)[-1]

