"""Per-stage activation recomputation: policies, checkpointed stage forward, memory meter."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeflow import tree
from pipeflow.config import ConfigError, normalise_policy
from pipeflow.schedules.auto import format_bytes

__all__ = ["stage_forward", "SavedTensorMeter", "LayerBytes",
           "measure_layers", "estimate_stash_bytes", "choose_auto", "auto_policy"]

# -- policies: parsed in pipeflow.config (no torch there), applied here ------------------

def _segment_size(policy: str, n_layers: int) -> int | None:
    """Layers per checkpointed segment: None for `none`/`selective`, n_layers for `full`."""
    p = normalise_policy(policy)
    if p == "auto":
        raise ConfigError("recompute policy 'auto' must be resolved to a concrete policy "
                          "(choose_auto / auto_policy) before the stage runs")
    if p == "full":
        return max(n_layers, 1)
    if p.startswith("every:"):
        return int(p.split(":")[1])
    return None


# -- the stage forward ------------------------------------------------------------------

def stage_forward(layers: Sequence[nn.Module], x: Any, policy: str,
                  side: Mapping[str, Any] | None = None) -> Any:
    """Run `layers` in order on `x` (any structure of tensors) under `policy`.

    `side` holds the side inputs (attention mask, position ids, ...): each layer gets, by
    keyword, those its `forward` names (all of them if it takes `**kwargs`). Checkpointed
    segments replay the CPU and CUDA random state in their recomputation, so dropout draws
    the same masks and the gradients are bit-for-bit those of `none`. Gradients reach the
    stage input as without recomputation (`x.grad` of a leaf input is filled).
    """
    side = dict(side or {})
    k = _segment_size(policy, len(layers))
    if not torch.is_grad_enabled():
        return run_layers(layers, x, side)          # nothing is saved, nothing to recompute
    if k is None:
        if normalise_policy(policy) == "selective":
            with _selective(layers):
                return run_layers(layers, x, side)
        return run_layers(layers, x, side)
    for start in range(0, len(layers), k):
        x = _checkpointed(functools.partial(run_layers, layers[start:start + k]), x, side)
    return x


def run_layers(layers: Sequence[nn.Module], x: Any, side: Mapping[str, Any] | None = None
               ) -> Any:
    """The layers in order, each given the side inputs its forward accepts."""
    for layer in layers:
        x = layer(x, **side_inputs_for(layer, side)) if side else layer(x)
    return x


def side_inputs_for(layer: nn.Module, side: Mapping[str, Any]) -> dict[str, Any]:
    """The side inputs `layer.forward` declares: by name, or all with `**kwargs`."""
    names = _accepted(type(layer))
    if names is None:
        return dict(side)
    return {k: v for k, v in side.items() if k in names}


def reads_side_input(cls: Any, name: str) -> bool | None:
    """Whether layers of class `cls` are given the side input `name` (`side_inputs_for`):
    True, False, or None where `cls` is not a class with a `forward` (a factory function)."""
    if not isinstance(cls, type) or not hasattr(cls, "forward"):
        return None
    names = _accepted(cls)
    return names is None or name in names


@functools.lru_cache(maxsize=None)
def _accepted(cls: type) -> frozenset[str] | None:
    params = inspect.signature(cls.forward).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params
                     if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def _checkpointed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, its saved tensors dropped and recomputed in the backward."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    # Hand the checkpoint every tensor as a top-level argument, also those inside a
    # structured activation: it saves its top-level tensor inputs through autograd (where
    # the meter's hooks count what the recomputation keeps, and whence they are freed after
    # the backward) and reads their devices for the RNG replay. The closure keeps only the
    # structure, so it holds no tensor alive longer than autograd does.
    leaves, spec = tree.flatten((args, kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    consts = [None if isinstance(v, torch.Tensor) else v for v in leaves]

    def run(*flat: torch.Tensor) -> Any:
        filled = list(consts)
        for i, t in zip(where, flat):
            filled[i] = t
        a, kw = tree.unflatten(filled, spec)
        return fn(*a, **kw)

    # Non-reentrant: works with inputs that need no gradient (token ids), lets the gradient
    # flow on to a leaf stage input, and preserve_rng_state replays dropout's masks.
    return checkpoint(run, *[leaves[i] for i in where], use_reentrant=False,
                      preserve_rng_state=True)


def _selective_modules(root: nn.Module) -> list[nn.Module]:
    """The outermost submodules marked `pipeflow_selective = True` (a marked module's own
    marked children are covered by its checkpoint)."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if getattr(m, "pipeflow_selective", False) is True:
            found.append(m)
            return
        for child in m.children():
            visit(child)

    visit(root)
    return found


@contextlib.contextmanager
def _selective(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Run marked submodules' forwards under checkpoint while the context is open.

    An instance attribute `forward` shadows the class's method for the duration only, so the
    same modules run unchanged under every other policy (and hooks still fire around them).
    The recomputation calls the original bound method, so it works after the context closes.
    """
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for layer in layers:
            for m in _selective_modules(layer):
                own = m.__dict__.get("forward", _MISSING)
                m.forward = functools.partial(_checkpointed, m.forward)
                patched.append((m, own))
        yield
    finally:
        for m, own in reversed(patched):
            if own is _MISSING:
                del m.forward
            else:
                m.forward = own


_MISSING = object()


# -- the memory meter -------------------------------------------------------------------

class _Saved:
    """A tensor saved for backward while a meter counts it; its deletion (autograd freeing
    the saved variable) releases it from the count."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "SavedTensorMeter", key: tuple) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def _storage(t: torch.Tensor) -> tuple[tuple, int]:
    """(key, bytes) of the storage under `t`: views of one storage share the key."""
    try:
        s = t.untyped_storage()
        return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError):   # storage-less tensors (sparse, subclasses)
        return ("object", id(t)), t.numel() * t.element_size()


def _is_parameter(t: torch.Tensor) -> bool:
    # Weights saved by a layer (or a view such as weight.t()) are the model, not activations.
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class SavedTensorMeter:
    """Counts the bytes autograd keeps for backward: the activation memory of a stash.

    While entered (`with meter:`), every tensor saved for backward is counted once per
    storage (views of one storage count once) until autograd frees it, normally in the
    backward that uses it. Parameters are not counted. Checkpointed segments count the inputs
    they keep for their recomputation. `current` is the bytes held now, `peak` the most held
    since the meter was made or `reset_peak()`; the meter may be entered many times (once per
    micro-batch forward) and keeps counting across entries, since what a forward saved stays
    held until its backward.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._held: dict[tuple, list[int]] = {}     # storage key -> [bytes, saved refs]
        self._hooks: list[Any] = []
        # Autograd may free saved tensors on its own worker threads (CUDA backward); a
        # reentrant lock, since a garbage collection inside _pack can run a release.
        self._lock = threading.RLock()

    def __enter__(self) -> "SavedTensorMeter":
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.pop().__exit__(*exc)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now (call at the start of each step)."""
        self.peak = self.current

    @property
    def storages(self) -> int:
        """How many distinct storages are held now."""
        return len(self._held)

    def _pack(self, t: torch.Tensor) -> Any:
        if _is_parameter(t):
            return t
        key, nbytes = _storage(t)
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                self._held[key] = [nbytes, 1]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            else:
                entry[1] += 1
        # Detached: a saved output would otherwise hold its own grad_fn, which holds the
        # saved tensor — a cycle nothing frees while a graph is kept for a later W.
        return _Saved(t.detach(), self, key)

    def _release(self, key: tuple) -> None:
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[key]
                self.current -= entry[0]

    def __repr__(self) -> str:
        return (f"SavedTensorMeter(current={self.current}, peak={self.peak}, "
                f"storages={self.storages})")


# -- measuring a stage and choosing its policy ------------------------------------------

class LayerBytes(NamedTuple):
    """Bytes one micro-batch keeps for backward, measured per layer of a stage."""

    saved: list[int]          # per layer under `none`
    selective: list[int]      # per layer under `selective` (== saved where nothing is marked)
    boundary: int             # the largest segment input: the stage input or a layer output
    tail: int = 0             # kept by the stage's tail (its loss) under every policy


def measure_layers(layers: Sequence[nn.Module], sample_input: Any,
                   tail: Callable[[Any], Any] | None = None) -> LayerBytes:
    """Measure one micro-batch's saved bytes per layer, under `none` and `selective`.

    Runs two forwards of `sample_input` (a micro-batch of the stage's input; its floating
    tensors stand in for a received activation that needs a gradient) with the layers in
    their current mode, so call it in training mode for dropout's masks to count. `tail`
    is what the stage runs on its output in the same forward and never recomputes (the loss
    on the last stage: `lambda out: loss_fn(out, targets)`). The caller's random state is
    left as it was; the graphs are dropped and no gradient is made.
    """
    x = tree.map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()),
                         sample_input)
    devices = sorted({t.device.index or 0 for t in tree.tensors(x) if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        saved, boundary, tail_bytes = _per_layer(layers, x, "none", tail)
        selective, _, _ = _per_layer(layers, x, "selective", tail)
    return LayerBytes(saved, selective, boundary, tail_bytes)


def _per_layer(layers: Sequence[nn.Module], x: Any, policy: str,
               tail: Callable[[Any], Any] | None) -> tuple[list[int], int, int]:
    meter = SavedTensorMeter()
    per_layer, boundary = [], _floating_bytes(x)
    selective = _selective(layers) if policy == "selective" else contextlib.nullcontext()
    with selective, meter:
        for i, layer in enumerate(layers):
            before = meter.current
            x = layer(x)        # each output's graph keeps the earlier layers' saves alive
            per_layer.append(meter.current - before)
            if i < len(layers) - 1:
                # A segment may start after any layer but the last; the stage's output is
                # the engine's to keep (or the loss's), under every policy alike.
                boundary = max(boundary, _floating_bytes(x))
        before = meter.current
        if tail is not None:
            x = tail(x)
        tail_bytes = meter.current - before
    return per_layer, boundary, tail_bytes


def _floating_bytes(obj: Any) -> int:
    storages = dict(_storage(t) for t in tree.tensors(obj) if t.is_floating_point())
    return sum(storages.values())


def _held_and_transient(policy: str, saved: Sequence[int], selective: Sequence[int] | None,
                        boundary: int) -> tuple[int, int]:
    """(bytes one stashed micro-batch holds, extra bytes while one micro-batch recomputes)."""
    n = len(saved)
    k = _segment_size(policy, n)
    if k is None:
        if normalise_policy(policy) == "none":
            return sum(saved), 0
        if selective is None or len(selective) != n:
            raise ValueError(f"the selective estimate needs selective bytes for each of the "
                             f"{n} layers, found {selective!r}")
        # Recomputing a layer's marked insides brings back what selective did not keep.
        return sum(selective), max((a - b for a, b in zip(saved, selective)), default=0)
    segments = [saved[i:i + k] for i in range(0, n, k)] or [[]]
    # Each segment keeps its input; in the backward one segment at a time is recomputed.
    return len(segments) * boundary, max(sum(s) for s in segments)


def estimate_stash_bytes(policy: str, saved_bytes_per_layer: Sequence[int],
                         selective_saved_bytes_per_layer: Sequence[int] | None,
                         boundary_bytes: int, stash_depth: int, *, tail_bytes: int = 0) -> int:
    """Peak activation bytes of a stage holding `stash_depth` micro-batches under `policy`.

    Each of the `stash_depth` micro-batches holds what the policy keeps (plus `tail_bytes`,
    the loss's, never recomputed); during a backward one micro-batch's recomputation (a
    segment, or a layer's marked insides) comes on top. The kept part is exactly what
    `SavedTensorMeter` measures over the stash, since the recomputation runs in the backward
    outside the meter; the total models an allocator's peak, an upper bound of the meter.
    """
    if stash_depth < 0:
        raise ValueError(f"stash_depth must be >= 0, found {stash_depth}")
    held, transient = _held_and_transient(policy, saved_bytes_per_layer,
                                          selective_saved_bytes_per_layer, boundary_bytes)
    return stash_depth * (held + tail_bytes) + (transient if stash_depth else 0)


def _candidates(n_layers: int, selective: bool) -> list[str]:
    # Cheapest compute first: selective reruns only the marked insides; every:k and full
    # rerun the whole forward once, fewer checkpoints (larger k) first, full last.
    return (["none"] + (["selective"] if selective else [])
            + [f"every:{k}" for k in range(n_layers - 1, 0, -1)] + ["full"])


def choose_auto(saved_bytes_per_layer: Sequence[int], boundary_bytes: int, stash_depth: int,
                budget_bytes: int, *,
                selective_saved_bytes_per_layer: Sequence[int] | None = None,
                tail_bytes: int = 0, where: str = "") -> str:
    """The cheapest policy whose estimated stash (`estimate_stash_bytes`) fits the budget.

    Tried in order none, selective (when measured and it keeps less), every:k from the
    largest k down, full. Under 1F1B stage s holds min(p - s, m) micro-batches
    (`pipeflow.schedules.simulate(...).peak_stash[s]`), so the first stages recompute most.
    `where` names the rank and stage in the error raised when no policy fits.
    """
    saved = list(saved_bytes_per_layer)
    sel = (list(selective_saved_bytes_per_layer)
           if selective_saved_bytes_per_layer is not None else None)
    use_selective = sel is not None and sum(sel) < sum(saved)
    need = {p: estimate_stash_bytes(p, saved, sel, boundary_bytes, stash_depth,
                                    tail_bytes=tail_bytes)
            for p in _candidates(len(saved), use_selective)}
    for policy, nbytes in need.items():
        if nbytes <= budget_bytes:
            return policy
    least = min(need, key=need.__getitem__)
    prefix = f"{where}: " if where else ""
    raise ConfigError(
        f"{prefix}recompute='auto' cannot fit a stash of {stash_depth} micro-batch(es) in the "
        f"activation budget of {format_bytes(budget_bytes)}: the least any policy needs is "
        f"{format_bytes(need[least])} ({least}; none needs {format_bytes(need['none'])}). "
        f"Raise the budget to at least {format_bytes(need[least])}, use smaller micro-batches, "
        f"or more pipeline stages")


def auto_policy(layers: Sequence[nn.Module], sample_input: Any, stash_depth: int,
                budget_bytes: int, where: str = "",
                tail: Callable[[Any], Any] | None = None) -> str:
    """Measure the stage on a sample micro-batch (`measure_layers`) and `choose_auto`."""
    b = measure_layers(layers, sample_input, tail)
    return choose_auto(b.saved, b.boundary, stash_depth, budget_bytes,
                       selective_saved_bytes_per_layer=b.selective, tail_bytes=b.tail,
                       where=where)
