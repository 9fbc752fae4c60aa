"""Keys and values kept for generation, preallocated to the positions a call needs.

`engine.generate` hands a layer's `decode(x, cache, position)` one dict per prompt and layer,
holding `cache[POSITIONS]`: the most positions that prompt reaches in the call (its prompt and
all but its last new token). A layer allocates its keys and values once at that size
(`KeyValues`) and writes each step's new positions in place, so a token costs a copy of its
own keys and values; growing the cache by `torch.cat` copied the whole cache every token,
quadratic in the text's length. A cache without `POSITIONS` (a caller of `decode` of its own)
grows by concatenation, as before.
"""

from __future__ import annotations

import torch

__all__ = ["POSITIONS", "KeyValues"]

POSITIONS = "positions"     # the key of a decode cache's size in positions, where known


class KeyValues:
    """One layer's keys and values for one prompt, along dimension `dim` (positions).

    `positions`: the most positions the cache will hold (allocated on the first `extend`,
    shaped as the first keys and values but for `dim`), or None to grow by concatenation.
    """

    def __init__(self, positions: int | None, dim: int = 2) -> None:
        self.positions, self.dim = positions, dim
        self.filled = 0
        self.keys: torch.Tensor | None = None       # whole buffers (preallocated) ...
        self.values: torch.Tensor | None = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the keys and values of the new positions; every position's so far (views of
        the buffers where preallocated)."""
        new = keys.shape[self.dim]
        if self.positions is None:
            if self.keys is not None:
                keys = torch.cat([self.keys, keys], dim=self.dim)
                values = torch.cat([self.values, values], dim=self.dim)
            self.keys, self.values, self.filled = keys, values, keys.shape[self.dim]
            return keys, values
        if self.filled + new > self.positions:
            raise ValueError(f"key/value cache: {self.filled} positions held and {new} more "
                             f"asked, past the {self.positions} it was allocated for (the "
                             f"prompt and new tokens of the generate call)")
        if self.keys is None:
            self.keys = self._buffer(keys)
            self.values = self._buffer(values)
        self.keys.narrow(self.dim, self.filled, new).copy_(keys)
        self.values.narrow(self.dim, self.filled, new).copy_(values)
        self.filled += new
        return (self.keys.narrow(self.dim, 0, self.filled),
                self.values.narrow(self.dim, 0, self.filled))

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        shape = list(like.shape)
        shape[self.dim] = self.positions
        return like.new_empty(shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: both buffers whole (what the cache costs in memory)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values)
                   if t is not None)
