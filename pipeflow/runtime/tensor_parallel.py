"""Tensor parallelism inside a stage: a layer's `tp_plan` cuts its matrices over the tensor
group, and collectives inside autograd make the cut layer compute what the whole one does.

A layer says how it splits with a `tp_plan` dictionary on its class or instance: submodule
names (fnmatch patterns, as transformers' `base_model_tp_plan`) to a style, with the meaning
`torch.distributed.tensor.parallel` gives it:

    class Block(nn.Module):
        tp_plan = {"attn.qkv": ("colwise", 3), "attn.proj": "rowwise",
                   "mlp.up": "colwise", "mlp.down": "rowwise"}

- `"colwise"` on `nn.Linear`: output features cut (weight rows, bias); the input is copied to
  the group (identity forward, all-reduce of its gradient backward: Megatron's
  `copy_to_tensor_model_parallel_region`). `("colwise", k)`: the output is `k` fused blocks
  (q, k, v) and each block is cut, so rank r holds its slice of every block.
  `("colwise", k, unit)`: each rank's slice of a block is a whole number of `unit`s (a head).
  `("colwise", (q, k, v), unit)`: fused blocks of unequal widths (Phi-3's q, k and v with
  fewer key/value heads), each cut alike. A layout interleaved per head ([h0: q k v][h1: q
  k v]...: GPT-NeoX, Bloom, Falcon's groups) is plain `("colwise", 1, unit)` with `unit` a
  head's q, k and v together: a rank's contiguous run of whole heads.
- `"rowwise"` on `nn.Linear`: input features cut (weight columns); the partial products are
  summed over the group (`reduce_from`: all-reduce forward, identity backward), then the
  whole bias added once.
- `"gather_sequence"` on any module: under sequence parallelism its input is gathered whole
  on entry (for code that reshapes by its input's length, as transformers' attention does)
  and its column layers take it as it is; without sequence parallelism nothing.
- `"partial_gradient"` on any module: its whole weights act on this rank's slice of the
  features (a norm over each head of q and k), so their gradient is summed over the group.
- `"tokenwise"` on any module that acts on each token (row) alone, with its weights cut by
  `Shard` entries (an expert bank, a shared expert): each rank computes every token with its
  slices and the group sums the outputs (copy-to of its floating inputs, reduce-from of its
  output; under sequence parallelism every rank's tokens gathered in, each rank's sums
  scattered out). See "Parameter cuts" below.
- `"rowwise"` on `nn.Embedding`: the vocabulary cut (a vocabulary-parallel embedding: ids
  outside a rank's rows give zeros, the group sums); `"colwise"` on `nn.Embedding`: the
  embedding width cut, the slices gathered.

`register_linear` lets a plan cut other linear maps: a subclass of `nn.Linear` with its own
forward (Falcon's `FalconLinear`), or one that stores its weight (in, out) (transformers'
`Conv1D`: GPT-2's dimensions transposed).

Everything the plan does not name is replicated: every tensor rank holds it whole, computes
it alike and gets the same gradient. Each layer is built whole under its own seed (as
`build_sequential` builds it) and then cut, so every grid starts from the same weights; the
parameters keep their names and their shapes say which slice a rank holds (`split_of`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import weakref
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from pipeflow.comm.base import Communicator
from pipeflow.config import ConfigError
from pipeflow.layers import layer_seed

__all__ = ["TensorGroup", "Split", "plan_of", "shard_layer", "split_of", "cut", "kept_ranges",
           "join", "gather_whole", "check_cut_consistent", "register_linear",
           "copy_to", "reduce_from", "Shard", "Once"]

STYLES = ("colwise", "rowwise", "gather_sequence", "partial_gradient", "tokenwise")


@dataclasses.dataclass(frozen=True)
class Split:
    """One `tp_plan` entry: the style, the fused blocks of the cut dimension (`k` equal
    blocks, or a tuple of the blocks' whole widths), and the unit each rank's slice of a
    block must be a whole number of (a head's width)."""

    style: str
    parts: int | tuple[int, ...] = 1
    unit: int = 1
    optional: bool = False      # a degree that does not divide leaves the module whole
    # the pattern may name nothing in a layer (a plan shared by dense and MoE blocks)
    if_present: bool = False
    # colwise by heads with fewer heads than ranks (grouped key/value heads, one for every
    # query head at t = 8): each rank computes the one head its query heads read, from the
    # whole weight, whose gradient is summed over the group (Megatron's replicated heads)
    replicate: bool = False

    @classmethod
    def parse(cls, value: Any, where: str) -> "Split":
        if isinstance(value, Split):
            return value
        items = (value,) if isinstance(value, str) else tuple(value) \
            if isinstance(value, (tuple, list)) else None
        ok = (items is not None and 1 <= len(items) <= 3 and items[0] in STYLES
              and all(_whole(n) for n in items[2:])
              and (len(items) < 2 or _whole(items[1]) or _widths_given(items[1])))
        if not ok:
            raise ConfigError(
                f"{where}: expected \"colwise\", \"rowwise\" or (style, fused blocks[, unit]) "
                f"with whole numbers >= 1 (the blocks a count or a tuple of widths), found "
                f"{value!r}; e.g. \"colwise\", (\"colwise\", 3, head_dim) for a fused q, k, v "
                f"projection or (\"colwise\", (q_width, kv_width, kv_width), head_dim)")
        if len(items) > 1 and isinstance(items[1], list):
            items = (items[0], tuple(items[1]), *items[2:])
        return cls(*items)


def _whole(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _widths_given(parts: Any) -> bool:
    return isinstance(parts, (tuple, list)) and len(parts) >= 1 and all(map(_whole, parts))


class RankRandom:
    """Random draws on slices: each tensor rank its own stream (Megatron's model-parallel
    random state), everywhere else the stream the group shares.

    The tensor ranks of a group share one random stream (`Engine` seeds them alike), so a
    dropout on a whole, replicated activation draws the same mask on every rank, as it must.
    On a slice (this rank's heads, between a column layer and its row layer; under sequence
    parallelism, this rank's positions anywhere in the layer) the same stream would draw the
    same mask on every rank: heads h and h + H/t, or positions i and i + S/t, dropped alike.
    There each rank draws from its own stream instead, seeded from one draw of the shared
    stream and the tensor rank: the shared stream advances alike on every rank, and a
    recomputed layer (its random state replayed) draws again what it drew."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.depth = 0                   # nested stretches (a layer, a cut region inside)
        self.cut_open = False            # between a column layer and its row layer
        self._saved: list[tuple[Any, torch.Tensor]] = []

    @staticmethod
    def _generators() -> list[Any]:
        gens = [torch.default_generator]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gens.append(torch.cuda.default_generators[torch.cuda.current_device()])
        return gens

    def enter(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        shared = int(torch.randint(0, 2**62, ()))       # the shared stream moves alike
        seed = layer_seed(shared, self.rank)
        self._saved = [(g, g.get_state()) for g in self._generators()]
        for g, _ in self._saved:
            g.manual_seed(seed)

    def leave(self) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            for g, state in self._saved:
                g.set_state(state)
            self._saved = []

    def open_cut(self) -> None:
        """A column layer's output: this rank's slice of the features from here on."""
        if not self.cut_open:
            self.cut_open = True
            self.enter()

    def close_cut(self) -> None:
        """A row layer's input (its output is whole again), or the layer's end."""
        if self.cut_open:
            self.cut_open = False
            self.leave()


def draws_random(layer: nn.Module) -> bool:
    """Whether `layer` draws random numbers in training (a dropout): an `nn.Dropout` of
    p > 0, or a float attribute `dropout` / `attention_dropout` / `dropout_p` > 0 (what
    attention code passes to `scaled_dot_product_attention`, transformers' attention
    modules). `tp_random = True / False` on the layer says it outright."""
    said = getattr(layer, "tp_random", None)
    if said is not None:
        return bool(said)
    for module in layer.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for field in ("dropout", "attention_dropout", "dropout_p"):
            value = getattr(module, field, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


def _own_random_stretches(layer: nn.Module, group: "TensorGroup") -> None:
    """A layer that draws random numbers draws its own on this rank's slices (`RankRandom`):
    its column layers open a stretch, its row layers close it, and under sequence
    parallelism the whole layer (its positions are this rank's) is one."""
    for module in layer.modules():
        module.pf_random = True
    inner = layer.forward
    random = group.random

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not layer.training:
            return inner(*args, **kwargs)
        sliced = group.sequence_parallel and getattr(layer, "pf_in_region", False)
        if sliced:
            random.enter()
        try:
            return inner(*args, **kwargs)
        finally:
            random.close_cut()         # a column layer with no row layer after it
            if sliced:
                random.leave()
    layer.forward = forward


class TensorGroup:
    """A stage's handle on its tensor group: its size, this rank's place, and (bound once the
    communicators exist) the `Communicator` the layers' collectives run on."""

    def __init__(self, size: int, rank: int, sequence_parallel: bool = False) -> None:
        self.size, self.rank, self.sequence_parallel = size, rank, sequence_parallel
        self.comm: Communicator | None = None
        self.gathered = 0        # inside a `gather_sequence` module (sequence parallelism)
        self.waiting = ""        # the collective this rank waits in (the watchdog says it)
        self._copied: tuple[Any, Any] | None = None    # the last input copied to the group
        self.random = RankRandom(rank)    # this rank's own masks on slices (dropout)

    def allreduce(self, x: torch.Tensor, key: str) -> torch.Tensor:
        """A new tensor: `x` summed over the group. Halves are summed in fp32 over MPI (which
        has no bf16 sum), natively over torch.distributed."""
        native = type(self.comm).__name__ == "TorchDistCommunicator"
        wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) and not native \
            else x.dtype
        y = x.detach().to(wide, memory_format=torch.contiguous_format, copy=True)
        self.wait(self.comm.iallreduce_(y, key=key), key)
        return y.to(x.dtype)

    def wait(self, request: Any, key: str) -> None:
        """Wait for a collective, named for the watchdog's report while it lasts."""
        self.waiting = key
        request.wait()
        self.waiting = ""

    def copy(self, x: torch.Tensor, key: str) -> torch.Tensor:
        """`copy_to(x)`, once for an input that several column layers read (q, k and v; gate
        and up): their gradients meet in one all-reduce instead of one each."""
        if self._copied is not None:
            seen, made = (ref() for ref in self._copied)
            if seen is x and made is not None:
                return made
        y = _CopyTo.apply(x, self, key)
        if torch.is_grad_enabled():
            self._copied = (weakref.ref(x), weakref.ref(y))
        return y


class _CopyTo(torch.autograd.Function):
    """Identity forward; the gradient summed over the tensor group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup, key: str) -> torch.Tensor:
        ctx.group, ctx.key = group, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.group.allreduce(grad, f"{ctx.key} (input gradient)"), None, None


class _ReduceFrom(torch.autograd.Function):
    """Partial results summed over the tensor group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup, key: str) -> torch.Tensor:
        return group.allreduce(x, key)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class _GatherLast(torch.autograd.Function):
    """Each rank's slice of the last dimension gathered whole forward; the rank's slice of
    the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup, key: str) -> torch.Tensor:
        ctx.group = group
        return torch.cat(_allgather(x.detach(), group, key).unbind(0), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad.chunk(ctx.group.size, dim=-1)[ctx.group.rank].contiguous(), None, None


SEQ = 1      # the sequence dimension of activations: [batch, sequence, features]


def _wide(x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    native = type(group.comm).__name__ == "TorchDistCommunicator"
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) and not native else x


def _allgather(x: torch.Tensor, group: TensorGroup, key: str) -> torch.Tensor:
    """Every rank's `x` stacked in rank order: [size, *x.shape]."""
    shard = x.contiguous()
    # Flat, as every backend's all-gather takes it: `size` blocks of the shard's elements.
    out = torch.empty(group.size * shard.numel(), dtype=shard.dtype, device=shard.device)
    group.wait(group.comm.iallgather_(shard.view(-1), out, key=key), key)
    return out.view(group.size, *shard.shape)


def _seq_dim(x: torch.Tensor) -> int:
    """The dimension a column or row layer's input is gathered and scattered along: the
    sequence of [batch, sequence, features], or the tokens of [tokens, features] (a block
    that flattens batch and sequence before its MLP, as OPT's: its rows are per token, so
    any order works that the scatter undoes)."""
    return SEQ if x.dim() > 2 else 0


def _seq_gather(x: torch.Tensor, group: TensorGroup, key: str,
                dim: int | None = None) -> torch.Tensor:
    """Every rank's slice of the sequence (or of dimension `dim`), whole (in rank order)."""
    dim = _seq_dim(x) if dim is None else dim
    shard = _wide(x.detach(), group).transpose(0, dim)
    out = _allgather(shard, group, key)
    whole = out.reshape(group.size * shard.shape[0], *shard.shape[1:])
    return whole.transpose(0, dim).to(x.dtype)


def _seq_reduce_scatter(x: torch.Tensor, group: TensorGroup, key: str,
                        dim: int | None = None) -> torch.Tensor:
    """The sum over the group of `x` (whole sequence, or dimension `dim`), this rank's slice
    of it."""
    dim = _seq_dim(x) if dim is None else dim
    whole = _wide(x.detach(), group)
    whole = (whole.transpose(0, dim) if dim else whole).contiguous()
    out = torch.empty((whole.shape[0] // group.size, *whole.shape[1:]), dtype=whole.dtype,
                      device=whole.device)
    group.wait(group.comm.ireduce_scatter_(whole.view(-1), out.view(-1), key=key), key)
    return (out.transpose(0, dim) if dim else out).to(x.dtype)


def _seq_slice(x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    return x.chunk(group.size, SEQ)[group.rank].contiguous()


class _SeqColwise(torch.autograd.Function):
    """A column layer under sequence parallelism (Megatron's
    `LinearWithGradAccumulationAndAsyncCommunication`): the input's sequence slices
    all-gathered forward, the product taken; only the slice is kept for backward, which
    gathers it again for the weight gradient and reduce-scatters the input gradient, so the
    whole sequence's input is never kept between forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: TensorGroup, key: str) -> torch.Tensor:
        ctx.group, ctx.key, ctx.has_bias = group, key, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_seq_gather(x, group, key), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        group, key = ctx.group, ctx.key
        total = _seq_gather(x, group, f"{key} (input again, for the weight gradient)")
        grad_x = _seq_reduce_scatter(grad @ weight, group, f"{key} (input gradient)") \
            if ctx.needs_input_grad[0] else None
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.t() @ total.reshape(-1, total.shape[-1]) \
            if ctx.needs_input_grad[1] else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


class _GatherSeq(torch.autograd.Function):
    """Into a module that needs the whole sequence (`gather_sequence`), or every rank's
    tokens (`dim` 0: a `tokenwise` module): all-gather forward, reduce-scatter backward; the
    column layers inside then take it as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup, key: str,
                dim: int | None = None) -> torch.Tensor:
        ctx.group, ctx.key, ctx.dim = group, key, dim
        return _seq_gather(x, group, key, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (_seq_reduce_scatter(grad, ctx.group, f"{ctx.key} (input gradient)", ctx.dim),
                None, None, None)


class _ScatterSeq(torch.autograd.Function):
    """Out of a row layer (or a `tokenwise` module, `dim` 0): reduce-scatter forward,
    all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup, key: str,
                dim: int | None = None) -> torch.Tensor:
        ctx.group, ctx.key, ctx.dim = group, key, dim
        y = _seq_reduce_scatter(x, group, key, dim)
        # not a view: blocks add into their row layers' outputs in place (Falcon's MLP)
        return y.contiguous() if y._is_view() else y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (_seq_gather(grad, ctx.group, f"{ctx.key} (output gradient)", ctx.dim),
                None, None, None)


class _EnterSeq(torch.autograd.Function):
    """Whole (replicated) activations into a sequence-parallel region: this rank's slice
    forward; the slices gathered backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup, key: str) -> torch.Tensor:
        ctx.group, ctx.key = group, key
        return _seq_slice(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _seq_gather(grad, ctx.group, f"{ctx.key} (gradient)"), None, None


class _LeaveSeq(torch.autograd.Function):
    """Out of a sequence-parallel region: the slices gathered forward; this rank's slice of
    the (replicated) gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup, key: str) -> torch.Tensor:
        ctx.group = group
        return _seq_gather(x, group, key)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _seq_slice(grad, ctx.group), None, None


def copy_to(x: torch.Tensor, group: TensorGroup, key: str) -> torch.Tensor:
    """Identity forward, the gradient summed over the group backward (once per input)."""
    return group.copy(x, key)


def reduce_from(x: torch.Tensor, group: TensorGroup, key: str) -> torch.Tensor:
    """Partial results summed over the group (all-reduce forward, identity backward)."""
    return _ReduceFrom.apply(x, group, key)


# -- the cut layers: nn.Linear and nn.Embedding with the group's collectives around them ----

def _sequence(module: nn.Module) -> bool:
    """Whether `module` runs on sequence slices now: sequence parallelism on, and its layer
    inside the region (`sequence_boundaries`)."""
    return module.pf_tensor.sequence_parallel and getattr(module, "pf_in_region", False)


def _open_cut(module: nn.Module) -> None:
    if getattr(module, "pf_random", False) and module.training:
        module.pf_tensor.random.open_cut()


def _close_cut(module: nn.Module) -> None:
    if getattr(module, "pf_random", False) and module.training:
        module.pf_tensor.random.close_cut()


def _colwise(module: nn.Module, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    """A column layer's product (`weight` (out, in), this rank's output features)."""
    _open_cut(module)
    if module.pf_tensor.gathered:      # inside `gather_sequence`: the whole input is here
        return F.linear(x, weight, bias)
    if _sequence(module):
        return _SeqColwise.apply(x, weight, bias, module.pf_tensor, module.pf_key)
    return F.linear(copy_to(x, module.pf_tensor, module.pf_key), weight, bias)


def _rowwise(module: nn.Module, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    """A row layer's product (`weight` (out, in), this rank's input features), summed."""
    _close_cut(module)
    if _sequence(module):
        y = _ScatterSeq.apply(F.linear(x, weight), module.pf_tensor, module.pf_key)
    else:
        y = reduce_from(F.linear(x, weight), module.pf_tensor, module.pf_key)
    return y if bias is None else y + bias


class ColwiseLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _colwise(self, x, self.weight, self.bias)


class RowwiseLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rowwise(self, x, self.weight, self.bias)


class ColwiseTransposed(nn.Module):
    """`colwise` on a linear map with its weight stored (in, out) (transformers' Conv1D)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _colwise(self, x, self.weight.t(), self.bias)


class RowwiseTransposed(nn.Module):
    """`rowwise` on a linear map with its weight stored (in, out) (transformers' Conv1D)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rowwise(self, x, self.weight.t(), self.bias)


_ROW_CLASSES = (RowwiseLinear, RowwiseTransposed)
_COLUMN_CLASSES = (ColwiseLinear, ColwiseTransposed)


class VocabEmbedding(nn.Embedding):
    """`rowwise` embedding: this rank's rows of the vocabulary; the group sums the lookups."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.pf_tensor.rank * self.num_embeddings
        outside = (ids < start) | (ids >= start + self.num_embeddings)
        local = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, None, None, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from(out, self.pf_tensor, self.pf_key)


class ColwiseEmbedding(nn.Embedding):
    """`colwise` embedding: this rank's columns of every vector, gathered whole."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight, self.padding_idx, None, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        return _GatherLast.apply(out, self.pf_tensor, self.pf_key)


# (module class, style) -> (cut class, {parameter: dimension cut}, the size field it divides)
_CUTS: dict[tuple[type, str], tuple[type, dict[str, int], str]] = {
    (nn.Linear, "colwise"): (ColwiseLinear, {"weight": 0, "bias": 0}, "out_features"),
    (nn.Linear, "rowwise"): (RowwiseLinear, {"weight": 1}, "in_features"),
    (nn.Embedding, "rowwise"): (VocabEmbedding, {"weight": 0}, "num_embeddings"),
    (nn.Embedding, "colwise"): (ColwiseEmbedding, {"weight": 1}, "embedding_dim"),
}


def register_linear(kind: type, transposed: bool = False,
                    fields: tuple[str, str] = ("out_features", "in_features")) -> None:
    """Let a `tp_plan` cut modules of `kind` (exactly that type) as linear maps: `x @ W.T +
    b` as `nn.Linear` computes it (a subclass with its own forward, as Falcon's
    `FalconLinear`), or with `transposed`, `x @ W + b` with the weight stored (in, out)
    (transformers' `Conv1D`); `fields` name its output and input widths. Once cut, the
    module computes through the group's collectives like a cut `nn.Linear`."""
    out_field, in_field = fields
    if transposed:
        _CUTS[(kind, "colwise")] = (ColwiseTransposed, {"weight": 1, "bias": 0}, out_field)
        _CUTS[(kind, "rowwise")] = (RowwiseTransposed, {"weight": 0}, in_field)
    else:
        _CUTS[(kind, "colwise")] = (ColwiseLinear, {"weight": 0, "bias": 0}, out_field)
        _CUTS[(kind, "rowwise")] = (RowwiseLinear, {"weight": 1}, in_field)


def enter_sequence(value: Any, group: TensorGroup, key: str) -> Any:
    """A layer's input entering the sequence-parallel region: this rank's slice of every
    activation ([batch, sequence, ...] floating tensors) in it."""
    if not group.sequence_parallel:      # off for the moment (generation)
        return value
    return _map_activations(value, lambda x: _EnterSeq.apply(x, group, key), group, key)


def leave_sequence(value: Any, group: TensorGroup, key: str) -> Any:
    """A layer's output leaving the sequence-parallel region: the slices gathered whole."""
    if not group.sequence_parallel:
        return value
    return _map_activations(value, lambda x: _LeaveSeq.apply(x, group, key), None, key)


@contextlib.contextmanager
def whole_sequence(group: TensorGroup) -> Iterator[None]:
    """Sequence parallelism off while it lasts (generation: a few new positions a call,
    with a cache of keys and values per position): the tensor split alone."""
    saved, group.sequence_parallel = group.sequence_parallel, False
    try:
        yield
    finally:
        group.sequence_parallel = saved


def _map_activations(value: Any, fn: Any, cut_by: TensorGroup | None, key: str) -> Any:
    if torch.is_tensor(value):
        if not value.is_floating_point() or value.dim() < 2:
            return value
        if cut_by is not None and value.shape[SEQ] % cut_by.size:
            raise ConfigError(
                f"{key}: sequence parallelism cuts the sequence ({value.shape[SEQ]} positions, "
                f"dimension {SEQ} of {tuple(value.shape)}) over tensor = {cut_by.size}, "
                f"which does not divide it; feed sequences of a multiple of {cut_by.size} "
                f"positions, or set sequence_parallel = false")
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_activations(v, fn, cut_by, key) for v in value)
    if isinstance(value, dict):
        return {k: _map_activations(v, fn, cut_by, key) for k, v in value.items()}
    return value


def in_region(layer: nn.Module) -> bool:
    """Whether a cut layer runs on sequence slices under sequence parallelism: one with a
    row layer (whose output is then reduce-scattered); an embedding or a head cut along the
    vocabulary is not."""
    return any(isinstance(m, _ROW_CLASSES) for m in layer.modules())


def sequence_boundaries(layer: nn.Module, index: int, planned: list[bool],
                        group: TensorGroup) -> None:
    """Hooks on a layer of the model's `planned` list (True: `in_region`, so it runs on
    sequence slices): entering the region slices its input, leaving it gathers its output,
    so whole activations flow between the other layers and slices between these (across
    stages too)."""
    if not planned[index]:
        return
    layer.pf_sequence_group = group      # a layer that builds masks from the whole length
    for module in layer.modules():
        module.pf_in_region = True
    key = f"tensor group: layer {index} ({type(layer).__name__})"
    if index == 0 or not planned[index - 1]:
        layer.register_forward_pre_hook(
            lambda _m, args, kwargs: (enter_sequence(args, group, f"{key} input"),
                                      enter_sequence(kwargs, group, f"{key} input")),
            with_kwargs=True)
    if index == len(planned) - 1 or not planned[index + 1]:
        layer.register_forward_hook(
            lambda _m, _args, out: leave_sequence(out, group, f"{key} output"))


def plan_of(layer: nn.Module) -> Mapping[str, Any]:
    """The layer's `tp_plan` (instance first, then class); empty: replicated whole."""
    plan = getattr(layer, "tp_plan", None) or {}
    if not isinstance(plan, Mapping):
        raise ConfigError(f"{type(layer).__name__}.tp_plan must be a dict of submodule name "
                          f"patterns to \"colwise\" / \"rowwise\", found {type(plan).__name__}")
    return plan


def split_of(param: torch.Tensor) -> tuple[int, int | tuple[int, ...]] | None:
    """(dimension, fused blocks) a cut parameter was cut along; None where it is whole."""
    return getattr(param, "pf_tensor_split", None)


def _widths(parts: int | tuple[int, ...], length: int) -> list[int]:
    """The whole widths of the fused blocks along a dimension of `length`."""
    return [length // parts] * parts if isinstance(parts, int) else list(parts)


def cut(whole: torch.Tensor, dim: int, parts: int | tuple[int, ...], size: int,
        rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of `whole`: each of its `parts` blocks along `dim` (a count of
    equal blocks, or their widths) cut in `size`."""
    blocks = whole.split(_widths(parts, whole.shape[dim]), dim)
    return torch.cat([b.chunk(size, dim)[rank] for b in blocks], dim)


def kept_ranges(shape: Sequence[int], split: Any, size: int,
                rank: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Which part of a whole tensor of `shape` rank `rank` of `size` keeps, before the tensor
    is read: `(dim, [(start, stop), ...])`, the ranges along `dim` whose pieces, concatenated
    in order, are `cut`'s slice (one range a fused block). `split` is the parameter's
    `split_of`. None where this function does not know the layout, or the degree does not
    divide it evenly: the reader then reads the whole tensor and `cut`s it.

    The one place a reader learns what to read (`pipeflow.train.hub` reads a Hub folder's
    safetensors files in these ranges, `get_slice(key)[...]`): a new layout of `cut` gives
    its ranges here, and `tests/test_tensor_hub_mpi.py` checks both agree."""
    if not (isinstance(split, tuple) and len(split) == 2 and isinstance(split[0], int)
            and (isinstance(split[1], int) or _widths_given(split[1]))):
        return None
    dim, parts = split
    width = shape[dim] if 0 <= dim < len(shape) else 0
    widths = _widths(parts, width) if width else []
    if not widths or sum(widths) != width or any(w % size for w in widths):
        return None              # `cut`'s uneven chunks: left to it
    ranges, start = [], 0
    for w in widths:             # each fused block (equal ones, or Phi-3's q | k | v)
        piece = w // size
        ranges.append((start + rank * piece, start + (rank + 1) * piece))
        start += w
    return dim, ranges


def join(slices: list[torch.Tensor], dim: int, parts: int | tuple[int, ...]) -> torch.Tensor:
    """The whole tensor from every rank's slice (the inverse of `cut`)."""
    widths = [w // len(slices) for w in _widths(parts, slices[0].shape[dim] * len(slices))]
    blocks = [s.split(widths, dim) for s in slices]
    return torch.cat([torch.cat([b[p] for b in blocks], dim) for p in range(len(widths))],
                     dim)


def whole_shape(shape: torch.Size, dim: int, size: int) -> torch.Size:
    """The whole tensor's shape from a slice's."""
    return torch.Size(n * size if i == dim else n for i, n in enumerate(shape))


def gather_whole(group: TensorGroup, value: torch.Tensor, dim: int,
                 parts: int | tuple[int, ...], key: str) -> torch.Tensor:
    """The whole tensor from this rank's slice `value` and the group's (every rank calls it)."""
    return join(list(_allgather(value.detach(), group, f"tensor group: {key}").unbind(0)),
                dim, parts)


def shard_layer(layer: nn.Module, group: TensorGroup, index: int) -> None:
    """Cut `layer` (built whole) by its `tp_plan` for this rank of `group`, in place: the
    parameters keep their objects (a tie within the stage stays one tensor) and names.
    A plan that does not fit (an unknown style, a pattern that names nothing, a type it
    cannot cut, a width the degree does not divide) raises `ConfigError` naming the layer.
    A layer with a `tp_after_cut(group)` method has it called once the plan is applied (a
    head count its code keeps as an attribute, slopes per head)."""
    name = type(layer).__name__
    plan = plan_of(layer)
    where = f"layer {index} ({name})"
    named = dict(layer.named_modules())
    for pattern, value in plan.items():
        if isinstance(value, (Shard, Once)):
            _cut_parameters(layer, pattern, value, group, where)
            continue
        split = Split.parse(value, f"{where}: tp_plan[{pattern!r}]")
        hits = [n for n in named if n and fnmatch.fnmatchcase(n, pattern)]
        if not hits and split.if_present:
            continue
        if not hits:
            raise ConfigError(
                f"{where}: tp_plan entry {pattern!r} names no submodule; its submodules are "
                f"{[n for n in named if n][:12]}; fix the pattern")
        for sub_name in hits:
            _cut_module(named[sub_name], split, group, f"{where}.{sub_name}",
                        f"layer {index}.{sub_name}")
    _check_tokenwise(layer, where)
    after = getattr(layer, "tp_after_cut", None)
    if after is not None:         # what the layer's code reads from its whole shape
        after(group)
    if plan and draws_random(layer):
        _own_random_stretches(layer, group)


def _gather_sequence(module: nn.Module, group: TensorGroup, key: str) -> None:
    """`gather_sequence`: under sequence parallelism the module's input (its first argument
    or `hidden_states`) is gathered whole on entry (code that reshapes by its input's length,
    as transformers' attention does, sees the whole sequence) and its column layers take it
    as it is; its row layers still scatter their output. Without it, nothing; nor while it
    is off for the moment (`whole_sequence`: generation)."""
    if not group.sequence_parallel:
        return
    entered: list[bool] = []      # per call: whether this one gathered (calls nest in recompute)

    def enter(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        entered.append(group.sequence_parallel)
        if not entered[-1]:
            return None
        group.gathered += 1
        if args:
            return (_GatherSeq.apply(args[0], group, key), *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = _GatherSeq.apply(kwargs["hidden_states"], group, key)
        return args, kwargs

    def leave(_m: nn.Module, _args: tuple, out: Any) -> Any:
        if entered.pop():
            group.gathered -= 1
        return out

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave)


def _cut_module(module: nn.Module, split: Split, group: TensorGroup, where: str,
                key: str) -> None:
    if split.style == "gather_sequence":
        _gather_sequence(module, group, f"tensor group: {key} (gather_sequence)")
        return
    if split.style == "partial_gradient":
        for param in module.parameters():
            param.pf_partial_gradient = True
        return
    if split.style == "tokenwise":
        _tokenwise(module, group, f"tensor group: {key} (tokenwise)")
        return
    kind = next((k for k, _ in _CUTS if type(module) is k), None)
    if kind is None:
        kinds = ", ".join(dict.fromkeys(k.__name__ for k, _ in _CUTS))
        raise ConfigError(
            f"{where}: tp_plan cuts {kinds}, found {type(module).__name__}; "
            f"name its Linear submodules instead, or leave it out of the plan (replicated)")
    if kind is nn.Embedding and (split.parts != 1 or module.max_norm is not None or
                                 (split.style == "rowwise" and module.padding_idx is not None)):
        raise ConfigError(
            f"{where}: a {split.style} nn.Embedding is cut as one block without max_norm"
            f"{' or padding_idx' if split.style == 'rowwise' else ''}; found parts "
            f"{split.parts}, max_norm {module.max_norm}, padding_idx {module.padding_idx}; "
            f"leave it replicated (out of the plan)")
    cls, dims, field = _CUTS[(kind, split.style)]
    total = getattr(module, field)
    if split.optional and not _divides(total, split, group.size):
        return                  # left whole: e.g. a vocabulary of 50257 at tensor = 2
    if split.replicate and _replicates(module, split, group, total, cls, key):
        return
    _check_divides(total, split, group.size, where, field)
    for pname, dim in dims.items():
        param = getattr(module, pname, None)
        if param is None:
            continue
        if split_of(param) is not None:      # a tie within the stage, cut through its twin
            if split_of(param) != (dim, split.parts):
                raise ConfigError(f"{where}.{pname}: a tied weight cut two ways "
                                  f"({split_of(param)} and {(dim, split.parts)}); cut both "
                                  f"holders alike")
            continue
        param.data = cut(param.data, dim, split.parts, group.size, group.rank).clone()
        param.pf_tensor_split = (dim, split.parts)
    setattr(module, field, total // group.size)
    module.__class__ = cls
    module.pf_tensor, module.pf_key = group, f"tensor group: {key} ({split.style})"


class ReplicatedHeads(nn.Linear):
    """`Split(..., replicate=True)` with fewer heads than ranks: the whole weight on every
    rank, this rank computing its one head (rows `pf_rows`) as a column layer would; the
    gradient (a share of the whole, from this rank's query heads) is summed over the group
    (`pf_partial_gradient`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.pf_rows
        return _colwise(self, x, self.weight[rows],
                        None if self.bias is None else self.bias[rows])


def _replicates(module: nn.Module, split: Split, group: TensorGroup, total: int, cls: type,
                key: str) -> bool:
    """Replicate a colwise nn.Linear's heads where there are fewer than ranks and the ranks
    share them evenly (`Split.replicate`); False where it cuts as usual."""
    heads = total // split.unit if split.parts == 1 and total % split.unit == 0 else 0
    if cls is not ColwiseLinear or not heads or heads % group.size == 0 or \
            group.size % heads:
        return False
    share = group.size // heads                  # ranks reading each head
    head = group.rank // share                   # query heads r·H/t .. read head r // share
    module.pf_rows = slice(head * split.unit, (head + 1) * split.unit)
    for param in module.parameters(recurse=False):
        param.pf_partial_gradient = True
    module.out_features = split.unit
    module.__class__ = ReplicatedHeads
    module.pf_tensor, module.pf_key = group, f"tensor group: {key} (replicated heads)"
    return True


def _divides(total: int, split: Split, t: int) -> bool:
    """Whether each fused block of a `total` wide dimension cuts in `t` whole units."""
    if isinstance(split.parts, int):
        return total % (split.parts * split.unit * t) == 0
    return sum(split.parts) == total and all(w % (split.unit * t) == 0 for w in split.parts)


def _check_divides(total: int, split: Split, t: int, where: str, field: str) -> None:
    if _divides(total, split, t):
        return
    if not isinstance(split.parts, int) and sum(split.parts) != total:
        raise ConfigError(f"{where}: {split.style} cuts {field} = {total} as fused blocks of "
                          f"widths {split.parts}, which sum to {sum(split.parts)}; give the "
                          f"blocks' widths as the module holds them")
    fits = [d for d in range(2, 129) if _divides(total, split, d)][:8] or [1]
    unit = f" in units of {split.unit}" if split.unit > 1 else ""
    blocks = "" if split.parts == 1 else f" (fused blocks of widths {split.parts})" \
        if isinstance(split.parts, tuple) else f" ({split.parts} fused blocks)"
    raise ConfigError(
        f"{where}: {split.style} cuts {field} = {total}{blocks}{unit} over tensor = {t}, "
        f"which does not divide it; tensor degrees that would: {fits}; change "
        f"Config.tensor or the model's width")


def check_cut_consistent(module: nn.Module, where: str) -> None:
    """No module computes with a weight cut for another: a weight tied within the stage is
    cut through one holder, so every holder must be cut alike (or none)."""
    cut_classes = tuple(c for c, _, _ in _CUTS.values())
    for name, sub in module.named_modules():
        if isinstance(sub, cut_classes):
            continue
        for pname, param in sub.named_parameters(recurse=False):
            if split_of(param) is not None and not getattr(param, "pf_shard", False):
                raise ConfigError(
                    f"{where}: {name}.{pname} is a weight tied to one cut by a tp_plan, but "
                    f"{name} ({type(sub).__name__}) is not cut; give every holder of a tied "
                    f"weight the same tp_plan style")


# -- parameter cuts: an expert bank's 3-D weights, a vector per head, a bias added once ------
#
# transformers 5 keeps a mixture's experts as fused 3-D parameters of one module
# (`gate_up_proj` (experts, 2 x inner, hidden), `down_proj` (experts, hidden, inner)), not as
# `nn.Linear`s, and some blocks read a parameter per head (GPT-OSS's attention sinks). A
# `Shard` entry names parameters (not modules) and cuts each along a dimension; its module
# computes with the slice as it is, with no collective of its own: the boundary is the
# `tokenwise` module around it (an expert bank: the inner width cut, the group sums), or the
# cut layers beside it (a sink per head of a head-cut attention).

@dataclasses.dataclass(frozen=True)
class Shard:
    """A `tp_plan` entry naming parameters: each cut along `dim` (its `parts` fused blocks each
    cut, every slice a whole number of `unit`s), e.g. `Shard(1, 2)` for an expert bank's
    fused gate and up, `Shard(2)` for its down projection, `Shard(0)` for a vector per head."""

    dim: int
    parts: int = 1
    unit: int = 1
    if_present: bool = False    # the pattern may name nothing in a layer

    @property
    def style(self) -> str:
        return "shard"


@dataclasses.dataclass(frozen=True)
class Once:
    """A `tp_plan` entry naming whole parameters that a `tokenwise` module adds to each
    token's output (an expert bank's down-projection bias): tensor rank 0 adds them, the
    others add zeros, and their gradient is summed over the group, so the sum counts them
    once."""

    if_present: bool = False


def _cut_parameters(layer: nn.Module, pattern: str, entry: "Shard | Once", group: TensorGroup,
                    where: str) -> None:
    named = dict(layer.named_parameters())
    hits = [n for n in named if fnmatch.fnmatchcase(n, pattern)]
    if not hits and not entry.if_present:
        raise ConfigError(
            f"{where}: tp_plan entry {pattern!r} ({entry}) names no parameter; its parameters "
            f"are {list(named)[:12]}; fix the pattern")
    for name in hits:
        param, here = named[name], f"{where}.{name}"
        if isinstance(entry, Once):
            owner, _, attr = name.rpartition(".")
            _added_once(layer.get_submodule(owner), attr, group)
            continue
        if not 0 <= entry.dim < param.dim():
            raise ConfigError(f"{here}: Shard cuts dimension {entry.dim} of a parameter of "
                              f"shape {tuple(param.shape)}; name a dimension it has")
        if split_of(param) is not None:
            raise ConfigError(f"{here}: cut twice (tp_plan patterns overlap); name it once")
        _check_divides(param.shape[entry.dim], entry, group.size, here,
                       f"dimension {entry.dim}")
        param.data = cut(param.data, entry.dim, entry.parts, group.size, group.rank).clone()
        param.pf_tensor_split, param.pf_shard = (entry.dim, entry.parts), True


def _added_once(owner: nn.Module, name: str, group: TensorGroup) -> None:
    """`Once`: while `owner` runs on a tensor rank other than 0, its parameter `name` reads as
    zeros (still in the graph, so its gradient exists, zero, for the group's sum)."""
    getattr(owner, name).pf_partial_gradient = True
    if group.rank == 0:
        return
    held: list[Any] = []

    def enter(module: nn.Module, _args: tuple) -> None:
        held.append(module._parameters[name])
        module._parameters[name] = held[-1] * 0

    def leave(module: nn.Module, _args: tuple, _out: Any) -> None:
        module._parameters[name] = held.pop()

    owner.register_forward_pre_hook(enter)
    owner.register_forward_hook(leave)


def _tokenwise(module: nn.Module, group: TensorGroup, key: str) -> None:
    """`tokenwise`: the module's floating inputs (the tokens, an expert bank's routing
    weights) are copied to the group (their gradients summed) and its output is summed over
    it. Under sequence parallelism (its layer in the region) every rank's tokens are gathered
    along dimension 0 first, integer inputs (expert indices) too, and each rank keeps the
    sums of its own tokens: a per-token module does not mind their order."""
    module.pf_tensor, module.pf_key, module.pf_tokenwise = group, key, True

    def one(x: Any, rows: bool) -> Any:
        if not torch.is_tensor(x):
            return x
        if rows:
            return _GatherSeq.apply(x, group, key, 0) if x.is_floating_point() \
                else _seq_gather(x, group, f"{key} (indices)", 0)
        return copy_to(x, group, key) if x.is_floating_point() else x

    def enter(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rows = _sequence(m)
        return (tuple(one(a, rows) for a in args),
                {k: one(v, rows) for k, v in kwargs.items()})

    def leave(m: nn.Module, _args: tuple, out: Any) -> Any:
        if not torch.is_tensor(out):
            raise ConfigError(f"{key}: a tokenwise module returns one tensor (its output for "
                              f"every token), found {type(out).__name__}; name the module "
                              f"inside it that does")
        if _sequence(m):
            return _ScatterSeq.apply(out, group, key, 0)
        return reduce_from(out, group, key)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave)


def _check_tokenwise(layer: nn.Module, where: str) -> None:
    """Inside a `tokenwise` module every parameter is cut (`Shard`) or added once (`Once`):
    a whole one would be counted once per tensor rank in the sum."""
    for name, module in layer.named_modules():
        if not getattr(module, "pf_tokenwise", False):
            continue
        whole = [n for n, p in module.named_parameters()
                 if split_of(p) is None and not getattr(p, "pf_partial_gradient", False)]
        if whole:
            raise ConfigError(
                f"{where}.{name}: a tokenwise module sums its output over the tensor group, "
                f"but its parameters {whole} are neither cut (Shard) nor added once (Once): "
                f"each rank would add them whole; give them a tp_plan entry")


# -- the vocabulary cut: logits stay in slices into the loss --------------------------------

_ACTIVE: list[TensorGroup] = []      # the group whose logits slices a loss now receives


@contextlib.contextmanager
def vocab_slices(group: TensorGroup) -> Iterator[None]:
    """While it lasts, `cross_entropy` takes logits cut along the vocabulary over `group`."""
    _ACTIVE.append(group)
    try:
        yield
    finally:
        _ACTIVE.pop()


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy` on logits [N, V] and targets [N]; inside `vocab_slices`, on this
    rank's slice of the vocabulary (Megatron's vocabulary-parallel cross-entropy: the maxima,
    the picked logits and the sums of exponentials crossing the group, never the logits)."""
    if not _ACTIVE:
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    per = _VocabCrossEntropy.apply(logits.float(), target, _ACTIVE[-1], ignore_index)
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / (target != ignore_index).sum()


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: TensorGroup,
                ignore_index: int) -> torch.Tensor:
        width = logits.shape[1]
        key = "tensor group: cross-entropy over the vocabulary"
        maxima = _allgather(logits.detach().max(-1).values, group, f"{key} (maxima)")
        shifted = logits.detach() - maxima.max(0).values.unsqueeze(1)
        start = group.rank * width
        valid = target != ignore_index
        inside = valid & (target >= start) & (target < start + width)
        index = (target - start).clamp(0, width - 1)
        picked = shifted.gather(1, index.unsqueeze(1)).squeeze(1) * inside
        exp = shifted.exp()
        both = torch.stack([picked, exp.sum(-1)])
        group.wait(group.comm.iallreduce_(both, key=f"{key} (sums)"), key)
        loss = (both[1].log() - both[0]) * valid
        ctx.save_for_backward(exp.div_(both[1].unsqueeze(1)), inside, index, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, inside, index, valid = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        out = softmax.clone()
        out[rows, index] -= inside.to(out.dtype)
        return out * (grad * valid).unsqueeze(1), None, None, None


def vocab_output(layer: nn.Module) -> bool:
    """Whether a cut layer's output is logits cut along the vocabulary: it declares
    `tp_output = "vocab"` and its column layer was cut (an optional cut may stay whole)."""
    return getattr(layer, "tp_output", None) == "vocab" and \
        any(isinstance(m, _COLUMN_CLASSES) for m in layer.modules())


def gather_vocab(logits: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    """Whole logits from the slices (all-gather forward, this rank's slice backward)."""
    return _GatherLast.apply(logits, group, "tensor group: logits gathered whole")


def vocab_loss(loss_fn: Any, group: TensorGroup) -> Any:
    """The loss a last stage with vocabulary-cut logits calls: a loss that says it takes
    slices (`pipeflow_vocab_parallel = True`: the built-in ones, through `cross_entropy`)
    gets them; any other gets the logits gathered whole first."""
    if getattr(loss_fn, "pipeflow_vocab_parallel", False):
        def loss(output: Any, targets: Any) -> Any:
            with vocab_slices(group):
                return loss_fn(output, targets)
    else:
        def loss(output: Any, targets: Any) -> Any:
            return loss_fn(gather_vocab(output, group), targets)
    return functools.wraps(loss_fn)(loss)
