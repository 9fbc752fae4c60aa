"""What a training run reports: records to its trackers, a progress bar or log lines, and the
figures behind them (tokens/s, MFU, each stage's peak memory and measured bubble)."""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from pipeflow.comm import waiting
from pipeflow.train.trackers import strict_record
from pipeflow.train.trace import COMPUTE_KINDS, op_kind

if TYPE_CHECKING:
    from pipeflow.engine import Engine

__all__ = ["strict_record", "bubble_fraction", "peak_flops", "count_parameters", "stage_stats",
           "memory_reports", "MetricsLog", "clock_text", "devices_in_use", "launcher_terminal"]

# Dense bf16 peaks (FLOP/s) of common accelerators, from their data sheets (no sparsity).
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                  "A10": 125e12, "L4": 121e12, "V100": 125e12, "A6000": 155e12}


def bubble_fraction(events: Sequence[tuple[str, float, float]]) -> float:
    """Idle share of one step's pipeline instructions on one rank, from its timeline.

    The span runs from the first instruction's start to the last one's end (the optimizer
    step left out); busy time is the forward and backward compute (`F`, `B`, `W`) in it.
    Receives that wait and gaps between instructions count as bubble.
    """
    pipeline = [e for e in events if op_kind(e[0]) != "optimizer step"]
    if not pipeline:
        return 0.0
    span = max(e[2] for e in pipeline) - min(e[1] for e in pipeline)
    busy = sum(e[2] - e[1] for e in pipeline if op_kind(e[0]) in COMPUTE_KINDS)
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


def _measured_matmul_flops(device: torch.device | None = None, trials: int = 8) -> float:
    """The best of several timed matmuls on `device`: fp32 on a CPU, bf16 on a GPU (the
    precision its tensor cores are rated in). A peak stands in better than an average on a
    machine whose cores are shared. Its operands come from a private generator: a draw from
    the global stream would move a resumed run's dropout masks off the uninterrupted run's."""
    device = device if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    n, dtype = (4096, torch.bfloat16) if cuda else (384, torch.float32)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))

    def timed() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed()                                 # warm-up: thread pool, caches, cuBLAS handles
    return max(2 * n**3 / max(timed(), 1e-9) for _ in range(trials))


def peak_flops(device: torch.device, tflops: float = 0.0) -> tuple[float, str]:
    """Per-rank peak FLOP/s for MFU, and where the figure comes from."""
    if tflops > 0:
        return tflops * 1e12, "[train] peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops, f"{name} bf16 data sheet"
        # Not in the table: the GPU's own bf16 matmul (never the host's: MFU would read
        # thousands of percent).
        return _measured_matmul_flops(device), f"measured bf16 matmul on {name}"
    return _measured_matmul_flops(device), f"measured fp32 matmul on {device.type}"


def devices_in_use(engine: "Engine") -> int:
    """The distinct devices the job's ranks run on, the count MFU's peak is multiplied by:
    ranks that share one GPU (several ranks over MPI on one device) share its peak. A CPU
    rank counts as a device of its own (its peak is measured per rank). A collective."""
    device = engine.stage.device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        mine: tuple = (socket.gethostname(), str(getattr(props, "uuid", device.index)))
    else:
        mine = (socket.gethostname(), engine.stage.topo.rank)
    return len(set(waiting.allgather(engine.stage.topo.world, mine)))


def count_parameters(engine: "Engine") -> int:
    """The `N` of `6 N` FLOPs per token for models without a formula: the parameters a
    token's forward multiplies, summed over the stages (replica 0 of each). An embedding
    table is looked up, not multiplied, so it does not count; a weight tied between an
    embedding and the output head (two stages hold copies) counts once, as the head."""
    local = _multiplied_parameters(engine.stage.module) if engine.stage.topo.replica == 0 else 0
    return sum(waiting.allgather(engine.stage.topo.world, local))


def _multiplied_parameters(module: torch.nn.Module) -> int:
    """Trainable parameters some module other than an embedding uses, each once."""
    used = {id(p): p.numel() for sub in module.modules()
            if not isinstance(sub, torch.nn.Embedding)
            for p in sub._parameters.values() if p is not None and p.requires_grad}
    return sum(used.values())


def _peak_memory(engine: "Engine") -> tuple[int, str]:
    if engine.stats.peak_memory_bytes is not None:
        return engine.stats.peak_memory_bytes, "cuda allocator"
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "process rss"


def stage_stats(engine: "Engine") -> list[dict[str, Any]] | None:
    """Each stage's peak memory (largest over its replicas) and measured bubble (mean), on
    world rank 0; a collective: every rank calls it at the same step."""
    memory, kind = _peak_memory(engine)
    mine = (engine.stage.index, memory, kind, bubble_fraction(engine.runner.timeline))
    views = waiting.gather(engine.stage.topo.world, mine, 0)
    if views is None:
        return None
    stages: dict[int, list] = {}
    for stage, mem, kind, bubble in views:
        stages.setdefault(stage, []).append((mem, kind, bubble))
    return [{"stage": s, "peak_memory_bytes": max(v[0] for v in rows), "memory": rows[0][1],
             "bubble": round(sum(v[2] for v in rows) / len(rows), 4)}
            for s, rows in sorted(stages.items())]


def memory_reports(engine: "Engine") -> list[dict[str, Any]] | None:
    """Every rank's `engine.memory_report()` (bytes of working weights, masters, gradients,
    optimizer state, activations at peak, and per parameter), by world rank, on world rank
    0; a collective: every rank calls it at the same step."""
    return waiting.gather(engine.stage.topo.world, engine.memory_report(), 0)


# Processes of MPI launchers and their per-node daemons: a rank's stdout is a pipe to one of
# them, and what reaches the person is the stdout of the outermost (mpirun's own).
LAUNCHERS = ("mpirun", "mpiexec", "mpiexec.hydra", "hydra_pmi_proxy", "orterun", "prterun",
             "prte", "prted", "orted", "srun", "slurmstepd")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:     # "pid (comm) state ppid ...": comm may hold ")"
        return int(f.read().rsplit(")", 1)[1].split()[1])


def launcher_terminal(pid: int | None = None) -> str | None:
    """The terminal this process's output reaches through its MPI launcher, or None.

    Under `mpirun` a rank's stdout is a pipe to the launcher, which copies it to its own
    stdout as it comes: when that is a terminal (a person watching `mpirun -n N pipeflow
    train`), a progress bar drawn in place on the pipe shows in place there. Walks up from the
    parent through launcher processes only (Linux `/proc`): `mpirun ... > log` or `| tee`
    find no terminal, and neither does a shell above the launcher.
    """
    try:
        pid = os.getppid() if pid is None else pid
        for _ in range(8):
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() not in LAUNCHERS:
                    return None
            out = os.readlink(f"/proc/{pid}/fd/1")
            if out.startswith(("/dev/pts/", "/dev/tty")):
                return out
            pid = _parent(pid)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _columns(terminal: str) -> int | None:
    """The width of the terminal at `terminal` (a path), or None."""
    try:
        fd = os.open(terminal, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.get_terminal_size(fd).columns or None
    except OSError:
        return None
    finally:
        os.close(fd)


class MetricsLog:
    """Rank 0's outputs: the trackers (`pipeflow.train.trackers`), progress bar or lines.

    The bar (tqdm, on stdout with the lines) is drawn where a person sees it update in place:
    stdout a terminal, or a pipe to an MPI launcher whose own stdout is one
    (`launcher_terminal`). Elsewhere (a file, a pipe to another program, a caller's own `log`)
    plain lines only.
    """

    def __init__(self, trackers: Sequence[Any], total: int, first: int, progress: bool,
                 log: Callable[..., None] = print) -> None:
        self.log = log
        self.trackers = list(trackers)
        self.bar = None
        # Only where the lines go to the process's own stdout: a caller's `log` (or a test's
        # capture of stdout) gets every line as it is, never a bar.
        if not progress or log is not print or sys.stdout is not sys.__stdout__:
            return
        terminal = "" if sys.stdout.isatty() else launcher_terminal()
        if terminal is None:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        # Through a pipe tqdm cannot ask the width: the launcher's terminal's, read once.
        width = {"dynamic_ncols": True} if not terminal else {"ncols": _columns(terminal)}
        self.bar = tqdm(total=total, initial=first, unit="step", file=sys.stdout, **width)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            self.log(text, flush=True)

    def advance(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")

    def record(self, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        for thing in (*self.trackers, self.bar):
            if thing is not None:
                thing.close()


def clock_text(seconds: float) -> str:
    """`1:02:03`, `2:03`: a duration as a log line shows it."""
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
