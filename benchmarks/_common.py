"""Pieces every benchmark shares: a sleeping barrier, timed blocks, the machine, the report."""

# A script imports these after putting its own folder first on sys.path:
#   sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from _common import ...

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable

import torch
from mpi4py import MPI

from pipeflow.comm.waiting import sleeping_barrier

__all__ = ["REPO", "DEFAULT_OUTPUT", "add_model_args", "sync", "time_block", "cpu_model", "cpu_flags",
           "load_average", "command_line", "header", "write_section", "busy", "busy_note",
           "run_main"]

# The repository's BENCHMARKS.md, wherever the script is run from.
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = str(REPO / "BENCHMARKS.md")


def add_model_args(parser, layers: int = 8, width: int = 256, heads: int = 8,
                   seq: int = 128) -> None:
    """The GPT shape every benchmark takes: --layers, --width, --heads, --seq."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--seq", type=int, default=seq)


def sync(comm: MPI.Comm = MPI.COMM_WORLD) -> None:
    """`pipeflow.comm.waiting.sleeping_barrier` over `comm` (the world by default)."""
    sleeping_barrier(comm)


def time_block(step: Callable[[int], None], first: int, n: int, active: bool,
               comm: MPI.Comm = MPI.COMM_WORLD) -> float:
    """Seconds per step of `n` back-to-back `step(k)` calls, k = first .. first + n - 1.

    Every rank of `comm` calls this; only the `active` ones run the steps, the others sleep
    in the barrier. The clock runs from a common start to a common end, on `comm`'s rank 0
    (which must be active), and every rank gets its figure.
    """
    sync(comm)
    start = time.perf_counter()
    if active:
        for k in range(first, first + n):
            step(k)
    sync(comm)
    return comm.bcast((time.perf_counter() - start) / max(n, 1), root=0)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"model name\s*:\s*(.+)", f.read())
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(wanted: Iterable[str]) -> dict[str, bool]:
    """Which of the `wanted` CPU feature flags /proc/cpuinfo lists (all False where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^flags\s*:\s*(.+)$", f.read(), re.M)
        have = set(match.group(1).split()) if match else set()
    except OSError:
        have = set()
    return {name: name in have for name in wanted}


def load_average() -> float:
    """The 1-minute load average (0.0 where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def command_line(ranks: int) -> str:
    """How this run was launched, as one would type it again from the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    cmd = shlex.join(["python", script, *sys.argv[1:]])
    return f"mpirun -n {ranks} {cmd}" if ranks > 1 else cmd


def header(ranks: int) -> str:
    """The report's provenance line: command, date, torch, CPU, Python."""
    return (f"`{command_line(ranks)}` · {datetime.date.today()} · torch {torch.__version__} · "
            f"{cpu_model()} ({os.cpu_count()} cores) · Python {platform.python_version()}")


def busy(before: float, after: float, ranks: int) -> bool:
    """Whether the load averages say that other work shared the machine."""
    # Before the run the load is someone else's (or a run just finished); during it, this
    # run's own ranks add up to `ranks` (MPI spins while it waits), and no more.
    return before > 1.0 or after > ranks + 0.5


def busy_note(before: float, after: float, ranks: int) -> str:
    """A sentence on the load average around the run, and what it means for the figures."""
    cores = os.cpu_count() or 1
    text = f"Load average {before:.1f} before and {after:.1f} after the run on {cores} cores"
    if busy(before, after, ranks):
        return text + (": the machine was busy before or during the run (other work, or a "
                       "run just before), so the times are noisy; the best rounds say more "
                       "than the medians.")
    return text + ": a quiet machine."


def write_section(path: str, text: str, name: str, require: bool = False) -> None:
    """Replace what lies between `<!-- name:begin -->` and `<!-- name:end -->` in `path`,
    appending the section where it is missing (an error with `require`); other sections
    stay as they are."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in old and end in old.split(begin, 1)[1]:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1]
    elif require:
        raise SystemExit(f"{path} has no {begin} … {end} markers to write between")
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    # Write then rename: a reader (or a crash) never sees half a file.
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


def run_main(main: Callable[[], None]) -> None:
    """Run `main`; an error on any rank ends the whole job instead of leaving the other
    ranks asleep in a barrier, waiting for a rank that is gone."""
    try:
        main()
    except SystemExit as exc:
        if exc.code in (None, 0) or MPI.COMM_WORLD.size == 1:
            raise
        # Argument errors are found alike on every rank; say it once.
        if MPI.COMM_WORLD.rank == 0:
            sys.stderr.write(f"{exc.code}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(2)
    except BaseException:  # noqa: BLE001 - any failure must end every rank
        if MPI.COMM_WORLD.size == 1:
            raise
        sys.stderr.write(f"rank {MPI.COMM_WORLD.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
