"""Hugging Face causal language models (GPT-2, Llama, Mixtral and 25 more) as layer lists.

`causal_lm_layers(config)` turns a `transformers` config into `LayerSpec`s that any pipeline
grid can split: an embedding layer (token ids -> hidden), one layer per decoder block
(hidden -> hidden) and a head (final norm + `lm_head` -> logits). The blocks are transformers'
own modules, built from the config with SDPA attention (eager where the family refuses SDPA)
and initialised by the model class's own `_init_weights`. What a block needs besides the
hidden states (the causal + padding mask, position ids, rotary cos/sin, ALiBi) it builds
locally from the side inputs `attention_mask` (B, T) and `position_ids` (B, T), so nothing but
the hidden states crosses a stage boundary (and, for a mixture of experts with its
load-balancing loss on, three running sums: `pipeflow.models.hf_moe`).

Only the families of `hf_families.FAMILIES` build, each compared with transformers in
tests/test_hf.py; any other model type is refused with the list of those supported.

`from_hf_state_dict` / `to_hf_state_dict` map weights between the two key spaces, so a model
from `transformers` trains in a pipeline and comes back. `transformers` is an optional extra
(`pip install -e ".[hf]"`), imported only when a function here needs it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import sys
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from pipeflow.aux_loss import add_aux_loss
from pipeflow.layers import LayerSpec
from pipeflow.models import hf_checkpoint, hf_families, hf_moe, hf_tensor
from pipeflow.runtime.kv_cache import POSITIONS, KeyValues
from pipeflow.runtime.tensor_parallel import cross_entropy
from pipeflow.models.hf_families import (FAMILIES, Family, family, local_name, positions,
                                         refusal, submodule)

__all__ = ["causal_lm_layers", "from_hf_state_dict", "to_hf_state_dict", "memory_layout",
           "pipeflow_keys", "causal_lm_loss",
           "causal_lm_loss_sum", "num_valid_tokens", "Embedding", "DecoderLayer", "Head",
           "Arch", "arch", "refusal", "supported_model_types", "attention_implementation",
           "decode_cache", "IGNORE_INDEX", "TIE_KEY"]

IGNORE_INDEX = -100     # labels with this value count for no loss (HF's convention)
TIE_KEY = "wte"         # the tie key of the input embedding and the output head


def supported_model_types() -> tuple[str, ...]:
    """The model types `causal_lm_layers` builds, each checked against transformers in
    tests/test_hf.py (logits with and without padding, SGD and AdamW steps)."""
    return tuple(sorted(FAMILIES))


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
    family: Family             # what its base model does besides the blocks (hf_families)
    causal_lm: type            # e.g. LlamaForCausalLM: its `_init_weights` initialises
    base: type                 # e.g. LlamaModel: built on the meta device to find the parts
    prefix: str                # "model." / "transformer.": the base model in HF's keys
    embed: tuple[str, ...]     # base submodules before the blocks, in order (dotted paths)
    layers: str                # the ModuleList of blocks (dotted path)
    norm: tuple[str, ...]      # base submodules after the blocks (dotted paths)
    head: str                  # the output projection on the causal LM ("lm_head")
    block: type                # the decoder block class
    rotary: type | None        # the rotary embedding class, None where positions are not rotary
    router: tuple[type, int] | None   # MoE router class, index of its logits in its output

    def __repr__(self) -> str:
        return f"Arch({self.model_type})"


def arch(config: Any) -> Arch:
    """The classes and submodule names of `config`'s causal LM, from transformers' mappings.

    A ValueError for a model type or config pipeflow does not build (`refusal` says why).
    """
    rows = family(config)
    auto = _transformers().models.auto.modeling_auto
    causal_lm = auto.AutoModelForCausalLM._model_mapping.get(type(config), None)
    base = auto.AutoModel._model_mapping.get(type(config), None)
    if causal_lm is None or base is None:   # pragma: no cover - every family has both
        raise ValueError(f"{type(config).__name__} (model_type {config.model_type!r}) has no "
                         f"causal LM in transformers' auto mappings")
    plan = list(rows.plan or getattr(type(config), "base_model_pp_plan", None) or ())
    meta = _meta_base(base, config)
    plan = [name for name in plan if submodule(meta, name) is not None]
    lists = [n for n in plan if isinstance(submodule(meta, n), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"{config.model_type}: expected a pipeline plan naming one list of "
                         f"blocks (the config's base_model_pp_plan, or hf_families' plan), "
                         f"found {plan}")
    cut = plan.index(lists[0])
    rotary = getattr(meta, "rotary_emb", None)
    return Arch(config.model_type, rows, causal_lm, base, causal_lm.base_model_prefix + ".",
                tuple(plan[:cut]), lists[0], tuple(plan[cut + 1:]),
                next(iter(getattr(causal_lm, "_pp_plan", None) or {"lm_head": None})),
                getattr(sys.modules[causal_lm.__module__], causal_lm._no_split_modules[0]),
                None if rotary is None else type(rotary), hf_moe.router_class(base))


def _meta_base(base: type, config: Any) -> nn.Module:
    """The base model without blocks, on the meta device: its parts, no memory, no init."""
    empty = copy.deepcopy(config)
    empty.num_hidden_layers = 0
    with torch.device("meta"):
        return base(empty)


def _meta_head(config: Any, parts: Arch) -> nn.Module:
    """The causal LM's output projection (with its bias, where it has one), on meta."""
    empty = copy.deepcopy(config)
    empty.num_hidden_layers = 0
    with torch.device("meta"):
        return getattr(parts.causal_lm(empty), parts.head)


def _with_attention(config: Any, parts: Arch) -> Any:
    config = copy.deepcopy(config)
    config._attn_implementation = parts.family.attention_for(config)
    if parts.router is not None:    # the experts' kernels transformers' own model would choose
        chosen = _meta_base(parts.base, config).config._experts_implementation
        config._experts_implementation = chosen
    return config


def attention_implementation(config: Any) -> str:
    """The attention the blocks of `config`'s model run ("sdpa", or "eager" for Gemma2,
    Bloom, GPT-OSS and a soft-capped Gemma3); give transformers the same to compare."""
    return family(config).attention_for(config)


def causal_lm_layers(config: Any) -> list[LayerSpec]:
    """The causal LM of a transformers `config` as pipeflow layers: embedding, blocks, head.

    Layer 0 takes token ids (B, T) int64; layers 1..n are the decoder blocks, hidden (B, T, d)
    in and out; the last layer returns logits (B, T, V). Every layer reads the side inputs
    `attention_mask` (B, T; 1 = token, 0 = padding) and `position_ids` (B, T; default 0..T-1)
    by keyword where its family needs them. With `config.tie_word_embeddings` the head's
    weight is the embedding's (tie key "wte").

    With a mixture of experts and `config.output_router_logits`, the activations between
    layers are `(hidden, sums)` (see `pipeflow.models.hf_moe`) and the head adds
    `router_aux_loss_coef x` transformers' load-balancing loss through `pf.add_aux_loss`.

    A model type not in `supported_model_types()`, or a config of one that pipeflow does not
    reproduce, is a ValueError saying which and why.
    """
    parts = arch(config)
    config = _with_attention(config, parts)
    embed = LayerSpec(Embedding, config, parts)
    head = LayerSpec(Head, config, parts)
    if getattr(config, "tie_word_embeddings", False):
        embed.tie(TIE_KEY, f"{local_name(parts.embed[0])}.weight")
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
    return {local_name(name): submodule(meta, name) for name in names}


def _split(x: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """(hidden, MoE sums) from what crosses a layer boundary: hidden alone, or the pair."""
    if isinstance(x, tuple):
        return x
    return x, None


class _Parts(nn.Module):
    """A layer made of named base-model submodules, named as in the base model."""

    def __init__(self, config: Any, parts: Arch, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.family = parts.family
        self.names = tuple(modules)
        self.aux = hf_moe.aux_loss_on(config, parts)
        for name, module in modules.items():
            self.add_module(name, module)
        _materialize(self, config, parts)

    def run(self, x: Any, names: Iterable[str]) -> Any:
        for name in names:
            x = getattr(self, name)(x)
        return x


class Embedding(_Parts):
    """Token ids (B, T) -> hidden (B, T, d): the base model's steps before the blocks.

    With the MoE load-balancing loss on, (hidden, zero sums) (`hf_moe.initial_state`).
    """

    def __init__(self, config: Any, parts: Arch) -> None:
        super().__init__(config, parts, _base_parts(config, parts, parts.embed))
        # Learned absolute positions (GPT-2, OPT) end somewhere: generation crops to them.
        learned = any(hasattr(self, name) for name in ("wpe", "embed_positions"))
        self.max_positions = getattr(config, "max_position_embeddings", None) if learned \
            else None

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Any:
        hidden = self.family.embed(self, input_ids, attention_mask, position_ids)
        if self.aux:
            return hidden, hf_moe.initial_state(self.config, self.family.experts,
                                                hidden.device)
        return hidden

    def decode(self, input_ids: torch.Tensor, cache: dict, position: int) -> Any:
        """Generation (`engine.generate`): tokens (B, T) that start at `position`."""
        return self.forward(input_ids, position_ids=_positions_from(input_ids, position))


class Head(_Parts):
    """Hidden (B, T, d) -> logits (B, T, V): the final norm, the output projection and the
    family's logit step (Cohere's scale, Granite's divisor, Gemma2's soft-cap).

    Given (hidden, MoE sums), it adds `router_aux_loss_coef x` the load-balancing loss with
    `pf.add_aux_loss` and returns the logits alone.
    """

    def __init__(self, config: Any, parts: Arch) -> None:
        modules = _base_parts(config, parts, parts.norm)
        modules[parts.head] = _meta_head(config, parts)
        super().__init__(config, parts, modules)

    def decode(self, hidden: Any, cache: dict, position: int) -> torch.Tensor:
        """Generation: position by position, nothing to keep (no load-balancing loss)."""
        return self.forward(_split(hidden)[0])

    def forward(self, hidden: Any) -> torch.Tensor:
        hidden, sums = _split(hidden)
        logits = self.run(hidden, self.names)
        if self.family.logits is not None:
            logits = self.family.logits(self.config, logits)
        if sums is not None:
            add_aux_loss(self.config.router_aux_loss_coef * hf_moe.balance_loss(sums))
        return logits


class DecoderLayer(nn.Module):
    """One transformers decoder block; builds its mask, positions and rotary cos/sin locally.

    The block is `self.layer` (so its keys read `"{i}.layer.self_attn.q_proj.weight"`). The
    rotary embedding is kept outside the module tree: no cast (`.to(bfloat16)`, a precision
    policy) reaches its fp32 tables; it follows the hidden states' device on first use.
    Given (hidden, MoE sums), it returns (hidden, the sums plus its router's contribution).
    """

    def __init__(self, config: Any, parts: Arch, index: int) -> None:
        super().__init__()
        self.config = config
        self.index = index
        self.family = parts.family
        self.router = parts.router
        self.modeling = sys.modules[parts.block.__module__]
        with torch.device("meta"):
            block = parts.block(config, layer_idx=index)
        self.layer = _materialize(block, config, parts)
        self.kind = parts.family.kind(config, index)   # as the family's base forward chooses
        self._rotary = (None if parts.rotary is None else parts.rotary(config=config),)
        self.decodes = parts.family.cache is not None    # a key/value cache for generation
        plan = hf_tensor.plan(config)
        if plan is not None:
            self.tp_plan = plan           # runtime.tensor_parallel cuts it at tensor > 1
        else:
            self.tp_refusal = hf_tensor.refusal(config)

    def tp_after_cut(self, group: Any) -> None:
        """runtime.tensor_parallel, once the plan has cut the block: the family's fix-ups."""
        hf_tensor.localize(self, group)

    @property
    def rotary(self) -> nn.Module | None:
        return self._rotary[0]

    def _mask(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor, cache: Any = None) -> torch.Tensor | None:
        masking = _transformers().masking_utils
        make = (masking.create_sliding_window_causal_mask if self.kind == "sliding_attention"
                else masking.create_causal_mask)
        # With a cache, sized against this block's own entry (each block keeps its own).
        where = {} if cache is None else {"layer_idx": self.index}
        return make(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                    cache=cache, position_ids=position_ids, **where)

    def decode(self, hidden: Any, cache: dict, position: int) -> Any:
        """Generation (`engine.generate`): the block on new positions starting at `position`,
        its keys and values kept in a transformers `DynamicCache` in `cache`, this block's
        entry preallocated to the call's positions (`decode_cache`)."""
        hidden, sums = _split(hidden)
        kv = cache.get("kv")
        if kv is None:
            kv = cache["kv"] = decode_cache(self.config, self.index, cache.get(POSITIONS))
        position_ids = _positions_from(hidden, position)
        # No padding: every position so far is seen (Bloom sizes its ALiBi biases by it).
        seen = torch.ones(hidden.shape[0], position + hidden.shape[1], dtype=torch.long,
                          device=hidden.device)
        extra = self.family.block_inputs(self, hidden, seen, position_ids)
        extra[self.family.cache] = kv
        mask = self._mask(hidden, None, position_ids, kv)
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                         use_cache=True, **extra)
        out = out[0] if isinstance(out, tuple) else out
        return out if sums is None else (out, sums)

    def rotary_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                          *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's output for `position_ids` (and the family's further
        arguments: Gemma3's layer type), on the hidden states' device."""
        rotary = self.rotary
        table = next(rotary.buffers())           # inv_freq, or GPT-J's sin/cos table
        if table.device != hidden.device:
            rotary.to(hidden.device)             # a device move only: the table stays fp32
        return rotary(hidden, position_ids, *args)

    def forward(self, hidden: Any, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Any:
        hidden, sums = _split(hidden)
        whole = _whole_sequence(self, hidden)     # what the mask and positions are made for
        position_ids = positions(whole, position_ids)
        extra = self.family.block_inputs(self, whole, attention_mask, position_ids)
        mask = self._mask(whole, attention_mask, position_ids)
        if sums is None:
            return self._block(hidden, mask, position_ids, extra)
        with hf_moe.capture_router_logits(self.layer, self.router) as routed:
            out = self._block(hidden, mask, position_ids, extra)
        top_k = self.config.num_experts_per_tok      # as the causal LM's loss counts them
        group = getattr(self, "pf_sequence_group", None)     # sequence parallelism
        for logits, _ in routed:
            logits = hf_moe.whole_sequence_logits(logits, hidden, group)
            sums = hf_moe.add_router_logits(sums, logits, top_k, attention_mask)
        return out, sums

    def _block(self, hidden: torch.Tensor, mask: Any, position_ids: torch.Tensor,
               extra: dict[str, Any]) -> torch.Tensor:
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, **extra)
        return out[0] if isinstance(out, tuple) else out


def decode_cache(config: Any, index: int, positions: int | None) -> Any:
    """A transformers `DynamicCache` for block `index` whose entry keeps its keys and values
    in a `KeyValues` of `positions` (written in place, never concatenated); None: the entry
    transformers makes, grown by `torch.cat` each token. A sliding-window block's entry then
    holds every position too, the window applied by its mask."""
    kv = _transformers().DynamicCache(config=config)
    if positions is None:
        return kv
    cache_utils = _transformers().cache_utils
    while len(kv.layers) <= index:              # a config without layer types: grown lazily
        kv.layers.append(cache_utils.DynamicLayer())
    before = kv.layers[index]
    if type(before) in (cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer):
        kv.layers[index] = _preallocated_layer()(positions, before.is_sliding)
    return kv


@functools.cache
def _preallocated_layer() -> type:
    """transformers' `DynamicLayer` over a `KeyValues` (made once: transformers is imported
    only where a function here needs it)."""

    class PreallocatedLayer(_transformers().cache_utils.DynamicLayer):
        """Keys and values written in place into buffers of the call's positions; `keys`
        and `values` are views of the positions filled, as `DynamicLayer`'s tensors are."""

        def __init__(self, positions: int, sliding: bool) -> None:
            super().__init__()
            self.kv = KeyValues(positions)
            self.is_sliding = sliding

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = self.kv.extend(key_states, value_states)
            return self.keys, self.values

    return PreallocatedLayer


def _whole_sequence(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Under sequence parallelism a block receives its rank's slice of the sequence, while
    its mask, positions and rotary tables are the whole sequence's: a stand-in of the whole
    shape (an expanded scalar: no memory) to make them from."""
    group = getattr(layer, "pf_sequence_group", None)
    if group is None:
        return hidden
    b, t, *rest = hidden.shape
    return hidden.new_zeros(()).expand(b, t * group.size, *rest)


def _positions_from(x: torch.Tensor, position: int) -> torch.Tensor:
    """Position ids (1, T) of `x`'s T positions, the first at `position`."""
    return torch.arange(position, position + x.shape[1], device=x.device).unsqueeze(0)


# -- state dicts ---------------------------------------------------------------------------

def _key_map(config: Any) -> dict[str, str]:
    """HF key prefix -> pipeflow key prefix, one entry a submodule."""
    parts = arch(config)
    n = config.num_hidden_layers
    pairs = {f"{parts.prefix}{name}.": f"0.{local_name(name)}." for name in parts.embed}
    pairs.update({f"{parts.prefix}{parts.layers}.{i}.": f"{i + 1}.layer." for i in range(n)})
    pairs.update({f"{parts.prefix}{name}.": f"{n + 1}.{local_name(name)}."
                  for name in parts.norm})
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

    `state` is the model's (`model.state_dict()`) or its checkpoint's as `save_pretrained`
    wrote it (Mixtral's per-expert tensors, GPT-NeoX's `embed_out`): the family's conversions
    are applied first, as `from_pretrained` applies them (`hf_checkpoint`). A tied head missing
    from `state` (checkpoints often store the embedding only) is filled with the embedding's
    weight.
    """
    return pipeflow_keys(memory_layout(state, config), config)


def pipeflow_keys(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """A state in the transformers model's own layout, keyed as `build_sequential`: renamed
    only (a tied head missing from `state` filled with the embedding's entry)."""
    state = dict(state)
    tied = _tied_keys(config)
    if tied is not None and tied[1] not in state and tied[0] in state:
        state[tied[1]] = state[tied[0]]
    return _rename(state, _key_map(config), "from_hf_state_dict")


def memory_layout(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """`state` keyed and shaped as the transformers model holds it: a checkpoint's tensors
    converted as `from_pretrained` converts them, a model's own state unchanged."""
    return hf_checkpoint.to_memory_layout(state, config)


def to_hf_state_dict(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """The inverse of `from_hf_state_dict`: pipeflow keys back to the transformers model's keys
    (the model's own layout, for `model.load_state_dict`; `hf_checkpoint.to_checkpoint` gives
    the layout `save_pretrained` writes)."""
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
    return cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target,
                         ignore_index=IGNORE_INDEX, reduction="sum")


def num_valid_tokens(labels: torch.Tensor) -> int:
    """The number of tokens `causal_lm_loss_sum` counts: shifted labels not `IGNORE_INDEX`."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal LM loss (`model(ids, labels=labels).loss`): the mean over valid tokens."""
    target = _shifted(labels).to(logits.device).reshape(-1)
    return cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target,
                         ignore_index=IGNORE_INDEX)


# Both take logits cut along the vocabulary where a tensor-parallel head gives them.
causal_lm_loss.pipeflow_vocab_parallel = True
causal_lm_loss_sum.pipeflow_vocab_parallel = True
