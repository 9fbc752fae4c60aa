"""Models named by `[model] factory = "factory_models:..."` in the training tests."""

import torch
from torch import nn

import pipeflow as pf


class Embed(nn.Module):
    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x)


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 2 * d_model)
        self.proj = nn.Linear(2 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


class Out(nn.Module):
    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def token_mlp(vocab_size: int = 256, d_model: int = 16, n_layers: int = 2,
              seq_len: int = 16) -> list:
    """A token-wise residual MLP language model (no attention): small and fast."""
    return [pf.LayerSpec(Embed, vocab_size, d_model),
            *[pf.LayerSpec(MLP, d_model) for _ in range(n_layers)],
            pf.LayerSpec(Out, d_model, vocab_size)]


def not_a_list(**kwargs):
    return "three layers"


# A run of `token_mlp` as `pipeflow train` reads it; tests format in the grid and the sizes.
RUN_TOML = """
[engine]
pipeline = {pipeline}
data = {data}
microbatches = 2
[model]
factory = "factory_models:token_mlp"
d_model = 16
n_layers = 2
seq_len = 16
[train]
steps = {steps}
batch_size = {batch_size}
lr = 1e-2
warmup = 2
weight_decay = 0.1
log_every = {log_every}
eval_batches = 1
"""
