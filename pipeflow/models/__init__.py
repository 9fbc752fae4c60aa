"""Ready-made models, each a list of `LayerSpec`s that any pipeline grid can split.

`pipeflow.models.hf` (import it by name; needs the `hf` extra) does the same for Hugging Face
`transformers` causal LMs. The names load on first use: the shape and its formulas
(`gpt_shape`) need no torch, so the planner reads them without importing it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GPTConfig", "Embedding", "Block", "Head", "gpt_layers", "gpt_loss",
           "layer_parameters", "num_parameters", "flops_per_token"]
_SHAPE = {"GPTConfig", "layer_parameters", "num_parameters", "flops_per_token"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pipeflow.models' has no attribute {name!r}")
    home = "pipeflow.models.gpt_shape" if name in _SHAPE else "pipeflow.models.gpt"
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
