"""The engine's own cost at tiny compute: what decides its speed on a GPU, measured on CPUs.

# Run: mpirun -n 2 python benchmarks/bench_overhead.py   (and -n 4; writes BENCHMARKS.md)

With a GPT this small (8 blocks, width 16, sequence 8, one sample a micro-batch) the
arithmetic is close to nothing, so a step's time is the host's: instructions dispatched,
messages, waits. Measured in one run, alternated in rounds: pipeflow (1F1B, interleaved),
torch.distributed.pipelining (Schedule1F1B, ScheduleInterleaved1F1B) and the one-process loop
on the same micro-batches (for the tiny GPT, and a small one of width 128 and sequence 64
whose arithmetic begins to count); then, per pipeflow step of the tiny GPT: host time per
instruction, messages a micro-batch crosses per link (data and control apart, MPI and gloo
backends), host-device synchronisation points, aten operations against a plain loop, a
step's cost against m, and start-up (import, `pipeflow --help`, engine build, first step).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import pipeflow as pf  # noqa: E402
from pipeflow.comm import torch_dist, waiting  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss  # noqa: E402
from pipeflow.schedules import SENDS  # noqa: E402
from pipeflow.train.data import Batches, load_corpus  # noqa: E402

from _common import (DEFAULT_OUTPUT, header, load_average, busy_note, run_main,  # noqa: E402
                     sync, time_block, write_section)
from bench_gpu import _keep_fp32  # noqa: E402
from bench_peer import init_gloo, make_peer, make_single  # noqa: E402

COMM = MPI.COMM_WORLD


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--small", default="128,4,64",
                   help="the small GPT's width,heads,sequence (same blocks) for the side-by-side "
                        "table; '' leaves it out")
    p.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--scaling", type=int, nargs="+", default=[8, 32, 128, 256],
                   help="micro-batch counts for the cost-against-m row")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="'' to skip writing")
    return p.parse_args()


def _args_for(args, m: int) -> argparse.Namespace:
    """bench_peer's system builders read batch, microbatches, seq and lr."""
    return argparse.Namespace(batch=m, microbatches=m, seq=args.seq, lr=args.lr)


def _engine(cfg: GPTConfig, m: int, schedule: str, backend: str = "mpi",
            comm: MPI.Comm | None = None, precision: str = "fp32") -> pf.Engine:
    chunks = 2 if schedule == "interleaved" else 1
    size = (comm or COMM).size
    config = pf.Config(pipeline=size, microbatches=m, schedule=schedule,
                       virtual_stages=chunks, backend=backend, precision=precision, clip=1.0)
    return pf.Engine(gpt_layers(cfg), gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=3e-4,
                                                                               foreach=True),
                     config, comm=comm)


# -- 1. step time side by side -----------------------------------------------------------

def side_by_side(models: list[tuple[str, GPTConfig]], args) -> list[str]:
    rows = ["| GPT | m | pipeflow 1F1B (ms) | peer Schedule1F1B (ms) | one-process loop (ms) | "
            "pipeflow / peer | pipeflow / loop | pipeflow, pipeline 1 (ms) | pipeline 1 / "
            "loop | pipeflow interleaved (ms) | peer interleaved (ms) | interleaved / peer's |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (label, cfg), m in ((model, m) for model in models for m in args.microbatches):
        layers = gpt_layers(cfg)
        a = _args_for(args, m)
        data = Batches(load_corpus(), m, cfg.seq_len, seed=0)
        ours = {s: _engine(cfg, m, s) for s in ("1f1b", "interleaved")}
        # The engine alone on rank 0 (pipeline 1, the others asleep): its own cost on the
        # loop's work, without a second rank to wait for or share the cores with.
        alone = _engine(cfg, m, "1f1b", comm=MPI.COMM_SELF) if COMM.rank == 0 else None
        peer = {s: make_peer(name, layers, cfg, a, 0)
                for s, name in (("1f1b", "peer 1F1B"), ("interleaved", "peer interleaved"))}
        systems: dict[str, Callable] = {
            "ours 1f1b": ours["1f1b"].train_step, "peer 1f1b": peer["1f1b"].step,
            "loop": make_single(layers, a, 0, micro=m),
            "alone": lambda x, y: alone.train_step(x, y) if alone is not None else None,
            "ours interleaved": ours["interleaved"].train_step,
            "peer interleaved": peer["interleaved"].step}
        times = _rounds(systems, data, args)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(f"| {label} | {m} | {med['ours 1f1b'] * 1e3:.1f} | "
                    f"{med['peer 1f1b'] * 1e3:.1f} | {med['loop'] * 1e3:.1f} | "
                    f"{_ratio(times, 'ours 1f1b', 'peer 1f1b')} | "
                    f"{_ratio(times, 'ours 1f1b', 'loop')} | {med['alone'] * 1e3:.1f} | "
                    f"{_ratio(times, 'alone', 'loop')} | "
                    f"{med['ours interleaved'] * 1e3:.1f} | "
                    f"{med['peer interleaved'] * 1e3:.1f} | "
                    f"{_ratio(times, 'ours interleaved', 'peer interleaved')} |")
        for engine in [*ours.values(), *([alone] if alone is not None else [])]:
            engine.close()
    return rows


def _ratio(times: dict[str, list[float]], a: str, b: str) -> str:
    """`a` over `b`: the median of the rounds' ratios (the two ran back to back in each
    round, so a change of load between rounds cancels), and the best round's in brackets."""
    ratios = [x / y for x, y in zip(times[a], times[b])]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f})"


def _rounds(systems: dict[str, Callable], data: Batches, args) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in systems}
    for step in systems.values():                         # warm-up
        time_block(lambda k: step(*data.batch(k)), 0, 1, active=True)
    for r in range(args.rounds):
        for name, step in systems.items():
            times[name].append(time_block(lambda k: step(*data.batch(k)), 1 + r * args.steps,
                                          args.steps, active=True))
    return times


# -- 2. per instruction, messages, waits -------------------------------------------------

PACKAGE = os.path.dirname(os.path.abspath(pf.__file__))


@contextlib.contextmanager
def counting(targets: list[tuple[object, str]]) -> Iterator[collections.Counter]:
    """Count calls of each `(owner, attribute)` made from pipeflow's own code while inside
    (torch's optimizers read their step counts with `.item()`: the plain loop pays those
    too, and they are counted apart, as "torch")."""
    counts: collections.Counter = collections.Counter()
    saved = []
    for owner, name in targets:
        real = getattr(owner, name)

        def wrapper(*a, __real=real, __name=name, **kw):
            caller = sys._getframe(1).f_code.co_filename
            counts[__name if caller.startswith(PACKAGE) else "torch " + __name] += 1
            return __real(*a, **kw)
        saved.append((owner, name, real))
        setattr(owner, name, wrapper)
    try:
        yield counts
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def per_step_counts(cfg: GPTConfig, m: int, backend: str) -> dict[str, float]:
    """One steady-state pipeflow 1F1B step: host time per instruction, messages a
    micro-batch sends on each link (data and control apart), blocking waits and `.item()`."""
    engine = _engine(cfg, m, "1f1b", backend=backend)
    data = Batches(load_corpus(), m, cfg.seq_len, seed=0)
    for k in range(2):
        engine.train_step(*data.batch(k))
    comm = engine.stage.pipe_comm
    sent = collections.Counter()
    real_send = comm.send_message

    def send(header, tensors, dest, tag):
        sent["control"] += int(header is not None)
        sent["data"] += int(bool(tensors))
        return real_send(header, tensors, dest, tag)
    comm.send_message = send
    waits = [(waiting, n) for n in ("wait", "waitall", "wait_object", "mprobe", "recv_object",
                                    "allgather", "bcast", "barrier", "gather", "until")]
    # torch.distributed's requests block in torch (gloo, NCCL), not in the MPI wait policy.
    waits.append((torch_dist._DistWork, "wait"))
    engine.runner.trace = True
    with counting(waits + [(torch.Tensor, "item"), (torch.Tensor, "tolist"),
                           (torch.cuda, "synchronize")]) as calls:
        start = time.perf_counter()
        engine.train_step(*data.batch(2))
        step = time.perf_counter() - start
    engine.runner.trace = False
    spans = [(name, b - a) for name, a, b in engine.runner.timeline]
    comm.send_message = real_send
    instructions = [d for name, d in spans if name != "optimizer step"]
    # F, B and W (the arithmetic): the busiest rank's sum bounds the step from below.
    compute = sum(d for name, d in spans if name[:1] in "FBW" and name[1:2].isdigit())
    program = engine.plan.programs[engine.stage.index]
    links = max(1, len({engine.runner.route(a).peer for a in program if a.op in SENDS}))
    engine.close()
    mine = dict(step=step, instructions=len(instructions),
                per_instruction=sum(instructions) / max(1, len(instructions)),
                compute=compute,
                outside=step - sum(d for _, d in spans), data=sent["data"] / m / links,
                control=sent["control"] / m / links,
                blocking=sum(v for k, v in calls.items() if k not in (
                    "item", "tolist", "synchronize", "torch item", "torch tolist")),
                item=calls["item"] + calls["tolist"],
                torch_item=calls["torch item"] + calls["torch tolist"],
                synchronize=calls["synchronize"] + calls["torch synchronize"])
    every = COMM.allgather(mine)
    out = {k: max(e[k] for e in every) for k in mine}
    out["computes"] = [e["compute"] for e in every]
    return out


def counts_table(cfg: GPTConfig, m: int) -> list[str]:
    rows = ["| backend | m | instructions a rank | host time per instruction (µs) | outside "
            "instructions (ms) | data messages per micro-batch and link | control messages "
            "per micro-batch and link | blocking waits a step | pipeflow's `.item()`/`.tolist()` "
            "a step | torch's (the optimizer's step counts) | device synchronize a step | "
            "step (ms) | F, B and W a step, each rank (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for backend in ("mpi", "gloo"):
        c = per_step_counts(cfg, m, backend)
        rows.append(f"| {backend} | {m} | {c['instructions']:.0f} | "
                    f"{c['per_instruction'] * 1e6:.0f} | {c['outside'] * 1e3:.1f} | "
                    f"{c['data']:.2f} | {c['control']:.2f} | {c['blocking']:.0f} | "
                    f"{c['item']:.0f} | {c['torch_item']:.0f} | {c['synchronize']:.0f} | "
                    f"{c['step'] * 1e3:.1f} | "
                    f"{' / '.join(f'{x * 1e3:.1f}' for x in c['computes'])} |")
    return rows


# -- 3. aten operations against a plain loop ---------------------------------------------

class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def aten_ops(cfg: GPTConfig, precision: str, m: int = 4) -> tuple[int, int]:
    """(pipeflow's, a plain loop's) aten operations for one step on one rank, pipeline 1:
    the same model, m micro-batches, foreach AdamW, clipping at 1.0 (the plain loop: masters
    and a bf16 copy by hand under bf16)."""
    engine = _engine(cfg, m, "1f1b", comm=MPI.COMM_SELF, precision=precision)
    data = Batches(load_corpus(), m, cfg.seq_len, seed=0)
    engine.train_step(*data.batch(0))
    with _Ops() as ours:
        engine.train_step(*data.batch(1))
    engine.close()
    model = pf.build_sequential(gpt_layers(cfg), 0)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    if precision != "fp32":
        model.to(torch.bfloat16)
        _keep_fp32(model, (torch.nn.LayerNorm,))     # as pipeflow's fp32_modules keeps it
    opt = torch.optim.AdamW(masters if precision != "fp32" else model.parameters(), lr=3e-4,
                            foreach=True)
    params = list(model.parameters())

    def step(x, y):
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (gpt_loss(model(xs).float(), ys) / m).backward()
        if precision != "fp32":
            for w, p in zip(params, masters):
                p.grad = w.grad.float()
                w.grad = None
        torch.nn.utils.clip_grad_norm_(masters if precision != "fp32" else params, 1.0,
                                       foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precision != "fp32":
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
    step(*data.batch(0))
    with _Ops() as plain:
        step(*data.batch(1))
    return ours.count, plain.count


# -- 4. cost against m, start-up ---------------------------------------------------------

def scaling(cfg: GPTConfig, args) -> list[str]:
    rows = ["| m | pipeflow 1F1B step (ms) | per micro-batch (ms) |", "|---:|---:|---:|"]
    for m in args.scaling:
        engine = _engine(cfg, m, "1f1b")
        data = Batches(load_corpus(), m, cfg.seq_len, seed=0)
        engine.train_step(*data.batch(0))
        t = min(time_block(lambda k: engine.train_step(*data.batch(k)), 1 + r, 1, active=True)
                for r in range(2))
        rows.append(f"| {m} | {t * 1e3:.1f} | {t / m * 1e3:.2f} |")
        engine.close()
    return rows


def _clean_env() -> dict[str, str]:
    """This job's environment without the launcher's variables, so a child starts afresh
    (a job of its own under its own mpirun)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI", "OMPI", "HYDRA", "HYDI", "MPIR", "PMIX"))}


def _best_of(cmd: list[str], n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=_clean_env())
        best = min(best, time.perf_counter() - start)
    return best


# A rank of `make train`'s job that says when torch is imported, then runs `pipeflow train`.
_TRAIN_RANK = """import sys, time
import torch
from mpi4py import MPI
sys.stderr.write(f"torch imported {MPI.COMM_WORLD.rank} {time.time()}\\n")
sys.stderr.flush()
from pipeflow.cli import main
sys.argv = ["pipeflow", "train", *sys.argv[1:]]
main()
"""

_FIRST_OPTIMIZER = ("import time, torch; t = time.perf_counter(); "
                    "torch.optim.AdamW([torch.zeros(1, requires_grad=True)]); "
                    "print(time.perf_counter() - t)")


def first_step_of_make_train(np: int = 2) -> float:
    """Seconds from torch's import (the last rank's) to the first step's line of `make
    train`'s job (`mpirun -n 2 pipeflow train examples/gpt_small.toml`, one step)."""
    launcher = shutil.which("mpirun") or "mpirun"
    config = os.path.join(os.path.dirname(PACKAGE), "examples", "gpt_small.toml")
    job = subprocess.Popen([launcher, "-n", str(np), sys.executable, "-c", _TRAIN_RANK, config,
                            "--steps", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**_clean_env(), "OMP_NUM_THREADS": "1"})
    imported: dict[str, float] = {}
    first = None
    for line in job.stdout:
        if line.startswith("torch imported"):
            _, _, rank, at = line.split()
            imported[rank] = float(at)
        elif line.lstrip().startswith("step ") and first is None:
            first = time.time()
    if job.wait() != 0 or first is None or len(imported) != np:
        raise RuntimeError(f"`make train`'s job failed (exit {job.returncode})")
    return first - max(imported.values())


def _first_optimizer() -> float:
    out = subprocess.run([sys.executable, "-c", _FIRST_OPTIMIZER], check=True,
                         capture_output=True, text=True, env=_clean_env())
    return float(out.stdout.split()[-1])


def startup(cfg: GPTConfig) -> list[str]:
    """Import and `--help` in fresh processes (rank 0), engine build and first step here."""
    start = time.perf_counter()
    engine = _engine(cfg, 8, "1f1b")
    built = COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)
    data = Batches(load_corpus(), 8, cfg.seq_len, seed=0)
    start = time.perf_counter()
    engine.train_step(*data.batch(0))
    first = COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)
    engine.close()
    rows = ["| what | seconds |", "|---|---:|"]
    if COMM.rank == 0:
        py = sys.executable
        cli = os.path.join(os.path.dirname(py), "pipeflow")
        rows += [f"| `python -c 'import pipeflow'` (best of 3) | "
                 f"{_best_of([py, '-c', 'import pipeflow']):.2f} |",
                 f"| `python -c 'import torch'` (best of 3) | "
                 f"{_best_of([py, '-c', 'import torch']):.2f} |",
                 f"| `pipeflow --help` (best of 3) | {_best_of([cli, '--help']):.2f} |",
                 f"| `pipeflow schedule --help` (best of 3) | "
                 f"{_best_of([cli, 'schedule', '--help']):.2f} |",
                 f"| torch's first optimizer in a fresh process (`torch.optim` imports "
                 f"`torch._dynamo` then: any torch script pays it) | {_first_optimizer():.2f} |",
                 f"| `make train` (2 ranks, examples/gpt_small.toml): its first step's line "
                 f"after torch's import (the last rank's) | {first_step_of_make_train():.2f} |"]
    sync(COMM)                     # the other ranks nap while rank 0 starts processes
    rows += [f"| engine build, {COMM.size} ranks (slowest rank) | {built:.2f} |",
             f"| first step, m = 8 (slowest rank) | {first:.2f} |"]
    return rows


def _reading(p: int, m: int) -> str:
    """How to read the side-by-side table."""
    return (f"Ratios are the median of the rounds' ratios, the best round's in brackets. "
            f"*Pipeline 1* is the engine alone on rank 0 (the others asleep) on the loop's "
            f"micro-batches: its own cost on the same work, with no rank to wait for (its AdamW "
            f"is foreach, the loop's torch's default one on CPUs, a loop over the "
            f"parameters). {p} "
            f"stages on a free core each would take (m + p - 1)/(p·m) of the loop, "
            f"{(m + p - 1) / (p * m):.3f} at m = {m}{_oversubscribed(p)}; on cores shared "
            f"with other work a "
            f"pipeline pays more than its share: each of the 2m messages a link carries in a "
            f"step waits for the other rank to be scheduled, and a rank spinning in its wait "
            f"holds a share of the cores the working rank needs.")


def _oversubscribed(p: int) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not cores or p <= cores:
        return ""
    return (f" (here {p} ranks share {cores} cores: no pipeline beats 1/{cores} of the loop, "
            f"and a rank that waits hands its core to another rank, the one waited for or not)")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    init_gloo()
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq)
    load = load_average()
    models = [(f"tiny (width {cfg.d_model}, sequence {cfg.seq_len})", cfg)]
    if args.small:
        width, heads, seq = (int(v) for v in args.small.split(","))
        models.append((f"small (width {width}, sequence {seq})",
                       GPTConfig(n_layers=args.layers, d_model=width, n_heads=heads,
                                 seq_len=seq)))
    sections = [side_by_side(models, args), counts_table(cfg, max(args.microbatches)),
                scaling(cfg, args), startup(cfg)]
    ops = {p: aten_ops(cfg, p) for p in ("fp32", "bf16")} if COMM.rank == 0 else {}
    if COMM.rank != 0:
        return
    text = "\n".join([
        f"## The engine's own cost at tiny compute ({COMM.size} CPU ranks)", "",
        header(COMM.size), "",
        f"GPT of {cfg.n_layers} blocks, width {cfg.d_model}, {cfg.n_heads} heads, sequence "
        f"{cfg.seq_len}, one sample a micro-batch: a step is the host's own work"
        + (f" (and in the side-by-side table, a small GPT of the same blocks, width "
           f"{models[1][1].d_model}, {models[1][1].n_heads} heads, sequence "
           f"{models[1][1].seq_len}: some arithmetic)" if len(models) > 1 else "")
        + f". Medians of "
        f"{args.rounds} alternated rounds of {args.steps} steps; the one-process loop runs the "
        f"same micro-batches on rank 0 while the other ranks wait. "
        + busy_note(load, load_average(), COMM.size), "",
        *sections[0], "",
        _reading(COMM.size, max(args.microbatches)), "",
        "Per steady-state pipeflow 1F1B step (the slowest rank's figure): instructions and "
        "their mean host time from the runner's timeline; messages counted at the "
        "communicator (a control message is a header: shapes announced); blocking waits are "
        "the wait policy's calls (each receive, each agreement) and, under gloo, the waits on "
        "torch.distributed's requests (a receive posted ahead, a send unfinished at the "
        "step's end). The last column is each rank's arithmetic (its F, B and W "
        "instructions): the busiest rank's sum, plus the bubble, bounds the step from below "
        "whatever the engine does. The uniform split gives the last rank the head and the "
        "loss besides its blocks, and the first the embedding; a layer boundary cannot "
        "split them more evenly.", "",
        *sections[1], "",
        "A step's cost against m (best of 2 steps): linear, the per-micro-batch cost flat.", "",
        *sections[2], "",
        "Start-up:", "", *sections[3], "",
        "aten operations a step, one rank, pipeline 1, 4 micro-batches, against a plain loop "
        "(foreach AdamW, clipping at 1.0; bf16: fp32 masters and a bf16 copy by hand, "
        "LayerNorm kept in fp32 as pipeflow's `fp32_modules` keeps it):", "",
        "| precision | pipeflow | plain loop | ratio |", "|---|---:|---:|---:|",
        *[f"| {p} | {a} | {b} | {a / b:.2f} |" for p, (a, b) in ops.items()], ""])
    print(text)
    if args.output:
        write_section(args.output, text, f"overhead-{COMM.size}")


if __name__ == "__main__":
    run_main(main)
