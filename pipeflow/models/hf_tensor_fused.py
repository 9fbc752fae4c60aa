"""Tensor-parallel rows of `hf_tensor.FAMILIES` (see there): the fused families."""

from __future__ import annotations

from pipeflow.models.hf_tensor_base import TensorFamily

FAMILIES: dict[str, TensorFamily] = {}
