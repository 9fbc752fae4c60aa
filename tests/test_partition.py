"""Partitioning a layer list into contiguous stages."""

import itertools

import pytest
from torch import nn

import pipeflow as pf
from pipeflow.runtime.partition import (check_boundaries, measure_layer_times, partition_balanced,
                                partition_layers, partition_uniform)


def test_uniform_sizes_differ_by_at_most_one():
    for n in range(1, 20):
        for p in range(1, n + 1):
            b = partition_uniform(n, p)
            sizes = [b[i + 1] - b[i] for i in range(p)]
            assert b[0] == 0 and b[-1] == n and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def _brute_force(weights, p):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        b = [0, *cuts, n]
        heaviest = max(sum(weights[b[i]:b[i + 1]]) for i in range(p))
        best = heaviest if best is None else min(best, heaviest)
    return best


@pytest.mark.parametrize("weights", [[1, 1, 1, 1], [5, 1, 1, 1, 1, 5], [1, 9, 2, 2, 2, 8, 1],
                                     [3, 0, 0, 7, 1, 1, 1, 1, 4]])
def test_balanced_partition_is_optimal(weights):
    for p in range(1, len(weights) + 1):
        b = partition_balanced(weights, p)
        heaviest = max(sum(weights[b[i]:b[i + 1]]) for i in range(p))
        assert heaviest == _brute_force(weights, p)
        assert all(b[i] < b[i + 1] for i in range(p))


def test_parameters_partition_balances_parameter_counts():
    layers = [pf.LayerSpec(nn.Linear, 64, 64)] + [pf.LayerSpec(nn.Linear, 8, 8)] * 6
    assert partition_layers(layers, 2, "parameters") == [0, 1, 7]
    assert partition_layers(layers, 2, "uniform") == [0, 3, 7]


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(pf.ConfigError, match="cannot split 3 layers into 4 pipeline stages"):
        partition_layers([pf.LayerSpec(nn.Identity)] * 3, 4, "uniform")


def test_explicit_boundaries_are_checked():
    assert check_boundaries([0, 1, 5], 5, 2) == [0, 1, 5]
    with pytest.raises(pf.ConfigError, match="expected 3 boundaries starting at 0 and ending at 5"):
        check_boundaries([0, 5], 5, 2)
    with pytest.raises(pf.ConfigError, match="gives stage 1 no layers"):
        check_boundaries([0, 2, 2, 5], 5, 3)


def test_time_partition_isolates_the_slow_layer():
    import torch

    class Slow(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.lin = nn.Linear(width, width)

        def forward(self, x):
            for _ in range(20):            # the same parameters, 20x the work
                x = torch.tanh(self.lin(x))
            return x

    layers = [pf.LayerSpec(nn.Linear, 64, 64)] * 3 + [pf.LayerSpec(Slow, 64)] + \
        [pf.LayerSpec(nn.Linear, 64, 64)] * 3
    times = measure_layer_times(layers, torch.randn(32, 64))
    # Against the others' median (20x the work): one of them caught by a busy machine's
    # stall must not fail the test (a CI run at load 4 measured one at 4x its peers).
    others = sorted(times[:3] + times[4:])
    assert times[3] > 5 * (others[2] + others[3]) / 2
    # By parameters the slow layer looks like the others; by time it gets a stage of its own.
    assert partition_layers(layers, 3, "parameters") == [0, 2, 4, 7]
    assert partition_layers(layers, 3, "time", times) == [0, 3, 4, 7]
    with pytest.raises(pf.ConfigError, match="expected 7 times, found None"):
        partition_layers(layers, 3, "time")
