"""pipeflow's messages as `logging` records: a logger per module under `pipeflow`, the rank in
every record, handlers only where an application asks for them.

The library adds nothing but a `NullHandler` (on the `pipeflow` logger, in
`pipeflow/__init__.py`); a script routes pipeflow's records where it routes its own
(`logging.basicConfig(...)`), or calls `configure()` as the command line does. Each record
carries `rank`, the process's MPI world rank, so a handler's format can show it
(`%(rank)s`). What a run reports as its own progress (the training log lines, a command's
table) is not logged: it goes to stdout. Reports that end the job are logged too, and
`runtime.failure` writes them to stderr itself wherever no handler did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import IO, Iterator

__all__ = ["FORMAT", "ROOT", "RankFilter", "configure", "configured", "get_logger", "world_rank"]

ROOT = "pipeflow"
FORMAT = "[%(asctime)s] rank %(rank)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"

# What launchers set for this process's world rank: MPICH's hydra and PMI, Open MPI, PMIx,
# Slurm's srun. Read before MPI: a record never waits on MPI, from any thread.
_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def world_rank() -> int:
    """This process's MPI world rank: the launcher's variable, else MPI's own once mpi4py has
    started it, else 0 (one process, no launcher)."""
    for key in _RANK_ENV:
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    return 0


class RankFilter(logging.Filter):
    """Adds `rank` (`world_rank()`) to each record that has none; lets every record pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = world_rank()
        return True


_RANK = RankFilter()


def get_logger(name: str) -> logging.Logger:
    """The logger `name` (a module's `__name__`, under `pipeflow`), whose records carry the
    rank whichever handler receives them."""
    logger = logging.getLogger(name)
    if _RANK not in logger.filters:
        logger.addFilter(_RANK)
    return logger


class _Stderr(logging.StreamHandler):
    """A handler to whatever `sys.stderr` is when a record comes (as logging's `lastResort`):
    a stream replaced or closed since (pytest's capture, a redirect) is never written."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> IO[str]:              # type: ignore[override]
        return sys.stderr


def configure(level: int = logging.INFO, stream: IO[str] | None = None) -> logging.Handler:
    """What the command line does, and a script may: pipeflow's records at `level` and above
    to `stream` (default: stderr, as it is at each record), formatted with the rank
    (`FORMAT`). The handler goes on the `pipeflow` logger, never on the root, and replaces
    the one an earlier call added; records still propagate to the root's handlers, if the
    application has any. Returns the handler."""
    logger = logging.getLogger(ROOT)
    for old in [h for h in logger.handlers if getattr(h, "pipeflow_cli", False)]:
        logger.removeHandler(old)
    handler = _Stderr() if stream is None else logging.StreamHandler(stream)
    handler.pipeflow_cli = True   # type: ignore[attr-defined]
    handler.addFilter(_RANK)      # records of loggers made without get_logger, too
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


@contextlib.contextmanager
def configured(level: int = logging.INFO) -> Iterator[logging.Handler]:
    """`configure(level)` for the length of a command: the `pipeflow` logger's handlers and
    level as they were afterwards (`pipeflow.cli.main` run in-process, by tests, leaves
    nothing behind)."""
    logger = logging.getLogger(ROOT)
    before = logger.level, list(logger.handlers)
    handler = configure(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        for old in before[1]:
            if old not in logger.handlers:
                logger.addHandler(old)
        logger.setLevel(before[0])
