"""Tensors in any structure: flatten, rebuild, map, and describe the leaves that cross stages.

Everything that holds "a tensor or a structure of tensors" (stage inputs and outputs, side
inputs, batches, recomputed segments) goes through this one helper, built on
`torch.utils._pytree`: tuples, lists, dicts, namedtuples and `None` are nodes; tensors are
the leaves that travel; any other leaf (a Python number, a string) is a constant that travels
once in the header, never as a message.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch.utils import _pytree as pytree

__all__ = ["flatten", "unflatten", "tensors", "map_tensors", "cast_floating", "detach",
           "LeafMeta", "Header", "header_of", "describe"]

TreeSpec = pytree.TreeSpec


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """(leaves in a fixed order, the structure to rebuild them)."""
    return pytree.tree_flatten(tree)


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    return pytree.tree_unflatten(list(leaves), spec)


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of `tree`, in flattening order."""
    return [x for x in flatten(tree)[0] if isinstance(x, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` with `fn` applied to every tensor leaf; other leaves kept."""
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with its floating-point tensors cast to `dtype` (integer ones kept)."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def detach(tree: Any) -> Any:
    return map_tensors(torch.Tensor.detach, tree)


class LeafMeta(NamedTuple):
    """What a receiver needs to allocate one tensor leaf, and whether it gets a gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


class Header(NamedTuple):
    """A message's structure: the tree, its constant leaves and its tensor leaves' metadata.

    Sent once per link when it changes; the receiver checks every message against it.
    `slots[i]` is either `None` (leaf i is a tensor, described by the next entry of `metas`)
    or a one-tuple holding the constant.
    """

    spec: TreeSpec
    slots: tuple[tuple[Any] | None, ...]
    metas: tuple[LeafMeta, ...]

    def grad_metas(self) -> tuple[LeafMeta, ...]:
        """The leaves a gradient comes back for: floating tensors that required grad."""
        return tuple(m for m in self.metas if m.requires_grad)

    def __reduce__(self):
        # A TreeSpec travels as torch's JSON form where it has one (no deprecated classes
        # unpickled on the other side); structures it cannot write travel as objects.
        try:
            spec: Any = ("json", pytree.treespec_dumps(self.spec))
        except (TypeError, NotImplementedError):
            spec = ("object", self.spec)
        return _header, (spec, self.slots, self.metas)

    def rebuild(self, tensor_leaves: list[torch.Tensor]) -> Any:
        it = iter(tensor_leaves)
        leaves = [next(it) if s is None else s[0] for s in self.slots]
        return unflatten(leaves, self.spec)


def _header(spec: tuple[str, Any], slots: tuple, metas: tuple) -> Header:
    kind, value = spec
    return Header(pytree.treespec_loads(value) if kind == "json" else value, slots, metas)


def header_of(tree: Any) -> tuple[Header, list[torch.Tensor]]:
    """(the header of `tree`, its tensor leaves in order)."""
    leaves, spec = flatten(tree)
    slots, metas, ts = [], [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            slots.append(None)
            metas.append(LeafMeta(tuple(leaf.shape), leaf.dtype,
                                  bool(leaf.requires_grad and leaf.is_floating_point())))
            ts.append(leaf)
        else:
            slots.append((leaf,))
    return Header(spec, tuple(slots), tuple(metas)), ts


def describe(metas: tuple[LeafMeta, ...]) -> str:
    """A short text of leaf metadata for error messages."""
    return "[" + ", ".join(f"{tuple(m.shape)} {str(m.dtype).replace('torch.', '')}"
                           f"{' (grad)' if m.requires_grad else ''}" for m in metas) + "]"
