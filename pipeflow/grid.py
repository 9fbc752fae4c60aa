"""The rank grid (pure arithmetic): the one place that knows which world rank holds what.

Axes, outermost first: `pipeline`, `data`, `tensor`. Tensor is innermost, so a stage's tensor
ranks are consecutive world ranks (one node, where its all-reduces are cheap); then the
replicas of a stage are neighbours (the gradient all-reduce stays on fast links), and only
the light point-to-point activations cross nodes:

    rank = (stage · data + replica) · tensor + tensor_rank

Everything else (the MPI and torch.distributed groups, `Stage`, checkpoints, random state,
the planner) asks a `Grid` for ranks by axis name rather than spelling the layout out:

    >>> g = Grid(pipeline=2, data=2, tensor=2)
    >>> g.rank(pipeline=1, data=0, tensor=1)
    5
    >>> g.coords(5)
    Coords(pipeline=1, data=0, tensor=1)
    >>> g.group("tensor", 5), g.group("pipeline", 5), g.group("data", 5)
    ([4, 5], [1, 5], [5, 7])
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence, Union

__all__ = ["AXES", "Coords", "Grid", "GridError"]

AXES = ("pipeline", "data", "tensor")      # outermost to innermost

Axes = Union[str, Sequence[str]]


class GridError(ValueError):
    """A grid that cannot be, or a question it cannot answer."""


class Coords(NamedTuple):
    """A rank's place: its stage, replica and tensor rank."""

    pipeline: int
    data: int
    tensor: int


@dataclasses.dataclass(frozen=True)
class Grid:
    """`pipeline × data × tensor` ranks, tensor innermost (see the module's docstring)."""

    pipeline: int
    data: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise GridError(f"grid axis {axis!r} must be a whole number of ranks >= 1, "
                                f"found {size!r}")

    @property
    def size(self) -> int:
        """Ranks in the grid: pipeline · data · tensor."""
        return self.pipeline * self.data * self.tensor

    def degree(self, axes: Axes) -> int:
        """How many ranks a group along `axes` (one name or several) holds."""
        out = 1
        for axis in _axes(axes):
            out *= getattr(self, axis)
        return out

    def rank(self, pipeline: int = 0, data: int = 0, tensor: int = 0) -> int:
        """World rank at these coordinates."""
        for axis, at in zip(AXES, (pipeline, data, tensor)):
            if not 0 <= at < getattr(self, axis):
                raise GridError(f"{axis} coordinate {at} is outside the grid "
                                f"({axis} = {getattr(self, axis)})")
        return (pipeline * self.data + data) * self.tensor + tensor

    def coords(self, rank: int) -> Coords:
        """The coordinates of world rank `rank` (the inverse of `rank`)."""
        if not 0 <= rank < self.size:
            raise GridError(f"rank {rank} is outside the grid of {self.size} ranks "
                            f"({self.describe()})")
        rest, tensor = divmod(rank, self.tensor)
        pipeline, data = divmod(rest, self.data)
        return Coords(pipeline, data, tensor)

    def group(self, axes: Axes, rank: int) -> list[int]:
        """The ranks that share every coordinate of `rank` but those on `axes`, ordered by
        those coordinates (outer axis first): a rank's place in the list is its coordinate."""
        names = _axes(axes)
        at = self.coords(rank)._asdict()
        return [self.rank(**{**at, **dict(zip(names, inner))}) for inner in self._span(names)]

    def groups(self, axes: Axes) -> list[list[int]]:
        """Every group along `axes`, each ordered as `group` orders it, the groups ordered by
        their first rank (alike on every rank: groups are made collectively in this order)."""
        names = _axes(axes)
        firsts = [r for r in range(self.size)
                  if all(getattr(self.coords(r), a) == 0 for a in names)]
        return [self.group(names, r) for r in firsts]

    def index(self, axes: Axes, rank: int) -> int:
        """Which of `groups(axes)` holds `rank` (an MPI split's colour)."""
        first = self.group(axes, rank)[0]
        return [g[0] for g in self.groups(axes)].index(first)

    def position(self, axes: Axes, rank: int) -> int:
        """`rank`'s place within its group along `axes` (an MPI split's key)."""
        return self.group(axes, rank).index(rank)

    def describe(self) -> str:
        return f"pipeline {self.pipeline} x data {self.data} x tensor {self.tensor}"

    def _span(self, names: Sequence[str]) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = [()]
        for axis in names:
            out = [prefix + (i,) for prefix in out for i in range(getattr(self, axis))]
        return out


def _axes(axes: Axes) -> tuple[str, ...]:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in names if a not in AXES]
    if unknown or not names or len(set(names)) != len(names):
        raise GridError(f"grid axes {list(names)!r}: expected distinct names among {AXES}")
    return tuple(sorted(names, key=AXES.index))
