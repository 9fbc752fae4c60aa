"""pipeflow: pipeline-parallel training of PyTorch models across MPI ranks.

The public names load on first use (PEP 562), so `import pipeflow` and every command line
that does not train (`pipeflow --help`, `schedule`, `plan`) import neither torch nor MPI.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

__all__ = ["Config", "ConfigError", "BatchError", "CheckpointError", "CollectiveError", "Engine",
           "LayerSpec", "ScheduleError", "add_aux_loss", "build_sequential", "collect_aux_losses",
           "layer_seed"]
__version__ = "0.1.0"

_HOME = {"Config": "pipeflow.config", "ConfigError": "pipeflow.config",
         "BatchError": "pipeflow.engine", "CollectiveError": "pipeflow.engine",
         "Engine": "pipeflow.engine", "CheckpointError": "pipeflow.runtime.checkpoint",
         "LayerSpec": "pipeflow.layers", "build_sequential": "pipeflow.layers",
         "layer_seed": "pipeflow.layers", "ScheduleError": "pipeflow.schedules",
         "add_aux_loss": "pipeflow.aux_loss", "collect_aux_losses": "pipeflow.aux_loss"}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'pipeflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# What launchers set for the size of the job: MPICH's hydra and PMI, Open MPI, PMIx, Slurm.
_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS",
             "SLURM_STEP_NUM_TASKS")


def _cover_user_code() -> None:
    # Under a multi-rank launch, an uncaught exception anywhere (also before an Engine
    # exists) ends the whole job instead of leaving the other ranks blocked. Told by the
    # launcher's variables, without starting MPI; an Engine installs the same hook once MPI
    # says the world has several ranks, for launchers that set none of these.
    sizes = [os.environ.get(name, "") for name in _SIZE_ENV]
    if any(v.isdigit() and int(v) > 1 for v in sizes) and sys.excepthook is sys.__excepthook__:
        def hook(kind, exc, tb):
            from pipeflow.runtime.failure import uncaught
            uncaught(kind, exc, tb)
        hook.pipeflow = True
        sys.excepthook = hook


_cover_user_code()

# A library's one handler: pipeflow's records reach the application's handlers, or nowhere;
# the command line (`pipeflow.logs.configure`) or the application adds the rest.
logging.getLogger(__name__).addHandler(logging.NullHandler())
