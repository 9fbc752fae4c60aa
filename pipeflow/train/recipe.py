"""The training recipe of `[train]`: the learning-rate schedule and the optimizer.

    lr_schedule = "cosine"   # constant | linear | cosine | inverse-sqrt | wsd, after `warmup`
    optimizer = "AdamW"      # or any torch.optim class by name (SGD, Adam, Adafactor, ...)
    optimizer_args = {momentum = 0.9}   # its other arguments

Every schedule warms up linearly over `warmup` steps to `lr`. Then `constant` stays there;
`linear` and `cosine` decay to `min_lr_ratio x lr` at `steps`; `inverse-sqrt` falls as
`lr x sqrt(warmup / step)` (Megatron's); `wsd` (warm-up, stable, decay) holds `lr` until the
last `decay_fraction` of the steps, then decays linearly to `min_lr_ratio x lr`.

The optimizer gets `lr`, and where its class takes them, `betas = (beta1, beta2)` and
`weight_decay` on matrices only (nanoGPT's groups); `optimizer_args` adds or overrides
arguments, except `lr`: the schedule sets every step's rate from `[train] lr`, so an `lr`
there would be overwritten at the first step, and it is refused, naming `[train] lr`. An
unknown class or argument is a ConfigError naming the closest known one; the optimizer is
built once on a probe parameter when the run is loaded, so an argument of the wrong type
or range (`momentum = "high"`) is named then, with the class's own complaint. Classes whose
`step` needs a closure (LBFGS) are not offered: the engine steps without one.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Callable

import torch

from pipeflow.config import ConfigError

__all__ = ["SCHEDULES", "lr_at", "optimizer_class", "optimizer_factory", "check_recipe",
           "weight_decay_groups"]

SCHEDULES = ("constant", "linear", "cosine", "inverse-sqrt", "wsd")


def lr_at(step: int, train: Any) -> float:
    """The learning rate of `step` under `train.lr_schedule` (see the module's docstring)."""
    if step < train.warmup:
        return train.lr * (step + 1) / train.warmup
    kind, floor = train.lr_schedule, train.min_lr_ratio
    progress = min(1.0, (step - train.warmup) / max(1, train.steps - train.warmup))
    if kind == "constant":
        scale = 1.0
    elif kind == "linear":
        scale = 1.0 - (1.0 - floor) * progress
    elif kind == "cosine":
        scale = floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    elif kind == "inverse-sqrt":
        scale = math.sqrt(max(train.warmup, 1) / (step + 1))
    else:                       # wsd
        decay = max(1, round(train.steps * train.decay_fraction))
        start = train.steps - decay
        scale = 1.0 if step < start else 1.0 - (1.0 - floor) * min(1.0, (step - start) / decay)
    return train.lr * scale


def weight_decay_groups(params, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's rule: decay matrices (embeddings, linear weights), not biases or norms."""
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _needs_closure(cls: type) -> bool:
    """Whether `cls.step` takes a closure it cannot do without (LBFGS re-evaluates the loss)."""
    closure = inspect.signature(cls.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _optimizers() -> dict[str, type]:
    return {name: cls for name, cls in vars(torch.optim).items()
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer and not _needs_closure(cls)}


def optimizer_class(name: str) -> type:
    """The torch.optim class `name` (as written, or case-insensitively); a ConfigError with
    the closest name otherwise."""
    known = _optimizers()
    found = known.get(name) or {k.lower(): v for k, v in known.items()}.get(str(name).lower())
    every = {k.lower(): v for k, v in vars(torch.optim).items() if isinstance(v, type)}
    if found is None and str(name).lower() in every and \
            issubclass(every[str(name).lower()], torch.optim.Optimizer):
        raise ConfigError(f"[train] optimizer = {name!r}: its step() needs a closure that "
                          f"evaluates the loss again, and the pipeline steps once after "
                          f"accumulating every micro-batch's gradient; choose one of "
                          f"{sorted(known)}")
    if found is None:
        close = difflib.get_close_matches(str(name), list(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"[train] optimizer = {name!r} is no torch.optim class; {hint}"
                          f"known: {sorted(known)}")
    return found


def _arguments(train: Any, cls: type) -> dict[str, Any]:
    """The class's arguments from `[train]`: lr, betas and weight decay where it takes
    them, then `optimizer_args`; a ConfigError for an argument it does not take."""
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    args: dict[str, Any] = {"lr": train.lr}
    if "betas" in accepted:
        args["betas"] = (train.beta1, train.beta2)
    for key, value in dict(train.optimizer_args).items():
        if key == "lr":
            raise ConfigError(f"[train] optimizer_args: lr = {value!r} would be overwritten "
                              f"at every step by the learning-rate schedule, which starts "
                              f"from [train] lr = {train.lr!r}; set [train] lr = {value!r} "
                              f"instead and remove lr from optimizer_args")
        if key not in accepted:
            close = difflib.get_close_matches(key, sorted(accepted), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"[train] optimizer_args: {cls.__name__} takes no argument "
                              f"{key!r}; {hint}it takes {sorted(accepted)}")
        args[key] = tuple(value) if isinstance(value, list) else value
    return args


def check_recipe(train: Any) -> None:
    """`lr_schedule`, `optimizer` and `optimizer_args` are ones the run can build."""
    if train.lr_schedule not in SCHEDULES:
        close = difflib.get_close_matches(str(train.lr_schedule), SCHEDULES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"[train] lr_schedule = {train.lr_schedule!r} is unknown; {hint}"
                          f"known: {list(SCHEDULES)}")
    cls = optimizer_class(train.optimizer)
    _arguments(train, cls)
    probe = torch.nn.Parameter(torch.zeros(2, 2))
    try:
        optimizer_factory(train)([probe])
    except (TypeError, ValueError, RuntimeError) as exc:
        given = ", ".join(f"{k} = {v!r}" for k, v in dict(train.optimizer_args).items())
        raise ConfigError(f"[train] optimizer = {train.optimizer!r} refuses its arguments "
                          f"({type(exc).__name__}: {exc}); optimizer_args = {{{given}}}: "
                          f"give each the type and range {cls.__name__} documents "
                          f"(e.g. momentum = 0.9)") from None


def optimizer_factory(train: Any) -> Callable[[list], torch.optim.Optimizer]:
    """`params -> optimizer` for the engine, from `[train]`."""
    cls = optimizer_class(train.optimizer)
    args = _arguments(train, cls)
    decays = "weight_decay" in inspect.signature(cls.__init__).parameters
    decay = args.pop("weight_decay", train.weight_decay)

    def build(params: list) -> torch.optim.Optimizer:
        groups = weight_decay_groups(params, decay) if decays else list(params)
        return cls(groups, **args)
    return build
