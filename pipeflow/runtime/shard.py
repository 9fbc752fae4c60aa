"""The distributed optimizer (ZeRO stage 1, Megatron-Core's distributed optimizer): a stage's
fp32 masters and optimizer state sharded over its data group.

Per bucket of the stage's trainable parameters (one parameter group a bucket, padded to a
multiple of d x SHARD_ALIGN elements, so that every block starts aligned), each replica holds:

    weights  the working copies, all of them: every parameter is a view into this buffer
    flat     the fp32 gradient, all of it: micro-batches accumulate into it (with pipelining
             the gradient must stay whole until the last micro-batch, so only the optimizer
             state and the masters are sharded: stage 1 of ZeRO)
    master   its block (1/d) of the fp32 masters, what the optimizer steps; its `.grad` is the
             block of the summed gradient the reduce-scatter delivers

A step: after the last backward each bucket is reduce-scattered over the data group as soon
as it is final (overlapping the rest of the backward, as the all-reduce did); the gradient
norm is summed from the blocks (each element counted once); one `optimizer.step()` steps
every block; each block is cast to the working dtype and all-gathered into `weights`.

What overlaps: reduce-scatters with the last backward (bucket by bucket, as `GradReducer`);
the all-gathers with whatever comes before the next step's forwards read the weights (the
batch agreement, a training loop's own work, a later stage's first receive) and with the
forwards of the layers before (Megatron-Core's `overlap_param_gather`). `step` launches
them in the order the next forwards need them and returns; a forward pre-hook on each layer
waits for that layer's buckets just before it runs, and `wait_gathers` for all of them
before anything else reads or writes the weights (eval, generation, state dicts,
checkpoints, loading, close, the next optimizer step). MPI moves non-blocking collectives
only inside MPI calls: the runner's `poll` after each instruction tests the first gather
still in flight (one test; each gather passed once a step); NCCL runs them on the
communication stream, and a wait there orders the compute stream after them.

A weight tied across stages has a bucket of its own, launched by `finish` only: its whole
gradient is first summed over the stages that hold it (one replica's holders), then
reduce-scattered over the replicas; the sum over (stage, replica) is the same, and every
holder's block, master and state stay identical. Its block counts in the norm on the first
holder only.

Optimizers: any whose state is per element (SGD, Adam, AdamW, ... see ELEMENTWISE), built by
the user's factory and then rebuilt over the blocks with every parameter group's settings
kept. It is stepped once a step over every block, so a step hook registered on it runs once
a step, as unsharded.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pipeflow.comm.base import Communicator, Request
from pipeflow.comm.mpi import mpi_iallreduce_
from pipeflow.config import ConfigError
from pipeflow.runtime.data_parallel import CastBack, GradReducer, _Bucket, _bind, _wire

__all__ = ["ShardedOptimizer", "ELEMENTWISE", "WHOLE_TENSOR", "check_elementwise"]

# A block of a bucket is a multiple of this many elements, so every replica's block starts
# aligned (256 bytes of fp32, 128 of bf16) for the collectives' and the optimizer's kernels,
# as Megatron-Core pads its buckets; at most d x 64 elements of padding a bucket.
SHARD_ALIGN = 64

# Optimizers whose update of an element reads only that element's gradient and state: a
# flat block of a bucket steps exactly as the whole tensors would.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop",
               "Rprop", "Adadelta", "ASGD")
# Optimizers known to need whole tensors: factored or matrix state, closures, sparse grads.
WHOLE_TENSOR = {"LBFGS": "re-evaluates a closure and keeps a history over every parameter "
                         "flattened together",
                "Adafactor": "factors its second moment over the rows and columns of each "
                             "matrix",
                "SparseAdam": "takes sparse gradients, not flat blocks",
                "Shampoo": "preconditions each matrix with its own row and column factors",
                "Muon": "orthogonalises each matrix's update as a whole",
                "Lamb": "scales each tensor's update by that tensor's norm",
                "LARS": "scales each tensor's update by that tensor's norm"}


def check_elementwise(opt: torch.optim.Optimizer, where: str) -> None:
    """Refuse an optimizer whose update needs whole tensors (or cannot be shown not to): a
    block of a flat bucket would step differently. Torch's elementwise optimizers pass; a
    class of the user's passes when it sets `pipeflow_elementwise = True`."""
    kind = type(opt)
    name = kind.__name__
    if getattr(opt, "pipeflow_elementwise", False) or (
            kind.__module__.startswith("torch.optim") and name in ELEMENTWISE):
        return
    why = next((text for key, text in WHOLE_TENSOR.items() if key.lower() in name.lower()),
               None)
    found = f"it {why}" if why else "pipeflow cannot tell whether its state is per element"
    raise ConfigError(
        f"{where}: Config.shard_optimizer steps flat blocks of 1/d of each bucket, which "
        f"needs an optimizer whose update and state are per element ({', '.join(ELEMENTWISE)} "
        f"of torch.optim); found {kind.__module__}.{name}: {found}. Turn shard_optimizer "
        f"off for it" + ("" if why else ", or set `pipeflow_elementwise = True` on the "
                         "optimizer class if its update is per element"))


class _ShardBucket(_Bucket):
    """A bucket of one parameter group: whole working weights and fp32 gradient, and this
    replica's block of the masters (see the module's docstring)."""

    def __init__(self, params: list[nn.Parameter], flat: torch.Tensor,
                 weights: torch.Tensor, group: int, block: slice, tie: Any = None) -> None:
        super().__init__(params, flat)
        self.weights, self.group, self.block, self.tie = weights, group, block, tie
        n = block.stop - block.start
        self.master = nn.Parameter(torch.zeros(n, dtype=torch.float32, device=flat.device))
        self.master.grad = torch.zeros_like(self.master)
        # The block cast to the working dtype, sent by the all-gather (fp32: the master).
        self.send = (torch.empty(n, dtype=weights.dtype, device=flat.device)
                     if weights.dtype != torch.float32 else None)
        self.gather: Request | None = None

    def offsets(self) -> list[tuple[nn.Parameter, int, int]]:
        """(parameter, start, end) of each parameter in the flat buffers."""
        out, start = [], 0
        for p in self.params:
            out.append((p, start, start + p.numel()))
            start += p.numel()
        return out


class ShardedOptimizer(GradReducer):
    """Reduce-scatter of the gradient buckets, the optimizer over this replica's blocks, the
    all-gather of the working weights. Takes `GradReducer`'s place for the runner (`arm`,
    `poll`, `finish`, `zero_grad`) and the optimizer's for the step closer."""

    def __init__(self, working: Sequence[nn.Parameter], initial: dict[int, torch.Tensor],
                 ties: Sequence[Any], comm: Communicator, bucket_bytes: int,
                 probe: torch.optim.Optimizer, where: str,
                 reduce_dtype: torch.dtype | None = None,
                 counts: Callable[[nn.Parameter], bool] | None = None) -> None:
        """`working`: the stage's trainable parameters; `initial`: their exact fp32 start
        values (by id); `ties`: the stage's `Tie`s; `probe`: the user's optimizer over
        `working`, read for its type and parameter groups, then rebuilt over the blocks;
        `counts`: whether a parameter's gradient counts in the norm here (all by default)."""
        self._setup(comm, reduce_dtype)
        self.where = where
        check_elementwise(probe, where)
        group_of = {id(p): g for g, grp in enumerate(probe.param_groups) for p in grp["params"]}
        tie_of = {id(t.param): t for t in ties}
        # A bucket holds one parameter group and one working dtype (fp32_modules stay fp32).
        # ... and weights the norm counts here or not (tensor-parallel: the whole weights
        # count on tensor rank 0 only).
        counted = counts or (lambda p: True)
        open_buckets: dict[tuple[int, torch.dtype, bool], tuple[list[nn.Parameter], int]] = {}
        for p in reversed(list(working)):     # backward's order: early buckets final early
            if id(p) in tie_of:
                self._add_bucket_of([p], group_of[id(p)], initial, tie_of[id(p)])
                continue
            key = (group_of[id(p)], p.dtype, counted(p))
            params, size = open_buckets.pop(key, ([], 0))
            params.append(p)
            size += p.numel() * 4
            if size >= bucket_bytes:
                self._add_bucket_of(params, key[0], initial)
            else:
                open_buckets[key] = (params, size)
        for (g, _, _), (params, _) in open_buckets.items():
            self._add_bucket_of(params, g, initial)
        for b in self.buckets:
            b.counted = all(counted(p) for p in b.params)
        # The hooks launch every bucket but the ties' (`finish` launches those, after their
        # sum over the stages that hold them), in index order.
        self._ordered = [b for b in self.buckets if b.tie is None]
        # Each parameter's fp32 gradient: its view of its bucket's `flat`.
        self._grad_view = {id(p): b.flat[start:end].view_as(p)
                           for b in self.buckets for p, start, end in b.offsets()}
        self.optimizer = self._rebuild(probe)
        # The all-gathers of the working weights (`step`): launched in `_gather_order` (the
        # next forwards' order once `watch_layers` has said it; else the reverse of backward's),
        # in flight in `_gathers` from its `_seen`-th on, `_left` not yet waited. With
        # `overlap_gather` False `step` waits for them itself (the weights whole when
        # train_step returns, at the cost of the overlap; benchmarks compare the two).
        self.overlap_gather = True
        self._layer_buckets: dict[int, list[_ShardBucket]] = {}
        self._gather_order: list[_ShardBucket] = self.buckets[::-1]
        self._gathers: list[_ShardBucket] = []
        self._seen = self._left = 0
        self._hooks += [p.register_post_accumulate_grad_hook(self._accumulate) for p in working]
        self._watch(working, working)

    # -- construction ---------------------------------------------------------------------
    def _add_bucket_of(self, params: list[nn.Parameter], group: int,
                       initial: dict[int, torch.Tensor], tie: Any = None) -> None:
        """A padded bucket for `params`: they become views of its working buffer; this
        replica's block of their fp32 start values becomes its master."""
        d, r = self.comm.size, self.comm.rank
        numel = sum(p.numel() for p in params)
        unit = d * SHARD_ALIGN          # every block starts on a 256-byte boundary (fp32)
        padded = -(-numel // unit) * unit
        device, dtype = params[0].device, params[0].dtype
        flat = torch.zeros(padded, dtype=torch.float32, device=device)
        weights = torch.zeros(padded, dtype=dtype, device=device)
        n = padded // d
        bucket = _ShardBucket(params, flat, weights, group, slice(r * n, (r + 1) * n), tie)
        full = torch.zeros(padded, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, a, b in bucket.offsets():
                full[a:b].copy_(initial[id(p)].reshape(-1))
                weights[a:b].copy_(p.detach().reshape(-1))
                p.data = weights[a:b].view_as(p)
            bucket.master.copy_(full[bucket.block])
        if dtype == torch.float32:
            _bind(bucket)          # fp32: the parameters' `.grad` are views of `flat`
        bucket.index = len(self.buckets)
        self.buckets.append(bucket)
        if tie is None:            # a tie's bucket is launched by `finish`, after its sum
            for p in params:
                self._bucket_of[id(p)] = bucket

    def _rebuild(self, probe: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The user's optimizer, emptied and filled with the masters' blocks: each block in
        the group its parameters were in, with that group's settings."""
        settings = [{k: v for k, v in g.items() if k != "params"} for g in probe.param_groups]
        probe.param_groups.clear()
        probe.state.clear()
        for g, setting in enumerate(settings):
            blocks = [b.master for b in self.buckets if b.group == g]
            if blocks:
                probe.add_param_group({**setting, "params": blocks})
        return probe

    # -- gradients ------------------------------------------------------------------------
    def _accumulate(self, p: nn.Parameter) -> None:
        """Low-precision working weights: add the gradient into its fp32 view of `flat`, free
        it (fp32 ones accumulate into the view directly)."""
        if p.dtype == torch.float32:
            return
        self._grad_view[id(p)].add_(p.grad)
        p.grad = None

    def _launch(self, bucket: _Bucket) -> None:
        """Reduce-scatter: block `rank` of the sum over the data group into `master.grad`."""
        if self.reduce_dtype is None:
            bucket.request = self.comm.ireduce_scatter_(bucket.flat, bucket.master.grad,
                                                        key=self._key(bucket))
            return
        wire = _wire(bucket, "wire", bucket.flat.numel(), self.reduce_dtype)
        block = _wire(bucket, "wire_block", bucket.master.numel(), self.reduce_dtype)
        wire.copy_(bucket.flat)
        bucket.request = CastBack(self.comm.ireduce_scatter_(wire, block, key=self._key(bucket)),
                                  block, bucket.master.grad)

    def finish(self) -> None:
        """Launch what is left, in order (buckets without gradients this step; then ties, once
        summed over their stages), then wait for every reduce-scatter."""
        self._launch_ready(everything=True)
        for b in self.buckets:
            if b.tie is not None:
                _sum_over_holders(b.tie, b.flat)
                self.events.append(("launch", b.index))
                self._launch(b)
        self._launch_flags()
        self._wait_all()

    def zero_grad(self) -> None:
        self._touched = set()
        for b in self.buckets:
            b.flat.zero_()
            if b.weights.dtype == torch.float32:
                _bind(b)

    def begin_step(self) -> None:
        """As `GradReducer.begin_step`, and the blocks' gradients back where the user's
        `optimizer.zero_grad()` (which sees the blocks) set them to None."""
        for b in self.buckets:
            if b.master.grad is None:
                b.master.grad = torch.zeros_like(b.master)
            if b.weights.dtype == torch.float32:
                _bind(b)

    # -- the step -------------------------------------------------------------------------
    def unscale_(self, inv_scale: float) -> None:
        for b in self.buckets:
            b.master.grad.mul_(inv_scale)

    def square_sum(self) -> torch.Tensor:
        """Sum of squares of this replica's blocks of the summed gradient (fp64, one element),
        a tie's on its first holder only: summed over the data group and the pipeline it is
        the squared norm, each element counted once."""
        norms = [torch.linalg.vector_norm(b.master.grad) for b in self.buckets
                 if (b.tie is None or b.tie.first) and b.counted]
        checked = [torch.linalg.vector_norm(b.master.grad) for b in self.buckets
                   if not b.counted]     # 0 · their norm: 0, or NaN where one is not finite
        sq = torch.stack(norms).double().square().sum().reshape(1) if norms else \
            torch.zeros(1, dtype=torch.float64)
        if checked:
            sq = sq + 0.0 * torch.stack(checked).double().sum().to(sq.device)
        return sq

    def step(self, coef: float = 1.0) -> None:
        """Clip the blocks by `coef` (< 1), step them all (one `optimizer.step()`, as
        unsharded), then launch the all-gathers of the working weights and return: each is
        waited by the first forward that reads its bucket (`_before_forward`), or by
        `wait_gathers`, whatever reads the weights first."""
        self.wait_gathers()          # none left, unless a stage never ran a forward
        grads = [b.master.grad for b in self.buckets]
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        skipped = {id(p) for p in self.untouched()}
        kept = [(b, self._untouched_elements(b, skipped)) for b in self.buckets]
        self.optimizer.step()
        for b, elements in kept:
            self._restore(b, elements)
        self._launch_gathers()
        if not self.overlap_gather:
            self.wait_gathers()

    # -- the all-gather, overlapped with the next step's forwards --------------------------
    def watch_layers(self, layers: Sequence[nn.Module], compiled: bool = False) -> None:
        """Wait for a layer's buckets just before its forward (a forward pre-hook) and before
        its state dict is read or loaded: the gathers launched by `step` then run while the
        next step begins (its batch agreement, receives, the forwards of earlier layers).
        `layers` in the order the next step's first forwards run them (the stage's layers
        in index order): the gathers are launched in that order. `compiled` (the layers run
        under torch.compile): the pre-hook stays eager, a wait is MPI's or a stream's and
        not traceable (`torch.compiler.disable`, imported only then: it loads dynamo)."""
        before = self._before_forward
        if compiled:
            before = torch.compiler.disable(before)
        bucket_of = {id(p): b for b in self.buckets for p in b.params}
        order: dict[int, _ShardBucket] = {}
        for layer in layers:
            mine = {id(bucket_of[id(p)]): bucket_of[id(p)] for p in layer.parameters()
                    if id(p) in bucket_of}
            self._layer_buckets[id(layer)] = list(mine.values())
            order.update(mine)
            self._hooks += [layer.register_forward_pre_hook(before),
                            layer.register_state_dict_pre_hook(self._before_state),
                            layer.register_load_state_dict_pre_hook(self._before_state)]
        order.update({id(b): b for b in self.buckets})     # any bucket no layer named
        self._gather_order = list(order.values())

    def _launch_gathers(self) -> None:
        """Every bucket's all-gather of its updated block, in `_gather_order` (the same on
        every replica); `_gathers` keeps them in that order for `poll`'s tests."""
        for b in self._gather_order:
            b.gather = self.comm.iallgather_(self._outgoing(b), b.weights, key=self._key(b))
        self._gathers, self._seen, self._left = list(self._gather_order), 0, len(self.buckets)
        self.gathering = self._left > 0

    def _complete(self, b: _ShardBucket) -> None:
        b.gather.wait()
        b.gather = None
        self._left -= 1
        self.gathering = self._left > 0

    def _before_forward(self, layer: nn.Module, args: Any) -> None:
        """A layer's forward pre-hook: its buckets' gathers complete before it reads them.
        O(its buckets) while gathers are in flight, one test of a flag otherwise."""
        if self.gathering:
            for b in self._layer_buckets.get(id(layer), ()):
                if b.gather is not None:
                    self._complete(b)

    def _before_state(self, layer: nn.Module, *args: Any) -> None:
        """A layer's state-dict pre-hook (read or loaded): as before its forward."""
        self._before_forward(layer, ())

    def poll(self) -> None:
        """As `GradReducer.poll` while armed; while gathers are in flight, test them in order
        of launch from the first not seen done to the first still in flight (each passed
        once: linear in the buckets over a step, not a scan of every gather each time)."""
        if threading.get_ident() != self.thread:
            return
        if self.armed:
            super().poll()
        gathers = self._gathers
        while self.gathering and self._seen < len(gathers):
            b = gathers[self._seen]
            if b.gather is not None:
                if not b.gather.test():
                    return
                self._complete(b)
            self._seen += 1

    def wait_gathers(self) -> None:
        """Complete every all-gather still in flight: the working weights are whole after it.
        The engine calls it before anything but a training step reads or writes them (eval,
        generation, state dicts, checkpoints, close); a user reading `stage.module`'s
        parameters directly between steps calls it first (a layer's `state_dict()` waits by
        itself)."""
        for b in self._gathers[self._seen:] if self.gathering else ():
            if b.gather is not None:
                self._complete(b)
        self._gathers, self._seen = [], 0

    def close(self) -> None:
        self.wait_gathers()
        super().close()

    def _untouched_elements(self, b: _ShardBucket, skipped: set[int]) -> list[tuple]:
        """The block's elements of parameters no replica had a gradient for this step, with
        their master values and per-element optimizer state as they are before the step:
        restored after it, so those parameters are skipped as torch.optim skips a `.grad` of
        None (no weight decay, no momentum). A step count is the block's own: a parameter
        skipped in some steps then has its bias correction counted from the block's steps."""
        if not skipped:
            return []
        kept = []
        state = self.optimizer.state.get(b.master, {})
        for p, start, end in b.offsets():
            lo, hi = max(start, b.block.start), min(end, b.block.stop)
            if id(p) in skipped and lo < hi:
                part = slice(lo - b.block.start, hi - b.block.start)
                saved = {k: v[part].clone() for k, v in state.items() if _per_element(v, b.master)}
                kept.append((part, b.master.detach()[part].clone(), saved))
        return kept

    @torch.no_grad()
    def _restore(self, b: _ShardBucket, kept: list[tuple]) -> None:
        """Put back what `_untouched_elements` kept; per-element state this step created
        (the block's first step) is zero there, as a parameter that never stepped has none."""
        state = self.optimizer.state.get(b.master, {})
        for part, value, saved in kept:
            b.master[part] = value
            for k, v in state.items():
                if k in saved:
                    v[part] = saved[k]
                elif _per_element(v, b.master):
                    v[part] = 0

    @staticmethod
    @torch.no_grad()
    def _outgoing(b: _ShardBucket) -> torch.Tensor:
        if b.send is None:
            return b.master.detach()
        b.send.copy_(b.master.detach())
        return b.send

    # -- whole values (state dicts, checkpoints) ------------------------------------------
    def _gathered(self, b: _ShardBucket, block: torch.Tensor) -> torch.Tensor:
        whole = torch.empty(b.flat.numel(), dtype=block.dtype, device=block.device)
        self.comm.iallgather_(block.detach().contiguous(), whole).wait()
        return whole

    def full_masters(self) -> dict[int, torch.Tensor]:
        """Every trainable parameter's whole fp32 master, by id of its working parameter.
        Collective over the data group."""
        self.wait_gathers()
        out = {}
        for b in self.buckets:
            whole = self._gathered(b, b.master)
            for p, start, end in b.offsets():
                out[id(p)] = whole[start:end].view_as(p).clone()
        return out

    def full_optimizer_state(self) -> tuple[dict[int, dict], dict[int, dict]]:
        """(state, group settings) per trainable parameter (by id of its working parameter),
        whole, as an unsharded optimizer would hold them: per-element tensors gathered and
        cut per parameter, anything else (a step count) copied. Collective over the group."""
        self.wait_gathers()
        states: dict[int, dict] = {}
        settings: dict[int, dict] = {}
        group_of = self._group_of()
        for b in self.buckets:
            group = group_of[id(b.master)]
            kept = {k: v for k, v in group.items() if k != "params"}
            state = self.optimizer.state.get(b.master, {})
            whole = {k: self._gathered(b, v) for k, v in sorted(state.items())
                     if _per_element(v, b.master)}
            for p, start, end in b.offsets():
                settings[id(p)] = dict(kept)
                if state:
                    states[id(p)] = {k: (whole[k][start:end].view_as(p).clone() if k in whole
                                         else (v.clone() if torch.is_tensor(v) else v))
                                     for k, v in state.items()}
        return states, settings

    def _group_of(self) -> dict[int, dict]:
        """Each block's parameter group in the optimizer, by id of the block (looked up once
        a call, not scanned for every bucket)."""
        return {id(m): g for g in self.optimizer.param_groups for m in g["params"]}

    @torch.no_grad()
    def load_full(self, values: dict[int, torch.Tensor]) -> None:
        """Set this replica's blocks of the masters from whole values (by id of the working
        parameter; the working weights themselves are set by `Precision.load_masters`)."""
        self.wait_gathers()
        for b in self.buckets:
            kept = any(id(p) not in values for p in b.params)   # alike on every replica
            full = self._gathered(b, b.master) if kept else \
                torch.zeros(b.flat.numel(), dtype=torch.float32, device=b.flat.device)
            for p, start, end in b.offsets():
                if id(p) in values:
                    full[start:end].copy_(values[id(p)].reshape(-1))
            b.master.copy_(full[b.block])

    def load_optimizer_state(self, states: dict[int, dict], settings: dict[int, dict]) -> None:
        """Cut whole per-parameter optimizer state (by id of the working parameter, e.g. from
        a checkpoint of any grid) into this replica's blocks; per-element tensors missing for
        some parameters of a bucket start at zero, other values come from the first found.
        Loaded through the optimizer's own `load_state_dict`, so its rules hold as in an
        unsharded resume (a fused or capturable AdamW's `step` on the parameters' device,
        state cast to the parameters' dtype) and its load hooks run."""
        self.wait_gathers()
        blocks: dict[int, dict[str, Any]] = {}
        group_of = self._group_of()
        for b in self.buckets:
            found = [(states[id(p)], start, end) for p, start, end in b.offsets()
                     if id(p) in states]
            for p, _, _ in b.offsets():
                if id(p) in settings:
                    group_of[id(b.master)].update(settings[id(p)])
                    break
            if found:
                blocks[id(b.master)] = self._block_state(b, found)
        whole = self.optimizer.state_dict()
        order = [m for g in self.optimizer.param_groups for m in g["params"]]
        whole["state"] = {i: blocks[id(m)] for i, m in enumerate(order) if id(m) in blocks}
        self.optimizer.load_state_dict(whole)

    @staticmethod
    def _block_state(b: _ShardBucket, found: list[tuple[dict, int, int]]) -> dict[str, Any]:
        """This replica's block of a bucket's optimizer state from per-parameter entries."""
        state: dict[str, Any] = {}
        for key in found[0][0]:
            sample = found[0][0][key]
            if torch.is_tensor(sample) and sample.dim() >= 1 \
                    and sample.numel() == found[0][2] - found[0][1]:
                full = torch.zeros(b.flat.numel(), dtype=sample.dtype, device=b.flat.device)
                for st, start, end in found:
                    full[start:end].copy_(st[key].reshape(-1))
                state[key] = full[b.block].clone()
            else:
                state[key] = sample.clone() if torch.is_tensor(sample) else sample
        return state

    # -- memory ---------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes this replica holds: working buffers (incl. padding and the cast block),
        master blocks, gradient buffers (whole fp32 buckets and the summed blocks)."""
        working = sum(b.weights.numel() * b.weights.element_size()
                      + (b.send.numel() * b.send.element_size() if b.send is not None else 0)
                      for b in self.buckets)
        masters = sum(b.master.numel() * 4 for b in self.buckets)
        grads = sum(b.flat.numel() * 4 + b.master.grad.numel() * 4 for b in self.buckets)
        return {"working": working, "masters": masters, "gradients": grads}


def _per_element(value: Any, master: torch.Tensor) -> bool:
    """Whether optimizer state `value` holds one entry per element of the block `master`."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape == master.shape


def _sum_over_holders(tie: Any, flat: torch.Tensor) -> None:
    """A tied weight's whole gradient summed over the stages of this replica that hold it."""
    if tie.dist is None:
        mpi_iallreduce_(tie.comm, flat).wait()
    else:
        tie.dist.allreduce_(flat)

