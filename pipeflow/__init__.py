"""pipeflow: pipeline-parallel training of PyTorch models across MPI ranks."""

from pipeflow.config import Config, ConfigError
from pipeflow.engine import BatchError, Engine
from pipeflow.layers import LayerSpec, build_sequential, layer_seed
from pipeflow.schedule import ScheduleError

__all__ = ["Config", "ConfigError", "BatchError", "Engine", "LayerSpec", "ScheduleError",
           "build_sequential", "layer_seed"]
__version__ = "0.1.0"
