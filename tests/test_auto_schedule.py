"""`schedule = "auto"`: the chooser on synthetic times, the measurement, the one-rank engine."""

import logging

import pytest

import pipeflow as pf
from pipeflow.runtime.arrange import measure_layer_costs
from pipeflow.schedules.auto import LayerCosts, choose_schedule, peak_activation_bytes
from pipeflow.config import ConfigError
from pipeflow.layers import build_layer
from pipeflow.runtime.partition import partition_layers
from pipeflow.runtime.recompute import measure_layers
from pipeflow.runtime.balance import partition_uniform
from pipeflow.schedules import ScheduleError, build_schedule, simulate

from toy import adamw, assert_same_parameters, batches, loss_fn, toy_layers, train_reference


def costs(n, f=1.0, b=1.0, w=1.0, whole=None, nbytes=100):
    """n equal layers: F, B, W each; the whole backward B + W unless given."""
    return LayerCosts([f] * n, [b + w if whole is None else whole] * n, [b] * n, [w] * n,
                      [nbytes] * n)


def choose(c, p, m, budget_bytes=0, boundaries=None):
    """`choose_schedule` with the engine's uniform partition unless `boundaries` is given."""
    return choose_schedule(c, p, m, budget_bytes, boundaries=boundaries or (
        lambda k: partition_uniform(len(c.forward), k)))


def by_name(choice):
    return {c.schedule: c for c in choice.candidates}


def test_equal_thirds_pick_a_zero_bubble_schedule():
    for p, m, n in [(2, 8, 8), (4, 8, 8), (4, 16, 16), (3, 6, 7)]:
        choice = choose(costs(n), p, m)
        found = by_name(choice)
        assert choice.schedule in ("zb-h1", "zbv"), choice.describe()
        assert found[choice.schedule].step_time < found["1f1b"].step_time
        # 1F1B's step here is (m + p - 1)(F + B + W) of a stage's share.
        share = 3.0 * n / p if n % p == 0 else None
        if share:
            assert found["1f1b"].step_time == pytest.approx((m + p - 1) * share)


def test_zb_h1_is_chosen_over_zbv_when_layers_are_too_few_for_a_v():
    choice = choose(costs(7), 4, 8)       # zbv needs 2p = 8 layers
    assert choice.schedule == "zb-h1"
    assert "zbv skipped (needs 8 layers, has 7)" in choice.describe()


def test_no_weight_gradient_makes_zb_h1_no_better_than_1f1b():
    # W = 0: B is the whole backward, nothing is left to fill the bubble.
    choice = choose(costs(8, b=2.0, w=0.0), 2, 8)
    found = by_name(choice)
    assert found["zb-h1"].step_time == pytest.approx(found["1f1b"].step_time)
    assert choice.schedule not in ("zb-h1", "gpipe")    # equal: the simpler one runs


def test_split_backward_that_costs_more_than_it_saves_is_not_chosen():
    # B + W twice the whole backward (a tiny model's graph walking): split schedules lose.
    choice = choose(costs(6, b=2.0, w=2.0, whole=2.0), 2, 8)
    found = by_name(choice)
    assert choice.schedule in ("1f1b", "interleaved")
    assert min(found["zb-h1"].step_time, found["zbv"].step_time) > found["1f1b"].step_time


def test_a_budget_that_excludes_gpipe_picks_zb_h1_then_1f1b():
    # 3 layers on 2 stages (too few for the 2-chunk schedules): stage 0 holds layer 0,
    # stage 1 layers 1 and 2, 100 bytes a layer and micro-batch.
    choice = choose(costs(3), 2, 8)
    found = by_name(choice)
    assert found["zbv"].skipped and found["interleaved"].skipped
    # 1F1B: stage 0 holds 2 micro-batches of one layer, stage 1 one of two; ZB-H1's last
    # stage keeps a second for its deferred W; GPipe holds all 8.
    assert found["1f1b"].peak_bytes == [200, 200]
    assert found["zb-h1"].peak_bytes == [200, 400]
    assert found["gpipe"].peak_bytes == [800, 1600]
    assert choice.schedule == "zb-h1"
    fits = choose(costs(3), 2, 8, budget_bytes=400)
    assert fits.schedule == "zb-h1" and not by_name(fits)["gpipe"].fits
    assert "; gpipe 51 s, activations 1.6 KiB > budget 400 B; interleaved skipped (needs 4 " \
        "layers, has 3); zb-h1 49 s, activations 400 B;" in fits.describe()
    # A budget ZB-H1 exceeds where 1F1B does not: the faster schedule does not fit.
    tight = choose(costs(3), 2, 8, budget_bytes=300)
    assert tight.schedule == "1f1b" and not by_name(tight)["zb-h1"].fits


def test_when_nothing_fits_the_least_memory_runs_and_the_log_says_so():
    choice = choose(costs(6), 2, 8, budget_bytes=10)
    least = min(max(c.peak_bytes) for c in choice.candidates if not c.skipped)
    assert max(by_name(choice)[choice.schedule].peak_bytes) == least
    assert "none fits the budget" in choice.describe()


def test_uneven_stages_use_each_virtual_stages_own_times():
    # A heavy last layer: the engine's boundaries decide each stage's sums, and the step.
    c = LayerCosts([1, 1, 1, 1, 1, 9], [2, 2, 2, 2, 2, 18], [1] * 5 + [9], [1] * 5 + [9],
                   [100] * 6)
    uniform = by_name(choose(c, 2, 8))["1f1b"]
    explicit = by_name(choose(c, 2, 8, boundaries=lambda k: [0, 5, 6][:k + 1]
                                       if k == 2 else [0, 1, 2, 3, 4, 6][:k + 1]))["1f1b"]
    assert uniform.boundaries == [0, 3, 6] and explicit.boundaries == [0, 5, 6]
    # Uniform: stage 1 has F + B = 3 + 9 + 18 + ... = 33 a micro-batch; explicit 27.
    assert uniform.step_time >= 8 * (1 + 1 + 9 + 2 + 2 + 18)
    assert explicit.step_time >= 8 * 27 and explicit.step_time < uniform.step_time


def test_an_explicit_partition_for_one_chunk_skips_the_two_chunk_schedules():
    layers = toy_layers(blocks=6)
    choice = choose(costs(8), 2, 8, boundaries=lambda k: partition_layers(
        layers, k, [0, 3, 8]))
    assert choice.schedule == "zb-h1"
    assert by_name(choice)["zbv"].skipped == "the partition does not give 4 virtual stages"
    with pytest.raises(ScheduleError, match="no schedule to run 8 layers on 2 stages"):
        choose(costs(8), 2, 8, boundaries=lambda k: partition_layers(
            layers, k, [0, 1, 2, 8]))


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2),
                                         ("zb-h1", 1), ("zbv", 2)])
def test_peak_bytes_are_the_simulators_held_count_when_stages_weigh_alike(name, chunks):
    for p, m in [(2, 4), (3, 6), (4, 8), (4, 12)]:
        programs = build_schedule(name, p, m, chunks)
        held = simulate(programs).peak_held
        assert peak_activation_bytes(programs, [7] * (p * chunks)) == [7 * h for h in held]


def test_measured_costs_are_per_layer_and_bytes_match_the_recompute_meter():
    layers = toy_layers(blocks=3)
    sample = batches(1, 4)[0][0]
    got = measure_layer_costs(layers, sample, repeats=1)
    n = len(layers)
    for column in (got.forward, got.backward, got.backward_input, got.weight):
        assert len(column) == n and all(t >= 0 for t in column)
    assert all(t > 0 for t in got.forward)
    assert got.totals == [f + b for f, b in zip(got.forward, got.backward)]
    built = [build_layer(spec, 0, i) for i, spec in enumerate(layers)]
    assert got.saved_bytes == measure_layers(built, sample).saved


def test_one_stage_auto_trains_like_build_sequential(caplog):
    caplog.set_level(logging.INFO, logger="pipeflow")
    layers = toy_layers()
    data = batches(3, 8)
    engine = pf.Engine(layers, loss_fn, adamw,
                       pf.Config(microbatches=4, schedule="auto"), sample=data[0][0][:2])
    assert engine.config.schedule == "auto"
    assert engine.schedule in ("1f1b", "gpipe", "zb-h1")       # one stage: one chunk
    assert engine.schedule_choice.startswith(f"pipeflow: schedule 'auto' chose "
                                             f"{engine.schedule!r}")
    said = [r for r in caplog.records if r.name == "pipeflow.runtime.arrange"]
    assert [r.getMessage() for r in said] == [engine.schedule_choice.removeprefix("pipeflow: ")]
    assert said[0].levelno == logging.INFO and said[0].rank == 0
    losses = [engine.train_step(x, y) for x, y in data]
    reference, ref_losses = train_reference(layers, data)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_parameters(engine.gather_state_dict(), reference.state_dict())
    engine.close()


def test_no_schedule_for_the_partition_is_the_engines_config_error():
    # choose_schedule's ScheduleError (schedules/ knows no ConfigError) reaches the user as
    # the engine's ConfigError, message kept: raised alike on every rank, the CLI's one line.
    layers = toy_layers()
    with pytest.raises(ConfigError, match="'auto' found no schedule to run 7 layers on 1 "
                       "stages: 1f1b: the partition does not give 1 virtual stages"):
        pf.Engine(layers, loss_fn, adamw, pf.Config(microbatches=4, schedule="auto",
                                                    partition=[0, 1, len(layers)]),
                  sample=batches(1, 8)[0][0][:2])


def test_auto_without_a_sample_says_what_to_pass():
    with pytest.raises(ConfigError, match=r"schedule 'auto' .* sample=inputs\[:micro_batch"):
        pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(schedule="auto"))
    with pytest.raises(ConfigError, match="'auto' chooses the model chunks"):
        pf.Config(schedule="auto", virtual_stages=2)
    assert pf.Config.from_dict({"schedule": "AUTO"}).schedule == "auto"
