"""Calibration: measured layer times feed the cost model (single process, no MPI)."""

import json

import pytest

from pipeflow.planner import cli
from pipeflow.planner.calibrate import calibrate, measure_layer_times
from pipeflow.planner.cost import Grid, estimate
from pipeflow.planner.hardware import Cluster, Hardware, LayerTimes, fit_relative
from pipeflow.planner.shapes import Shape

TINY = Shape(2, 64, 2, seq_len=16, vocab_size=64)


def test_fit_relative_recovers_a_line_and_weights_small_values():
    assert fit_relative([1, 2, 4, 8], [3 + 2 * x for x in (1, 2, 4, 8)]) == pytest.approx((3, 2))
    # A deviation at the large end must not swamp the small end, as it does in ordinary
    # least squares: the relative fit misses y(1) by less.
    xs, ys = [1, 2, 4, 8], [1.0, 2.0, 4.0, 12.0]
    c0, c1 = fit_relative(xs, ys)
    mx, my = sum(xs) / 4, sum(ys) / 4
    o1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    o0 = my - o1 * mx
    assert abs(c0 + c1 - 1.0) < abs(o0 + o1 - 1.0)


def test_measured_layer_times_are_positive_and_used_as_measured():
    lt = measure_layer_times(TINY, micro_batch_sizes=(1, 2), repeats=1)
    for kind in ("embed", "block", "head"):
        for phase in ("forward", "backward"):
            for b in (1, 2):
                assert lt.time(kind, phase, b) == lt.samples[kind][phase][b] > 0
            assert lt.time(kind, phase, 3) >= 0          # from the fit
    assert lt.optimizer_s_per_param > 0
    again = LayerTimes.from_dict(json.loads(json.dumps(lt.to_dict())))
    assert again.time("block", "backward", 2) == lt.time("block", "backward", 2)
    faster = lt.fastest(measure_layer_times(TINY, micro_batch_sizes=(1, 2), repeats=1))
    assert faster.time("block", "forward", 1) <= lt.time("block", "forward", 1)


def test_calibrated_estimate_adds_up_the_measured_layers():
    hw = calibrate(TINY, micro_batch_sizes=(1, 2), repeats=1)
    assert hw.calibrated and hw.name == "cpu-local"
    lt = hw.layer_times
    est = estimate(TINY, Cluster(hw, 1, 1), Grid(1, 1, 2, 3), "none", "fp32")
    per_mb = sum(lt.time(k, ph, 2) * n for k, n in (("embed", 1), ("block", 2), ("head", 1))
                 for ph in ("forward", "backward"))
    params = TINY.params
    assert est.step_time_s == pytest.approx(3 * per_mb + params * lt.optimizer_s_per_param)


def test_cli_calibrate_json_and_saved_hardware(capsys, tmp_path):
    saved = tmp_path / "cpu.json"
    argv = ["--calibrate", "--layers", "2", "--width", "64", "--heads", "2", "--seq-len", "16",
            "--vocab", "64", "--global-batch", "4", "--tokens", "1e5", "--gpus", "2",
            "--json", "--save-hardware", str(saved)]
    assert cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["calibrated"] and plan["gpu"] == "cpu-local" and plan["precision"] == "fp32"
    assert plan["pipeline"] * plan["data"] <= 2 and plan["step_time_s"] > 0
    hw = Hardware.load(saved)
    assert hw.layer_times is not None
    assert cli.main(["--hardware-file", str(saved), "--layers", "2", "--width", "64",
                     "--heads", "2", "--seq-len", "16", "--vocab", "64", "--global-batch",
                     "4", "--tokens", "1e5", "--gpus", "2", "--precision", "fp32"]) == 0
    assert "cpu-local" in capsys.readouterr().out
