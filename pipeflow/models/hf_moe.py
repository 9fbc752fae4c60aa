"""The mixture-of-experts load-balancing loss of transformers, exact across pipeline stages.

transformers' `load_balancing_loss_func` concatenates the router logits of every layer and
takes, over (layers x tokens), the mean top-k assignment per expert times the mean router
probability per expert: a product of means, not a sum of per-layer losses, so it couples layers
on different stages. pipeflow carries the three running sums it needs through the activations:

    (hidden, {"prob_sum": (E,) float32, with gradient: sum of softmax(router logits),
              "assigned_sum": (E,) int64: sum of top-k one-hot assignments,
              "tokens": () int64: rows counted})

every sum over the layers run so far and their tokens, weighted by the attention mask where
one is given (padding counts for nothing). The counts are integers, so a mixed-precision
policy that casts floating activations between stages leaves them exact. The embedding starts
them at zero (`initial_state`), each MoE block adds its router's contribution
(`add_router_logits`), and the head turns them into the loss (`balance_loss`) and hands
`router_aux_loss_coef x loss` to `pf.add_aux_loss`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["aux_loss_on", "num_experts", "initial_state", "router_class", "capture_router_logits",
           "whole_sequence_logits", "add_router_logits", "balance_loss"]


def router_class(base: type) -> tuple[type, int] | None:
    """(router module class, index of its logits in the router's output) from the base model's
    `_can_record_outputs["router_logits"]`, or None for a model without routers."""
    recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        return None
    if isinstance(recorder, type):
        return recorder, 0
    return recorder.target_class, recorder.index


def aux_loss_on(config: Any, parts: Any) -> bool:
    """Whether the causal LM adds the load-balancing loss: `output_router_logits`, routers,
    and a family whose causal LM adds it (`parts.family.experts`; DeepSeek-V3's does not)."""
    return (bool(getattr(config, "output_router_logits", False)) and parts.router is not None
            and parts.family.experts is not None)


def num_experts(config: Any, field: str) -> int:
    """E, the routed experts per MoE block, from the field the family's causal LM reads
    (Mixtral: num_local_experts; Qwen2-MoE: num_experts), never from another family's."""
    value = getattr(config, field, None)
    if not value:
        raise ValueError(f"{type(config).__name__}: output_router_logits is set but the "
                         f"config's {field} (the expert count) is {value!r}")
    return int(value)


def initial_state(config: Any, field: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The running sums before any layer: zeros (probabilities in float32, as transformers
    sums them; counts in int64). `field`: the config's expert count (`num_experts`)."""
    e = num_experts(config, field)
    return {"prob_sum": torch.zeros(e, dtype=torch.float32, device=device),
            "assigned_sum": torch.zeros(e, dtype=torch.int64, device=device),
            "tokens": torch.zeros((), dtype=torch.int64, device=device)}


@contextlib.contextmanager
def capture_router_logits(block: nn.Module, router: tuple[type, int]) -> Iterator[list[Any]]:
    """Within the block, every call of a router module inside `block` appends
    (its logits, the router) to the list yielded."""
    cls, index = router
    captured: list[Any] = []
    handles = [m.register_forward_hook(
        lambda module, args, out: captured.append((out[index], module)))
        for m in block.modules() if isinstance(m, cls)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def whole_sequence_logits(logits: torch.Tensor, hidden: torch.Tensor, group: Any) -> torch.Tensor:
    """A router's logits (B*T, E) for the whole sequence. Under sequence parallelism (`group`,
    the block's tensor group, with it on) the router saw this rank's slice of the sequence
    (`hidden`: B, T/t, ...), while the sums count every token against the whole mask: the
    slices gathered (backward: this rank's slice of the gradient, alike on every rank)."""
    if group is None or not group.sequence_parallel:
        return logits
    from pipeflow.runtime.tensor_parallel import leave_sequence
    batch, length = hidden.shape[:2]
    whole = leave_sequence(logits.reshape(batch, length, -1), group,
                           "tensor group: router logits for the load-balancing loss")
    return whole.reshape(-1, whole.shape[-1])


def add_router_logits(state: dict[str, torch.Tensor], logits: torch.Tensor, top_k: int,
                      attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`state` plus one layer's router logits (B*T, E), as `load_balancing_loss_func` adds them."""
    e = logits.shape[-1]
    probs = F.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    if attention_mask is None:
        keep = torch.ones(logits.shape[0], dtype=torch.int64, device=logits.device)
    else:   # 1 = token, 0 = padding
        keep = attention_mask.reshape(-1).to(device=logits.device, dtype=torch.int64)
    assigned = torch.zeros(e, dtype=torch.int64, device=logits.device).scatter_add_(
        0, selected.reshape(-1), keep.repeat_interleave(top_k))
    weighted = probs.float() * keep.to(torch.float32).unsqueeze(-1)
    return {"prob_sum": state["prob_sum"] + weighted.sum(dim=0),
            "assigned_sum": state["assigned_sum"] + assigned,
            "tokens": state["tokens"] + keep.sum()}


def balance_loss(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' load-balancing loss from the sums: E x sum(mean assigned x mean prob)."""
    tokens = state["tokens"].to(torch.float32)
    tokens_per_expert = state["assigned_sum"].to(torch.float32) / tokens
    prob_per_expert = state["prob_sum"].to(torch.float32) / tokens
    return (tokens_per_expert * prob_per_expert).sum() * prob_per_expert.shape[0]
