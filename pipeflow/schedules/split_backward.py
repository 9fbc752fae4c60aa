"""Split backward for zero-bubble schedules: B (input gradients) now, W (weight gradients) later.

A stage's backward has two consumers: the previous stage waits for the gradient of this
stage's inputs (B), while the gradient of its weights (W) is wanted only by the optimizer.
`backward_input` runs B alone and records, at each node of the graph where a weight's
branch leaves the input path, the gradient that reached it; `backward_weight` later pushes
those recorded gradients into the weights' branches only, so W redoes none of B's work. W
accumulates into `.grad` through autograd's own accumulators, so post-accumulate-grad hooks
(mixed precision's fp32 masters, data parallelism's buckets) fire as in a full backward.

    grads, w = backward_input(outputs, grad_outputs, inputs, params)   # B: send `grads` back
    ...
    backward_weight(w)                                                  # W: `.grad` += dW

On a first stage (no input needs a gradient) B is a no-op and W runs the whole backward.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.utils._pytree import tree_leaves

__all__ = ["PendingWeight", "backward_input", "backward_weight"]


class PendingWeight:
    """What B leaves for W on one (micro-batch, chunk): for each group of weights, the graph
    nodes where their branches leave the input path and the gradients that reached them.

    For weights no input path leads to (all of them on a first stage) and weights used at
    several places, it holds the outputs and their gradients instead, and W runs their whole
    backward. `done` turns true once W has run.
    """

    def __init__(self) -> None:
        # one entry a group: (its weights, [(node where a branch leaves the input path, the
        # edges into the branch, the gradient B recorded at the node's outputs)])
        self.groups: list[tuple[list[torch.Tensor],
                                list[tuple[Node, list[tuple[Node, int]], tuple | None]]]] = []
        self.whole: tuple[list[torch.Tensor], list[torch.Tensor | None],
                          list[torch.Tensor]] | None = None
        self.done = False


def _pairs(outputs: Any, grad_outputs: Any) -> tuple[list[torch.Tensor], list[Any]]:
    """The output leaves that carry a gradient and theirs (None: a scalar loss's implicit
    1)."""
    outs = tree_leaves(outputs)
    grads = [None] * len(outs) if grad_outputs is None else \
        tree_leaves(grad_outputs, is_leaf=lambda g: g is None)
    if len(grads) != len(outs):
        raise ValueError(f"backward: {len(outs)} output leaves but {len(grads)} gradients; "
                         f"pass one gradient (or None) per output leaf, in the same structure")
    # With gradients given, an output without one (None) takes no part, as in
    # torch.autograd.backward over the outputs that have one.
    keep = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor)
            and o.requires_grad and (g is not None or grad_outputs is None)]
    return [o for o, _ in keep], [g for _, g in keep]


def _node(t: torch.Tensor) -> Node:
    """The autograd node a tensor's gradient enters: its grad_fn, or a leaf's accumulator
    (created lazily: a view makes it)."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def _parents(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that feed it gradient (one step toward the outputs)."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen, queue = set(roots), collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    return parents


def _upward(starts: Iterable[Node], parents: dict[Node, list[Node]],
            stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `starts` toward the outputs without entering `stop`, and the
    nodes of `stop` where the climb ended."""
    seen: set[Node] = set()
    hit: set[Node] = set()
    queue = collections.deque(starts)
    while queue:
        node = queue.popleft()
        for parent in parents.get(node, ()):
            if parent in stop:
                hit.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, hit


Group = tuple[list[torch.Tensor], dict[Node, list[tuple[Node, int]]]]


def _groups(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
            params: Sequence[torch.Tensor]) -> tuple[list[Group], list[torch.Tensor]]:
    """Weights grouped by their branches: the nodes on the input path where a branch leaves
    it (a Linear's weight and bias share one), each with the edges into the branch. Also the
    weights W must reach from the outputs: those no input path leads to (all of them on a
    first stage) and those used at several places."""
    roots = {o.grad_fn for o in outputs if o.grad_fn is not None}
    parents = _parents(roots)
    input_nodes = [_node(t) for t in inputs]
    input_path = _upward(input_nodes, parents, set())[0] | set(input_nodes)
    owner: dict[Node, int] = {}
    groups: list[tuple[list[torch.Tensor], set[Node], set[Node]]] = []   # params, hits, branch
    whole: list[torch.Tensor] = []
    for p in params:
        start = _node(p)
        if start not in parents:
            continue                        # unused: no gradient, as in a full backward
        seen, hit = _upward([start], parents, input_path)
        if (seen | {start}) & roots - input_path:
            whole.append(p)                 # a branch from an output that B never visits
            continue
        merged = sorted({owner[n] for n in hit | seen if n in owner})
        group = ([p] + [q for i in merged for q in groups[i][0]],
                 hit.union(*(groups[i][1] for i in merged)),
                 (seen | {start}).union(*(groups[i][2] for i in merged)))
        for i in merged:
            groups[i] = ([], set(), set())
        groups.append(group)
        owner.update({n: len(groups) - 1 for n in group[1] | group[2]})
    # A weight whose branches leave the input path at several nodes (one used twice): rerun
    # from one of them, autograd would also send gradient down the input path to the others.
    # Those weights take the whole backward instead.
    whole += [p for ps, hits, _ in groups if len(hits) > 1 for p in ps]
    return [(ps, {n: [(c, nr) for c, nr in n.next_functions if c in branch] for n in hits})
            for ps, hits, branch in groups if len(hits) == 1], whole


def backward_input(outputs: Any, grad_outputs: Any, inputs: Any,
                   params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor | None],
                                                            PendingWeight]:
    """B: the gradients of `inputs` (a pytree; one entry a leaf, None where a leaf needs no
    gradient) for `outputs` (a pytree, or the scalar loss with `grad_outputs=None`) given
    `grad_outputs`; `params` are the stage's weights. Nothing is added to any `.grad`. The
    graph is kept for W: drop your own references to `outputs` once B is done."""
    outs, grads = _pairs(outputs, grad_outputs)
    leaves = tree_leaves(inputs)
    need = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    pending = PendingWeight()
    if not outs:
        pending.done = True
        return [None] * len(leaves), pending
    groups, whole = _groups(outs, need, [p for p in params if p.requires_grad])
    recorded: dict[Node, tuple] = {}
    hooks = [n.register_prehook(lambda g, n=n: recorded.__setitem__(n, g))
             for _, hits in groups for n in hits]
    try:
        got = torch.autograd.grad(outs, need, grads, retain_graph=True,
                                  allow_unused=True) if need else ()
    finally:
        for h in hooks:
            h.remove()
    pending.groups = [(ps, [(n, edges, recorded.get(n)) for n, edges in hits.items()])
                      for ps, hits in groups]
    if whole:
        pending.whole = (outs, grads, whole)
    by_id = {id(t): g for t, g in zip(need, got)}
    return [by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in leaves], pending


def backward_weight(pending: PendingWeight) -> None:
    """W: add the weight gradients B left pending into each weight's `.grad`, through
    autograd's accumulators (post-accumulate-grad hooks fire once a weight), then free the
    graph."""
    if pending.done:
        raise RuntimeError("backward_weight: this micro-batch's W already ran (or it had "
                           "no gradient to give); each B is followed by exactly one W")
    if pending.whole is not None:
        outs, grads, params = pending.whole
        torch.autograd.backward(outs, grads, inputs=params, retain_graph=bool(pending.groups))
    # Each node alone (see `_branch_grads`); then every branch at once: the branches of
    # different groups share no node, and each weight's accumulator runs once.
    into: dict[tuple[Node, int], torch.Tensor] = {}
    for _, hits in pending.groups:
        for node, edges, recorded in hits:
            _branch_grads(node, edges, recorded, into)
    if into:
        torch.autograd.backward([GradientEdge(c, nr) for c, nr in into], list(into.values()),
                                inputs=[p for params, _ in pending.groups for p in params])
    pending.groups, pending.whole, pending.done = [], None, True


def _branch_grads(node: Node, edges: list[tuple[Node, int]], recorded: tuple | None,
                  into: dict[tuple[Node, int], torch.Tensor]) -> None:
    """Rerun one node where weight branches leave the input path, from the gradient B
    recorded there, for its branch edges alone (autograd skips its input-gradient output);
    add what enters each edge into `into`. The edges lead to this node's weights only (see
    `_groups`), so nothing else runs."""
    seeds = [(GradientEdge(node, i), g) for i, g in enumerate(recorded or ()) if g is not None]
    if not seeds or not edges:
        return
    got = torch.autograd.grad([e for e, _ in seeds], [GradientEdge(c, nr) for c, nr in edges],
                              [g for _, g in seeds], allow_unused=True)
    for edge, g in zip(edges, got):
        if g is not None:
            into[edge] = g if edge not in into else into[edge] + g
