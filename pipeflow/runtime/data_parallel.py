"""Bucketed gradient all-reduce over a stage's data group, overlapped with the last backward."""

from __future__ import annotations

import threading
from typing import Sequence

import torch
from torch import nn

from pipeflow.comm.base import Communicator, Request

__all__ = ["GradReducer", "CastBack"]


class _Bucket:
    def __init__(self, params: list[nn.Parameter], flat: torch.Tensor) -> None:
        self.params = params
        self.flat = flat
        self.pending = len(params)
        self.ready = False              # every gradient of the step's last backward is in
        self.request: Request | None = None
        self.index = -1                 # its place in the reducer's `buckets`


class GradReducer:
    """Sums gradients over replicas, a bucket at a time, as soon as a bucket is final.

    Every parameter's `.grad` is a view into its bucket's flat buffer, so autograd
    accumulates straight into what MPI or NCCL reduces: no copies. Buckets are filled in
    reverse parameter order, the order backward produces gradients, so the first bucket is
    final early in the last micro-batch's backward and its reduction runs while backward goes on
    through the earlier layers. Gradients arrive pre-scaled (the loss carries 1 / (m · d)), so
    the sum is the global mean.

    One order of collectives on every replica: buckets are launched in index order, a final
    bucket held until every bucket before it has launched. The order in which gradients become
    final differs between replicas whenever a parameter gets no gradient in the last backward
    on one of them (an expert no token was routed to, a branch not taken): launched as they
    became final, the same index would name different buckets on different replicas, and
    collectives on one communicator match by order (MPI and NCCL alike), so equal sizes
    would sum the wrong buckets and unequal ones fail or hang. In the usual case buckets
    become final in index order anyway (they are built in backward's order) and nothing waits.

    Where a reduction is issued from: on the engine's own thread (CPU) the hook launches its
    bucket directly. On CUDA, autograd runs gradient hooks on its device thread while the
    engine's thread waits in `backward()`: with NCCL (`comm.launch_from_any_thread`) the
    hook launches the bucket there, on the communication stream ordered after the gradient
    by the stream (as DDP does; every replica's backward makes buckets final in the same
    order, so NCCL's issue order agrees); with MPI (not entered from two threads) the hook
    only marks its bucket ready, and `poll()` (after each instruction) or `finish()`
    launches it from the engine's thread.
    """

    def __init__(self, params: Sequence[nn.Parameter], comm: Communicator,
                 bucket_bytes: int, grad_params: Sequence[nn.Parameter] | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        """`params` are watched for their gradients; `grad_params` (default: the same) hold
        the gradients that are reduced: with mixed precision, the fp32 masters, into which
        each working gradient has been added by a hook registered before this one.
        `reduce_dtype` (`Config.grad_reduce_dtype`; None: the buckets' own fp32): the dtype a
        bucket crosses the group in, cast for the reduction and back."""
        self._setup(comm, reduce_dtype)
        grad_params = list(params if grad_params is None else grad_params)
        watched = {id(g): p for p, g in zip(params, grad_params)}
        group: list[nn.Parameter] = []
        size = 0
        for g in reversed(grad_params):
            group.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes:
                self._add_bucket(group, watched)
                group, size = [], 0
        if group:
            self._add_bucket(group, watched)
        self._watch(params, grad_params)

    def _watch(self, params: Sequence[nn.Parameter], grad_params: Sequence[nn.Parameter]) -> None:
        """Hook every watched parameter; remember which gradient parameter each one feeds."""
        self._watched = list(params)
        self._grad_of = {id(p): g for p, g in zip(params, grad_params)}
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _setup(self, comm: Communicator, reduce_dtype: torch.dtype | None = None) -> None:
        """The state every reducer starts with: no buckets, nothing armed or in flight."""
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.buckets: list[_Bucket] = []
        self.armed = False
        # ("launch", bucket) in order, this step's only (for tests).
        self.events: list[tuple[str, int]] = []
        self.thread = threading.get_ident()
        # The buckets the hooks launch, in the one order every replica issues them (the
        # sharded optimizer leaves its ties' to `finish`); index of the next launch in it.
        self._ordered: list[_Bucket] = self.buckets
        self._next = 0
        self._done = 0                       # of `_ordered`'s launched, how many seen done
        # Collectives in flight between steps (the sharded optimizer's all-gathers): `poll`
        # is then called after each instruction even when not armed.
        self.gathering = False
        self._armed_ids: set[int] = set()    # parameters in their step's last backward
        self._lock = threading.Lock()
        self._bucket_of: dict[int, _Bucket] = {}   # watched parameter -> its bucket
        self._hooks: list = []
        # Which watched parameters got a gradient this step on this replica, and after
        # `finish` on any replica (`untouched`): torch.optim skips a parameter whose `.grad`
        # is None, and so must the engine, whose gradients are views that are never None.
        self._watched: list[nn.Parameter] = []
        self._touched: set[int] = set()
        self._flags: Request | None = None
        self._flag_buffer: torch.Tensor | None = None
        self.present: list[float] | None = None     # `_flag_buffer`, read with the norm

    def close(self) -> None:
        """Remove the gradient hooks: they hold the reducer, which holds the parameters, a
        cycle that kept a closed engine's weights until the garbage collector ran."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _add_bucket(self, params: list[nn.Parameter], watched: dict[int, nn.Parameter]) -> None:
        dtype, device = params[0].dtype, params[0].device
        flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        bucket = _Bucket(params, flat)
        _bind(bucket)
        bucket.index = len(self.buckets)
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[id(watched[id(p)])] = bucket

    def arm(self, params: Sequence[nn.Parameter] | None = None) -> None:
        """The next backward is the last of `params` (default: of every watched parameter)
        this step: launch each bucket as its gradients become final. With several chunks a
        rank, each chunk's parameters are armed at that chunk's last backward."""
        if not self.armed:
            self.armed = True
            self.events = []
            self._next = self._done = 0
            self._armed_ids = set()
            for b in self.buckets:
                b.pending = len(b.params)
                b.ready = False
                b.request = None
        self._armed_ids.update(id(p) for p in (self._watched if params is None else params))

    def _on_grad(self, p: nn.Parameter) -> None:
        self._touched.add(id(p))
        if not self.armed or id(p) not in self._armed_ids:
            return
        bucket = self._bucket_of.get(id(p))
        if bucket is None:              # launched by `finish` alone (a sharded tie's bucket)
            return
        with self._lock:
            bucket.pending -= 1
            if bucket.pending == 0:
                bucket.ready = True
        if threading.get_ident() == self.thread:
            self.poll()
        elif self.comm.launch_from_any_thread:
            self._launch_ready()

    def _launch_ready(self, everything: bool = False) -> None:
        """Launch, in index order, the buckets that are final and whose predecessors have all
        launched (`everything`: the rest too, final or not). Under the lock, launch included:
        with NCCL a hook on autograd's device thread and the engine's thread may both get here,
        and the order of issue is what must agree."""
        with self._lock:
            ordered = self._ordered
            while self._next < len(ordered) and (everything or ordered[self._next].ready):
                bucket = ordered[self._next]
                self._next += 1
                self.events.append(("launch", bucket.index))
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        """Start the bucket's reduction: here, the sum over the data group, in place (in
        `reduce_dtype` where set: cast, summed, and cast back into the fp32 bucket)."""
        if self.reduce_dtype is None:
            bucket.request = self.comm.iallreduce_(bucket.flat, key=self._key(bucket))
            return
        wire = _wire(bucket, "wire", bucket.flat.numel(), self.reduce_dtype)
        wire.copy_(bucket.flat)
        bucket.request = CastBack(self.comm.iallreduce_(wire, key=self._key(bucket)), wire,
                                  bucket.flat)

    def _key(self, bucket: _Bucket) -> str:
        """What the strict backend compares across ranks besides shape and dtype, so that two
        buckets of one size issued in different orders are told apart."""
        return f"gradient bucket {bucket.index}"

    def poll(self) -> None:
        """On the engine's thread: launch the buckets made final since the last call, and let
        reductions in flight progress (MPI moves non-blocking collectives only inside MPI
        calls)."""
        if threading.get_ident() != self.thread:
            return
        self._launch_ready()
        self._test_launched()

    def _test_launched(self) -> None:
        """Test the launched reductions in order of launch, from the first not seen done, up
        to the first still in flight: one test a call while one is in flight (on MPI a test
        drives every request's progress), each request passed once a step; not every bucket
        every instruction."""
        ordered = self._ordered
        while self._done < self._next and ordered[self._done].request.test():
            self._done += 1

    def finish(self) -> None:
        """Launch what is left in order (buckets some of whose parameters got no gradient in
        the last backward), then wait for every reduction."""
        self._launch_ready(everything=True)
        self._launch_flags()
        self._wait_all()

    def _launch_flags(self) -> None:
        """After the buckets, in the same place on every replica: the count of replicas on
        which each watched parameter got a gradient this step (one small sum)."""
        flags = torch.tensor([float(id(p) in self._touched) for p in self._watched])
        self._flag_buffer = flags.to(self.buckets[0].flat.device) if self.buckets else flags
        self._flags = self.comm.iallreduce_(self._flag_buffer, key="gradients present")
        self.present = None

    @property
    def flag_buffer(self) -> torch.Tensor | None:
        """The replicas' counts of a gradient per watched parameter (after `finish`), for the
        gradient norm's read to fetch with the norm: one host synchronisation for both, which
        then sets `present`."""
        return self._flag_buffer

    def untouched(self) -> list[nn.Parameter]:
        """The gradient parameters (masters) that got no gradient on any replica this step:
        the optimizer skips them, as torch.optim skips a `.grad` of None. After `finish`."""
        if self._flag_buffer is None:
            return []
        present = self.present if self.present is not None else self._flag_buffer.tolist()
        return [self._grad_of[id(p)] for p, n in zip(self._watched, present) if n == 0.0]

    def begin_step(self) -> None:
        """Before a step's first backward: the gradients are this reducer's views again, had
        the user's own `optimizer.zero_grad()` (set_to_none, every plain loop's habit) dropped
        them between steps; a gradient made outside the buckets would never be summed over
        the replicas, which would drift apart without a word."""
        for b in self.buckets:
            _bind(b)

    def _wait_all(self) -> None:
        """Wait for every bucket's reduction, then disarm until the next step's last backward."""
        for b in self.buckets:
            b.request.wait()
            b.request = None
        if self._flags is not None:
            self._flags.wait()
            self._flags = None
        self.armed = False

    def zero_grad(self) -> None:
        self._touched = set()
        for b in self.buckets:
            b.flat.zero_()
            # An optimizer's zero_grad(set_to_none=True) would break the views: restore them.
            _bind(b)


class CastBack(Request):
    """A reduction in a lower precision: done when the reduction is, its result then copied
    (cast back to fp32) into `target`."""

    def __init__(self, request: Request, wire: torch.Tensor, target: torch.Tensor) -> None:
        self.request, self.wire, self.target = request, wire, target

    def test(self) -> bool:
        return self.request.test()

    def wait(self) -> None:
        self.request.wait()
        self.target.copy_(self.wire)


def _wire(bucket: _Bucket, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The bucket's buffer `name` of `numel` elements in the reduction's dtype, made once."""
    buf = getattr(bucket, name, None)
    if buf is None:
        buf = torch.empty(numel, dtype=dtype, device=bucket.flat.device)
        setattr(bucket, name, buf)
    return buf


def _bind(bucket: _Bucket) -> None:
    """Make each parameter's `.grad` its slice of the bucket's flat buffer (if not already)."""
    offset = 0
    for p in bucket.params:
        if p.grad is None or p.grad.data_ptr() != bucket.flat[offset:].data_ptr():
            p.grad = bucket.flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
