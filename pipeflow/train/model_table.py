"""The `[model]` table of a run → layers, loss and FLOPs per token.

Three kinds:

- `kind = "gpt"` (the default): `pipeflow.models.GPTConfig`'s fields.
- `factory = "package.module:function"`: any model. The function is called with the table's
  other keys as keyword arguments and returns the list of `LayerSpec`s; `loss =
  "package.module:function"` names the loss (default: cross-entropy over the last dimension,
  `gpt_loss`). `seq_len` in the table (or `[data] seq_len`) sets the sample length.
- `kind = "hf"`: a Hugging Face causal LM (`pipeflow.models.hf`, needs `transformers`),
  `config = "path/config.json"` or a `[model.config]` table of the model's config fields.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from pipeflow.config import ConfigError
from pipeflow.layers import LayerSpec
from pipeflow.models import GPTConfig, flops_per_token, gpt_layers, gpt_loss, num_parameters

__all__ = ["Model", "build_model", "import_object"]


@dataclasses.dataclass
class Model:
    """What the training loop needs to know of a model."""

    layers: list[LayerSpec]
    loss_fn: Callable
    name: str                       # for logs
    seq_len: int | None             # tokens per sample, when the model fixes it
    vocab_size: int | None          # largest token id + 1, when known
    flops_per_token: int | None     # None: 6 x the counted parameters


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


def _gpt(table: dict[str, Any]) -> Model:
    try:
        cfg = GPTConfig(**table)
    except TypeError as exc:
        known = sorted(f.name for f in dataclasses.fields(GPTConfig))
        raise ConfigError(f"[model] (kind \"gpt\"): {exc}; known keys: {known}") from None
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


def _hf(table: dict[str, Any]) -> Model:
    try:
        from pipeflow.models import hf   # optional: needs transformers
    except ImportError as exc:
        raise ConfigError(f"[model] kind = \"hf\" needs pipeflow.models.hf and the "
                          f"'transformers' package ({exc}): pip install transformers") from None
    config = table.get("config")
    if isinstance(config, str):
        if not os.path.isfile(config):
            raise ConfigError(f"[model] config = {config!r}: no such file (a Hugging Face "
                              f"config.json, or a [model.config] table)")
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise ConfigError(f"[model] kind = \"hf\" needs config = \"path/config.json\" or a "
                          f"[model.config] table, found {config!r}")
    import transformers
    hf_config = transformers.AutoConfig.for_model(**dict(config))
    seq = getattr(hf_config, "max_position_embeddings", None) or getattr(
        hf_config, "n_positions", None)
    return Model(list(hf.causal_lm_layers(hf_config)), gpt_loss,
                 f"Hugging Face {hf_config.model_type}", table.get("seq_len", seq),
                 getattr(hf_config, "vocab_size", None), None)


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
