"""A small GPT (nanoGPT-style) written as a list of `LayerSpec`s: embedding, blocks, head."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from pipeflow.layers import LayerSpec
from pipeflow.runtime.kv_cache import POSITIONS, KeyValues
from pipeflow.runtime.tensor_parallel import Split, cross_entropy
from pipeflow.models.gpt_shape import GPTConfig, flops_per_token, layer_parameters, num_parameters

__all__ = ["GPTConfig", "Embedding", "AttentionCore", "Block", "Head", "gpt_layers",
           "gpt_loss", "layer_parameters", "num_parameters", "flops_per_token"]


def _init_linear(layer: nn.Linear, std: float = 0.02) -> None:
    nn.init.normal_(layer.weight, mean=0.0, std=std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class Embedding(nn.Module):
    """Token ids [B, T] -> hidden states [B, T, d]: token plus learned position embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.max_positions = cfg.seq_len     # learned positions: generation crops to these
        # Tensor-parallel: the vocabulary cut over the tensor ranks (left whole where the
        # degree does not divide it), as the head's.
        self.tp_plan = {"tokens": Split("rowwise", optional=True)}
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        nn.init.normal_(self.tokens.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.positions.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than GPTConfig.seq_len "
                             f"({self.seq_len}); raise seq_len or feed shorter windows")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.tokens(idx) + self.positions(pos))

    def decode(self, idx: torch.Tensor, cache: dict, position: int) -> torch.Tensor:
        """Generation (`engine.generate`): tokens [B, T] that start at `position`."""
        T = idx.shape[1]
        if position + T > self.seq_len:
            raise ValueError(f"generation reached position {position + T}, past "
                             f"GPTConfig.seq_len ({self.seq_len}); generate fewer tokens")
        pos = torch.arange(position, position + T, device=idx.device)
        return self.drop(self.tokens(idx) + self.positions(pos))


class AttentionCore(nn.Module):
    """Fused q, k, v [B, T, 3d] -> causal multi-head attention [B, T, d]; no parameters.

    With dropout, attention keeps its T x T scores, softmax and dropout mask per head for the
    backward: the largest activations of a block at long sequences, yet cheap to recompute
    (no weight matmuls). Marked so that `recompute = "selective"` reruns it in the backward
    instead of storing its insides (Korthikanti et al. 2022).
    """

    pipeflow_selective = True

    def __init__(self, n_heads: int, dropout: float, head_dim: int | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.head_dim = head_dim      # given: the heads are counted from the width it is fed

    def heads(self, d: int) -> int:
        """Heads in a width of `d`: all of them, or (tensor-parallel) this rank's."""
        return d // self.head_dim if self.head_dim else self.n_heads

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        B, T, three_d = qkv.shape
        d = three_d // 3
        q, k, v = qkv.split(d, dim=2)
        h = self.heads(d)
        # [B, T, d] -> [B, heads, T, head_dim]
        q, k, v = (t.view(B, T, h, d // h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, d)

    def decode(self, qkv: torch.Tensor, cache: dict) -> torch.Tensor:
        """Attention of T new positions over the cached keys and values and their own; the
        cache (`cache["kv"]`: [B, heads, positions, head_dim], this rank's heads where the
        block is cut) grows by T in place, allocated once for the call's positions."""
        B, T, three_d = qkv.shape
        d = three_d // 3
        h = self.heads(d)
        q, k, v = (t.view(B, T, h, d // h).transpose(1, 2) for t in qkv.split(d, dim=2))
        kv = cache.get("kv")
        if kv is None:
            kv = cache["kv"] = KeyValues(cache.get(POSITIONS))
        k, v = kv.extend(k, v)
        past = k.shape[2] - T
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:         # query i sits at position past + i: it sees keys 0 .. past + i
            seen = torch.arange(past + T, device=qkv.device)[None, :] <= \
                (past + torch.arange(T, device=qkv.device))[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        return y.transpose(1, 2).contiguous().view(B, T, d)


class Block(nn.Module):
    """One transformer block, pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x)).

    Tensor-parallel (`tp_plan`, Megatron's split): attention by heads (q, k and v each cut in
    whole heads, the output projection by rows), the MLP by its inner width; the norms are
    replicated."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        head_dim = d // cfg.n_heads
        self.tp_plan = {"qkv": ("colwise", 3, head_dim), "attn_proj": ("rowwise", 1, head_dim),
                        "fc": "colwise", "mlp_proj": "rowwise"}
        self.ln_1 = nn.LayerNorm(d, bias=cfg.bias)
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.bias)
        # no parameters: same state dict
        self.core = AttentionCore(cfg.n_heads, cfg.dropout, head_dim)
        self.attn_proj = nn.Linear(d, d, bias=cfg.bias)
        self.ln_2 = nn.LayerNorm(d, bias=cfg.bias)
        self.fc = nn.Linear(d, 4 * d, bias=cfg.bias)
        self.mlp_proj = nn.Linear(4 * d, d, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        _init_linear(self.qkv)
        _init_linear(self.fc)
        # Each block adds two projections into the residual stream, so its variance grows
        # with 2 * n_layers additions; GPT-2 scales these inits by 1/sqrt(2 * n_layers) to
        # keep the stream's scale independent of depth at initialisation.
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        _init_linear(self.attn_proj, std=residual_std)
        _init_linear(self.mlp_proj, std=residual_std)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.attn_proj(self.core(self.qkv(x))))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.mlp_proj(F.gelu(self.fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def decode(self, x: torch.Tensor, cache: dict, position: int) -> torch.Tensor:
        """Generation: the block on new positions, keys and values kept in `cache`."""
        x = x + self.drop(self.attn_proj(self.core.decode(self.qkv(self.ln_1(x)), cache)))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Hidden states [B, T, d] -> logits [B, T, vocab]: final LayerNorm and a linear map."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        # Tensor-parallel: logits cut along the vocabulary straight into the loss (whole
        # logits are never built on one rank; see runtime.tensor_parallel.cross_entropy).
        self.tp_plan = {"lm_head": Split("colwise", optional=True)}
        self.tp_output = "vocab"
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        # With tie_embeddings this weight is the token embedding's (see gpt_layers): the two
        # usually sit on the first and last stages, and the engine keeps the copies equal.
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.bias)
        _init_linear(self.lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def decode(self, x: torch.Tensor, cache: dict, position: int) -> torch.Tensor:
        """Generation: position by position, nothing to keep."""
        return self.forward(x)


def gpt_layers(cfg: GPTConfig) -> list[LayerSpec]:
    """The model as pipeline layers: Embedding, `n_layers` Blocks, Head."""
    embedding, head = LayerSpec(Embedding, cfg), LayerSpec(Head, cfg)
    if cfg.tie_embeddings:
        # One matrix maps tokens to vectors and vectors back to token scores (Press & Wolf
        # 2017, as GPT-2): fewer parameters and a better-trained output layer.
        embedding.tie("wte", "tokens.weight")
        head.tie("wte", "lm_head.weight")
    return [embedding, *[LayerSpec(Block, cfg) for _ in range(cfg.n_layers)], head]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of the batch: logits [B, T, V], targets [B, T].
    Tensor-parallel, on each rank's slice of the vocabulary (`pipeflow_vocab_parallel`)."""
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


gpt_loss.pipeflow_vocab_parallel = True
