"""transformers' checkpoint layout in and out: the conversions `from_pretrained` applies to the
files of a folder and `save_pretrained` reverses when it writes one.

A model in memory and its checkpoint do not always have the same keys. transformers 5 merges
Mixtral's, PhiMoE's and Qwen2-MoE's per-expert tensors (`block_sparse_moe.experts.3.w1.weight`,
`mlp.experts.3.gate_proj.weight` on disk) into one `mlp.experts.gate_up_proj` in memory, renames
GPT-NeoX's `embed_out` to `lm_head`, and so on, each family by its own conversion mapping
(`transformers.conversion_mapping`). pipeflow takes that mapping as transformers holds it:

- `load_plan(file_keys, config)`: which checkpoint keys make each in-memory key, so a rank reads
  only the files' tensors of its own layers, and `realize` turns them into the in-memory tensor
  as `from_pretrained` would (experts merged in index order);
- `to_checkpoint(state, config)`: the in-memory state as `save_pretrained` writes it
  (`revert_weight_conversion`), so tools that read the files see the usual checkpoint.

The conversions need only a model's structure: they are read from the causal LM built on the
meta device (no memory, no initialisation).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable, Mapping

import torch
from torch import nn

__all__ = ["Source", "load_plan", "renamed_key", "realize", "to_memory_layout", "to_checkpoint"]


@dataclasses.dataclass
class Source:
    """The checkpoint tensors one in-memory tensor is made of: `keys` (in the order
    transformers collects them) and the converter that combines them (None: a renamed key)."""

    keys: list[str]
    patterns: list[str]
    converter: Any = None


def _meta_model(config: Any) -> nn.Module:
    """The causal LM of `config` on the meta device: its conversions and its key set. Its
    class comes from transformers' auto mapping, as `from_pretrained` finds it (this module
    needs nothing of `pipeflow.models.hf`, which imports it)."""
    from transformers import AutoModelForCausalLM
    causal_lm = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if causal_lm is None:
        raise ValueError(f"{type(config).__name__} (model_type "
                         f"{getattr(config, 'model_type', '?')!r}) has no causal LM in "
                         f"transformers' auto mappings")
    with torch.device("meta"):
        return causal_lm(copy.deepcopy(config))


def _split(conversions: list) -> tuple[list, list]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    return ([c for c in conversions if isinstance(c, WeightRenaming)],
            [c for c in conversions if isinstance(c, WeightConverter)])


def load_plan(file_keys: Iterable[str], config: Any) -> tuple[dict[str, Source], nn.Module]:
    """In-memory key -> its `Source` among `file_keys`, as `from_pretrained` groups them; and
    the meta model `realize` needs. A file key that makes no in-memory key maps to itself
    (`from_hf_state_dict` then names it)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import dot_natural_key, rename_source_key
    model = _meta_model(config)
    renamings, converters = _split(get_model_conversion_mapping(model))
    known = {k: True for k in model.state_dict()}
    plan: dict[str, Source] = {}
    for key in sorted(file_keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters,
                                            model.base_model_prefix, known)
        if target not in known and key in known:     # as transformers: the key as it is
            target, pattern = key, None
        if target not in known:
            target, pattern = key, None
        converter = None
        if pattern is not None:
            converter = next(c for c in converters if pattern in c.source_patterns)
        source = plan.setdefault(target, Source([], [], converter))
        source.keys.append(key)
        source.patterns.append(pattern if pattern is not None else key)
    return plan, model


def renamed_key(target: str, source: Source) -> str:
    """The one checkpoint key whose tensor is `target` as it is (a `source` without a
    converter: renamed at most), or a ValueError."""
    if len(source.keys) != 1:
        raise ValueError(f"checkpoint keys {source.keys} all load into {target!r}; expected "
                         f"one (does the folder hold the same tensor twice?)")
    return source.keys[0]


def realize(target: str, source: Source, tensors: Mapping[str, torch.Tensor],
            model: nn.Module) -> dict[str, torch.Tensor]:
    """The in-memory tensor(s) of `target` from its checkpoint tensors (`tensors[key]` for
    each of `source.keys`), converted as `from_pretrained` converts them."""
    if source.converter is None:
        return {target: tensors[renamed_key(target, source)]}
    converter = copy.deepcopy(source.converter)
    for key, pattern in zip(source.keys, source.patterns):
        converter.add_tensor(target, key, pattern, tensors[key])
    out = converter.convert(target, model=model, config=model.config)
    return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


def to_memory_layout(state: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A whole checkpoint's tensors (as the files hold them, or already as the model holds
    them: then unchanged) keyed and shaped as the transformers model holds them."""
    plan, model = load_plan(state, config)
    order = {key: i for i, key in enumerate(state)}          # the caller's order kept
    out: dict[str, torch.Tensor] = {}
    for target, source in sorted(plan.items(), key=lambda kv: order[kv[1].keys[0]]):
        out.update(realize(target, source, state, model))
    return out


def to_checkpoint(state: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The model's in-memory state (transformers' keys) as `save_pretrained` writes it: the
    family's conversions reversed (experts split again, renames undone)."""
    from transformers.core_model_loading import revert_weight_conversion
    return dict(revert_weight_conversion(_meta_model(config), dict(state)))
