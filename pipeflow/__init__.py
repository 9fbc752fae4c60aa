"""pipeflow: pipeline-parallel training of PyTorch models across MPI ranks."""

from pipeflow.config import Config, ConfigError
from pipeflow.layers import LayerSpec, build_sequential, layer_seed

__all__ = ["Config", "ConfigError", "LayerSpec", "build_sequential", "layer_seed"]
__version__ = "0.1.0"
