"""A model of your own for `pipeflow train`: a stacked GRU language model as `LayerSpec`s.

`examples/char_rnn.toml` names `factory = "char_rnn:gru_lm"`; `pipeflow train` calls it with
the `[model]` table's other keys and splits the returned layers over the pipeline stages.
Each layer takes the previous layer's output; the last returns logits [B, T, vocab].
"""

import torch
from torch import nn

import pipeflow as pf


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab_size, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


class GRULayer(nn.Module):
    """One recurrent layer with a residual connection, so deep stacks still train."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.norm(x))
        return x + self.drop(out)


class Readout(nn.Module):
    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def gru_lm(vocab_size: int = 256, width: int = 128, layers: int = 4, dropout: float = 0.0,
           seq_len: int = 64) -> list[pf.LayerSpec]:
    """`layers` residual GRU layers between an embedding and a readout."""
    return [pf.LayerSpec(TokenEmbedding, vocab_size, width),
            *[pf.LayerSpec(GRULayer, width, dropout) for _ in range(layers)],
            pf.LayerSpec(Readout, width, vocab_size)]
