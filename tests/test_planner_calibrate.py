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


def test_calibrated_tensor_grid_adds_the_cut_layers_and_the_measured_allreduce():
    """At tensor 2 the calibrated estimate is the layers timed cut as one rank holds them
    (block@2, head@2; the embedding whole) plus the tensor group's all-reduces at the
    measured link: two ring all-reduces of b·s·h forward and two backward per block."""
    import dataclasses

    from pipeflow.planner.cost import PRECISIONS, ring_allreduce_time, tensor_comm_time

    lt = measure_layer_times(TINY, micro_batch_sizes=(1, 2), repeats=1, tensors=(2, 4))
    # TINY has 2 heads: a cut of 4 is no layout the engine builds, so it is not timed.
    assert {"block@2", "head@2"} <= set(lt.samples) and "block@4" not in lt.samples
    assert lt.time_at("block", "forward", 2, 2) == lt.samples["block@2"]["forward"][2]
    hw = dataclasses.replace(calibrate(TINY, micro_batch_sizes=(1, 2), repeats=1,
                                       layer_times=lt),
                             tensor_bandwidth=1e9, tensor_latency=1e-5)
    again = Hardware.from_dict(json.loads(json.dumps(hw.to_dict())))
    assert (again.tensor_bandwidth, again.tensor_latency) == (1e9, 1e-5)
    cluster = Cluster(hw, 2, 2)
    prec = PRECISIONS["fp32"]
    b = 2
    ring = ring_allreduce_time(b * TINY.seq_len * TINY.d_model * 4, 2, 1e9, 1e-5)
    assert tensor_comm_time(TINY, cluster, prec, "block", "forward", b, 2) == 2 * ring
    est = estimate(TINY, cluster, Grid(1, 1, b, 3, tensor=2), "none", "fp32")
    per_mb = sum(lt.time(k, ph, b) * n for k, n in (("embed", 1), ("block@2", 2), ("head@2", 1))
                 for ph in ("forward", "backward"))
    per_mb += sum(tensor_comm_time(TINY, cluster, prec, k, ph, b, 2) * n
                  for k, n in (("embed", 1), ("block", 2), ("head", 1))
                  for ph in ("forward", "backward"))
    params = est.stages[0].params
    assert params < TINY.params
    assert est.step_time_s == pytest.approx(3 * per_mb + params * lt.optimizer_s_per_param)
