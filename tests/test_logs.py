"""pipeflow's messages through `logging`: the library configures no handler, each record
carries the rank, `--quiet` / `--verbose` set the level, and a report that ends the job
reaches stderr once whatever the logging configuration."""

import io
import logging
import os
import subprocess
import sys
import types

import pytest

from pipeflow import logs
from pipeflow.cli import main
from pipeflow.runtime import failure

HERE = os.path.dirname(os.path.abspath(__file__))
_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")

LIBRARY_USE = """
import logging, sys
sys.path.insert(0, sys.argv[1])
import pipeflow as pf
from toy import adamw, batches, loss_fn, toy_layers
data = batches(1, 8)
engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(microbatches=4, schedule="auto"),
                   sample=data[0][0][:2])
engine.train_step(*data[0])
assert engine.schedule_choice, "auto chose nothing"
engine.close()
root, ours = logging.getLogger(), logging.getLogger("pipeflow")
print(repr(root.handlers), repr(ours.handlers), file=sys.__stderr__)
"""



@pytest.fixture(autouse=True)
def _pipeflow_logger_as_imported():
    # Each test starts from the `pipeflow` logger as the library leaves it (level NOTSET,
    # the NullHandler only), whatever a test of another file run before in this worker did.
    ours = logging.getLogger("pipeflow")
    before = ours.level, list(ours.handlers)
    ours.setLevel(logging.NOTSET)
    ours.handlers = [h for h in ours.handlers if isinstance(h, logging.NullHandler)]
    yield
    ours.setLevel(before[0])
    ours.handlers = before[1]

def test_the_library_adds_no_handler_and_says_nothing_unasked():
    # A fresh interpreter: pytest's own handlers sit on the root logger in this one.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    proc = subprocess.run([sys.executable, "-c", LIBRARY_USE, HERE], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    # The engine built, measured and chose a schedule (an INFO record): no line anywhere.
    assert proc.stdout == ""
    assert proc.stderr.strip() == "[] [<NullHandler (NOTSET)>]"


def _clear_rank(monkeypatch):
    for key in _RANK_ENV:
        monkeypatch.delenv(key, raising=False)


def test_records_carry_the_rank_and_the_format_shows_it(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pipeflow")
    _clear_rank(monkeypatch)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    logs.get_logger("pipeflow.test").info("no handler of pipeflow's")
    assert caplog.records[0].rank == 3            # on the record, for any handler
    out = io.StringIO()
    handler = logs.configure(logging.INFO, stream=out)
    try:
        logs.get_logger("pipeflow.test").warning("stage %d waits", 1)
        logging.getLogger("pipeflow.other").info("made without get_logger")
    finally:
        logging.getLogger("pipeflow").removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "rank 3 WARNING pipeflow.test: stage 1 waits",
        "rank 3 INFO pipeflow.other: made without get_logger"]
    # No launcher variable: MPI's rank once mpi4py has started, else 0.
    _clear_rank(monkeypatch)
    fake = types.SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False,
                                 COMM_WORLD=types.SimpleNamespace(Get_rank=lambda: 5))
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
    assert logs.world_rank() == 5
    monkeypatch.delitem(sys.modules, "mpi4py.MPI")
    assert logs.world_rank() == 0


SMALL = """
[engine]
microbatches = 2
schedule = "auto"
[model]
n_layers = 2
d_model = 16
n_heads = 2
seq_len = 8
[train]
steps = 1
batch_size = 4
log_every = 1
"""


def _train(tmp_path, capsys, before=(), after=()):
    path = tmp_path / "run.toml"
    path.write_text(SMALL)
    assert main([*before, "train", str(path), *after]) == 0
    said = capsys.readouterr()
    ours = logging.getLogger("pipeflow")
    # The command's handler and level are gone once it returns (in-process runs, tests).
    assert ours.level == logging.NOTSET and not [h for h in ours.handlers
                                                 if not isinstance(h, logging.NullHandler)]
    assert "step     0/1  loss" in said.out        # the run's own progress, always
    return said.err


@pytest.mark.timeout(120)
def test_quiet_hides_info_lines_and_verbose_shows_debug_ones(tmp_path, capsys, monkeypatch):
    _clear_rank(monkeypatch)
    chose = "rank 0 INFO pipeflow.runtime.arrange: schedule 'auto' chose "
    backend = ("rank 0 DEBUG pipeflow.comm.topology: rank 0 (stage 0 of 1, replica 0 of 1): "
               "backend 'mpi' on cpu")
    err = _train(tmp_path, capsys)
    assert chose in err and " DEBUG " not in err
    err = _train(tmp_path, capsys, before=["--verbose"])     # before the command
    assert chose in err and backend in err
    err = _train(tmp_path, capsys, after=["--quiet"])        # or after it
    assert " INFO " not in err and " DEBUG " not in err and "auto" not in err


def test_a_report_that_ends_the_job_reaches_stderr_once(tmp_path, capsys, monkeypatch):
    _clear_rank(monkeypatch)
    monkeypatch.setenv("PMI_RANK", "1")
    text = "\npipeflow: rank 1 (stage 1 of 2) failed at instruction F0 of step 2:\nboom\n"
    failure.say(text)                              # no logging configured: the text itself
    assert capsys.readouterr().err == text
    ours = logging.getLogger("pipeflow")
    with logs.configured(logging.WARNING):         # the CLI's handler, --quiet
        failure.say(text)
    err = capsys.readouterr().err
    assert err.count("boom") == 1 and "rank 1 CRITICAL pipeflow.runtime.failure: " in err
    # The application's own handler, to a file only: the record there, the text on stderr.
    handler = logging.FileHandler(tmp_path / "app.log")
    ours.addHandler(handler)
    try:
        failure.say(text, logging.ERROR)
    finally:
        ours.removeHandler(handler)
        handler.close()
    assert capsys.readouterr().err == text
    assert "failed at instruction F0" in (tmp_path / "app.log").read_text()


# Where `print` may stand: a command's own output, and the run's progress lines.
PRINTS = {"pipeflow/cli.py": "the commands' output", "pipeflow/planner/cli.py": "plan's table",
          "pipeflow/train/loop.py": "the run's log lines (train(log=print))",
          "pipeflow/train/metrics.py": "the run's log lines", "pipeflow/train/sample.py": "text"}


def test_print_stands_only_for_a_commands_output_or_the_runs_progress():
    import ast
    import pathlib

    root = pathlib.Path(HERE).parent
    found = []
    for path in sorted((root / "pipeflow").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in PRINTS:
            continue
        found += [f"{rel}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Name) and node.id == "print"]
    assert not found, (f"print in {found}: a message that is not a command's output or the "
                       f"run's progress goes through logging (pipeflow.logs.get_logger)")
