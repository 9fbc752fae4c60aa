"""A failure on one rank ends the whole job within seconds, naming the rank: no hang."""

import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")


def _clean_env():
    # A fresh launch: no MPI/PMI state inherited from a parent job or singleton init.
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "I_MPI_"))}


@pytest.mark.skipif(MPIRUN is None, reason="needs mpirun on PATH")
@pytest.mark.parametrize("script,mode,expected", [
    # An exception on one rank: inside a layer, or in user code between steps.
    ("crash.py", "in-layer",
     "rank 1 (stage 1 of 2, replica 0 of 1) failed at instruction F0 of step 2"),
    ("crash.py", "outside", "rank 1 raised an uncaught ValueError; aborting all ranks"),
    # Ctrl-C to one rank mid-step: named and ended at once, not left to the others' watchdog.
    ("crash.py", "sigint-in-layer",
     "rank 1 (stage 1 of 2, replica 0 of 1) failed at instruction F0 of step 2"),
    # A rank stuck in a layer (the watchdog), a rank a step ahead (the close check), a layer
    # constructor failing on one rank (abort from the first line).
    ("stall.py", "sleep", "no progress for"),
    # A rank that never comes back from its own code: the waiting rank's watchdog names
    # the per-step agreement it waits in, and where its main thread is.
    ("stall.py", "outside", "rank 0 (stage 0 of 2, replica 0 of 1) at instruction batch of "
                            "step 2: no progress for"),
    ("stall.py", "extra-step", "ranks disagree on the call"),
    ("stall.py", "build", "failed at instruction setup"),
    # An engine call made on some ranks only: the agreement it starts with gives up after
    # agree_s (2 s here), on the collecting rank naming the ranks that never came.
    ("stall.py", "save-rank0", "called save() at step 3; rank(s) 1 did not within 2 s"),
    ("stall.py", "close-skipped", "called close() at step 3; rank(s) 1 did not within 2 s"),
    # The trainer: one rank's exception between steps is printed, and the job ends (its close
    # gives up after FAILING_CLOSE_S while the other rank waits at the stop-signal agreement);
    # Ctrl-C on one rank ends it at once.
    ("trainer_fault.py", "raise", "ValueError: user code failed between steps"),
    # ... and ends promptly: not after agree_s (600 s there), FAILING_CLOSE_S after the raise.
    ("trainer_fault.py", "raise-patient",
     "closed the engine while raising ValueError: user code failed between steps"),
    ("trainer_fault.py", "interrupt", "rank 1 interrupted at step 2"),
    # A tensor rank that skips a cut layer's collective: the waiting rank's watchdog names
    # the tensor group's collective (layer, style) it waits in; strict mode fails both at
    # the first collective that differs, naming each side's.
    ("tensor_skip.py", "mpi", "; inside tensor group: layer "),
    ("tensor_skip.py", "strict", "collective 0 of this group differs between ranks (rank 0: "
                                 "all_reduce[tensor group: layer 0.down (rowwise)]"),
])
def test_a_failed_stalled_or_mismatched_rank_ends_the_job_fast(script, mode, expected):
    start = time.monotonic()
    proc = subprocess.run([MPIRUN, "-n", "2", sys.executable,
                           os.path.join(HERE, "scripts", script), mode],
                          capture_output=True, text=True, timeout=120, env=_clean_env())
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished without failing" not in out
    assert expected in out, out
    if script == "crash.py":
        assert "boom" in out or "user code failed" in out or "KeyboardInterrupt" in out
    # Start-up (python, torch, MPI) takes a few seconds here; the abort itself is immediate.
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
