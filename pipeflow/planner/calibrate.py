"""Measure this machine for the cost model: layer times, optimizer step, link bandwidth."""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Sequence

from pipeflow.planner.cost import block_forward_flops
from pipeflow.planner.hardware import Hardware, LayerTimes, fit_relative
from pipeflow.planner.shapes import Shape
from pipeflow.comm import waiting

__all__ = ["measure_layer_times", "measure_link", "measure_tensor_allreduce",
           "estimate_shared_memory_link", "calibrate", "DEFAULT_MICRO_BATCHES"]

# torch and numpy are imported inside the functions that measure, and the communicator comes
# from the caller: the cost model never runs a tensor. (`import pipeflow` itself loads the
# engine, so torch and mpi4py are installed wherever the planner runs.)

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)


def _best_of(fn: Callable[[], float], repeats: int) -> float:
    # The minimum over repeats: on a shared machine every disturbance only adds time, so the
    # fastest run is the best estimate of the undisturbed cost (as `timeit` advises).
    return min(fn() for _ in range(repeats))


def measure_layer_times(shape: Shape, micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCHES,
                        repeats: int = 5, threads: int = 1, seed: int = 0, chain: int = 8,
                        log: Callable[[str], None] | None = None,
                        tensors: Sequence[int] = ()) -> LayerTimes:
    """Forward and backward seconds of the GPT's embedding, one block and the head with its
    loss, at each micro-batch size, fitted as t(b) = c0 + c1·b; and the optimizer step.

    Runs the layers of `pipeflow.models.gpt` exactly as the engine does (fp32, on CPU with
    `threads` torch threads), so the times include what the FLOP count leaves out. Blocks
    are timed as a chain of up to `chain` distinct blocks, divided by their number: one block
    timed alone keeps its weights in cache, which a stage of many blocks does not.

    For each degree t > 1 of `tensors` that divides the heads, the block (and the head,
    where t divides the vocabulary) is also timed as one rank of a tensor group of t holds
    it, cut by its `tp_plan` ("block@t", "head@t"), with the group's collectives answered
    at once (`_LocalGroup`): the compute of a rank alone, to which the cost model adds the
    measured all-reduces (`measure_tensor_allreduce`). Work that the cut does not divide
    (the layer norms, the copies into the collectives' buffers) is in the time.
    """
    import torch

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    try:
        torch.manual_seed(seed)
        k = max(1, min(chain, shape.n_layers))
        layers, per_call = _calibration_layers(shape, k, tensors)
        samples: dict[str, dict[str, list[float]]] = {
            k: {"forward": [], "backward": []} for k in layers}
        for b in micro_batch_sizes:
            ids = torch.randint(0, shape.vocab_size, (b, shape.seq_len), generator=gen)
            hidden = torch.randn(b, shape.seq_len, shape.d_model, generator=gen)

            for kind, (module, group) in layers.items():
                for phase in ("forward", "backward"):
                    run = functools.partial(_time_layer, module, kind.split("@")[0], phase,
                                            ids, hidden, group)
                    run()                                  # warm-up: allocator, kernels
                    samples[kind][phase].append(_best_of(run, repeats) / per_call[kind])
        # Over the whole chain: a stage's optimizer state does not fit in cache either.
        per_param = _measure_optimizer(layers["block"][0], repeats)
    finally:
        torch.set_num_threads(old_threads)
    if log:
        b = max(micro_batch_sizes)
        log(f"calibrate: block forward {samples['block']['forward'][-1] * 1e3:.2f} ms, backward "
            f"{samples['block']['backward'][-1] * 1e3:.2f} ms at micro-batch {b}; optimizer "
            f"{per_param * 1e9:.2f} ns/parameter")
    by_size = {k: {ph: dict(zip(micro_batch_sizes, v)) for ph, v in phs.items()}
               for k, phs in samples.items()}
    return LayerTimes.from_samples(shape.to_dict(), by_size, per_param)


class _LocalGroup:
    """The collectives of a tensor group answered at once, on one process: the cut layers'
    compute timed without their communication. `TensorGroup.allreduce` still copies its
    input as it does in the engine; the sum is left out and the gather repeats this rank's
    slice (the values are wrong, the shapes right)."""

    class _Done:
        def wait(self) -> None:
            return None

    def iallreduce_(self, tensor: Any, key: str | None = None) -> Any:
        return self._Done()

    def iallgather_(self, shard: Any, out: Any, key: str | None = None) -> Any:
        out.view(-1, shard.numel()).copy_(shard.expand(out.numel() // shard.numel(), -1))
        return self._Done()


def _calibration_layers(shape: Shape, chain: int,
                        tensors: Sequence[int]) -> tuple[dict[str, tuple[Any, Any]],
                                                         dict[str, int]]:
    """{kind: (module, tensor group or None)} to time, and how many layers each call runs:
    the embedding, a chain of blocks, the head; and per degree of `tensors` the chain and the
    head cut as tensor rank 0 holds them."""
    import torch

    from pipeflow.models.gpt import Block, Embedding, Head
    from pipeflow.runtime.tensor_parallel import TensorGroup, shard_layer

    # A Shape is the GPTConfig the engine builds from.
    layers: dict[str, tuple[Any, Any]] = {
        "embed": (Embedding(shape), None),
        "block": (torch.nn.Sequential(*[Block(shape) for _ in range(chain)]), None),
        "head": (Head(shape), None)}
    per_call = {"embed": 1, "block": chain, "head": 1}
    for t in tensors:
        if t == 1 or shape.n_heads % t:
            continue
        group = TensorGroup(t, 0)
        group.comm = _LocalGroup()
        blocks = [Block(shape) for _ in range(chain)]
        for i, block in enumerate(blocks):
            shard_layer(block, group, i)
        layers[f"block@{t}"] = (torch.nn.Sequential(*blocks), group)
        per_call[f"block@{t}"] = chain
        if shape.vocab_size % t == 0:
            head = Head(shape)
            shard_layer(head, group, 0)
            layers[f"head@{t}"] = (head, group)
            per_call[f"head@{t}"] = 1
    return layers, per_call


def _time_layer(module: Any, kind: str, phase: str, ids: Any, hidden: Any,
                group: Any = None) -> float:
    """Seconds of one forward (the head with its loss) or, after it, one backward; with a
    tensor `group`, the head's loss on its slice of the vocabulary."""
    import contextlib

    import torch

    from pipeflow.models.gpt import gpt_loss
    from pipeflow.runtime.tensor_parallel import vocab_slices

    x = ids if kind == "embed" else hidden.clone().requires_grad_(True)
    slices = vocab_slices(group) if kind == "head" and group is not None else \
        contextlib.nullcontext()
    t0 = time.perf_counter()
    with slices:
        out = module(x)
        if kind == "head":
            out = gpt_loss(out, ids)
    t1 = time.perf_counter()
    if phase == "forward":
        return t1 - t0
    grad = None if kind == "head" else torch.ones_like(out)
    t1 = time.perf_counter()
    out.backward(grad)
    return time.perf_counter() - t1


def _measure_optimizer(module: Any, repeats: int) -> float:
    """Seconds per parameter of the engine's step: the gradient norm, AdamW, zero_grad."""
    import torch

    params = [p for p in module.parameters()]
    count = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4)

    def once() -> float:
        for p in params:
            p.grad = torch.randn_like(p)
        t0 = time.perf_counter()
        sq = torch.zeros(1, dtype=torch.float64)
        for p in params:
            sq += p.grad.detach().double().pow(2).sum()
        float(sq.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    once()
    return _best_of(once, repeats) / count


def measure_link(comm: Any, sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20, 1 << 22),
                 repeats: int = 20) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) between ranks 0 and 1 of `comm` by ping-pong; one-way
    time t(n) = latency + n/bandwidth, fitted over `sizes`. Collective: every rank calls it."""
    import numpy as np

    rank = comm.Get_rank()
    one_way: list[float] = []
    for n in sizes:
        buf = np.zeros(n, dtype=np.uint8)
        best = float("inf")
        waiting.sleeping_barrier(comm)
        # Round trips back to back, both ranks in blocking calls as the engine's waits are;
        # the first two only wake the partner up.
        for i in range(repeats + 2):
            if rank == 0:
                t0 = time.perf_counter()
                comm.Send(buf, dest=1, tag=7)
                comm.Recv(buf, source=1, tag=7)
                if i >= 2:
                    best = min(best, (time.perf_counter() - t0) / 2)
            elif rank == 1:
                comm.Recv(buf, source=0, tag=7)
                comm.Send(buf, dest=0, tag=7)
        one_way.append(best)
    latency, inv_bw = (fit_relative([float(n) for n in sizes], one_way) if rank == 0
                       else (0.0, 1.0))
    result = (1.0 / max(inv_bw, 1e-15), max(latency, 0.0)) if rank == 0 else None
    return waiting.bcast(comm, result, 0)


def measure_tensor_allreduce(comm: Any, sizes: Sequence[int],
                             repeats: int = 10) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a ring step of the tensor group's all-reduce,
    measured between ranks 0 and 1 of `comm` on the engine's own MPI communicator
    (`MpiCommunicator.iallreduce_` of fp32 tensors of `sizes` bytes, the b·s·h activations
    the layers sum): the fit t(n) = c0 + c1·n is a two-rank ring all-reduce,
    `cost.ring_allreduce_time` = n/bandwidth + 2·latency, so bandwidth 1/c1 and latency c0/2.
    Collective over `comm`: every rank calls it and gets the answer; ranks past 1 wait."""
    import torch

    from mpi4py import MPI

    from pipeflow.comm.mpi import MpiCommunicator

    rank = comm.Get_rank()
    pair = comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    result = None
    if pair != MPI.COMM_NULL:
        group = MpiCommunicator(pair)
        times = []
        for n in sizes:
            buf = torch.ones(max(1, n // 4), dtype=torch.float32)

            def once() -> float:
                waiting.sleeping_barrier(pair)
                t0 = time.perf_counter()
                group.iallreduce_(buf).wait()
                return time.perf_counter() - t0

            once()
            # Both ranks take their fastest; the all-reduce ends for the group when the
            # slower one's does.
            times.append(max(waiting.allgather(pair, _best_of(once, repeats))))
        group.free()
        pair.Free()
        if rank == 0:
            xs = [float(max(4, n)) for n in sizes]
            c0, c1 = fit_relative(xs, times)
            if c1 <= 0:
                # Noise hid the bytes' share (small sizes on a loaded machine): the least
                # time as the latency, the largest size's excess over it as the bandwidth.
                c0 = min(times)
                c1 = (times[xs.index(max(xs))] - c0) / max(xs)
            result = (1.0 / max(c1, 1e-15), max(c0, 0.0) / 2)
    return waiting.bcast(comm, result, 0)


def estimate_shared_memory_link(nbytes: int = 1 << 25, repeats: int = 5) -> tuple[float, float]:
    """Without a second rank: a shared-memory MPI transport copies twice (sender to shared
    segment to receiver), so half the measured memcpy bandwidth; latency an assumed 5 µs."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)

    def once() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    once()
    return nbytes / _best_of(once, repeats) / 2, 5e-6


def _physical_memory() -> float:
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8e9


def calibrate(shape: Shape, comm: Any = None, ranks_per_node: int = 1,
              micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCHES, repeats: int = 5,
              log: Callable[[str], None] | None = None,
              layer_times: LayerTimes | None = None,
              tensors: Sequence[int] | None = None) -> Hardware:
    """A "cpu-local" Hardware for `shape` on this machine: measured layer times replace
    peak × efficiency, and the link is measured by ping-pong when `comm` has two ranks or
    more (else estimated from memory bandwidth), the tensor group's all-reduce likewise
    (`measure_tensor_allreduce`). The block and head cut for each tensor degree of
    `tensors` (default: 2 when `comm` has two ranks or more) are timed too. Collective over
    `comm`; every rank returns the same description. `layer_times`, when given, is used
    instead of measuring anew."""
    rank = comm.Get_rank() if comm is not None else 0
    ranks = comm.Get_size() if comm is not None else 1
    if tensors is None:
        tensors = (2,) if ranks > 1 else ()
    if rank == 0 and layer_times is None:
        layer_times = measure_layer_times(shape, micro_batch_sizes, repeats, log=log,
                                          tensors=tensors)
    tensor_bw = tensor_lat = None
    if comm is not None and ranks > 1:
        waiting.sleeping_barrier(comm)
        layer_times = waiting.bcast(comm, layer_times, 0)
        bandwidth, latency = measure_link(comm)
        link_note = f"measured by ping-pong between 2 of {ranks} MPI ranks"
        # The activations the layers sum, and 4 MiB to pin the bandwidth down.
        sizes = sorted({b * shape.seq_len * shape.d_model * 4 for b in micro_batch_sizes}
                       | {1 << 22})
        tensor_bw, tensor_lat = measure_tensor_allreduce(comm, sizes)
    else:
        bandwidth, latency = estimate_shared_memory_link()
        link_note = ("estimated: half the memcpy bandwidth, 5 µs latency (run under "
                     "`mpirun -n 2` to measure)")
    assert layer_times is not None
    if log:
        log(f"calibrate: link {bandwidth / 1e9:.2f} GB/s, latency {latency * 1e6:.1f} µs "
            f"({link_note})")
        if tensor_bw is not None:
            log(f"calibrate: tensor all-reduce {tensor_bw / 1e9:.2f} GB/s, latency "
                f"{tensor_lat * 1e6:.1f} µs per ring step (2 ranks, the engine's "
                f"MpiCommunicator)")
    b = max(micro_batch_sizes)
    rate = block_forward_flops(shape, b) / layer_times.time("block", "forward", b)
    memory = _physical_memory() / max(1, ranks_per_node)
    return Hardware(
        "cpu-local", peak_flops=rate, memory_bytes=memory, memory_bandwidth=bandwidth,
        intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
        intra_node_latency=latency, inter_node_latency=latency, efficiency=1.0,
        link_efficiency=1.0, memory_reserve_fraction=0.10,
        sources={"layer_times": f"measured on this machine, 1 torch thread, micro-batches "
                                f"{list(micro_batch_sizes)}, best of {repeats}",
                 "peak_flops": "the block forward's measured FLOP rate (so MFU is relative "
                               "to what this CPU reaches)",
                 "memory": f"physical memory / {ranks_per_node} ranks",
                 "link": link_note,
                 **({"tensor": "the all-reduce of the engine's MpiCommunicator between 2 "
                               "ranks, timed at the layers' activation sizes"}
                    if tensor_bw is not None else {})},
        layer_times=layer_times, tensor_bandwidth=tensor_bw, tensor_latency=tensor_lat)
