"""Audits of `tests/gpu/first_run.sh`: the host synchronisations a training step makes, the
data group's reductions against the last backward, and the allocator's memory figures.

    python tests/gpu/audit.py syncs --device cuda    # torch.cuda.set_sync_debug_mode("warn")
    python tests/gpu/audit.py generate-syncs --device cuda   # none a generated token
    mpirun -n 2 python tests/gpu/audit.py overlap --device cuda --out DIR   # a profile each
    python tests/gpu/audit.py memory --device cuda   # with and without expandable_segments

`syncs` trains 5 steps and lists every host synchronisation of steps 3-5 with its stack (on a
GPU what CUDA reports; on the CPU the engine's own reads of tensor values, `item`, `tolist`,
`float`), failing above 2 a step (the norm with the replicas' flags, the loss);
`generate-syncs` those of greedy generation on one rank, failing where 12 new tokens take
more than 4 (a synchronisation a token). `overlap`
profiles a step of 2 replicas (sharing the GPU over MPI) into DIR/overlap-rank{r}.json and
fails unless a bucket's reduction was launched before backward reached the first layer. `memory`
prints `num_alloc_retries`, reserved minus allocated and the peak after 5 steps, each way.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
import warnings

import torch
from mpi4py import MPI

import pipeflow as pf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from toy import adamw, batches, loss_fn, toy_layers  # noqa: E402

STEPS, AUDITED = 5, 3          # steps 3..5 are audited (the first two agree shapes, compile)


def _engine(device: str) -> pf.Engine:
    return pf.Engine(toy_layers(blocks=8), loss_fn, adamw, pf.Config(microbatches=4),
                     comm=MPI.COMM_SELF, device=device)


# pipeflow's own folder (a clone may sit under a folder named pipeflow, its venv inside it)
PACKAGE = os.path.dirname(os.path.abspath(pf.__file__)) + os.sep


def _engine_reads(found: list[str]):
    """On the CPU: record the engine's own reads of tensor values, each with its stack."""
    names = ("item", "tolist", "__float__", "__int__", "__bool__")
    real = {n: getattr(torch.Tensor, n) for n in names}

    def counted(name):
        def read(t, *args):
            if sys._getframe(1).f_code.co_filename.startswith(PACKAGE):
                found.append(f"{name}\n" + "".join(traceback.format_stack(limit=8)[:-1]))
            return real[name](t, *args)
        return read
    for n in names:
        setattr(torch.Tensor, n, counted(n))
    return lambda: [setattr(torch.Tensor, n, f) for n, f in real.items()]


def _watch(device: str, found: list[str]):
    """Record each host synchronisation into `found` (on a GPU what CUDA reports, on the CPU
    the engine's own reads); the function that stops recording."""
    if not device.startswith("cuda"):
        return _engine_reads(found)
    torch.cuda.synchronize()
    shown = warnings.showwarning
    warnings.showwarning = lambda msg, *a, **k: found.append(
        f"{msg}\n" + "".join(traceback.format_stack(limit=10)[:-1]))
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    return lambda: (torch.cuda.set_sync_debug_mode(0), setattr(warnings, "showwarning", shown))


def syncs(device: str) -> int:
    engine, found = _engine(device), []
    data = [(x.to(device), y.to(device)) for x, y in batches(STEPS, 16)]
    for x, y in data[:AUDITED - 1]:
        engine.train_step(x, y)
    restore = _watch(device, found)
    try:
        for x, y in data[AUDITED - 1:]:
            engine.train_step(x, y)
    finally:
        restore()
    engine.close()
    steps = STEPS - AUDITED + 1
    for i, where in enumerate(found):
        print(f"--- sync {i + 1}: {where}")
    print(f"{len(found)} host synchronisations in {steps} steps ({len(found) / steps:.1f} a step)")
    return 0 if len(found) <= 2 * steps else 1


def generate_syncs(device: str) -> int:
    """Greedy generation on one rank: as many host synchronisations for 12 new tokens as for
    4 (the prompts' copy to the device, the tokens' read at the call's end), none a token."""
    from pipeflow.models import gpt_loss
    from test_generate import PROMPTS, gpt_model
    layers, state, _ = gpt_model()
    engine = pf.Engine(layers, gpt_loss, adamw, pf.Config(), comm=MPI.COMM_SELF,
                       device=device)
    engine.load_state_dict(state)
    engine.generate(PROMPTS, 2)                      # first calls: allocations, kernels
    found: dict[int, list[str]] = {}
    for n in (4, 12):
        found[n] = []
        restore = _watch(device, found[n])
        try:
            engine.generate(PROMPTS, n)
        finally:
            restore()
    engine.close()
    for i, where in enumerate(found[12]):
        print(f"--- sync {i + 1} of the 12-token call: {where}")
    print(f"host synchronisations a call of {len(PROMPTS)} prompts: {len(found[4])} for 4 new "
          f"tokens, {len(found[12])} for 12")
    return 0 if len(found[12]) == len(found[4]) else 1


def overlap(device: str, out: str) -> int:
    world = MPI.COMM_WORLD
    engine = pf.Engine(toy_layers(blocks=8), loss_fn, adamw,
                       pf.Config(data=world.size, microbatches=2, bucket_mb=0.0005),
                       device=device)
    reducer = engine.stage.reducer
    first = engine.stage.module.get_submodule(str(engine.stage.module.indices[0]))
    next(first.parameters()).register_post_accumulate_grad_hook(
        lambda p: reducer.events.append(("first layer", -1)) if reducer.armed else None)
    kinds = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        kinds.append(torch.profiler.ProfilerActivity.CUDA)
    data = [(x.to(device), y.to(device)) for x, y in batches(2, 8 * world.size)]
    engine.train_step(*data[0])
    reducer.events.clear()
    with torch.profiler.profile(activities=kinds) as prof:
        engine.train_step(*data[1])
    os.makedirs(out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out, f"overlap-rank{world.rank}.json"))
    events = [kind for kind, _ in reducer.events]
    engine.close()
    ahead = events.count("launch") and events.index("launch") < events.index("first layer")
    print(f"rank {world.rank}: {events.count('launch')} buckets, the first launched "
          f"{'before' if ahead else 'AFTER'} backward reached the first layer; profile in {out}")
    return 0 if ahead else 1


def memory(device: str) -> int:
    if not device.startswith("cuda"):
        print("memory: allocator figures exist on a GPU only (the CPU run checks the script)")
        return 0
    for conf in ("", "expandable_segments:True"):
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        code = subprocess.call([sys.executable, __file__, "memory-one", "--device", device],
                               env=env)
        if code:
            return code
    return 0


def memory_one(device: str) -> int:
    engine = _engine(device)
    for x, y in batches(STEPS, 16):
        engine.train_step(x.to(device), y.to(device))
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"
    print(f"{conf}: num_alloc_retries {stats.get('num_alloc_retries', 0)}, reserved - "
          f"allocated {(torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2**20:.1f}"
          f" MiB, peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    engine.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["syncs", "generate-syncs", "overlap", "memory",
                                         "memory-one"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="runs/first_run")
    args = parser.parse_args()
    if args.what == "overlap":
        sys.exit(overlap(args.device, args.out))
    run = {"syncs": syncs, "generate-syncs": generate_syncs, "memory": memory,
           "memory-one": memory_one}[args.what]
    sys.exit(run(args.device))
