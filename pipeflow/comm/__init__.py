"""How ranks talk: the communicator interface (`base`), its backends (`mpi`, `torch_dist` with
NCCL's process-group cache, `strict`: MPI under NCCL's rules), CUDA staging for MPI (`cuda`),
the wait policy every blocking call goes through (`waiting`) and the rank grid (`topology`).

Import what you need from the module that holds it; this package re-exports the interface.
"""

from pipeflow.comm.base import (CommDeviceError, Communicator, ProtocolError, Request,
                                TensorMeta, check_on_device, meta_of)

__all__ = ["CommDeviceError", "Communicator", "ProtocolError", "Request", "TensorMeta",
           "check_on_device", "meta_of"]
