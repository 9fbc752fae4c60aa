"""Every reported figure true, in one process: `skipped` is each step's own verdict, the
metrics file is strict JSON (non-finite values as null with a `nonfinite` record), and the
planner answers any request within seconds (the partition solver equal to the exact one)."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import torch

import pipeflow as pf
from pipeflow.runtime.partition import partition_balanced
from pipeflow.train.metrics import MetricsLog, strict_record
from pipeflow.train.trackers import JsonlTracker

from toy import batches, loss_fn, sgd, toy_layers


def test_skipped_is_the_verdict_of_each_step_not_of_the_last_overflow():
    # A loss scale of 2^40 overflows fp16 at once; the backoff brings it to 2^10 for step 2.
    engine = pf.Engine(toy_layers(), loss_fn, sgd,
                       pf.Config(microbatches=2, precision="fp16", initial_loss_scale=2.0 ** 40,
                                 loss_scale_backoff=2.0 ** -30))
    seen = []
    for x, y in batches(3, 8):
        before = {k: v.clone() for k, v in engine.gather_state_dict().items()}
        engine.train_step(x, y)
        after = engine.gather_state_dict()
        moved = any(not torch.equal(before[k], after[k]) for k in before)
        seen.append((engine.stats.skipped, moved, engine.stats.skipped_steps))
    engine.close()
    assert seen == [(True, False, 1), (False, True, 1), (False, True, 1)], seen


def _strict(line: str):
    def refuse(name):
        raise ValueError(f"bare {name} in {line!r}: not JSON")
    return json.loads(line, parse_constant=refuse)


def test_metrics_lines_are_strict_json_with_non_finite_values_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog([JsonlTracker(str(path))], total=2, first=0, progress=False,
                     log=lambda *a, **k: None)
    log.record({"step": 0, "loss": float("nan"), "grad_norm": float("inf"),
                "stages": [{"bubble": 0.1}, {"bubble": -math.inf}], "lr": 1e-3})
    log.record({"step": 1, "loss": 2.5, "grad_norm": 1.0})
    log.close()
    first, second = (_strict(line) for line in path.read_text().splitlines())
    assert first["loss"] is None and first["grad_norm"] is None
    assert first["stages"] == [{"bubble": 0.1}, {"bubble": None}] and first["lr"] == 1e-3
    assert first["nonfinite"] == {"loss": "nan", "grad_norm": "inf", "stages.1.bubble": "-inf"}
    assert second == {"step": 1, "loss": 2.5, "grad_norm": 1.0}         # no flag when finite
    assert strict_record({"a": (1.0, float("nan"))}) == {"a": [1.0, None],
                                                         "nonfinite": {"a.1": "nan"}}


def _dp_reference(weights, stages):
    """The O(n^2 p) programme the solver replaced: the earliest cut of least heaviest stage."""
    n, inf = len(weights), float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def test_the_fast_partition_is_the_exact_programme_ties_included():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 12)
        pick = rng.random()
        weights = ([rng.choice([0, 1, 2]) for _ in range(n)] if pick < 0.4 else
                   [rng.random() for _ in range(n)] if pick < 0.7 else
                   [rng.choice([0.1, 0.2, 0.3, 1e-17, 1e16]) for _ in range(n)])
        for p in range(1, n + 1):
            assert partition_balanced(weights, p) == _dp_reference(weights, p), (weights, p)
    start = time.perf_counter()
    deep = partition_balanced([0.3] + [1.0] * 512 + [0.7], 514)
    assert deep == list(range(515)) and time.perf_counter() - start < 5
