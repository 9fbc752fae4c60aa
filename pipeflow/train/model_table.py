"""The `[model]` table of a run → layers, loss and FLOPs per token.

Three kinds:

- `kind = "gpt"` (the default): `pipeflow.models.GPTConfig`'s fields.
- `factory = "package.module:function"`: any model. The function is called with the table's
  other keys as keyword arguments and returns the list of `LayerSpec`s; `loss =
  "package.module:function"` names the loss (default: cross-entropy over the last dimension,
  `gpt_loss`). `seq_len` in the table (or `[data] seq_len`) sets the sample length.
- `kind = "hf"`: a Hugging Face causal LM (`pipeflow.models.hf`, needs `transformers`):
  `pretrained = "folder"` (a Hub folder: `config.json` and safetensors weights, each rank
  reading only its own layers' tensors, `pipeflow.train.hub`), or `config =
  "folder/config.json"` (or the folder) or a `[model.config]` table of the config's fields for
  a random initialisation.

Every kind refuses a key it does not know, naming the known keys and the closest one.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
import sys
from typing import Any, Callable, Mapping, Sequence

import torch

from pipeflow.config import ConfigError
from pipeflow.layers import LayerSpec
from pipeflow.models import GPTConfig, flops_per_token, gpt_layers, gpt_loss, num_parameters

__all__ = ["Model", "build_model", "import_object", "check_keys", "hf_config_of", "HF_KEYS"]


@dataclasses.dataclass
class Model:
    """What the training loop needs to know of a model."""

    layers: list[LayerSpec]
    loss_fn: Callable
    name: str                       # for logs
    seq_len: int | None             # tokens per sample, when the model fixes it
    vocab_size: int | None          # largest token id + 1, when known
    flops_per_token: int | None     # None: 6 x the counted parameters
    hf_config: Any = None           # kind "hf": the transformers config
    pretrained: str = ""            # kind "hf": the Hub folder whose weights the run starts from
    hf_source: str = ""             # kind "hf": the folder of its config.json (tokenizer, ...)
    notes: list[str] = dataclasses.field(default_factory=list)   # for the log, on rank 0


def import_object(spec: str, what: str, search: Sequence[str] = ()) -> Any:
    """`package.module:name` → the object, or a ConfigError that says what to change.

    Modules are looked up on `sys.path`, then in the `search` folders (the config file's
    folder and the working directory), so a model file beside the config just works.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"[model] {what} must look like \"package.module:function\", found "
                          f"{spec!r}")
    for folder in search:
        if folder not in sys.path:
            sys.path.append(folder)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"[model] {what} = {spec!r}: cannot import module {module_name!r} "
                          f"({exc}); is it installed or on PYTHONPATH?") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"[model] {what} = {spec!r}: module {module_name!r} has no "
                          f"{attr!r}") from None


def check_keys(table: Mapping[str, Any], known: Sequence[str], kind: str) -> None:
    """Every key of the `[model]` table is one `kind` reads: a typo (`n_layerz`) is refused
    with the known keys and the closest match, never silently ignored."""
    for key in table:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"[model] (kind \"{kind}\"): unknown key {key!r}; {hint}known keys: "
                          f"{sorted(known)}; fix or remove it in the [model] table")


def _gpt(table: dict[str, Any]) -> Model:
    check_keys(table, [f.name for f in dataclasses.fields(GPTConfig)], "gpt")
    try:
        cfg = GPTConfig(**table)
    except TypeError as exc:
        raise ConfigError(f"[model] (kind \"gpt\"): {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"[model] (kind \"gpt\"): {exc}") from None
    return Model(gpt_layers(cfg), gpt_loss,
                 f"GPT of {num_parameters(cfg) / 1e6:.2f}M parameters", cfg.seq_len,
                 cfg.vocab_size, flops_per_token(cfg))


def _factory(table: dict[str, Any], search: Sequence[str]) -> Model:
    fn = import_object(table.pop("factory"), "factory", search)
    loss = import_object(table.pop("loss"), "loss", search) if "loss" in table else gpt_loss
    try:
        layers = fn(**table)
    except TypeError as exc:
        raise ConfigError(f"[model] factory {fn.__qualname__} does not take the table's keys "
                          f"{sorted(table)}: {exc}") from None
    if (not isinstance(layers, (list, tuple)) or not layers
            or not all(isinstance(s, LayerSpec) for s in layers)):
        raise ConfigError(f"[model] factory {fn.__qualname__} must return a non-empty list of "
                          f"pipeflow.LayerSpec, found {type(layers).__name__}")
    return Model(list(layers), loss, f"{fn.__module__}.{fn.__qualname__}",
                 table.get("seq_len"), table.get("vocab_size"), None)


HF_KEYS = ("config", "pretrained", "seq_len")


def _hf(table: dict[str, Any]) -> Model:
    try:
        from pipeflow.models import hf   # optional: needs transformers
    except ImportError as exc:
        raise ConfigError(f"[model] kind = \"hf\" needs pipeflow.models.hf and the "
                          f"'transformers' package ({exc}): pip install transformers") from None
    check_keys(table, HF_KEYS, "hf")
    config, notes = _hf_config_dict(table)
    pretrained = table.get("pretrained", "")
    hf_config = hf_config_of(config)
    if pretrained:
        notes += _untie_as_transformers_does(hf_config, pretrained)
    try:
        layers = list(hf.causal_lm_layers(hf_config))
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"[model] kind = \"hf\": {exc}") from None
    seq = getattr(hf_config, "max_position_embeddings", None) or getattr(
        hf_config, "n_positions", None)
    name = f"Hugging Face {hf_config.model_type}" + (f" from {pretrained}" if pretrained else "")
    return Model(layers, gpt_loss, name, table.get("seq_len", seq),
                 getattr(hf_config, "vocab_size", None), None, hf_config=hf_config,
                 pretrained=pretrained, hf_source=_source_folder(table), notes=notes)


def hf_config_of(fields: Mapping[str, Any]) -> Any:
    """The transformers config of a config.json's fields; a model type pipeflow does not
    build is refused first, in one line naming it and the supported ones (transformers' own
    validation of, say, a Mamba2 config never runs)."""
    import transformers

    from pipeflow.models import hf
    model_type = fields.get("model_type")
    if model_type not in hf.supported_model_types():
        raise ConfigError(f"[model] kind = \"hf\": model_type {model_type!r} is not supported "
                          f"by pipeflow.models.hf; supported: "
                          f"{', '.join(hf.supported_model_types())}")
    from huggingface_hub.errors import StrictDataclassError   # transformers' validation
    try:
        return transformers.AutoConfig.for_model(**dict(fields))
    except (StrictDataclassError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"[model] kind = \"hf\": transformers refuses this "
                          f"{model_type} config ({type(exc).__name__}: {exc})") from None


def _source_folder(table: Mapping[str, Any]) -> str:
    """The folder whose non-weight files (tokenizer, generation config) exports carry: the
    pretrained folder, or the folder of `config = "..."`; empty for a [model.config] table."""
    pretrained, config = table.get("pretrained"), table.get("config")
    if pretrained:
        return pretrained
    if isinstance(config, str):
        return config if os.path.isdir(config) else (os.path.dirname(config) or ".")
    return ""


def _untie_as_transformers_does(hf_config: Any, folder: str) -> list[str]:
    """A config that ties the head to the embedding while the folder's weights store a head
    of other values: transformers (5) then loads the two untied ("both are present in the
    checkpoints with different values, so we will NOT tie them"), and so does pipeflow, or
    the run would train another model than `from_pretrained(folder)` gives. The note says so."""
    from pipeflow.models import hf
    from pipeflow.train import hub
    tied = hf._tied_keys(hf_config)
    if tied is None:
        return []
    index = hub.weight_index(folder)
    embed_key, head_key = tied
    if head_key not in index or embed_key not in index:
        return []
    embed, head = (hub.read_tensor(index[k], k) for k in tied)
    if embed.shape == head.shape and torch.equal(embed, head):
        return []
    hf_config.tie_word_embeddings = False
    return [f"pipeflow: [model] pretrained = {folder!r}: config.json ties {head_key} to "
            f"{embed_key} (tie_word_embeddings = true) but the weights store a different "
            f"{head_key}; loaded untied, as transformers does (set \"tie_word_embeddings\": "
            f"false in config.json to say so, or remove {head_key} from the weights to tie)"]


def _hf_config_dict(table: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[str]]:
    """The config's fields from `pretrained = "folder"`, `config = "folder"` or
    `".../config.json"`, or a `[model.config]` table; and notes for the log."""
    from pipeflow.train import hub
    pretrained, config = table.get("pretrained"), table.get("config")
    if pretrained is not None:
        if config is not None:
            raise ConfigError(f"[model] pretrained = {pretrained!r} and config = {config!r} "
                              f"both name the model; keep pretrained (its folder holds "
                              f"config.json) and remove config")
        if not isinstance(pretrained, str) or not os.path.isdir(pretrained):
            raise ConfigError(f"[model] pretrained = {pretrained!r}: expected a folder with "
                              f"config.json and model.safetensors (or its sharded index), as "
                              f"save_pretrained writes; found no such folder")
        try:
            hub.weight_index(pretrained)
        except ValueError as exc:
            raise ConfigError(f"[model] pretrained: {exc}") from None
        return _read_json(os.path.join(pretrained, "config.json"), "pretrained"), []
    if isinstance(config, str):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        notes = []
        if hub.has_weights(os.path.dirname(path) or "."):
            folder = os.path.dirname(path) or "."
            notes.append(f"pipeflow: [model] config = {config!r} is config only: random "
                         f"initialisation; use pretrained = {folder!r} to load the weights "
                         f"of that folder")
        return _read_json(path, "config"), notes
    if not isinstance(config, Mapping):
        raise ConfigError(f"[model] kind = \"hf\" needs pretrained = \"folder\", config = "
                          f"\"path/config.json\" (or its folder) or a [model.config] table, "
                          f"found config = {config!r}")
    return config, []


def _read_json(path: str, key: str) -> Mapping[str, Any]:
    """A Hugging Face config.json as a dict; a ConfigError naming `[model] key` otherwise."""
    if not os.path.isfile(path):
        raise ConfigError(f"[model] {key}: {path!r}: no such file; expected a Hugging Face "
                          f"config.json (or a folder holding one)")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"[model] {key}: cannot read {path!r} as JSON ({exc}); expected a "
                          f"Hugging Face config.json") from None
    if not isinstance(config, Mapping) or "model_type" not in config:
        raise ConfigError(f"[model] {key}: {path!r} has no \"model_type\"; expected a "
                          f"Hugging Face config.json (as save_pretrained writes)")
    return config


def build_model(table: Mapping[str, Any], config_path: str = "") -> Model:
    """The `[model]` table as a `Model`; errors name the key and what to change.

    `config_path`: the run's TOML file; its folder is searched for a factory's module.
    """
    search = [os.path.dirname(os.path.abspath(config_path))] if config_path else []
    search.append(os.getcwd())
    table = dict(table)
    kind = table.pop("kind", None)
    if "factory" in table and kind in (None, "factory"):
        return _factory(table, search)
    if kind in (None, "gpt"):
        return _gpt(table)
    if kind == "hf":
        return _hf(table)
    raise ConfigError(f"[model] kind must be \"gpt\", \"hf\" or absent with factory = "
                      f"\"package.module:function\", found {kind!r}")
