"""pipeflow on one GPU vs a plain PyTorch loop: step time, MFU, memory, precision, recompute."""

# Run from the repository root on a machine with a GPU (each writes its BENCHMARKS.md section,
# naming the GPU; `--output ''` to skip writing):
#
#   python benchmarks/bench_gpu.py speed        # GPT 350M and 760M, 8 x 1024 tokens a step:
#                                               # pipeflow (pipeline=1) vs the plain loop
#   python benchmarks/bench_gpu.py precision    # 350M: fp32 / tf32 / bf16 side by side
#   python benchmarks/bench_gpu.py recompute    # 350M: each recompute policy's memory and time
#   python benchmarks/bench_gpu.py all
#
# `--device cpu --tiny` runs the same code on a tiny model in seconds (tests/gpu/run.sh's
# dry run), to check the script itself; it writes nothing.

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeflow as pf  # noqa: E402
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss, num_parameters  # noqa: E402
from _common import DEFAULT_OUTPUT, header, run_main, write_section  # noqa: E402

__all__ = ["main"]

BATCH, SEQ = 8, 1024            # 8 x 1024 tokens a step
MODELS = {"350M": GPTConfig(n_layers=24, d_model=1024, n_heads=16, seq_len=SEQ,
                            vocab_size=50304),
          "760M": GPTConfig(n_layers=24, d_model=1536, n_heads=16, seq_len=SEQ,
                            vocab_size=50304)}
TINY = GPTConfig(n_layers=2, d_model=64, n_heads=2, seq_len=32)
# Dense peak FLOP/s (bf16, tf32, fp32) by GPU name, from the vendor's sheets (SXM parts).
PEAKS = {"H200": (989e12, 494e12, 67e12), "H100": (989e12, 494e12, 67e12),
         "A100": (312e12, 156e12, 19.5e12)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("what", nargs="?", default="all",
                   choices=["speed", "precision", "recompute", "all"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model: test the script")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="'' to skip writing")
    return p.parse_args()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fixed_batches(cfg: GPTConfig, batch: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g),
             torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g))
            for _ in range(n)]


def _measure(step: Callable, data: list, steps: int, device: torch.device) -> tuple[float, int]:
    """Median seconds a step over `steps` steps after 2 warm-up ones (the GPU synchronised
    around each), and the allocator's peak over all of them (the optimizer step included),
    taken step by step the same way for every system: pipeflow's train_step resets the
    allocator's peak at its start, so one reading after the loop would show pipeflow's last
    step against the plain loop's every step."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    times, peak = [], 0
    for k in range(steps + 2):
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        step(*data[k % len(data)])
        _sync(device)
        times.append(time.perf_counter() - start)
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated(device))
    return statistics.median(times[2:]), peak


@contextlib.contextmanager
def _tf32(on: bool) -> Iterator[None]:
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _adamw(device: torch.device) -> Callable:
    fused = device.type == "cuda"
    return lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused)


def pipeflow_step(cfg: GPTConfig, device: torch.device, precision: str,
                  recompute: str = "none", microbatches: int = 1) -> tuple[Callable, object]:
    engine = pf.Engine(gpt_layers(cfg), gpt_loss, _adamw(device),
                       pf.Config(precision="fp32" if precision == "tf32" else precision,
                                 microbatches=microbatches, recompute=recompute,
                                 schedule="gpipe"), device=device)
    return engine.train_step, engine


def _grad_norm(params: list[torch.Tensor]) -> float:
    """The whole model's gradient norm, read on the host as pipeflow's non-finite check and
    clipping do every step (one foreach norm, one synchronisation)."""
    return float(torch.nn.utils.get_total_norm([p.grad for p in params]))


def _keep_fp32(model: torch.nn.Module, kinds: tuple[type, ...]) -> None:
    """What pipeflow's bf16 does with `Config.fp32_modules` (LayerNorm by default): those
    modules keep fp32 weights and run in fp32, their inputs cast up and outputs back down."""
    for sub in model.modules():
        if isinstance(sub, kinds):
            sub.float()
            sub.register_forward_pre_hook(
                lambda m, args: tuple(a.float() if torch.is_tensor(a) else a for a in args))
            sub.register_forward_hook(lambda m, args, out: out.to(torch.bfloat16))


def plain_step(cfg: GPTConfig, device: torch.device, precision: str) -> tuple[Callable, None]:
    """The same step without pipeflow, written as one would by hand, doing the same work:
    bf16 working weights (LayerNorm kept in fp32, as pipeflow keeps it) with fp32 masters and
    AdamW, or the fp32 model itself for fp32/tf32; the gradient norm read every step."""
    model = pf.build_sequential(gpt_layers(cfg), 0).to(device)
    if precision in ("fp32", "tf32"):
        opt = _adamw(device)(list(model.parameters()))

        def step(x, y):
            loss = gpt_loss(model(x.to(device)), y.to(device))
            loss.backward()
            _grad_norm(list(model.parameters()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, None
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    model.to(torch.bfloat16)
    _keep_fp32(model, (torch.nn.LayerNorm,))
    opt = _adamw(device)(masters)
    working = list(model.parameters())

    def step(x, y):
        loss = gpt_loss(model(x.to(device)).float(), y.to(device))
        loss.backward()
        for w, m in zip(working, masters):
            m.grad = w.grad.float()
            w.grad = None
        _grad_norm(masters)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            if hasattr(torch, "_foreach_copy_"):       # one launch for all (torch >= 2.2)
                torch._foreach_copy_(working, masters)
            else:
                for w, m in zip(working, masters):
                    w.copy_(m)
    return step, None


def flops_per_step(cfg: GPTConfig, tokens: int) -> float:
    """6 FLOPs a parameter a token (forward 2, backward 4) for the blocks and the output
    projection, plus attention's scores and mixing, 12 · layers · width · sequence a token
    (PaLM's accounting, causal masking not discounted)."""
    matmul_params = num_parameters(cfg, embeddings=False) + cfg.vocab_size * cfg.d_model
    return tokens * (6 * matmul_params + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len)


def _mfu(cfg: GPTConfig, tokens: int, seconds: float, device: torch.device,
         precision: str) -> str:
    if device.type != "cuda":
        return "n/a"
    name = torch.cuda.get_device_name(device)
    peaks = next((v for k, v in PEAKS.items() if k in name), None)
    if peaks is None:
        return "n/a"
    peak = peaks[{"bf16": 0, "tf32": 1, "fp32": 2}[precision]]
    return f"{flops_per_step(cfg, tokens) / seconds / peak:.0%}"


def _run(make: Callable, args, cfg: GPTConfig, precision: str, batch: int) -> tuple:
    device = torch.device(args.device)
    with _tf32(precision == "tf32"):
        step, engine = make()
        data = _fixed_batches(cfg, batch, 4)
        t, peak = _measure(step, data, args.steps, device)
    if engine is not None:
        engine.close()
    del step, engine
    return t, peak, _mfu(cfg, batch * cfg.seq_len, t, device, precision)


def _row(name: str, t: float, peak: int, mfu: str, base: float | None) -> str:
    ratio = f"{t / base:.3f}" if base else ""
    return f"| {name} | {t * 1e3:.1f} | {ratio} | {mfu} | {peak / 2**30:.2f} |"


TABLE = ["| system | step (ms) | vs plain loop | MFU | peak allocated (GiB) |",
         "|---|---:|---:|---:|---:|"]


def bench_speed(args) -> str:
    device = torch.device(args.device)
    models = {"tiny": TINY} if args.tiny else MODELS
    batch = 2 if args.tiny else BATCH
    lines = []
    for label, cfg in models.items():
        plain = _run(lambda: plain_step(cfg, device, "bf16"), args, cfg, "bf16", batch)
        ours = _run(lambda: pipeflow_step(cfg, device, "bf16"), args, cfg, "bf16", batch)
        lines += [f"GPT {label} ({num_parameters(cfg) / 1e6:.3g}M parameters, {cfg.n_layers} "
                  f"layers, width {cfg.d_model}), batch {batch} x {cfg.seq_len}, bf16 working "
                  f"weights with fp32 masters, AdamW; median of {args.steps} steps.", "",
                  *TABLE, _row("plain PyTorch loop", *plain, None),
                  _row("pipeflow, pipeline=1", *ours[:2], ours[2], plain[0]), ""]
    return "\n".join(lines)


def bench_precision(args) -> str:
    device = torch.device(args.device)
    cfg = TINY if args.tiny else MODELS["350M"]
    batch = 2 if args.tiny else BATCH
    rows = []
    for precision in ("fp32", "tf32", "bf16"):
        plain = _run(lambda: plain_step(cfg, device, precision), args, cfg, precision, batch)
        ours = _run(lambda: pipeflow_step(cfg, device, precision), args, cfg, precision, batch)
        rows += [_row(f"plain loop, {precision}", *plain, None),
                 _row(f"pipeflow, {precision}", *ours[:2], ours[2], plain[0])]
    return (f"GPT {num_parameters(cfg) / 1e6:.3g}M, batch {batch} x {cfg.seq_len}, one stage; "
            f"tf32 = fp32 weights with TF32 matmuls; bf16 = bf16 working weights, fp32 "
            f"masters; median of {args.steps} steps.\n\n" + "\n".join(TABLE + rows))


def bench_recompute(args) -> str:
    device = torch.device(args.device)
    cfg = TINY if args.tiny else MODELS["350M"]
    batch = 4 if args.tiny else BATCH
    rows, base = [], None
    for policy in ("none", "selective", "every:2", "full"):
        t, peak, mfu = _run(lambda: pipeflow_step(cfg, device, "bf16", policy, 4), args, cfg,
                            "bf16", batch)
        base = base or t
        rows.append(f"| {policy} | {t * 1e3:.1f} | {t / base - 1:+.0%} | {mfu} | "
                    f"{peak / 2**30:.2f} |")
    return (f"GPT {num_parameters(cfg) / 1e6:.3g}M, bf16, batch {batch} x {cfg.seq_len} in 4 "
            f"micro-batches, GPipe on one stage (all 4 stashed); median of {args.steps} "
            f"steps.\n\n| recompute | step (ms) | extra time | MFU (useful FLOPs) | peak "
            f"allocated (GiB) |\n|---|---:|---:|---:|---:|\n" + "\n".join(rows))


SECTIONS = {"speed": ("pipeflow vs a plain PyTorch loop", bench_speed),
            "precision": ("fp32, tf32 and bf16", bench_precision),
            "recompute": ("recomputation: memory and time", bench_recompute)}


def main() -> None:
    args = parse_args()
    if args.tiny:
        args.steps = min(args.steps, 2)
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (script test)"
    for what in (SECTIONS if args.what == "all" else [args.what]):
        title, bench = SECTIONS[what]
        text = f"## GPU: {title} ({gpu})\n\n{header(1)}\n\n{bench(args)}"
        print(text, flush=True)
        if args.output and not args.tiny:
            write_section(args.output, text, f"gpu-{what}")


if __name__ == "__main__":
    run_main(main)
