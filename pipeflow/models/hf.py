"""Hugging Face causal language models (GPT-2, Llama and models shaped alike) as layer lists.

`causal_lm_layers(config)` turns a `transformers` config into `LayerSpec`s that any pipeline
grid can split: an embedding layer (token ids -> hidden), one layer per decoder block
(hidden -> hidden) and a head (final norm + `lm_head` -> logits). The blocks are transformers'
own modules, built from the config with SDPA attention and initialised by the model class's
own `_init_weights`. What a block needs besides the hidden states (the causal + padding mask,
position ids, rotary cos/sin) it builds locally from the side inputs `attention_mask` (B, T)
and `position_ids` (B, T), so nothing but the hidden states crosses a stage boundary.

`from_hf_state_dict` / `to_hf_state_dict` map weights between the two key spaces, so a model
from `transformers` trains in a pipeline and comes back. `transformers` is an optional extra
(`pip install -e ".[hf]"`), imported only when a function here needs it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import warnings
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from pipeflow.layers import LayerSpec

__all__ = ["causal_lm_layers", "from_hf_state_dict", "to_hf_state_dict", "causal_lm_loss",
           "causal_lm_loss_sum", "num_valid_tokens", "Embedding", "GPT2Embedding",
           "DecoderLayer", "Head", "Arch", "arch", "IGNORE_INDEX", "TIE_KEY"]

IGNORE_INDEX = -100     # labels with this value count for no loss (HF's convention)
TIE_KEY = "wte"         # the tie key of the input embedding and the output head

# Model types whose pipeflow layers were checked against the transformers model (logits and
# training, tests/test_hf.py). Others that follow the same pipeline plan build too, with a
# warning: their forward may hold a step the plan does not name (e.g. Cohere's logit scale).
_VERIFIED = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "olmo2", "gpt_neox",
             "mixtral")

# GPT-2's config carries no pipeline plan; this is the one transformers would write for it.
_GPT2_PLAN = {"wte": None, "wpe": None, "drop": None, "h": None, "ln_f": None}


def _transformers():
    try:
        import transformers
    except ImportError as exc:   # pragma: no cover - exercised only without the extra
        raise ImportError(
            "pipeflow.models.hf needs the transformers library: pip install -e \".[hf]\" "
            "(or pip install 'transformers>=5.0')") from exc
    return transformers


@dataclasses.dataclass(frozen=True)
class Arch:
    """Where the parts of one transformers causal LM live, found from its config's classes."""

    model_type: str
    causal_lm: type            # e.g. LlamaForCausalLM: its `_init_weights` initialises
    base: type                 # e.g. LlamaModel: built on the meta device to find the parts
    prefix: str                # "model." / "transformer.": the base model in HF's keys
    embed: tuple[str, ...]     # base submodules before the blocks, in order
    layers: str                # the ModuleList of blocks
    norm: tuple[str, ...]      # base submodules after the blocks
    head: str                  # the output projection on the causal LM ("lm_head")
    block: type                # the decoder block class
    rotary: type | None        # the rotary embedding class, None for absolute positions

    def __repr__(self) -> str:
        return f"Arch({self.model_type})"


def arch(config: Any) -> Arch:
    """The classes and submodule names of `config`'s causal LM, from transformers' mappings."""
    auto = _transformers().models.auto.modeling_auto
    causal_lm = auto.AutoModelForCausalLM._model_mapping.get(type(config), None)
    base = auto.AutoModel._model_mapping.get(type(config), None)
    if causal_lm is None or base is None:
        raise ValueError(f"{type(config).__name__} (model_type {config.model_type!r}) has no "
                         f"causal LM in transformers' auto mappings; pipeflow.models.hf builds "
                         f"decoder-only causal LMs such as {', '.join(_VERIFIED)}")
    plan = dict(getattr(type(config), "base_model_pp_plan", None) or {})
    if config.model_type == "gpt2":
        plan = _GPT2_PLAN
    meta = _meta_base(base, config)
    lists = [n for n in plan if isinstance(getattr(meta, n, None), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"{config.model_type}: expected a pipeline plan (config "
                         f"base_model_pp_plan) naming one list of blocks, found {plan}")
    cut = list(plan).index(lists[0])
    block_name = causal_lm._no_split_modules[0]
    rotary = getattr(meta, "rotary_emb", None)
    return Arch(config.model_type, causal_lm, base, causal_lm.base_model_prefix + ".",
                tuple(list(plan)[:cut]), lists[0], tuple(list(plan)[cut + 1:]),
                next(iter(getattr(causal_lm, "_pp_plan", None) or {"lm_head": None})),
                getattr(sys.modules[causal_lm.__module__], block_name),
                None if rotary is None else type(rotary))


def _meta_base(base: type, config: Any) -> nn.Module:
    """The base model without blocks, on the meta device: its parts, no memory, no init."""
    empty = copy.deepcopy(config)
    empty.num_hidden_layers = 0
    with torch.device("meta"):
        return base(empty)


def _sdpa(config: Any) -> Any:
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    return config


def causal_lm_layers(config: Any) -> list[LayerSpec]:
    """The causal LM of a transformers `config` as pipeflow layers: embedding, blocks, head.

    Layer 0 takes token ids (B, T) int64; layers 1..n are the decoder blocks, hidden (B, T, d)
    in and out, reading the side inputs `attention_mask` (B, T; 1 = token, 0 = padding) and
    `position_ids` (B, T; default 0..T-1) by keyword; the last layer returns logits (B, T, V).
    With `config.tie_word_embeddings` the head's weight is the embedding's (tie key "wte").
    """
    parts = arch(config)
    config = _sdpa(config)
    if parts.model_type not in _VERIFIED:
        warnings.warn(f"pipeflow.models.hf: model_type {parts.model_type!r} follows a "
                      f"pipeline plan but was not checked against transformers (checked: "
                      f"{', '.join(_VERIFIED)}); compare its logits before training on it",
                      stacklevel=2)
    embed_cls = GPT2Embedding if parts.model_type == "gpt2" else Embedding
    embed = LayerSpec(embed_cls, config, parts)
    head = LayerSpec(Head, config, parts)
    if getattr(config, "tie_word_embeddings", False):
        embed.tie(TIE_KEY, f"{parts.embed[0]}.weight")
        head.tie(TIE_KEY, f"{parts.head}.weight")
    blocks = [LayerSpec(DecoderLayer, config, parts, i) for i in range(config.num_hidden_layers)]
    return [embed, *blocks, head]


# -- building: meta device, then materialised and initialised by the model class ------------

def _hf_init(module: nn.Module, config: Any, parts: Arch) -> None:
    """Initialise `module` as `parts.causal_lm` would (its `_init_weights`, children first)."""
    # _init_weights reads only `self.config`: an instance without __init__ carries it.
    owner = parts.causal_lm.__new__(parts.causal_lm)
    nn.Module.__init__(owner)
    owner.config = config
    with torch.no_grad():
        for sub in reversed(list(module.modules())):   # post-order: children before parents
            owner._init_weights(sub)


def _materialize(module: nn.Module, config: Any, parts: Arch) -> nn.Module:
    """A meta-device `module` on the current default device, initialised the HF way.

    Every floating tensor starts as NaN, so one the model's `_init_weights` does not reach
    is an error here rather than uninitialised memory in training.
    """
    device = torch.get_default_device()
    module = module.to_empty(device=device)
    if device.type == "meta":
        return module
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point():
                t.fill_(math.nan)
    _hf_init(module, config, parts)
    missed = [n for n, t in tensors.items() if t.is_floating_point() and t.isnan().any()]
    if missed:
        raise RuntimeError(f"{parts.causal_lm.__name__}._init_weights left {missed} "
                           f"uninitialised; pipeflow.models.hf cannot build this model")
    return module


def _base_parts(config: Any, parts: Arch, names: Iterable[str]) -> dict[str, nn.Module]:
    meta = _meta_base(parts.base, config)
    return {name: getattr(meta, name) for name in names}


class _Parts(nn.Module):
    """A layer made of named base-model submodules, named as in the base model."""

    def __init__(self, config: Any, parts: Arch, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.names = tuple(modules)
        for name, module in modules.items():
            self.add_module(name, module)
        _materialize(self, config, parts)

    def run(self, x: Any, names: Iterable[str]) -> Any:
        for name in names:
            x = getattr(self, name)(x)
        return x


class Embedding(_Parts):
    """Token ids (B, T) -> hidden (B, T, d): the base model's modules before the blocks."""

    def __init__(self, config: Any, parts: Arch) -> None:
        super().__init__(config, parts, _base_parts(config, parts, parts.embed))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.run(input_ids, self.names)


class GPT2Embedding(_Parts):
    """GPT-2's token embedding plus learned absolute positions (`position_ids`), dropout."""

    def __init__(self, config: Any, parts: Arch) -> None:
        super().__init__(config, parts, _base_parts(config, parts, parts.embed))

    def forward(self, input_ids: torch.Tensor, *,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = _position_ids(input_ids, position_ids)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class Head(_Parts):
    """Hidden (B, T, d) -> logits (B, T, V): the final norm and the output projection."""

    def __init__(self, config: Any, parts: Arch) -> None:
        modules = _base_parts(config, parts, parts.norm)
        with torch.device("meta"):
            modules[parts.head] = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        super().__init__(config, parts, modules)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.run(hidden, self.names)


def _position_ids(x: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    if position_ids is not None:
        return position_ids
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _attention_kind(config: Any, index: int) -> str:
    """Which mask block `index` attends under, as the base model's forward decides it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    if getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"      # Mistral: every layer, when the config sets a window
    return "full_attention"


class DecoderLayer(nn.Module):
    """One transformers decoder block; builds its mask, positions and rotary cos/sin locally.

    The block is `self.layer` (so its keys read `"{i}.layer.self_attn.q_proj.weight"`). The
    rotary embedding is kept outside the module tree: no cast (`.to(bfloat16)`, a precision
    policy) reaches its fp32 `inv_freq`; it follows the hidden states' device on first use.
    """

    def __init__(self, config: Any, parts: Arch, index: int) -> None:
        super().__init__()
        self.config = config
        self.index = index
        with torch.device("meta"):
            block = parts.block(config, layer_idx=index)
        self.layer = _materialize(block, config, parts)
        self.kind = _attention_kind(config, index)
        self._rotary = (None if parts.rotary is None else parts.rotary(config=config),)

    def _mask(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor) -> torch.Tensor | None:
        masking = _transformers().masking_utils
        make = (masking.create_sliding_window_causal_mask if self.kind == "sliding_attention"
                else masking.create_causal_mask)
        return make(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                    cache=None, position_ids=position_ids)

    def _rotary_embeddings(self, hidden: torch.Tensor,
                           position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self._rotary[0]
        if rotary.inv_freq.device != hidden.device:
            rotary.to(hidden.device)          # a device move only: inv_freq stays fp32
        return rotary(hidden, position_ids)

    def forward(self, hidden: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        position_ids = _position_ids(hidden, position_ids)
        extra = {}
        if self._rotary[0] is not None:
            extra["position_embeddings"] = self._rotary_embeddings(hidden, position_ids)
        out = self.layer(hidden, attention_mask=self._mask(hidden, attention_mask, position_ids),
                         position_ids=position_ids, **extra)
        return out[0] if isinstance(out, tuple) else out


# -- state dicts ---------------------------------------------------------------------------

def _key_map(config: Any) -> dict[str, str]:
    """HF key prefix -> pipeflow key prefix, one entry a submodule."""
    parts = arch(config)
    n = config.num_hidden_layers
    pairs = {f"{parts.prefix}{name}.": f"0.{name}." for name in parts.embed}
    pairs.update({f"{parts.prefix}{parts.layers}.{i}.": f"{i + 1}.layer." for i in range(n)})
    pairs.update({f"{parts.prefix}{name}.": f"{n + 1}.{name}." for name in parts.norm})
    pairs[f"{parts.head}."] = f"{n + 1}.{parts.head}."
    return pairs


def _rename(state: dict[str, Any], pairs: dict[str, str], what: str) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        prefix = next((p for p in pairs if key.startswith(p)), None)
        if prefix is None:
            raise KeyError(f"{what}: key {key!r} belongs to no layer; expected keys starting "
                           f"with one of {sorted(pairs)[:6]}... (is the config the model's?)")
        out[pairs[prefix] + key[len(prefix):]] = value
    return out


def _tied_keys(config: Any) -> tuple[str, str] | None:
    """(embedding weight, head weight) HF keys when the config ties them, else None."""
    if not getattr(config, "tie_word_embeddings", False):
        return None
    parts = arch(config)
    return f"{parts.prefix}{parts.embed[0]}.weight", f"{parts.head}.weight"


def from_hf_state_dict(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """A transformers causal LM's state dict, keyed as `build_sequential(causal_lm_layers(config))`.

    A tied head missing from `state` (checkpoints often store the embedding only) is filled
    with the embedding's weight.
    """
    state = dict(state)
    tied = _tied_keys(config)
    if tied is not None and tied[1] not in state and tied[0] in state:
        state[tied[1]] = state[tied[0]]
    return _rename(state, _key_map(config), "from_hf_state_dict")


def to_hf_state_dict(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """The inverse of `from_hf_state_dict`: pipeflow keys back to the transformers model's keys."""
    inverse = {v: k for k, v in _key_map(config).items()}
    out = _rename(state, inverse, "to_hf_state_dict")
    tied = _tied_keys(config)
    if tied is not None and tied[1] not in out and tied[0] in out:
        out[tied[1]] = out[tied[0]]
    return out


# -- loss ----------------------------------------------------------------------------------

def _shifted(labels: torch.Tensor) -> torch.Tensor:
    # Position t predicts token t+1; the last position predicts nothing.
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal LM loss summed over tokens: shift by one, ignore `IGNORE_INDEX` (-100).

    Divide by `num_valid_tokens` of the whole batch for the token mean of the whole batch.
    """
    target = _shifted(labels).to(logits.device).reshape(-1)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target,
                           ignore_index=IGNORE_INDEX, reduction="sum")


def num_valid_tokens(labels: torch.Tensor) -> int:
    """The number of tokens `causal_lm_loss_sum` counts: shifted labels not `IGNORE_INDEX`."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal LM loss (`model(ids, labels=labels).loss`): the mean over valid tokens."""
    target = _shifted(labels).to(logits.device).reshape(-1)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target,
                           ignore_index=IGNORE_INDEX)
