"""Model definition: a list of `LayerSpec`s, built lazily, one seed per layer."""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Sequence

import torch
from torch import nn

__all__ = ["LayerSpec", "build_sequential", "layer_seed", "fingerprint", "build_layer",
           "tie_groups", "get_parameter", "set_parameter"]


class LayerSpec:
    """A layer that is not built yet: `LayerSpec(cls, *args, **kwargs)`.

    Only the stage that owns a layer builds it, so a 10B-parameter model never exists whole
    in one process. `cls(*args, **kwargs)` must return an `nn.Module` whose `forward` takes the
    previous layer's output (a tensor or a tuple of tensors) and returns the next one.
    """

    def __init__(self, cls: type[nn.Module] | Any, *args: Any, **kwargs: Any) -> None:
        if not callable(cls):
            raise TypeError(
                f"LayerSpec expects a module class or factory as its first argument, "
                f"found {type(cls).__name__}: {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.ties: dict[str, str] = {}      # parameter path -> tie key

    def tie(self, key: str, attr: str) -> "LayerSpec":
        """Declare parameter `attr` (a dotted path such as `"lm_head.weight"`) one copy of the
        weight named `key`: every layer tied under `key` holds the same values, starting from
        the first such layer's initialisation, and their gradients are summed. Returns self.
        """
        self.ties[attr] = key
        return self

    @property
    def name(self) -> str:
        return getattr(self.cls, "__name__", type(self.cls).__name__)

    def build(self) -> nn.Module:
        module = self.cls(*self.args, **self.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"LayerSpec({self.name}) built a {type(module).__name__}, expected an nn.Module")
        return module

    def num_parameters(self) -> int:
        """Parameter count, found by building the layer on the meta device (no memory)."""
        with torch.device("meta"):
            module = self.build()
        return sum(p.numel() for p in module.parameters())

    def arguments(self) -> str:
        """The constructor arguments as written in a call."""
        return ", ".join([repr(a) for a in self.args]
                         + [f"{k}={v!r}" for k, v in self.kwargs.items()])

    def __repr__(self) -> str:
        args = self.arguments()
        return f"LayerSpec({self.name}{', ' if args else ''}{args})"


def fingerprint(layers: Sequence[LayerSpec]) -> list[str]:
    """Each layer as a checkpoint remembers it: class and constructor arguments (addresses of
    functions and objects left out: they differ from one process to the next). Two models
    with the same parameter shapes but other arguments (another `n_heads`) differ here."""
    return [re.sub(r" at 0x[0-9a-fA-F]+", "", f"{_qualname(spec.cls)}({spec.arguments()})")
            for spec in layers]


def _qualname(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"


def layer_seed(seed: int, index: int) -> int:
    """The seed layer `index` is built under: a function of `(seed, index)` only.

    So every partition of the same layer list starts from identical weights.
    """
    # splitmix64-style mixing keeps nearby (seed, index) pairs far apart.
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    # fork_rng leaves the caller's random state untouched: the CPU's and every CUDA
    # device's. manual_seed also seeds CUDA, and before CUDA is initialised it queues that
    # seed for later: forking only initialised devices let the last layer's seed replace
    # the user's CUDA seed (every data replica's dropout then started alike).
    # Without CUDA, the CPU generator alone: manual_seed would queue a CUDA seed anyway, and
    # queueing records the caller's stack (traceback.format_stack: a stat of every frame's
    # file), 77 us a layer against 1 us.
    cuda = torch.cuda.is_available()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with torch.random.fork_rng(devices=devices):
        if cuda:
            torch.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


def build_layer(spec: LayerSpec, seed: int, index: int) -> nn.Module:
    """Build layer `index` of a model exactly as `build_sequential` would."""
    with _seeded(layer_seed(seed, index)):
        return spec.build()


def build_sequential(layers: Sequence[LayerSpec], seed: int = 0) -> nn.Sequential:
    """The whole model as one `nn.Sequential`, with the same initial weights as any pipeline.

    State-dict keys are `"{layer index}.{parameter name}"`, the keys that
    `Engine.gather_state_dict()` returns. Tied parameters are one shared `nn.Parameter`.
    """
    _check_layers(layers)
    modules = [build_layer(spec, seed, i) for i, spec in enumerate(layers)]
    for key, holders in tie_groups(layers).items():
        first, first_attr = holders[0]
        shared = get_parameter(modules[first], first_attr)
        for index, attr in holders[1:]:
            set_parameter(modules[index], attr, shared)
    return nn.Sequential(*modules)


def tie_groups(layers: Sequence[LayerSpec]) -> dict[str, list[tuple[int, str]]]:
    """Tie key -> [(layer index, parameter path), ...] in layer order, for keys held twice+."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for i, spec in enumerate(layers):
        for attr, key in spec.ties.items():
            groups.setdefault(key, []).append((i, attr))
    return {k: v for k, v in sorted(groups.items()) if len(v) > 1}


def get_parameter(module: nn.Module, path: str) -> nn.Parameter:
    owner, _, name = path.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    param = getattr(target, name, None)
    if not isinstance(param, nn.Parameter):
        raise ValueError(f"{type(module).__name__} has no parameter {path!r} to tie; its "
                         f"parameters are {[n for n, _ in module.named_parameters()]}")
    return param


def set_parameter(module: nn.Module, path: str, param: nn.Parameter) -> None:
    mine = get_parameter(module, path)
    if mine.shape != param.shape:
        raise ValueError(f"cannot tie {path!r} of shape {tuple(mine.shape)} to a parameter of "
                         f"shape {tuple(param.shape)}")
    owner, _, name = path.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, name, param)


def _check_layers(layers: Sequence[LayerSpec]) -> None:
    if len(layers) == 0:
        raise ValueError("the layer list is empty: expected at least one pipeflow.LayerSpec")
    for i, spec in enumerate(layers):
        if not isinstance(spec, LayerSpec):
            raise TypeError(
                f"layer {i} is a {type(spec).__name__}, expected a pipeflow.LayerSpec; "
                f"wrap it as pipeflow.LayerSpec(ModuleClass, *args)")
