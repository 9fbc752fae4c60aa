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

__all__ = ["measure_layer_times", "measure_link", "estimate_shared_memory_link", "calibrate",
           "DEFAULT_MICRO_BATCHES"]

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
                        log: Callable[[str], None] | None = None) -> LayerTimes:
    """Forward and backward seconds of the GPT's embedding, one block and the head with its
    loss, at each micro-batch size, fitted as t(b) = c0 + c1·b; and the optimizer step.

    Runs the layers of `pipeflow.models.gpt` exactly as the engine does (fp32, on CPU with
    `threads` torch threads), so the times include what the FLOP count leaves out. Blocks
    are timed as a chain of up to `chain` distinct blocks, divided by their number: one block
    timed alone keeps its weights in cache, which a stage of many blocks does not.
    """
    import torch

    from pipeflow.models.gpt import Block, Embedding, Head

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    try:
        torch.manual_seed(seed)
        k = max(1, min(chain, shape.n_layers))
        # A Shape is the GPTConfig the engine builds from.
        layers = {"embed": Embedding(shape),
                  "block": torch.nn.Sequential(*[Block(shape) for _ in range(k)]),
                  "head": Head(shape)}
        per_call = {"embed": 1, "block": k, "head": 1}
        samples: dict[str, dict[str, list[float]]] = {
            k: {"forward": [], "backward": []} for k in layers}
        for b in micro_batch_sizes:
            ids = torch.randint(0, shape.vocab_size, (b, shape.seq_len), generator=gen)
            hidden = torch.randn(b, shape.seq_len, shape.d_model, generator=gen)

            for kind in layers:
                for phase in ("forward", "backward"):
                    run = functools.partial(_time_layer, layers[kind], kind, phase, ids, hidden)
                    run()                                  # warm-up: allocator, kernels
                    samples[kind][phase].append(_best_of(run, repeats) / per_call[kind])
        # Over the whole chain: a stage's optimizer state does not fit in cache either.
        per_param = _measure_optimizer(layers["block"], repeats)
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


def _time_layer(module: Any, kind: str, phase: str, ids: Any, hidden: Any) -> float:
    """Seconds of one forward (the head with its loss) or, after it, one backward."""
    import torch

    from pipeflow.models.gpt import gpt_loss

    x = ids if kind == "embed" else hidden.clone().requires_grad_(True)
    t0 = time.perf_counter()
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
              layer_times: LayerTimes | None = None) -> Hardware:
    """A "cpu-local" Hardware for `shape` on this machine: measured layer times replace
    peak × efficiency, and the link is measured by ping-pong when `comm` has two ranks or
    more (else estimated from memory bandwidth). Collective over `comm`; every rank returns
    the same description. `layer_times`, when given, is used instead of measuring anew."""
    rank = comm.Get_rank() if comm is not None else 0
    if rank == 0 and layer_times is None:
        layer_times = measure_layer_times(shape, micro_batch_sizes, repeats, log=log)
    if comm is not None and comm.Get_size() > 1:
        waiting.sleeping_barrier(comm)
        layer_times = waiting.bcast(comm, layer_times, 0)
        bandwidth, latency = measure_link(comm)
        link_note = f"measured by ping-pong between 2 of {comm.Get_size()} MPI ranks"
    else:
        bandwidth, latency = estimate_shared_memory_link()
        link_note = ("estimated: half the memcpy bandwidth, 5 µs latency (run under "
                     "`mpirun -n 2` to measure)")
    assert layer_times is not None
    if log:
        log(f"calibrate: link {bandwidth / 1e9:.2f} GB/s, latency {latency * 1e6:.1f} µs "
            f"({link_note})")
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
                 "link": link_note},
        layer_times=layer_times)
