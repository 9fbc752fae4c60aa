"""Ready-made models, each a list of `LayerSpec`s that any pipeline grid can split.

`pipeflow.models.hf` (import it by name; needs the `hf` extra) does the same for Hugging Face
`transformers` causal LMs.
"""

from pipeflow.models.gpt import (Block, Embedding, GPTConfig, Head, flops_per_token,
                                 gpt_layers, gpt_loss, layer_parameters, num_parameters)

__all__ = ["GPTConfig", "Embedding", "Block", "Head", "gpt_layers", "gpt_loss",
           "layer_parameters", "num_parameters", "flops_per_token"]
