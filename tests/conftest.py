"""Test-session guards: the MPI tests must really run under mpirun, none silently skipped."""

import faulthandler
import os
import signal
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/toy.py

_skipped: list[str] = []
_started: list[str] = []          # the test files begun, in order
_name_files: list[bool] = []      # [True] on rank 0 of an mpirun job

# A hung engine call reports itself (rank, instruction, the peer it waits on and what has
# arrived from that peer) and ends the job well before pytest-timeout's plain stack dump.
# No test step comes near this.
os.environ.setdefault("PIPEFLOW_WATCHDOG_S", "45")

# Debugging a hung test process: with PIPEFLOW_TEST_STACKS=DIR set, `kill -USR1 PID` writes
# every thread's stack (the main thread's MPI or torch.distributed call included) to
# DIR/stacks.PID.txt (a file: pytest captures the test's own stderr).
if os.environ.get("PIPEFLOW_TEST_STACKS") and hasattr(signal, "SIGUSR1"):
    _stacks = open(os.path.join(os.environ["PIPEFLOW_TEST_STACKS"],
                                f"stacks.{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)


# With PIPEFLOW_TEST_TOUCHED=DIR set, each test process notes the modules imported and those
# whose functions ran (a call-event profiler: slower, for checking what a tier covers) and
# writes them to DIR/touched.PID.txt at its end (tests/check.sh --modules reads them).
_touched: set[tuple[str, str]] = set()


def _note_call(frame, event, arg):
    if event == "call":
        code = frame.f_code
        _touched.add(("imported" if code.co_name == "<module>" else "ran", code.co_filename))


if os.environ.get("PIPEFLOW_TEST_TOUCHED"):
    sys.setprofile(_note_call)
    threading.setprofile(_note_call)


def _with_mpi(config) -> bool:
    return bool(config.getoption("--with-mpi", default=False))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if _with_mpi(config):
        from mpi4py import MPI
        if MPI.COMM_WORLD.size < 2:
            raise pytest.UsageError(
                "--with-mpi needs at least 2 ranks: run `mpirun -n 2 python -m pytest "
                "--with-mpi -m mpi` (a 1-rank run would test no pipeline)")
        _name_files.append(MPI.COMM_WORLD.rank == 0)
        if MPI.COMM_WORLD.rank != 0:
            # Every rank runs the same tests in step: rank 0's JUnit XML (run_all.sh's
            # PIPEFLOW_TEST_TIMES) is the job's; the others would overwrite the same file.
            config.option.xmlpath = None


def pytest_runtest_logstart(nodeid, location):
    # Under mpirun several files share a job (run_all.sh): name each as it starts, so a job
    # ended by an abort or a hang says in the log which file it was in, and keep the test
    # begun last in PIPEFLOW_TEST_CURRENT, which run_all.sh names when a job ends early.
    if not any(_name_files):
        return
    path = nodeid.split("::", 1)[0]
    if _started[-1:] != [path]:
        _started.append(path)
        print(f"\n-- {path}", file=sys.stderr, flush=True)
    _note_current(nodeid)


def _note_current(text: str) -> None:
    if os.environ.get("PIPEFLOW_TEST_CURRENT"):
        with open(os.environ["PIPEFLOW_TEST_CURRENT"], "w") as note:
            note.write(text)


def pytest_runtest_logreport(report):
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PIPEFLOW_TEST_TOUCHED"):
        sys.setprofile(None)
        threading.setprofile(None)
        root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
        with open(os.path.join(os.environ["PIPEFLOW_TEST_TOUCHED"],
                               f"touched.{os.getpid()}.txt"), "w") as out:
            out.writelines(f"{how} {os.path.relpath(f, root)}\n" for how, f in sorted(_touched)
                           if f.startswith(os.path.join(root, "pipeflow", "")))
    if any(_name_files):
        _note_current(":finished")   # the job ran to its end: pytest names its failures
    # Under mpirun a skipped test is a test that did not run where it should have.
    if _with_mpi(session.config) and _skipped and exitstatus == 0:
        print(f"\nerror: {len(_skipped)} MPI test(s) skipped under mpirun: {_skipped[:5]}",
              file=sys.stderr)
        session.exitstatus = 1
