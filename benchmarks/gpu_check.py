"""The checks that need a GPU: NCCL backend, host-staged MPI, mixed precision, recompute peaks."""

# Prepared for a session with a lent GPU machine (one H200 seen there: torch with CUDA, NCCL,
# Open MPI at /usr/bin/mpirun needing --allow-run-as-root). Run from the repository root:
#
#   python benchmarks/gpu_check.py nccl          # grid 1x1 on the NCCL backend
#   mpirun --allow-run-as-root -n 2 python benchmarks/gpu_check.py shared
#                                                # 2 ranks share GPU 0 over the MPI backend
#   python benchmarks/gpu_check.py precision     # ~350M GPT: fp32 / bf16 / fp16 vs a plain loop
#   python benchmarks/gpu_check.py recompute     # allocator peaks per recomputation policy
#
# Each writes its section of BENCHMARKS.md (`--output ''` to skip) naming the GPU. `--tiny
# --device cpu` runs the same code on a CPU in seconds, to check the script itself.

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeflow as pf  # noqa: E402
from pipeflow.data import Batches, load_corpus  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss, num_parameters  # noqa: E402
from _common import DEFAULT_OUTPUT, header, run_main, write_section  # noqa: E402

__all__ = ["main"]

COMM = MPI.COMM_WORLD


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("check", choices=["nccl", "shared", "precision", "recompute"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model: test the script")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="'' to skip writing")
    return p.parse_args()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (script test)"


def _timed(step, batches, first: int, n: int, device: torch.device) -> float:
    """Median seconds per step over `n` steps, after the first (warm-up) one."""
    step(*batches.batch(first))
    times = []
    for k in range(n):
        _sync(device)
        start = time.perf_counter()
        step(*batches.batch(first + 1 + k))
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _max_rel_diff(state, ref) -> float:
    return max(((state[k].float().cpu() - v.float().cpu()).abs().max()
                / v.float().abs().max().clamp_min(1e-12)).item() for k, v in ref.items())


def check_equivalence(args, backend: str) -> str:
    """Train 3 steps through pipeflow and through build_sequential on the same device."""
    device = torch.device(args.device)
    pipeline = COMM.size
    small = GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64)
    cfg = small if args.tiny else GPTConfig(n_layers=8, d_model=512, n_heads=8, seq_len=256)
    layers = gpt_layers(cfg)
    # SGD: its update is the gradient itself, so the check sees gradient differences as
    # they are (AdamW's g / sqrt(v) blows up rounding where gradients are near zero).
    opt = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    config = pf.Config(pipeline=pipeline, microbatches=4, backend=backend)
    engine = pf.Engine(layers, gpt_loss, opt, config, device=device)
    data = Batches(load_corpus(), 16, cfg.seq_len, seed=0)
    losses = [engine.train_step(*data.batch(k)) for k in range(3)]
    full = engine.gather_state_dict()
    lines = []
    if COMM.rank == 0:
        ref = pf.build_sequential(layers, 0).to(device)
        ref_opt = opt(list(ref.parameters()))
        ref_losses = []
        for k in range(3):
            x, y = (t.to(device) for t in data.batch(k))
            loss = gpt_loss(ref(x), y)
            ref_opt.zero_grad()
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.item())
        diff = _max_rel_diff(full, ref.state_dict())
        loss_diff = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
        lines.append(f"Equivalence after 3 SGD steps against `build_sequential` on the same "
                     f"device (fp32; GPU kernels sum in their own order): max relative "
                     f"parameter difference {diff:.2g}, loss {loss_diff:.2g} "
                     f"({'same update' if diff < 1e-4 else '**MISMATCH**'}).")
    step_time = _timed(engine.train_step, data, 3, args.steps, device)
    if COMM.rank == 0:
        tokens = 16 * cfg.seq_len
        lines.append(f"Step time {step_time * 1e3:.1f} ms ({tokens / step_time:.0f} tokens/s), "
                     f"GPT {num_parameters(cfg) / 1e6:.1f}M, batch 16 x {cfg.seq_len} in 4 "
                     f"micro-batches, backend {engine.backend}, pipeline {pipeline}.")
    engine.close()
    return "\n\n".join(lines)


def check_precision(args) -> str:
    """pipeflow on one stage in fp32, bf16, fp16 against a plain bf16 loop with fp32 masters."""
    device = torch.device(args.device)
    cfg = (GPTConfig(n_layers=2, d_model=64, n_heads=2, seq_len=32) if args.tiny else
           GPTConfig(n_layers=24, d_model=1024, n_heads=16, seq_len=1024, vocab_size=50304))
    batch = 2 if args.tiny else 8
    layers = gpt_layers(cfg)
    g = torch.Generator().manual_seed(0)
    fixed = [(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g),
              torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g))
             for _ in range(args.steps + 2)]

    class Fixed:
        def batch(self, k):
            return fixed[k % len(fixed)]

    fused = device.type == "cuda"
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        torch.cuda.empty_cache() if device.type == "cuda" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        engine = pf.Engine(layers, gpt_loss,
                           lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused),
                           pf.Config(precision=precision), device=device)
        t = _timed(engine.train_step, Fixed(), 0, args.steps, device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        rows.append((f"pipeflow {precision}", t, peak))
        engine.close()
        del engine
    # The plain loop the issue quotes: bf16 weights, hand-kept fp32 masters, fused AdamW.
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = pf.build_sequential(layers, 0).to(device)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=fused)
    working = list(model.parameters())

    def plain(x, y):
        x, y = x.to(device), y.to(device)
        loss = gpt_loss(model(x).float(), y)
        loss.backward()
        for w, m in zip(working, masters):
            m.grad = w.grad.float()
            w.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w, m in zip(working, masters):
                w.copy_(m)

    t = _timed(plain, Fixed(), 0, args.steps, device)
    rows.append(("plain bf16 loop, fp32 masters", t, torch.cuda.max_memory_allocated(device)
                 if device.type == "cuda" else 0))
    fp32 = rows[0][1]
    best = rows[-1][1]
    table = ["| system | step (ms) | vs fp32 | vs plain bf16 loop | peak allocated (GiB) |",
             "|---|---:|---:|---:|---:|"]
    for name, t, peak in rows:
        table.append(f"| {name} | {t * 1e3:.1f} | {fp32 / t:.2f}x | {t / best:.3f} | "
                     f"{peak / 2**30:.1f} |")
    return (f"GPT {num_parameters(cfg) / 1e6:.0f}M ({cfg.n_layers} layers, width "
            f"{cfg.d_model}), batch {batch} x {cfg.seq_len}, one stage, one micro-batch, "
            f"AdamW{' (fused)' if fused else ''}; median of {args.steps} steps.\n\n"
            + "\n".join(table))


def check_recompute(args) -> str:
    """Allocator peak and step time per recomputation policy, GPipe stash of 4 micro-batches."""
    device = torch.device(args.device)
    cfg = (GPTConfig(n_layers=2, d_model=64, n_heads=2, seq_len=32) if args.tiny else
           GPTConfig(n_layers=24, d_model=1024, n_heads=16, seq_len=1024, vocab_size=50304))
    batch = 4 if args.tiny else 16
    data = Batches(load_corpus(), batch, cfg.seq_len, seed=0)
    rows = []
    for policy in ("none", "selective", "every:2", "full"):
        if device.type == "cuda":
            torch.cuda.empty_cache()
        engine = pf.Engine(gpt_layers(cfg), gpt_loss,
                           lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                           pf.Config(precision="bf16", microbatches=4, schedule="gpipe",
                                     recompute=policy), device=device,
                           measure_activations=True)
        t = _timed(engine.train_step, data, 0, args.steps, device)
        rows.append((policy, t, engine.peak_memory_bytes or 0, engine.peak_activation_bytes))
        engine.close()
        del engine
    base_t, base_peak, base_act = rows[0][1], rows[0][2], rows[0][3]
    table = ["| policy | step (ms) | extra time | allocator peak (GiB) | stash (GiB, meter) "
             "| stash saved |", "|---|---:|---:|---:|---:|---:|"]
    for policy, t, peak, act in rows:
        table.append(f"| {policy} | {t * 1e3:.1f} | {t / base_t - 1:+.0%} | "
                     f"{peak / 2**30:.2f} | {act / 2**30:.2f} | "
                     f"{1 - act / base_act if base_act else 0:.0%} |")
    del base_peak
    return (f"GPT {num_parameters(cfg) / 1e6:.0f}M, bf16, batch {batch} x {cfg.seq_len} in 4 "
            f"micro-batches, GPipe on one stage (all 4 stashed); median of {args.steps} "
            f"steps.\n\n" + "\n".join(table))


def main() -> None:
    args = parse_args()
    if args.tiny:
        args.steps = min(args.steps, 2)
    if args.check == "nccl":
        body = check_equivalence(args, "nccl" if args.device.startswith("cuda") else "gloo")
    elif args.check == "shared":
        body = check_equivalence(args, "mpi")
    elif args.check == "precision":
        body = check_precision(args)
    else:
        body = check_recompute(args)
    if COMM.rank == 0:
        device = torch.device(args.device)
        titles = {"nccl": "NCCL backend, grid 1x1", "shared": f"{COMM.size} ranks sharing "
                  f"one GPU over the MPI backend (host-staged)", "precision": "Mixed precision",
                  "recompute": "Recomputation: allocator peaks"}
        text = (f"## GPU: {titles[args.check]} ({_gpu_name(device)})\n\n{header(COMM.size)}"
                f"\n\n{body}")
        print(text, flush=True)
        if args.output and not args.tiny:
            write_section(args.output, text, f"gpu-{args.check}")


if __name__ == "__main__":
    run_main(main)
