"""One rank's failure ends the whole job, named; a rank that stops progressing is reported.

mpi4py leaves the other ranks blocked in a receive when one rank raises; `MPI_Abort` ends
them all. `Abort` can return to Python (seen with some launchers): the process then exits
on its own, so a rank never prints a second, misleading report.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import weakref
from typing import Callable

from mpi4py import MPI

__all__ = ["abort_world", "report_and_abort", "install_excepthook", "Watchdog"]


def say(text: str) -> None:
    """A report that precedes an abort: to `sys.stderr`, and also to the process's own stderr
    where something replaced it (a log file, pytest's capture), which an abort would lose."""
    for stream in dict.fromkeys((sys.stderr, sys.__stderr__)):
        if stream is not None:
            stream.write(text)
            stream.flush()


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
        return

    def hook(kind, exc, tb):
        sys.__excepthook__(kind, exc, tb)
        say(f"pipeflow: rank {MPI.COMM_WORLD.rank} raised an uncaught {kind.__name__}; "
            f"aborting all ranks\n")
        abort_world()

    sys.excepthook = hook


ALARM_TAG = 11     # on the watchdog's own communicator: "my watchdog fired, report now"
_WATCHING: "weakref.WeakSet[Watchdog]" = weakref.WeakSet()


@atexit.register          # registered after mpi4py's own: runs before MPI_Finalize
def _stop_watching() -> None:
    """No watchdog thread may be inside MPI while the main thread finalizes it."""
    for dog in list(_WATCHING):
        dog.close(free=False)


class Watchdog:
    """Aborts the job when an engine call makes no progress for `timeout_s` seconds.

    The engine calls `beat()` after every instruction and arms the watchdog for the length of
    each call (`with watchdog:`); between calls (user code, data loading) nothing is timed.
    On expiry it prints `describe()` (rank, step, instruction and the peer waited on), asks
    every other rank to print theirs (a message on its own communicator, which each rank's
    watchdog thread polls, so a rank stuck in MPI or outside any engine call answers too),
    gives them a moment, and aborts every rank: a stuck collective or a rank that never
    arrives is reported from every side, not silent.

    `comm`: the ranks of the engine; a duplicate of it carries the alarms (made on every rank
    alike, whatever `timeout_s`, since duplicating is collective).
    """

    def __init__(self, timeout_s: float, describe: Callable[[], str],
                 comm: MPI.Comm | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.describe = describe
        self._last = time.monotonic()
        self._depth = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._period = min(1.0, self.timeout_s / 4)
        self._comm = comm.Dup() if comm is not None else None
        # Another thread's MPI calls need MPI_THREAD_MULTIPLE (mpi4py's default).
        self._alarms = self._comm is not None and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="pipeflow-watchdog",
                                            daemon=True)
            self._thread.start()
            _WATCHING.add(self)

    def beat(self) -> None:
        self._last = time.monotonic()

    def __enter__(self) -> "Watchdog":
        self._depth += 1
        self.beat()
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1

    def close(self, free: bool = True) -> None:
        """Stop watching; with `free`, collective over `comm`, like the engine's `close()`."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._period + 1)
        if free and self._comm is not None:
            self._comm.Free()
            self._comm = None

    def _watch(self) -> None:
        try:
            while not self._stop.wait(self._period):
                asker = self._alarmed_by()
                if asker is not None:
                    self._report(f"asked by rank {asker}, whose watchdog fired")
                    continue
                idle = time.monotonic() - self._last
                if self._depth > 0 and idle > self.timeout_s:
                    self._expire(idle)
                    return
        except MPI.Exception:      # MPI finalized under a daemon thread at exit
            return

    def _expire(self, idle: float) -> None:
        self._alarm_others()
        self._report(f"no progress for {idle:.1f} s (watchdog_s = {self.timeout_s:g}); a "
                     f"rank is stuck or never arrived. Aborting all ranks. Raise watchdog_s "
                     f"for steps that are legitimately this slow")
        time.sleep(self._period + 1.0)      # the other ranks' reports get out first
        abort_world()

    def _report(self, what: str) -> None:
        try:
            where = self.describe()
        except Exception as exc:  # noqa: BLE001 - the report must not stop the abort
            where = f"rank {MPI.COMM_WORLD.rank} (its report failed: {exc!r})"
        if self._depth == 0:
            where += " (now between engine calls, in the caller's own code)"
        say(f"\npipeflow: {where}: {what}.\n{_main_stack()}")

    def _alarmed_by(self) -> int | None:
        """The rank whose alarm arrived (all pending alarms taken), or None."""
        if not self._alarms or MPI.Is_finalized():
            return None
        asker, status = None, MPI.Status()
        while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=ALARM_TAG, status=status):
            asker = status.Get_source()
            self._comm.Recv([bytearray(0), MPI.BYTE], source=asker, tag=ALARM_TAG)
        return asker

    def _alarm_others(self) -> None:
        if not self._alarms:
            return
        me = self._comm.rank
        self._sent = [self._comm.Isend([bytearray(0), MPI.BYTE], dest=rank, tag=ALARM_TAG)
                      for rank in range(self._comm.size) if rank != me]   # the job ends
