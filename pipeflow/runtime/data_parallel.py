"""Bucketed gradient all-reduce over a stage's data group, overlapped with the last backward."""

from __future__ import annotations

import threading
from typing import Sequence

import torch
from torch import nn

from pipeflow.comm.base import Communicator, Request

__all__ = ["GradReducer"]


class _Bucket:
    def __init__(self, params: list[nn.Parameter], flat: torch.Tensor) -> None:
        self.params = params
        self.flat = flat
        self.pending = len(params)
        self.request: Request | None = None


class GradReducer:
    """Sums gradients over replicas, a bucket at a time, as soon as a bucket is final.

    Every parameter's `.grad` is a view into its bucket's flat buffer, so autograd
    accumulates straight into what MPI or NCCL reduces: no copies. Buckets are filled in
    reverse parameter order, the order backward produces gradients, so the first bucket is
    final early in the last micro-batch's backward and its reduction runs while backward goes on
    through the earlier layers. Gradients arrive pre-scaled (the loss carries 1 / (m · d)), so
    the sum is the global mean.

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
                 bucket_bytes: int, grad_params: Sequence[nn.Parameter] | None = None) -> None:
        """`params` are watched for their gradients; `grad_params` (default: the same) hold
        the gradients that are reduced: with mixed precision, the fp32 masters, into which
        each working gradient has been added by a hook registered before this one."""
        self._setup(comm)
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
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _setup(self, comm: Communicator) -> None:
        """The state every reducer starts with: no buckets, nothing armed or in flight."""
        self.comm = comm
        self.buckets: list[_Bucket] = []
        self.armed = False
        # ("launch", bucket) in order, this step's only (for tests).
        self.events: list[tuple[str, int]] = []
        self.thread = threading.get_ident()
        self._ready: list[_Bucket] = []      # final, waiting for the engine's thread
        self._lock = threading.Lock()
        self._bucket_of: dict[int, _Bucket] = {}   # watched parameter -> its bucket
        self._hooks: list = []

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
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[id(watched[id(p)])] = bucket

    def arm(self) -> None:
        """The next backward is the step's last: launch each bucket as it becomes final."""
        self.armed = True
        self.events = []
        self._ready = []
        for b in self.buckets:
            b.pending = len(b.params)
            b.request = None

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of.get(id(p))
        if bucket is None:              # launched by `finish` alone (a sharded tie's bucket)
            return
        with self._lock:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._ready.append(bucket)
        if threading.get_ident() == self.thread:
            self.poll()
        elif self.comm.launch_from_any_thread:
            self._launch_ready()

    def _launch_ready(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for bucket in ready:
            self.events.append(("launch", self.buckets.index(bucket)))
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        """Start the bucket's reduction: here, the sum over the data group, in place."""
        bucket.request = self.comm.iallreduce_(bucket.flat)

    def poll(self) -> None:
        """On the engine's thread: launch the buckets made final since the last call, and let
        reductions in flight progress (MPI moves non-blocking collectives only inside MPI
        calls)."""
        if threading.get_ident() != self.thread:
            return
        self._launch_ready()
        for b in self.buckets:
            if b.request is not None:
                b.request.test()

    def finish(self) -> None:
        """Wait for every reduction; launch those whose parameters got no gradient this step."""
        self._launch_ready()
        with self._lock:
            self._ready = [b for b in self.buckets if b.request is None]
        self._launch_ready()
        self._wait_all()

    def _wait_all(self) -> None:
        """Wait for every bucket's reduction, then disarm until the next step's last backward."""
        for b in self.buckets:
            b.request.wait()
            b.request = None
        self.armed = False

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.flat.zero_()
            # An optimizer's zero_grad(set_to_none=True) would break the views: restore them.
            _bind(b)


def _bind(bucket: _Bucket) -> None:
    """Make each parameter's `.grad` its slice of the bucket's flat buffer (if not already)."""
    offset = 0
    for p in bucket.params:
        if p.grad is None or p.grad.data_ptr() != bucket.flat[offset:].data_ptr():
            p.grad = bucket.flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
