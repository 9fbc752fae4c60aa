"""pipeflow against torch.distributed.pipelining, same GPT and grid, in one MPI run."""

# Run: mpirun -n 2 python benchmarks/bench_peer.py   (writes BENCHMARKS.md; --help for sizes)

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import pipeflow as pf
from pipeflow.data import Batches, load_corpus
from pipeflow.layers import build_layer
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss, num_parameters
from pipeflow.partition import partition_uniform

from _common import add_model_args, cpu_model, sync, write_section  # noqa: E402 (benchmarks/ is the script folder)

__all__ = ["main"]

COMM = MPI.COMM_WORLD
# fp32 sums in another order differ by ~1e-6 relative, the SGD probe's p - g rounding by ~1e-5
# (LayerNorm weights sit near 1); a wrong gradient scale differs by far more.
GRAD_TOL = 1e-4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system per round")
    p.add_argument("--output", default="BENCHMARKS.md", help="'' to skip writing")
    return p.parse_args()




def init_gloo() -> None:
    """torch.distributed from MPI: rank and size from COMM_WORLD, a free port from rank 0."""
    port = None
    if COMM.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(COMM.bcast(port, root=0))
    dist.init_process_group("gloo", rank=COMM.rank, world_size=COMM.size)


# -- the three systems: each is a `step(inputs, targets)` on every rank -------------------

def make_peer(layers, bounds, cfg: GPTConfig, args, seed: int):
    """This rank's stage under torch.distributed.pipelining's Schedule1F1B."""
    s, p = COMM.rank, COMM.size
    module = nn.Sequential(*[build_layer(layers[i], seed, i)
                             for i in range(bounds[s], bounds[s + 1])])
    mb = args.batch // args.microbatches
    if s == 0:
        example_in = torch.zeros(mb, cfg.seq_len, dtype=torch.long)
    else:
        example_in = torch.zeros(mb, cfg.seq_len, cfg.d_model, requires_grad=True)
    out_dim = cfg.vocab_size if s == p - 1 else cfg.d_model
    # The example tensors must carry requires_grad=True (torch 2.13): the stage takes its
    # autograd plan from them, and without it no gradient crosses the stage boundary.
    example_out = torch.zeros(mb, cfg.seq_len, out_dim, requires_grad=True)
    stage = PipelineStage(module, s, p, torch.device("cpu"), input_args=(example_in,),
                          output_args=(example_out,))
    # The schedule divides gradients by the micro-batch count, so a per-micro-batch mean
    # loss gives the gradient of the whole batch's mean, as one process would.
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=gpt_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)

    def backward(x, y) -> float | None:
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if s == 0:
            schedule.step(x, return_outputs=False)
        elif s == p - 1:
            schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        return torch.stack(losses).mean().item() if losses else None

    def step(x, y) -> None:
        backward(x, y)
        opt.step()

    return module, opt, backward, step


def make_pipeflow(layers, bounds, args, seed: int, chunks: int = 1):
    # chunks > 1: the interleaved schedule, `chunks` model chunks a rank, uniform layer counts.
    config = pf.Config(pipeline=COMM.size, microbatches=args.microbatches,
                       schedule="interleaved" if chunks > 1 else "1f1b",
                       virtual_stages=chunks, partition="uniform" if chunks > 1 else bounds,
                       seed=seed)
    engine = pf.Engine(layers, gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=args.lr), config)
    return engine, engine.train_step


def make_single(layers, args, seed: int):
    """T1: rank 0 trains the whole model on the whole batch while the others wait."""
    model = pf.build_sequential(layers, seed) if COMM.rank == 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr) if model is not None else None

    def step(x, y) -> None:
        if model is not None:
            opt.zero_grad(set_to_none=True)
            gpt_loss(model(x), y).backward()
            opt.step()

    return step


# -- the first step must match one process on the whole batch -----------------------------

def check_first_steps(layers, bounds, args, seed, batch, peer, engine) -> dict[str, float]:
    """Take each pipeline's first step and compare it with `build_sequential`'s.

    AdamW's first update is nearly `lr * sign(grad)`, blind to a wrong gradient scale, so
    the gradients are compared too: the peer's directly, pipeflow's through a probe engine
    whose optimizer is SGD with lr 1 (its update is minus the gradient). Returns the largest
    differences, already reduced over ranks.
    """
    x, y = batch
    initial = pf.build_sequential(layers, seed).state_dict()
    ref = pf.build_sequential(layers, seed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    ref_loss = gpt_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
    ref_opt.step()
    ref_params = {k: v.detach() for k, v in ref.state_dict().items()}

    lo = bounds[COMM.rank]

    def global_key(local: str) -> str:
        index, rest = local.split(".", 1)
        return f"{lo + int(index)}.{rest}"

    module, opt, backward, _ = peer
    peer_loss = backward(x, y)
    grad_err = max(((p.grad - ref_grads[global_key(k)]).abs().max().item()
                    / ref_grads[global_key(k)].abs().max().clamp_min(1e-12).item())
                   for k, p in module.named_parameters())
    missing = sum(p.grad is None for p in module.parameters())
    opt.step()
    peer_param_err = max((v - ref_params[global_key(k)]).abs().max().item()
                         for k, v in module.state_dict().items())

    probe = pf.Engine(layers, gpt_loss, lambda ps: torch.optim.SGD(ps, lr=1.0), engine.config)
    probe.train_step(x, y)
    probe_state = probe.gather_state_dict()
    probe.close()
    pf_loss = engine.train_step(x, y)
    state = engine.gather_state_dict()
    pf_param_err = pf_grad_err = 0.0
    if state is not None:
        if state.keys() != ref_params.keys():
            raise RuntimeError(f"pipeflow state keys differ from build_sequential's: "
                               f"{sorted(set(state) ^ set(ref_params))[:5]}")
        pf_param_err = max((state[k] - ref_params[k]).abs().max().item() for k in state)
        pf_grad_err = max(((initial[k] - probe_state[k] - g).abs().max()
                           / g.abs().max().clamp_min(1e-12)).item()
                          for k, g in ref_grads.items())

    def worst(v: float) -> float:
        return COMM.allreduce(v, op=MPI.MAX)

    return dict(
        ref_loss=ref_loss.item(),
        peer_loss=COMM.bcast(peer_loss, root=COMM.size - 1),
        pipeflow_loss=pf_loss,
        peer_grad_rel=worst(grad_err),
        peer_missing_grads=COMM.allreduce(missing),
        peer_param=worst(peer_param_err),
        pipeflow_grad_rel=worst(pf_grad_err),
        pipeflow_param=worst(pf_param_err),
    )


# -- timing ------------------------------------------------------------------------------

def time_block(step: Callable, batches: Batches, first: int, n: int) -> float:
    """Seconds per step of `n` back-to-back steps, from a common start to a common end."""
    sync()
    start = time.perf_counter()
    for k in range(n):
        step(*batches.batch(first + k))
    sync()
    return COMM.bcast((time.perf_counter() - start) / n, root=0)






def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    p, m = COMM.size, args.microbatches
    if args.batch % m:
        raise SystemExit(f"--batch {args.batch} must be divisible by --microbatches {m}")
    init_gloo()
    seed = 0
    # Untied: the peer has no cross-stage weight tying, and both must train the same model.
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                    seq_len=args.seq, tie_embeddings=False)
    layers = gpt_layers(cfg)
    bounds = partition_uniform(len(layers), p)
    batches = Batches(load_corpus(), args.batch, cfg.seq_len, seed=seed)
    rank0 = COMM.rank == 0
    if rank0:
        print(f"GPT {num_parameters(cfg) / 1e6:.2f}M parameters, {p} stages {bounds}, "
              f"batch {args.batch} x {cfg.seq_len}, {m} micro-batches", flush=True)

    load_before = os.getloadavg()[0]
    peer = make_peer(layers, bounds, cfg, args, seed)
    engine, pipeflow_step = make_pipeflow(layers, bounds, args, seed)
    check = check_first_steps(layers, bounds, args, seed, batches.batch(0), peer, engine)
    if rank0:
        print("first step vs build_sequential:", {k: f"{v:.3g}" for k, v in check.items()},
              flush=True)
        if check["pipeflow_grad_rel"] > GRAD_TOL:
            print("WARNING: pipeflow's first step does not match one process; timing anyway")
    if check["peer_missing_grads"] or check["peer_grad_rel"] > GRAD_TOL:
        raise SystemExit(f"the peer's first step does not match one process: {check}")

    systems = {"T1": make_single(layers, args, seed), "pipeflow": pipeflow_step,
               "peer": peer[3]}
    if m % p == 0 and len(layers) >= 2 * p:
        systems["interleaved"] = make_pipeflow(layers, bounds, args, seed, chunks=2)[1]
    times: dict[str, list[float]] = {name: [] for name in systems}
    next_batch = 1
    for name, step in systems.items():
        time_block(step, batches, next_batch, args.warmup)
    next_batch += args.warmup
    for r in range(args.rounds):
        for name, step in systems.items():
            times[name].append(time_block(step, batches, next_batch, args.steps))
        next_batch += args.steps
        if rank0:
            print(f"round {r}: " + "  ".join(f"{n} {t[-1] * 1e3:.0f} ms"
                                             for n, t in times.items()), flush=True)

    load_after = os.getloadavg()[0]
    tokens = args.batch * cfg.seq_len
    med = {name: statistics.median(t) for name, t in times.items()}
    best = {name: min(t) for name, t in times.items()}
    bubble = (m + p - 1) / (m * p)
    med["ideal"], best["ideal"] = med["T1"] * bubble, best["T1"] * bubble
    table = ["| system | median step (ms) | tokens/s | efficiency vs ideal | best round (ms) "
             "| efficiency, best rounds |", "|---|---:|---:|---:|---:|---:|"]
    for label, key in (("T1: one rank, whole model, 1 thread", "T1"),
                       ("ideal: T1/p·(m+p-1)/m", "ideal"),
                       ("pipeflow 1F1B", "pipeflow"),
                       ("torch.distributed.pipelining Schedule1F1B", "peer"),
                       ("pipeflow interleaved 1F1B, 2 chunks a rank", "interleaved")):
        if key not in med:
            continue
        eff = (lambda d: "" if key == "T1" else f"{d['ideal'] / d[key]:.1%}")
        table.append(f"| {label} | {med[key] * 1e3:.0f} | {tokens / med[key]:.0f} | {eff(med)} "
                     f"| {best[key] * 1e3:.0f} | {eff(best)} |")
    ratio = med["peer"] / med["pipeflow"]
    report = "\n".join([
        "## pipeflow vs torch.distributed.pipelining (CPU, gloo)",
        "",
        f"`mpirun -n {p} python benchmarks/bench_peer.py` · {datetime.date.today()} · "
        f"torch {torch.__version__} · {cpu_model()} ({os.cpu_count()} cores) · "
        f"Python {platform.python_version()}",
        "",
        f"GPT of {cfg.n_layers} layers, width {cfg.d_model}, {cfg.n_heads} heads "
        f"(head dim {cfg.head_dim}), sequence {cfg.seq_len}, "
        f"{num_parameters(cfg) / 1e6:.2f}M parameters; batch {args.batch} "
        f"({tokens} tokens) in {m} micro-batches; {p} stages, layers split {bounds}; "
        f"AdamW; one torch thread per rank. Step times are medians over {args.rounds} "
        f"rounds of {args.steps} steps per system, after {args.warmup} warmup steps, the "
        f"systems interleaved within each round (T1, pipeflow, peer"
        f"{', pipeflow interleaved' if 'interleaved' in med else ''}). Load average "
        f"{load_before:.1f} before and {load_after:.1f} after the run on "
        f"{os.cpu_count()} cores" + (
            ": other work shared the cores, so the times are noisy and the best rounds "
            "say more than the medians." if max(load_before, load_after) > p + 0.5 else "."),
        "",
        *table,
        "",
        f"**pipeflow / peer throughput: {ratio:.3f}** (above 1: pipeflow faster)."
        + (f" With its interleaved schedule (2 model chunks a rank, uniform layer counts, "
           f"bubble (p-1)/(2m+p-1) instead of (p-1)/(m+p-1), twice the messages): "
           f"**{med['peer'] / med['interleaved']:.3f}** x the peer's throughput."
           if "interleaved" in med else ""),
        "",
        f"Fairness check, first step against `build_sequential` on the whole batch in one "
        f"process (loss {check['ref_loss']:.4f}; gradients compared relative to each "
        f"tensor's largest entry, parameters after one AdamW step with lr {args.lr:g}):",
        "",
        "| system | loss | max rel. Δgrad | max abs. Δparam | verdict |",
        "|---|---:|---:|---:|---|",
        *[f"| {name} | {check[key + '_loss']:.4f} | {check[key + '_grad_rel']:.2g} | "
          f"{check[key + '_param']:.2g} | "
          f"{'same update' if check[key + '_grad_rel'] < GRAD_TOL else '**MISMATCH**'} |"
          for name, key in (("pipeflow", "pipeflow"), ("peer", "peer"))],
    ])
    if rank0:
        print(report, flush=True)
        if args.output:
            write_section(args.output, report, "peer")
            print(f"wrote {args.output}")
    sync()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
