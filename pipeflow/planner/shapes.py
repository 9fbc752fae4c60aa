"""GPT model shapes: the parameter count of a shape, and a shape for a parameter count."""

from __future__ import annotations

import dataclasses

from pipeflow.models.gpt_shape import GPTConfig, num_parameters

__all__ = ["Shape", "ShapeError", "shape_for_params", "smallest_shape", "DEFAULT_SEQ_LEN",
           "DEFAULT_VOCAB", "ASPECT_RANGE"]

DEFAULT_SEQ_LEN = 2048
DEFAULT_VOCAB = 50304          # GPT-2's 50257 padded to a multiple of 128 (as nanoGPT does)
# d_model / n_layers of common GPTs: GPT-3 2.7B 80, 6.7B 128, 175B 128; Chinchilla 70B 102.
ASPECT_RANGE = (64, 128)
MAX_LAYERS = 512               # the deepest shape (a stage holds at least one layer)
WIDTH_STEP = 128               # widths a multiple of 128 split into heads of 64 or 128


class ShapeError(ValueError):
    """A model shape that cannot be built or does not match the request."""


@dataclasses.dataclass
class Shape(GPTConfig):
    """The GPT `pipeflow.models.gpt` builds, with the planner's defaults: a 2048-token
    context and GPT-2's vocabulary. Its parameter count is `num_parameters`: every weight,
    bias and LayerNorm of the built model, the tied embedding counted once."""

    seq_len: int = DEFAULT_SEQ_LEN
    vocab_size: int = DEFAULT_VOCAB

    def validate(self) -> None:
        try:
            super().validate()
        except ValueError as e:
            raise ShapeError(str(e)) from None

    @property
    def params(self) -> int:
        return num_parameters(self)

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
    for n_layers in range(1, MAX_LAYERS + 1):
        if n_layers >= 8 and n_layers % 2:
            continue
        for d_model in range(max(WIDTH_STEP, (lo * n_layers + WIDTH_STEP - 1) // WIDTH_STEP
                                 * WIDTH_STEP), hi * n_layers + 1, WIDTH_STEP):
            count = Shape(n_layers, d_model, _heads(d_model), seq_len, vocab_size).params
            error = abs(count - params) / params
            # Ties (rare) go to the aspect ratio nearest the middle of the range.
            key = (round(error, 4), abs(d_model / n_layers - (lo + hi) / 2), n_layers, d_model)
            if best is None or key < best:
                best = key
            if count > params:
                break
    assert best is not None
    error, _, n_layers, d_model = best
    shape = Shape(n_layers, d_model, _heads(d_model), seq_len, vocab_size)
    if error > 0.5 and params > shape.params:    # past the largest: never plan another model
        raise ShapeError(
            f"{params:.3g} parameters is above the largest GPT this planner shapes "
            f"({shape.describe()}: {shape.params:.3g} parameters, {MAX_LAYERS} layers at "
            f"d_model/n_layers {hi}); ask for at most {shape.params:.3g}")
    return shape
