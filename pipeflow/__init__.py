"""pipeflow: pipeline-parallel training of PyTorch models across MPI ranks."""

from pipeflow.aux_loss import add_aux_loss, collect_aux_losses
from pipeflow.runtime.checkpoint import CheckpointError
from pipeflow.config import Config, ConfigError
from pipeflow.engine import BatchError, CollectiveError, Engine
from pipeflow.layers import LayerSpec, build_sequential, layer_seed
from pipeflow.schedules import ScheduleError

__all__ = ["Config", "ConfigError", "BatchError", "CheckpointError", "CollectiveError", "Engine",
           "LayerSpec", "ScheduleError", "add_aux_loss", "build_sequential", "collect_aux_losses",
           "layer_seed"]
__version__ = "0.1.0"


def _cover_user_code() -> None:
    # Under a multi-rank launch, an uncaught exception anywhere (also before an Engine
    # exists) ends the whole job instead of leaving the other ranks blocked.
    from mpi4py import MPI

    from pipeflow.runtime.failure import install_excepthook
    if MPI.COMM_WORLD.size > 1:
        install_excepthook()


_cover_user_code()
