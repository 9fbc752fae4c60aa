"""The tensor axis: pipeflow at tensor = 2 against PyTorch's own tensor parallelism.

# Run: mpirun -n 2 python benchmarks/bench_tensor.py   (writes BENCHMARKS.md; --help)

On 2 ranks, one GPT (by default width 1024, 4 blocks, sequence 512, SGD, fp32): pipeflow
with tensor = 2 over MPI, the same over gloo, with sequence parallelism over MPI, and
PyTorch's tensor parallelism (`parallelize_module` with ColwiseParallel / RowwiseParallel
DTensor plans on the same blocks, gloo). Each takes blocks of steps in turn, the order
rotating every round, so a slow spell of a shared machine falls on all alike. Before timing,
pipeflow's first step is checked against one process.

Also counted, from the tensor group's own communicator: collectives and bytes per block and
micro-batch, forward and backward together (without sequence parallelism Megatron's 2
all-reduces forward and 2 backward of b·s·h; with it all-gathers and reduce-scatters of the
same bytes, plus the column layers' second all-gather for the weight gradient), and each
rank's bytes of model states at t = 1, 2 (and 4 where the world has 4 ranks).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (DEFAULT_OUTPUT, add_model_args, busy_note, header,  # noqa: E402
                     load_average, run_main, time_block, write_section)

import pipeflow as pf  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss  # noqa: E402

__all__ = ["main"]

WORLD = MPI.COMM_WORLD


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


class Counting:
    """A communicator's stand-in that counts each collective and its bytes."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, collections.Counter()
        self.bytes = collections.Counter()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _note(self, op: str, t: torch.Tensor):
        self.calls[op] += 1
        self.bytes[op] += t.numel() * t.element_size()

    def iallreduce_(self, tensor, key=None):
        self._note("all-reduce", tensor)
        return self.inner.iallreduce_(tensor, key=key)

    def iallgather_(self, shard, out, key=None):
        self._note("all-gather", out)
        return self.inner.iallgather_(shard, out, key=key)

    def ireduce_scatter_(self, tensor, out, key=None):
        self._note("reduce-scatter", tensor)
        return self.inner.ireduce_scatter_(tensor, out, key=key)


def _pipeflow(layers, sp: bool, backend: str, t: int):
    return pf.Engine(layers, gpt_loss, _sgd,
                     pf.Config(tensor=t, sequence_parallel=sp, backend=backend))


def _peer(cfg: GPTConfig):
    """PyTorch's tensor parallelism on the same blocks: DTensor plans over gloo."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    model = pf.build_sequential(gpt_layers(cfg), 0)
    mesh = init_device_mesh("cpu", (WORLD.size,))
    plan = {"qkv": ColwiseParallel(), "attn_proj": RowwiseParallel(),
            "fc": ColwiseParallel(), "mlp_proj": RowwiseParallel()}
    for block in list(model)[1:-1]:
        parallelize_module(block, mesh, plan)
    opt = _sgd(list(model.parameters()))

    def step(x, y):
        opt.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _check(layers, x, y) -> None:
    """pipeflow at t = world equals one process on its first step (else nothing is timed)."""
    engine = _pipeflow(layers, True, "mpi", WORLD.size)
    loss = engine.train_step(x, y)
    model = pf.build_sequential(layers, 0)
    ref = gpt_loss(model(x), y).item()
    engine.close()
    if abs(loss - ref) > 1e-4 * abs(ref):
        raise SystemExit(f"pipeflow's loss {loss} differs from one process's {ref}")


def _traffic(layers, cfg: GPTConfig, x, y, sp: bool) -> dict:
    engine = _pipeflow(layers, sp, "mpi", WORLD.size)
    counting = Counting(engine.stage.tensor.comm)
    engine.stage.tensor.comm = counting
    engine.train_step(x, y)
    engine.close()
    per = cfg.n_layers                          # one micro-batch: per block
    bsh = x.shape[0] * x.shape[1] * cfg.d_model * 4
    return {op: (n / per, counting.bytes[op] / per / bsh) for op, n in counting.calls.items()}


def _memory(layers, x, y) -> list[tuple[str, dict]]:
    rows = []
    for t, sp in [(1, False), (2, False), (2, True), (4, False), (4, True)]:
        if t > WORLD.size or WORLD.size % t:
            continue
        comm = WORLD.Split(WORLD.rank // t, WORLD.rank)
        engine = pf.Engine(layers, gpt_loss, _sgd, pf.Config(tensor=t, sequence_parallel=sp),
                           comm=comm, measure_activations=True)
        engine.train_step(x, y)
        rows.append((f"{t}{' + sequence parallel' if sp else ''}", engine.memory_report()))
        engine.close()
        comm.Free()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, layers=4, width=1024, heads=16, seq=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    if WORLD.size != 2:
        raise SystemExit(f"bench_tensor.py runs on 2 ranks, found {WORLD.size}: "
                         f"mpirun -n 2 python benchmarks/bench_tensor.py")
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq, vocab_size=256)
    layers = gpt_layers(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    _check(layers, x, y)
    before = load_average()
    systems = {"pipeflow t2 (MPI)": _pipeflow(layers, False, "mpi", 2),
               "pipeflow t2 + sequence parallel (MPI)": _pipeflow(layers, True, "mpi", 2),
               "pipeflow t2 (gloo)": _pipeflow(layers, False, "gloo", 2)}
    steps = {k: (lambda e: lambda: e.train_step(x, y))(e) for k, e in systems.items()}
    steps["PyTorch DTensor TP (gloo)"] = (lambda s: lambda: s(x, y))(_peer(cfg))
    times = {k: [] for k in steps}
    for k in steps:                                   # warm-up
        steps[k]()
    names = list(steps)
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(time_block(lambda _: steps[k](), 0, args.steps, True))
    after = load_average()
    for e in systems.values():
        e.close()
    traffic = {sp: _traffic(layers, cfg, x, y, sp) for sp in (False, True)}
    memory = _memory(layers, x, y)
    if WORLD.rank == 0:
        text = _report(cfg, args, times, traffic, memory, before, after)
        print(text)
        write_section(args.output, text, "tensor")


def _report(cfg, args, times, traffic, memory, before, after) -> str:
    peer = "PyTorch DTensor TP (gloo)"
    lines = ["## Tensor parallelism: pipeflow t = 2 against PyTorch's DTensor plans (CPU)", "",
             header(WORLD.size), "",
             f"GPT {cfg.n_layers} blocks x {cfg.d_model} wide, {cfg.n_heads} heads, sequence "
             f"{cfg.seq_len}, batch {args.batch}, fp32, SGD; {args.rounds} rounds of "
             f"{args.steps} steps, the systems' order rotating. One torch thread a rank. "
             f"The peer cuts the fused qkv as one block (its heads grouped differently: the "
             f"same cost, another model); pipeflow's first step was checked against one "
             f"process.", "",
             "| system | s/step (median) | best | vs peer (median) | vs peer (best) |",
             "|---|---|---|---|---|"]
    for k, ts in times.items():
        lines.append(f"| {k} | {statistics.median(ts):.3f} | {min(ts):.3f} | "
                     f"{statistics.median(ts) / statistics.median(times[peer]):.3f} | "
                     f"{min(ts) / min(times[peer]):.3f} |")
    lines += ["", "Collectives of the tensor group per block and micro-batch (forward and "
              "backward), in units of b·s·h fp32 bytes:", "",
              "| mode | collective | calls | bytes / b·s·h |", "|---|---|---|---|"]
    for sp, ops in traffic.items():
        for op, (n, b) in sorted(ops.items()):
            lines.append(f"| {'sequence parallel' if sp else 'tensor only'} | {op} | "
                         f"{n:g} | {b:.2f} |")
    lines += ["", "Each rank's bytes (rank 0 of each grid; fp32 working weights are the "
              "masters), from `engine.memory_report()` after one step:", "",
              "| tensor | working | gradients | replicated working | activations peak |",
              "|---|---|---|---|---|"]
    for t, r in memory:
        lines.append(f"| {t} | {r['working']:,} | {r['gradients']:,} | "
                     f"{r.get('replicated_working', 0):,} | {r['activations_peak']:,} |")
    lines += ["", busy_note(before, after, WORLD.size)]
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
