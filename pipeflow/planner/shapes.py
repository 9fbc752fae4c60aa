"""GPT model shapes: the parameter count of a shape, and a shape for a parameter count."""

from __future__ import annotations

import dataclasses

__all__ = ["Shape", "ShapeError", "param_count", "shape_for_params", "smallest_shape",
           "DEFAULT_SEQ_LEN", "DEFAULT_VOCAB", "ASPECT_RANGE"]

DEFAULT_SEQ_LEN = 2048
DEFAULT_VOCAB = 50304          # GPT-2's 50257 padded to a multiple of 128 (as nanoGPT does)
# d_model / n_layers of common GPTs: GPT-3 2.7B 80, 6.7B 128, 175B 128; Chinchilla 70B 102.
ASPECT_RANGE = (64, 128)
WIDTH_STEP = 128               # widths a multiple of 128 split into heads of 64 or 128


class ShapeError(ValueError):
    """A model shape that cannot be built or does not match the request."""


def param_count(n_layers: int, d_model: int, seq_len: int = DEFAULT_SEQ_LEN,
                vocab_size: int = DEFAULT_VOCAB) -> int:
    """12·L·d² + V·d + s·d: the transformer blocks (4d² attention, 8d² MLP), the token
    embedding (tied with the output head) and the learned positions. Biases and layer norms
    (13·L·d + 2·d) are left out, as in Kaplan et al. 2020 and Narayanan et al. 2021."""
    return 12 * n_layers * d_model * d_model + vocab_size * d_model + seq_len * d_model


@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT: n_layers blocks of width d_model with n_heads heads, over seq_len tokens."""

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int = DEFAULT_SEQ_LEN
    vocab_size: int = DEFAULT_VOCAB

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ShapeError(f"model {name} must be a positive integer, found {value!r}")
        if self.d_model % self.n_heads:
            raise ShapeError(
                f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}; choose "
                f"heads that divide the width (head dim 64 or 128: n_heads="
                f"{max(1, self.d_model // 64)} or {max(1, self.d_model // 128)})")

    @property
    def params(self) -> int:
        return param_count(self.n_layers, self.d_model, self.seq_len, self.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (f"{self.n_layers} layers × d_model {self.d_model}, {self.n_heads} heads of "
                f"{self.head_dim}, seq {self.seq_len}, vocab {self.vocab_size}")


def _heads(d_model: int) -> int:
    # Head dim 64 below width 2048 (GPT-3 up to 1.3B), 128 from there on (GPT-3 6.7B up).
    return d_model // (128 if d_model >= 2048 else 64)


def smallest_shape(seq_len: int = DEFAULT_SEQ_LEN, vocab_size: int = DEFAULT_VOCAB) -> Shape:
    """The smallest shape `shape_for_params` builds: one block of width 128."""
    return Shape(1, WIDTH_STEP, _heads(WIDTH_STEP), seq_len, vocab_size)


def shape_for_params(params: float, seq_len: int = DEFAULT_SEQ_LEN,
                     vocab_size: int = DEFAULT_VOCAB) -> Shape:
    """The GPT shape whose parameter count is closest to `params`.

    Widths are multiples of 128, depth even from 8 layers up (a 2-stage pipeline splits it
    evenly), aspect d_model/n_layers within ASPECT_RANGE.
    """
    small = smallest_shape(seq_len, vocab_size)
    if params < 0.5 * small.params:
        raise ShapeError(
            f"{params:.3g} parameters is below the smallest GPT this planner shapes "
            f"({small.describe()}: {small.params:.3g} parameters, most of them the "
            f"{vocab_size}-token embedding); raise the budget, or shrink --vocab/--seq-len")
    best: tuple[float, float, int, int] | None = None
    lo, hi = ASPECT_RANGE
    for n_layers in range(1, 513):
        if n_layers >= 8 and n_layers % 2:
            continue
        for d_model in range(max(WIDTH_STEP, (lo * n_layers + WIDTH_STEP - 1) // WIDTH_STEP
                                 * WIDTH_STEP), hi * n_layers + 1, WIDTH_STEP):
            count = param_count(n_layers, d_model, seq_len, vocab_size)
            error = abs(count - params) / params
            # Ties (rare) go to the aspect ratio nearest the middle of the range.
            key = (round(error, 4), abs(d_model / n_layers - (lo + hi) / 2), n_layers, d_model)
            if best is None or key < best:
                best = key
            if count > params:
                break
    assert best is not None
    _, _, n_layers, d_model = best
    return Shape(n_layers, d_model, _heads(d_model), seq_len, vocab_size)
