"""Building layers leaves the caller's random state alone: the CPU's and every GPU's."""

from __future__ import annotations

import contextlib

import torch

import pipeflow as pf
from pipeflow.layers import build_layer


class Noisy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


def test_building_layers_leaves_the_cpu_random_state_untouched():
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    first = build_layer(pf.LayerSpec(Noisy), seed=0, index=3)
    pf.build_sequential([pf.LayerSpec(Noisy)] * 3, seed=1)
    assert torch.equal(torch.rand(5), expected)
    # And the layer's own init depends only on (seed, index).
    again = build_layer(pf.LayerSpec(Noisy), seed=0, index=3)
    assert torch.equal(first.lin.weight, again.lin.weight)


def test_every_cuda_device_is_forked_when_cuda_is_available(monkeypatch):
    # Without a GPU: pretend three, and record what layer building forks. Forking only the
    # initialised devices (none, before the model moves to the GPU) let manual_seed's queued
    # CUDA seed replace the user's.
    forked = []
    real = torch.random.fork_rng

    @contextlib.contextmanager
    def recording(devices=None, **kwargs):
        forked.append(list(devices))
        with real(devices=[], **kwargs):
            yield

    monkeypatch.setattr(torch.random, "fork_rng", recording)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    build_layer(pf.LayerSpec(Noisy), seed=0, index=0)
    assert forked == [[0, 1, 2]]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    build_layer(pf.LayerSpec(Noisy), seed=0, index=0)
    assert forked[-1] == []
