"""The small GPT's shape and its formulas (parameters, FLOPs): plain arithmetic, no torch, so
the planner and the command line read them without importing torch."""

from __future__ import annotations

import dataclasses

__all__ = ["GPTConfig", "layer_parameters", "num_parameters", "flops_per_token"]


@dataclasses.dataclass
class GPTConfig:
    """The shape of the model. The defaults train on bytes in seconds on one CPU core."""

    n_layers: int = 4          # transformer blocks
    d_model: int = 128         # width of the residual stream
    n_heads: int = 4           # attention heads; d_model / n_heads is the head size
    seq_len: int = 64          # longest context: the number of learned positions
    vocab_size: int = 256      # bytes
    dropout: float = 0.0
    bias: bool = True          # biases in the linear layers and LayerNorms
    tie_embeddings: bool = True  # the output projection is the token embedding (GPT-2)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, found {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); choose n_heads among the divisors of d_model, e.g. "
                f"{[h for h in (1, 2, 4, 8, 16) if self.d_model % h == 0]}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), found {self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig.bias must be true or false, found {self.bias!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def layer_parameters(cfg: GPTConfig) -> dict[str, int]:
    """Parameters of each layer `gpt_layers` builds: the "embed"ding, one "block", the "head".

    Each counts the tables it holds, the tied token matrix in both the embedding and the head:
    a stage holding only one of them keeps its own copy of that matrix.
    """
    d, V, b = cfg.d_model, cfg.vocab_size, int(cfg.bias)
    layer_norm = d + b * d
    block = (2 * layer_norm
             + 3 * d * d + b * 3 * d       # qkv
             + d * d + b * d               # attention projection
             + 4 * d * d + b * 4 * d       # fc
             + 4 * d * d + b * d)          # mlp projection
    return {"embed": V * d + cfg.seq_len * d, "block": block,
            "head": layer_norm + d * V + b * V}


def num_parameters(cfg: GPTConfig, embeddings: bool = True) -> int:
    """Parameter count from the formula (the tests check it against the built model).

    With `embeddings=False` the token and position tables are left out: they are lookups,
    not matrix products, so they cost no FLOPs.
    """
    per = layer_parameters(cfg)
    embedding = per["embed"] - (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)
    return cfg.n_layers * per["block"] + per["head"] + (embedding if embeddings else 0)


def flops_per_token(cfg: GPTConfig) -> int:
    """Training FLOPs per token (forward and backward): `6 N + 12 L d T`.

    `N` counts the parameters that take part in matrix products (all but the embedding
    tables), 2 FLOPs per multiply-add and three passes (forward, backward for activations,
    backward for weights). `12 L d T` is attention's scores and weighted sum (each `2 d T`
    per token and layer, times 3 passes), counted over the full `T x T` square as in the PaLM
    paper (appendix B), although the causal mask lets a kernel skip half of it.
    """
    return (6 * num_parameters(cfg, embeddings=False)
            + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len)
