"""The rank grid's arithmetic (pure): which world rank holds which (stage, replica)."""

from __future__ import annotations

__all__ = ["rank_of"]


def rank_of(stage: int, replica: int, data: int) -> int:
    """World rank of `(stage, replica)` in a grid of `data` replicas: pipeline-outermost, so
    a stage's replicas are neighbouring ranks (see `comm.topology.Topology`)."""
    return stage * data + replica
