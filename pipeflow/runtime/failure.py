"""One rank's failure ends the whole job, named; a rank that stops progressing is reported.

mpi4py leaves the other ranks blocked in a receive when one rank raises; `MPI_Abort` ends
them all. `Abort` can return to Python (seen with some launchers): the process then exits
on its own, so a rank never prints a second, misleading report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

from mpi4py import MPI

from pipeflow.logs import get_logger

__all__ = ["abort_world", "report_and_abort", "install_excepthook", "uncaught", "Watchdog",
           "CollectiveError", "check_failure_mode"]


def check_failure_mode(backend: str, pipeline: int, abort_on_error: bool, where: str) -> None:
    """Refuse `abort_on_error=False` where a failed step cannot be survived: a pipeline on
    NCCL. A stage posts receives ahead; NCCL has no cancel, and the link groups are cached
    for the next engine on the same ranks, which would read every message of such a link
    one late (or hang where sizes differ). MPI cancels them; `strict` remembers them and
    refuses the next engine as NCCL's behaviour would demand."""
    from pipeflow.config import ConfigError

    if backend == "nccl" and pipeline > 1 and not abort_on_error:
        raise ConfigError(
            f"{where}: abort_on_error=False with a pipeline on NCCL: a failed step leaves "
            f"receives posted that NCCL cannot withdraw, on link groups the next engine would "
            f"reuse (it would read each message one late). Keep abort_on_error=True (a "
            f"failure ends the job, named), or use backend 'mpi' for library use that "
            f"survives a failed step")


class CollectiveError(RuntimeError):
    """Not every rank joined an engine call in time (library use with abort_on_error=False;
    otherwise the job is aborted). The engine cannot be used again."""


_log = get_logger(__name__)


def say(text: str, level: int = logging.CRITICAL) -> None:
    """A report that precedes an abort: a record at `level` for the application's handlers,
    and the text itself on `sys.stderr` and on the process's own stderr where something
    replaced it (a log file, pytest's capture: an abort would lose those), each unless a
    handler of the record already writes there. So it reaches stderr, the rank named, with
    or without a logging configuration."""
    _log.log(level, "%s", text.strip("\n"))
    reached = {id(stream) for stream in _streams_reached(_log, level)}
    for stream in dict.fromkeys((sys.stderr, sys.__stderr__)):
        if stream is not None and id(stream) not in reached:
            stream.write(text)
            stream.flush()


def _streams_reached(logger: logging.Logger, level: int) -> list[Any]:
    """The streams the handlers of a `level` record of `logger` write to (as `callHandlers`
    finds them: up the parents while records propagate; `lastResort` where there are none)."""
    if not logger.isEnabledFor(level):
        return []
    streams, found, node = [], False, logger
    while node is not None:
        for handler in node.handlers:
            found = True
            if level >= handler.level and isinstance(handler, logging.StreamHandler):
                streams.append(handler.stream)
        node = node.parent if node.propagate else None
    last = logging.lastResort
    if not found and last is not None and level >= last.level:
        streams.append(sys.stderr)
    return streams


def _main_stack(limit: int = 10) -> str:
    """The main thread's innermost frames (the engine's or the caller's code where it is
    stuck), for a report written from another thread."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None or threading.current_thread() is threading.main_thread():
        return ""
    lines = [f"    {e.filename}:{e.lineno} in {e.name}"
             for e in traceback.extract_stack(frame)[-limit:]]
    return "  its main thread, innermost last:\n" + "\n".join(lines) + "\n"


def abort_world(code: int = 1) -> None:
    """End every rank. The launcher forwards a rank's output asynchronously and drops what is
    still in flight when it tears the job down: give the report a moment to get out."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.5)
    try:
        MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


def report_and_abort(where: str, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    say(f"\npipeflow: {where}:\n{text}pipeflow: aborting all ranks\n")
    abort_world()


def install_excepthook() -> None:
    """An uncaught exception on any rank ends the whole job instead of leaving it blocked.

    Installed when pipeflow is imported under a multi-rank launch, so user code before the
    engine exists is covered too. A hook the user set is left alone.
    """
    if sys.excepthook is not sys.__excepthook__:
        return                  # the user's, or pipeflow's own from its import
    sys.excepthook = uncaught


def uncaught(kind: type, exc: BaseException, tb: Any) -> None:
    """The excepthook under a multi-rank launch: the traceback, then the end of the job."""
    sys.__excepthook__(kind, exc, tb)
    say(f"pipeflow: rank {MPI.COMM_WORLD.rank} raised an uncaught {kind.__name__}; "
        f"aborting all ranks\n")
    abort_world()


class Watchdog:
    """Aborts the job when an engine call makes no progress for `timeout_s` seconds.

    The engine calls `beat()` after every instruction and arms the watchdog for the length of
    each call (`with watchdog:`); between calls (user code, data loading) nothing is timed.
    On expiry it prints `describe()` (rank, step, instruction, the peer waited on and what
    arrived from it) and the main thread's innermost frames, then aborts every rank: a stuck
    collective or a rank that never arrives is reported, not silent. Each rank's own watchdog
    reports for it; the thread makes no MPI call before expiry (a second thread polling MPI
    made this MPICH stall ranks), and should the report itself block, the process exits
    anyway after `_REPORT_S`.
    """

    def __init__(self, timeout_s: float, describe: Callable[[], str]) -> None:
        self.timeout_s = float(timeout_s)
        self.describe = describe
        self._extra_s = 0.0          # an allowance on top of timeout_s (checkpoint I/O)
        self._last = time.monotonic()
        self._depth = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="pipeflow-watchdog",
                                            daemon=True)
            self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def __enter__(self) -> "Watchdog":
        self._depth += 1
        self.beat()
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1

    def close(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def allow(self, extra_s: float) -> Iterator[None]:
        """Armed, with `extra_s` more seconds without progress allowed: a checkpoint of many GB
        a rank is written (or read) as one long stretch of disk I/O on the writer, and of
        waiting on the others; `watchdog_s`, sized for a step, would abort it mid-save."""
        self._extra_s = max(0.0, float(extra_s))
        try:
            with self:
                yield
        finally:
            self._extra_s = 0.0

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            idle = time.monotonic() - self._last
            if self._depth > 0 and idle > self.timeout_s + self._extra_s:
                self._expire(idle)
                return

    def _expire(self, idle: float) -> None:
        # The report probes MPI from this thread; if that blocks, exit all the same.
        threading.Timer(_REPORT_S, os._exit, args=(1,)).start()
        try:
            where = self.describe()
        except Exception as exc:  # noqa: BLE001 - the report must not stop the abort
            where = f"rank {MPI.COMM_WORLD.rank} (its report failed: {exc!r})"
        allowed = f" + {self._extra_s:.0f} s for checkpoint I/O" if self._extra_s else ""
        say(f"\npipeflow: {where}: no progress for {idle:.1f} s (watchdog_s = "
            f"{self.timeout_s:g}{allowed}); a rank is stuck or never arrived. Aborting all ranks. "
            f"Raise watchdog_s for steps that are legitimately this slow.\n{_main_stack()}")
        abort_world()


_REPORT_S = 20.0     # the longest a watchdog's report may take before the process exits
