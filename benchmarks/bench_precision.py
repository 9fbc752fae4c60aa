"""Mixed precision (fp32, bf16, fp16): step time against a plain loop, memory, stage traffic."""

# Run: mpirun -n 2 python benchmarks/bench_precision.py   (writes BENCHMARKS.md; --help)
#      python benchmarks/bench_precision.py                 (one process: the 1-stage part only)
#
# (a) pipeflow on one stage against the same step written by hand in plain PyTorch, on rank 0
#     alone while any other rank sleeps; (b) pipeflow on 2 stages (ranks 0 and 1); (c) memory
#     per stage, from the tensors; (d) bytes sent between the stages per micro-batch. Every
#     system takes its blocks of steps in turn within each round, in an order rotated every
#     round, so a slow spell of a shared machine falls on all of them alike.

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Any, Callable

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (DEFAULT_OUTPUT, add_model_args, busy, busy_note, cpu_flags,  # noqa: E402
                     header, load_average, run_main, sync, time_block, write_section)

import pipeflow as pf  # noqa: E402
from pipeflow.train.data import Batches, load_corpus  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss, num_parameters  # noqa: E402
from pipeflow.runtime.precision import DTYPES  # noqa: E402

try:
    from pipeflow.runtime.recompute import SavedTensorMeter
except ImportError:          # a pipeflow without the meter: count with autograd's hooks
    SavedTensorMeter = None

__all__ = ["main", "PlainLoop", "stage_memory"]

SECTION = "precision"
COMM = MPI.COMM_WORLD
MIB = 2 ** 20
# CPU features that decide low-precision matmul speed on x86.
FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16", "amx_fp16", "f16c")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    # The example GPT of examples/gpt_small.toml: fp16 matmuls are an order of magnitude slower
    # than fp32 on CPUs without AVX512-FP16, and a bigger model would not fit in minutes.
    add_model_args(p, layers=4, width=128, heads=4, seq=64)
    p.add_argument("--batch", type=int, default=16, help="global batch, sequences")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--precisions", default="fp32,bf16,fp16")
    p.add_argument("--loss-scale", type=float, default=pf.Config().initial_loss_scale,
                   help="fp16: pipeflow's initial dynamic scale and the plain loop's fixed one")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per system, after the "
                   "first (checked) step")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=2, help="fewest timed steps per block")
    p.add_argument("--block-seconds", type=float, default=0.6,
                   help="fast systems take more steps per block, to last about this long")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="'' to skip writing")
    return p.parse_args()


# -- the plain PyTorch loop ---------------------------------------------------------------

class PlainLoop:
    """The training step pipeflow takes on one stage, written by hand in plain PyTorch.

    fp32: the model and AdamW. bf16/fp16: low-precision working weights (LayerNorms kept in
    fp32, inputs cast up and outputs back, as pipeflow's default `fp32_modules`), fp32 master
    weights that AdamW steps (its state in fp32), each micro-batch's gradients added up into
    fp32 master gradients, the masters copied down after the step. fp16 multiplies the loss
    by a fixed scale and skips a step whose gradients overflow.
    """

    def __init__(self, layers, precision: str, args: argparse.Namespace) -> None:
        self.dtype = DTYPES[precision]
        self.mixed = precision != "fp32"
        self.m = args.microbatches
        self.scale = args.loss_scale if precision == "fp16" else 1.0
        self.skipped_steps = 0
        self.model = model = pf.build_sequential(layers, seed=0)
        if self.mixed:
            model.to(self.dtype)
            keep = set(pf.Config().fp32_modules)
            for sub in model.modules():
                if type(sub).__name__ in keep:
                    sub.float()
                    sub.register_forward_pre_hook(lambda mod, inputs: tuple(a.float()
                                                                            for a in inputs))
                    sub.register_forward_hook(lambda mod, inputs, out: out.to(self.dtype))
        self.names = [n for n, _ in model.named_parameters()]
        self.working = list(model.parameters())
        self.masters = ([nn.Parameter(p.detach().float().clone()) for p in self.working]
                        if self.mixed else self.working)
        self.optimizer = torch.optim.AdamW(self.masters, lr=args.lr)
        self.loss = float("nan")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        total = 0.0
        for xm, ym in zip(x.chunk(self.m), y.chunk(self.m)):
            loss = gpt_loss(self.model(xm).float(), ym)
            (loss * (self.scale / self.m)).backward()
            total += loss.item()
            if self.mixed:
                # Accumulate in fp32 (a bf16 sum of m gradients loses bits), free the copy.
                for w, p in zip(self.working, self.masters):
                    if w.grad is not None:
                        if p.grad is None:
                            p.grad = w.grad.float()
                        else:
                            p.grad.add_(w.grad)
                        w.grad = None
        self.loss = total / self.m
        if self.scale != 1.0:
            grads = [p.grad for p in self.masters if p.grad is not None]
            found_inf = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf, torch.full((1,), 1.0 / self.scale))
            if found_inf.item():
                self.skipped_steps += 1
                self.optimizer.zero_grad(set_to_none=True)
                return
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for w, p in zip(self.working, self.masters):
                    w.copy_(p)
        self.optimizer.zero_grad(set_to_none=True)

    def master_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in zip(self.names, self.masters)}


# -- memory, from the tensors -------------------------------------------------------------

def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def watch_gradients(engine: pf.Engine) -> dict[str, int]:
    """Bytes of every gradient the stage holds when its optimizer steps (recorded each step:
    pipeflow sets them to None after the step, so they must be read inside it)."""
    seen: dict[str, int] = {}

    def hook(optimizer, args, kwargs) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        working = [p.grad for p in engine.stage.module.parameters()
                   if all(p is not q for q in params)]
        seen["grads"] = _nbytes([p.grad for p in params] + working)

    if engine.stage.optimizer is not None:
        engine.stage.optimizer.register_step_pre_hook(hook)
    return seen


def saved_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes autograd keeps for backward while `fn` runs (views of a storage once)."""
    if SavedTensorMeter is not None:
        meter = SavedTensorMeter()
        with meter:
            out = fn()
        del out
        return meter.peak
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
            s = t.untyped_storage()
            held[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(held.values())


def stage_memory(engine: pf.Engine, grads_seen: dict[str, int], x: torch.Tensor,
                 y: torch.Tensor, comm: MPI.Comm) -> dict[str, int]:
    """This stage's parameters (working, master), gradients, optimizer state and the bytes one
    micro-batch saves for backward, its forward (and on the last stage, its loss) metered.

    Collective over the stage's pipeline `comm`: each stage passes the shape and dtype of its
    output on, so the next one meters a micro-batch input like the one it receives.
    """
    # One more step with the engine's own saved-tensor meter on (it is off by default: it
    # costs a Python call per saved tensor), for the most it stashed at once.
    engine.runner.measure_activations = True
    engine.train_step(x, y)
    engine.runner.measure_activations = False
    precision = engine.stage.precision
    working = list(engine.stage.module.parameters())
    opt_state = ([t for s in engine.stage.optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t)] if engine.stage.optimizer is not None else [])
    mb = x.shape[0] // engine.config.microbatches
    first, last = engine.plan.holds_first(engine.stage.index), \
        engine.plan.holds_last(engine.stage.index)
    if first:
        sample = x[:mb]
    else:
        shape, dtype = comm.recv(source=comm.rank - 1)
        sample = torch.randn(shape).to(dtype).requires_grad_(True)
    engine.stage.module.train()
    out_meta: list[Any] = []

    def forward() -> Any:
        with torch.enable_grad():
            out = engine.stage.module(precision.cast_input(sample))
            out_meta.append((tuple(out.shape), out.dtype))
            # The last stage's loss is taken in fp32, as the engine does.
            return gpt_loss(out.float(), y[:mb]) if last else out

    activations = saved_bytes(forward)
    if not last:
        comm.send(out_meta[0], dest=comm.rank + 1)
    return dict(
        params=sum(p.numel() for p in working),
        working=_nbytes(working),
        master=_nbytes(precision.masters) if precision.mixed else 0,
        grads=grads_seen.get("grads", -1),
        optimizer=_nbytes(opt_state),
        activations=activations,
        stash=engine.stats.peak_stash,
        # The engine's own meter: the most bytes saved for backward at once in its last step.
        engine_peak=engine.stats.peak_activation_bytes,
    )


# -- the systems --------------------------------------------------------------------------

class System:
    """A named training step on some ranks, with its timings and first-step figures."""

    def __init__(self, name: str, step: Callable[[int], None], active: bool) -> None:
        self.name, self.step, self.active = name, step, active
        self.times: list[float] = []
        self.steps_per_block = 1


def make_engine(layers, precision: str, pipeline: int, args, comm: MPI.Comm) -> pf.Engine:
    config = pf.Config(pipeline=pipeline, microbatches=args.microbatches, schedule="1f1b",
                       precision=precision, initial_loss_scale=args.loss_scale, seed=0)
    return pf.Engine(layers, gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=args.lr), config,
                     comm=comm)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)    # one core per rank
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in precisions:
        if p not in DTYPES:
            raise SystemExit(f"--precisions: {p!r} is not one of {list(DTYPES)}")
    if "fp32" not in precisions:
        precisions.insert(0, "fp32")   # the reference of every ratio
    if args.batch % args.microbatches:
        raise SystemExit(f"--batch {args.batch} must be divisible by --microbatches "
                         f"{args.microbatches}")
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq)
    layers = gpt_layers(cfg)
    batches = Batches(load_corpus(), args.batch, cfg.seq_len, seed=0)
    rank, size = COMM.rank, COMM.size
    two = size >= 2
    rank0 = rank == 0
    load_before = load_average()
    if rank0:
        print(f"GPT {num_parameters(cfg) / 1e6:.2f}M parameters, batch {args.batch} x "
              f"{cfg.seq_len}, {args.microbatches} micro-batches, precisions {precisions}, "
              f"{'1 and 2 stages' if two else '1 stage (one process)'}", flush=True)

    # (a) one stage, on rank 0 alone; (b) two stages on ranks 0 and 1; other ranks sleep.
    pair = COMM.Split(0 if rank < 2 else MPI.UNDEFINED, rank) if two else MPI.COMM_NULL
    engines1: dict[str, pf.Engine] = {}
    plains: dict[str, PlainLoop] = {}
    engines2: dict[str, pf.Engine] = {}
    grads1: dict[str, dict[str, int]] = {}
    grads2: dict[str, dict[str, int]] = {}
    for p in precisions:
        if rank0:
            engines1[p] = make_engine(layers, p, 1, args, MPI.COMM_SELF)
            grads1[p] = watch_gradients(engines1[p])
            plains[p] = PlainLoop(layers, p, args)
        if pair != MPI.COMM_NULL:
            engines2[p] = make_engine(layers, p, 2, args, pair)
            grads2[p] = watch_gradients(engines2[p])

    losses: dict[str, float] = {}

    def engine_step(engine: pf.Engine | None, key: str) -> Callable[[int], None]:
        def step(k: int) -> None:
            losses[key] = engine.train_step(*batches.batch(k))
        return step

    def plain_step(loop: PlainLoop | None) -> Callable[[int], None]:
        return lambda k: loop.step(*batches.batch(k))

    systems: list[System] = []
    for p in precisions:
        systems.append(System(f"pipeflow 1 stage {p}",
                              engine_step(engines1.get(p), f"1 {p}"), rank0))
        systems.append(System(f"plain {p}", plain_step(plains.get(p)), rank0))
    if two:
        for p in precisions:
            systems.append(System(f"pipeflow 2 stages {p}",
                                  engine_step(engines2.get(p), f"2 {p}"), rank < 2))

    # First step of every system on batch 0, from the same initial weights: the fairness check.
    for s in systems:
        time_block(s.step, 0, 1, s.active)
    first_losses = dict(losses)
    check: dict[str, dict[str, float]] = {}
    if rank0:
        for p in precisions:
            mine = engines1[p].master_state_dict()
            theirs = plains[p].master_state()
            check[p] = dict(
                pf_loss=losses[f"1 {p}"], plain_loss=plains[p].loss,
                dparam=max((mine[k] - v).abs().max().item() for k, v in theirs.items()))
        print("first step, pipeflow vs plain: " + "  ".join(
            f"{p} loss {c['pf_loss']:.5f}/{c['plain_loss']:.5f} dparam {c['dparam']:.2g}"
            for p, c in check.items()), flush=True)
    # Warmup, timed to size the blocks: a fast system takes more steps per block.
    for s in systems:
        warm = time_block(s.step, 1, args.warmup, s.active)
        s.steps_per_block = max(args.steps, math.ceil(args.block_seconds / max(warm, 1e-3)))
    next_batch = 1 + args.warmup

    for r in range(args.rounds):
        shift = r % len(systems)
        for s in systems[shift:] + systems[:shift]:
            s.times.append(time_block(s.step, next_batch, s.steps_per_block, s.active))
        # Every system sees the same batches in a round.
        next_batch += max(s.steps_per_block for s in systems)
        if rank0:
            print(f"round {r}: " + "  ".join(f"{s.name} {s.times[-1] * 1e3:.0f}"
                                             for s in systems) + " (ms)", flush=True)
    load_after = load_average()

    # (c) memory and (d) traffic, after the timing so they cannot disturb it.
    x, y = batches.batch(0)
    mem1 = {p: stage_memory(engines1[p], grads1[p], x, y, MPI.COMM_SELF)
            for p in precisions} if rank0 else {}
    mem2: dict[str, list[dict[str, int]]] = {}
    sent: dict[str, list[float]] = {}
    for p in precisions:
        mine = sent_mine = None
        if pair != MPI.COMM_NULL:
            engine = engines2[p]
            mine = stage_memory(engine, grads2[p], x, y, pair)
            sent_mine = engine.stage.pipe_comm.bytes_sent / (engine.stats.step * args.microbatches)
        if two:
            gathered = COMM.gather((mine, sent_mine), root=0)
            if rank0:
                mem2[p] = [g[0] for g in gathered[:2]]
                sent[p] = [g[1] for g in gathered[:2]]
    if rank0:
        status = {p: (engines1[p].loss_scale, engines1[p].stats.skipped_steps,
                      plains[p].skipped_steps) for p in precisions}
        status2 = {p: (engines2[p].loss_scale, engines2[p].stats.skipped_steps)
                   for p in precisions} if two else {}
        bounds = list(engines2["fp32"].plan.boundaries) if two else None
        report = make_report(args, cfg, precisions, systems, check, first_losses, bounds,
                             mem1, mem2, sent, status, status2, load_before, load_after)
        print(report, flush=True)
        if args.output:
            write_section(args.output, report, SECTION)
            print(f"wrote {args.output}")
    sync()
    for engine in [*engines1.values(), *engines2.values()]:
        engine.close()
    if pair != MPI.COMM_NULL:
        pair.Free()


# -- the report ---------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def make_report(args, cfg: GPTConfig, precisions: list[str], systems: list[System],
                check, first_losses, bounds, mem1, mem2, sent, status, status2,
                load_before: float,
                load_after: float) -> str:
    two = bool(mem2)
    tokens = args.batch * cfg.seq_len
    by = {s.name: s for s in systems}
    med = {s.name: statistics.median(s.times) for s in systems}
    best = {s.name: min(s.times) for s in systems}

    def paired(a: str, b: str) -> float:
        # Per round the two ran back to back: the median of the per-round ratios cancels
        # the drift of a shared machine better than a ratio of medians.
        return statistics.median(x / y for x, y in zip(by[a].times, by[b].times))

    flags = cpu_flags(FLAGS)
    have = [f for f, ok in flags.items() if ok]
    lack = [f for f, ok in flags.items() if not ok]
    m = args.microbatches

    rows_a = []
    for p in precisions:
        pfn, pln = f"pipeflow 1 stage {p}", f"plain {p}"
        ratio = paired(pfn, pln)
        scale, skipped, plain_skipped = status[p]
        fp16 = (f"{scale:g} · {skipped} / {plain_skipped}" if p == "fp16" else "–")
        c = check[p]
        rows_a.append(
            f"| {p} | {med[pfn] * 1e3:.1f} | {med[pln] * 1e3:.1f} | **{ratio:.3f}** "
            f"({(ratio - 1) * 100:+.1f}%) | {best[pfn] / best[pln]:.3f} | "
            f"{tokens / med[pfn]:.0f} | {med['pipeflow 1 stage fp32'] / med[pfn]:.2f} | "
            f"{c['pf_loss']:.5f} / {c['plain_loss']:.5f} | {c['dparam']:.1g} | {fp16} | "
            f"{by[pfn].steps_per_block} |")
    worst = max(paired(f"pipeflow 1 stage {p}", f"plain {p}") for p in precisions)

    lines = [
        "## Mixed precision: fp32, bf16, fp16 (CPU)",
        "",
        header(COMM.size),
        "",
        f"The example GPT (examples/gpt_small.toml's shape unless overridden): "
        f"{cfg.n_layers} layers, width {cfg.d_model}, {cfg.n_heads} heads, sequence "
        f"{cfg.seq_len}, {num_parameters(cfg) / 1e6:.2f}M parameters (tied embedding); batch "
        f"{args.batch} ({tokens} tokens) in {m} micro-batches, 1F1B, AdamW (lr {args.lr:g}), "
        f"one torch thread per rank; bf16/fp16 keep LayerNorms in fp32 and the loss in fp32; "
        f"fp16 starts pipeflow's dynamic loss scale, and fixes the plain loop's, at "
        f"{args.loss_scale:g}. Step times are medians over {args.rounds} rounds, each system "
        f"taking a block of steps (at least {args.steps}, more for fast systems so a block "
        f"lasts about {args.block_seconds:g} s) in an order rotated every round, after "
        f"{args.warmup + 1} untimed step(s). {busy_note(load_before, load_after, COMM.size)}",
        "",
        f"CPU features for low precision: present {', '.join(have) or 'none'}; absent "
        f"{', '.join(lack) or 'none'} (torch's CPU capability: "
        f"{torch.backends.cpu.get_cpu_capability()}).",
        "",
        "### (a) One stage: pipeflow against a plain PyTorch loop, side by side",
        "",
        "The plain loop takes the same step by hand on the same model and micro-batches "
        "(`PlainLoop` in the script): fp32, the model and AdamW; bf16/fp16, low-precision "
        "weights, fp32 master weights and AdamW state, each micro-batch's gradients added into "
        "fp32 master gradients, step, masters copied down; fp16 with a fixed loss scale and "
        "`torch._amp_foreach_non_finite_check_and_unscale_`. "
        "All run on rank 0 alone, any other rank asleep.",
        "",
        "| precision | pipeflow (ms) | plain (ms) | pipeflow / plain, median of per-round "
        "ratios | same, best rounds | "
        "pipeflow tokens/s | pipeflow speed vs fp32 | first-step loss, pipeflow / plain | "
        "max abs. Δmaster after step 1 | fp16: scale at end · skipped steps pipeflow / plain "
        "| steps per block |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|---:|",
        *rows_a,
        "",
        f"The issue asks pipeflow on one stage to come within 2% of the best plain loop: "
        f"here the worst precision is at {(worst - 1) * 100:+.1f}% "
        f"({'within' if worst <= 1.02 else '**outside**'} 2%)"
        + (", on a shared machine where single rounds vary by more than that; rerun on a "
           "quiet machine for the final word." if busy(load_before, load_after, COMM.size)
           else "."),
    ]

    if two:
        rows_b = []
        for p in precisions:
            name = f"pipeflow 2 stages {p}"
            scale, skipped = status2[p]
            rows_b.append(
                f"| {p} | {med[name] * 1e3:.1f} | {best[name] * 1e3:.1f} | "
                f"{tokens / med[name]:.0f} | {med['pipeflow 2 stages fp32'] / med[name]:.2f} | "
                f"{med[f'pipeflow 1 stage {p}'] / med[name]:.2f} | "
                f"{first_losses[f'2 {p}']:.5f} | "
                f"{sent[p][0]:.0f} | {sent[p][1]:.0f} | "
                f"{sent[p][0] / sent['fp32'][0]:.2f} / {sent[p][1] / sent['fp32'][1]:.2f} | "
                + (f"{scale:g} · {skipped}" if p == "fp16" else "–") + " |")
        lines += [
            "",
            "### (b) Two stages and (d) the bytes they send each other",
            "",
            f"Ranks 0 and 1, one stage each (layers split {bounds}). Bytes sent per "
            f"micro-batch are the engine's point-to-point payload counter (`engine.stage.pipe_comm."
            f"bytes_sent`) over all steps × {m} micro-batches: stage 0 sends activations, "
            f"stage 1 their gradients.",
            "",
            "| precision | median step (ms) | best round (ms) | tokens/s | speed vs fp32 | "
            "speed vs 1 stage | first-step loss | bytes sent per micro-batch, stage 0 → 1 | "
            "stage 1 → 0 | vs fp32 (0 → 1 / 1 → 0) | fp16: scale · skipped |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows_b,
        ]
        halves = all(abs(sent[p][i] / sent["fp32"][i] - 0.5) < 1e-9
                     for p in precisions if p != "fp32" for i in (0, 1))
        if len(precisions) > 1:
            lines += ["", ("The bytes between stages halve exactly in bf16 and fp16 "
                           "(2-byte activations and gradients against 4)." if halves else
                           "**The bytes between stages do not halve against fp32.**")]

    lines += ["", "### (c) Memory per stage, from the tensors", "",
              "Parameters: the working copy the forward uses and, in bf16/fp16, the fp32 "
              "master copy AdamW steps (in fp32 they are one). Gradients: every gradient the "
              "stage holds when the optimizer steps (fp32 master gradients: pipeflow adds "
              "each low-precision gradient into them as autograd makes it, then frees it). "
              "Optimizer state: AdamW's tensors. Activations: the bytes one micro-batch saves "
              "for backward (the forward of `engine.stage.module`, and the fp32 loss on the last "
              "stage), metered with "
              + ("`pipeflow.runtime.recompute.SavedTensorMeter`" if SavedTensorMeter is not None
                 else "`torch.autograd.graph.saved_tensors_hooks`")
              + "; the stash holds that many bytes per micro-batch in flight, at most the "
              "1F1B peak shown, and the engine's own meter "
              "(`engine.stats.peak_activation_bytes`, where the engine has it) gives the most it "
              "held at once in its last step. With 2 stages the tied embedding is held, and "
              "counted, on both. MiB = 2^20 bytes.", "",
              "| precision | stages | stage | parameters | working (MiB) | master (MiB) | "
              "gradients (MiB) | optimizer (MiB) | model state (MiB) | bytes / parameter | "
              "vs fp32 | activations per micro-batch (MiB) | vs fp32 | peak stash "
              "(micro-batches) | engine's stash peak (MiB) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for stages, mems in ((1, {p: [mem1[p]] for p in precisions}), (2, mem2)):
        if not mems:
            continue
        for p in precisions:
            for s, mm in enumerate(mems[p]):
                ref = mems["fp32"][s]
                state = mm["working"] + mm["master"] + mm["grads"] + mm["optimizer"]
                ref_state = ref["working"] + ref["master"] + ref["grads"] + ref["optimizer"]
                lines.append(
                    f"| {p} | {stages} | {s} | {mm['params']:,} | {_mib(mm['working'])} | "
                    f"{_mib(mm['master'])} | {_mib(mm['grads'])} | {_mib(mm['optimizer'])} | "
                    f"{_mib(state)} | {state / mm['params']:.1f} | {state / ref_state:.2f} | "
                    f"{_mib(mm['activations'])} | "
                    f"{mm['activations'] / ref['activations']:.2f} | {mm['stash']} | "
                    f"{_mib(mm['engine_peak']) if mm['engine_peak'] >= 0 else '–'} |")

    lines += ["", "### Against the seed's claim", "", *claim(precisions, med, mem1, flags,
                                                         two)]
    return "\n".join(lines)


def claim(precisions, med, mem1, flags, two: bool) -> list[str]:
    """What this machine says about "FP16 for forward and backward ... ~2x faster, half the
    memory", and what it cannot say."""
    out = []
    fp32 = med["pipeflow 1 stage fp32"]
    speed = {p: fp32 / med[f"pipeflow 1 stage {p}"] for p in precisions}
    for p in precisions:
        if p == "fp32":
            continue
        mm, ref = mem1[p], mem1["fp32"]
        state = lambda d: d["working"] + d["master"] + d["grads"] + d["optimizer"]  # noqa: E731
        out.append(
            f"- **{p}**: {speed[p]:.2f}x the fp32 speed on one stage (the claim: ~2x); "
            f"activations per micro-batch {mm['activations'] / ref['activations']:.2f}x "
            f"fp32's, model state {state(mm) / state(ref):.2f}x (the claim: half).")
    low = [p for p in precisions if p != "fp32"]
    act = (mem1[low[0]]["activations"] / mem1["fp32"]["activations"]) if low else 1.0
    bf16_hw = flags.get("avx512_bf16") or flags.get("amx_bf16")
    fp16_hw = flags.get("avx512_fp16") or flags.get("amx_fp16")
    out += [
        "",
        "Speed. On a CPU the answer is the instruction set's, not pipeflow's. "
        + ("This CPU has AVX512-BF16 (a bf16 dot-product instruction, twice the multiply-adds "
           "of an fp32 FMA)" if flags.get("avx512_bf16") else "This CPU lacks AVX512-BF16")
        + (" and AMX-BF16 (tile matrix units)" if flags.get("amx_bf16") else
           " but no AMX" if bf16_hw else " and AMX")
        + (f", and bf16 ran {speed['bf16']:.2f}x the fp32 speed here"
           if "bf16" in speed else "")
        + (": at this model's small matrices the casts, the fp32 LayerNorms and loss and the "
           "master-weight update weigh more than the faster products save; larger widths "
           "favour bf16 more. " if speed.get("bf16", 2.0) < 1.2 and bf16_hw else ". ")
        + ("It has AVX512-FP16, so fp16 matrix products run natively."
           if fp16_hw else
           "It has no AVX512-FP16 or AMX-FP16, so torch runs fp16 matrix products on a "
           "slow generic path"
           + (f" (fp16 ran {speed['fp16']:.2f}x the fp32 speed)" if "fp16" in speed else "")
           + ": fp16 on this CPU shows correctness and memory, not speed."),
        "",
        "Memory. Mixed precision with fp32 masters does not halve the model state: per "
        "parameter it keeps 2 bytes of working weight, 4 of master weight, 4 of fp32 "
        "gradient and 8 of AdamW state (18 bytes) against fp32's 4 + 4 + 8 (16 bytes), as "
        "the table shows. What shrinks by about half is what scales with the batch: the "
        f"activations saved for backward ({act:.2f}x fp32's here: a little more than half, "
        f"since LayerNorms and the loss stay in fp32)"
        + (" and the bytes sent between stages (exactly half)." if two else
           "; the bytes sent between stages are measured under `mpirun -n 2` only.")
        + " On a large model at long sequences the activations dominate, which is where the "
        "seed's \"half the memory\" comes from.",
        "",
        "GPU. The seed's figures are GPU figures (tensor cores run bf16/fp16 at many times "
        "the fp32 rate), and they need a GPU machine: none was lent to the session that "
        "wrote this script, so there are no GPU figures here. For reference, the issue's plain "
        "one-GPU loop on an H200 (GPT of 24 layers, width 1024, batch 8 × 1024 tokens, fused "
        "AdamW) took 419 ms/step in fp32, 135 in tf32, 60 with bf16 autocast and 55 with bf16 "
        "weights and hand-kept fp32 masters: 7.6x over fp32, 2.5x over tf32.",
    ]
    if not two:
        out += ["", "*Run as one process: the 2-stage part (step time on two stages, bytes "
                    "between stages) needs `mpirun -n 2 python benchmarks/bench_precision.py`.*"]
    return out


if __name__ == "__main__":
    run_main(main)
