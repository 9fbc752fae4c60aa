"""Mixed precision: low-precision working weights, fp32 master weights, dynamic loss scale."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn

from pipeflow.runtime.sizes import (OPTIMIZER_STATES, bytes_per_parameter, itemsize,
                                    sharded_bytes_per_parameter)
from pipeflow.tree import cast_floating

__all__ = ["DTYPES", "OPTIMIZER_STATES", "Precision", "LossScaler", "cast_floating", "itemsize",
           "bytes_per_parameter", "sharded_bytes_per_parameter", "class_matches"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class LossScaler:
    """Dynamic loss scaling for fp16 (as in Micikevicius et al. 2018, torch.amp.GradScaler).

    The scale multiplies the last stage's loss, and so every gradient upstream; an overflow
    anywhere in the grid skips the step and multiplies the scale by `backoff`; `interval`
    good steps in a row multiply it by `growth`. Every rank sees the same overflow verdict, so
    the scale stays identical everywhere.
    """

    scale: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000
    minimum: float = 1.0
    good_steps: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.minimum, self.scale * self.backoff)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.interval:
                self.scale *= self.growth
                self.good_steps = 0


class Precision:
    """One stage's working parameters and the fp32 masters the optimizer steps.

    fp32: the masters are the parameters themselves. bf16/fp16: the module's parameters are
    cast down (but for modules listed in `fp32_modules`, which run in fp32 with their inputs
    cast up and outputs cast back, and keep their buffers in fp32), and each working
    parameter's gradient is added into its master's fp32 `.grad` as soon as autograd produces
    it, so accumulation over micro-batches happens in fp32 and the low-precision gradient is
    freed at once. Frozen parameters (`requires_grad=False`) keep an fp32 value too, so saving
    and gathering are exact, but get no gradient and no optimizer state.
    """

    def __init__(self, module: nn.Module, precision: str, fp32_modules: Sequence[Any] = (),
                 scaler: LossScaler | None = None, sharded: bool = False) -> None:
        """`sharded`: the trainable parameters' fp32 masters live in a `ShardedOptimizer`
        (1/d of each on each replica), not here: this keeps masters of frozen parameters
        only, and hands the exact fp32 start values over once (`take_initial`)."""
        self.name = precision
        self.sharded = sharded
        self.dtype = DTYPES[precision]
        self.scaler = scaler
        self.mixed = self.dtype != torch.float32
        params = list(module.parameters())
        exact = {id(p): p.detach().float().clone() for p in params} if self.mixed else {}
        if self.mixed:
            self._cast_down(module, fp32_modules)
        self.all_working = params
        self.working = [p for p in params if p.requires_grad]
        self._initial: dict[int, torch.Tensor] = {}
        if self.mixed and sharded:
            self._master_of = {id(p): nn.Parameter(exact[id(p)], requires_grad=False)
                               for p in params if not p.requires_grad}
            self._initial = {id(p): exact[id(p)] for p in self.working}
        elif self.mixed:
            self._master_of = {id(p): nn.Parameter(exact[id(p)], requires_grad=p.requires_grad)
                               for p in params}
            for p in self.working:
                p.register_post_accumulate_grad_hook(_accumulate_into(self._master_of[id(p)]))
        else:
            self._master_of = {id(p): p for p in params}
        # What the optimizer steps: trainable parameters only (sharded: none of them here).
        self.masters = [] if sharded else [self._master_of[id(p)] for p in self.working]

    def take_initial(self) -> dict[int, torch.Tensor]:
        """Sharded: the exact fp32 start values of the trainable parameters, by id of their
        working parameter (the working copies may be rounded already); given once, then
        dropped here."""
        if not self.mixed:
            return {id(p): p.detach() for p in self.working}
        initial, self._initial = self._initial, {}
        return initial

    def _cast_down(self, module: nn.Module, fp32_modules: Sequence[Any]) -> None:
        """Cast every module's own parameters and buffers to the working dtype, but those of
        the `fp32_modules` and their children, which are never rounded (their values stay
        bit-identical to fp32) and run in fp32 between casts of their inputs and outputs."""
        kept: set[int] = set()
        for sub in module.modules():
            if id(sub) not in kept and class_matches(sub, fp32_modules):
                kept.update(id(m) for m in sub.modules())
                sub.register_forward_pre_hook(_cast_inputs_fp32)
                sub.register_forward_hook(self._cast_output_back)
        for sub in module.modules():
            if id(sub) not in kept:
                sub._apply(lambda t: t.to(self.dtype) if t.is_floating_point() else t,
                           recurse=False)

    def master_of(self, p: nn.Parameter) -> nn.Parameter:
        if id(p) not in self._master_of and self.sharded:
            raise KeyError(
                f"the fp32 master of a trainable parameter of shape {tuple(p.shape)} is "
                f"sharded over the data group (Config.shard_optimizer): ask the stage's "
                f"ShardedOptimizer (full_masters) for its whole value")
        return self._master_of[id(p)]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def cast_input(self, x: Any) -> Any:
        """Floating-point stage inputs enter in the working dtype; integer ones as they are."""
        return cast_floating(x, self.dtype) if self.mixed else x

    def _cast_output_back(self, module: nn.Module, args: Any, out: Any) -> Any:
        return self.cast_input(out)

    def unscale_(self) -> None:
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            for m in self.masters:
                if m.grad is not None:
                    m.grad.mul_(inv)

    @torch.no_grad()
    def refresh_working(self) -> None:
        """After the optimizer stepped the masters: the working copies are the masters cast."""
        if self.mixed and self.working:
            # One launch for all (as a plain loop's torch._foreach_copy_), casting down.
            torch._foreach_copy_(self.working, [self._master_of[id(p)] for p in self.working])

    @torch.no_grad()
    def load_masters(self, values: dict[int, torch.Tensor]) -> None:
        """Set parameters (by id of their working parameter) from full-precision values."""
        for p in self.all_working:
            if id(p) in values:
                master = self._master_of.get(id(p))      # sharded: not here, see above
                if master is not None:
                    master.copy_(values[id(p)])
                if self.mixed or master is None:
                    p.copy_(values[id(p)])

    def zero_grad(self, masters: bool = True) -> None:
        """Drop the gradients: the masters' (unless `masters` is False, when something else,
        the data-parallel buckets, owns and zeroes them) and the working copies'."""
        if masters:
            for m in self.masters:
                m.grad = None
        if self.mixed:
            for p in self.working:
                p.grad = None


def class_matches(module: nn.Module, names: Sequence[Any]) -> bool:
    """Whether `module` is one that `names` lists (as `fp32_modules` and `recompute_modules`
    do): a class, or a name its class name ends with ("RMSNorm" covers LlamaRMSNorm)."""
    name = type(module).__name__
    for entry in names:
        if isinstance(entry, type):
            if isinstance(module, entry):
                return True
        elif name.endswith(str(entry)):
            return True
    return False


def _cast_inputs_fp32(module: nn.Module, args: tuple) -> tuple:
    return cast_floating(args, torch.float32)


def _accumulate_into(master: nn.Parameter):
    def hook(p: nn.Parameter) -> None:
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None
    return hook
