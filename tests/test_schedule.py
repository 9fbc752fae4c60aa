"""Property tests of the schedules through the simulator: no MPI, no torch (a few Config and
command-line checks aside)."""

import functools

import pytest

from pipeflow import schedules as schedule
from pipeflow.schedules.links import device_stalls, link_orders, posting_order
from pipeflow.schedules.simulate import _replay
from pipeflow.cli import main
from pipeflow.config import Config, ConfigError
from pipeflow.schedules import (Action, BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT,
                               SEND_GRAD, WEIGHT, Programs, ScheduleError,
                               batched_rendezvous_stalls, build_schedule, format_table,
                               simulate)

GRID = [(p, m) for p in range(1, 9) for m in range(1, 33)]


@functools.lru_cache(maxsize=None)
def _built(name: str, p: int, m: int) -> Programs:
    """`build_schedule(name, p, m)` once per module: the grid tests share each build (a
    V-Min build at p = 8, m = 32 takes a tenth of a second). Read only: never mutate it."""
    return build_schedule(name, p, m)


@functools.lru_cache(maxsize=None)
def _simulated(name: str, p: int, m: int):
    """`simulate(_built(name, p, m))` with F = B = W = 1, once per module."""
    return simulate(_built(name, p, m))


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_every_microbatch_runs_forward_then_backward_once_per_stage(name):
    for p, m in GRID:
        for s, prog in enumerate(_built(name, p, m)):
            fwd = [a.mb for a in prog if a.op == FORWARD]
            bwd = [a.mb for a in prog if a.op == BACKWARD]
            assert sorted(fwd) == list(range(m)) == sorted(bwd), (name, p, m, s)
            for mb in range(m):
                assert prog.index(Action(FORWARD, mb)) < prog.index(Action(BACKWARD, mb))


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_no_deadlock_and_bubble_matches_formula(name):
    for p, m in GRID:
        result = _simulated(name, p, m)   # raises on deadlock or lost sends
        assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
        # A whole backward takes B + W = 2 units by default, 1 when set.
        assert result.makespan == 3 * (m + p - 1)
        assert simulate(_built(name, p, m), backward_time=1.0).makespan == 2 * (m + p - 1)


def test_stash_1f1b_is_min_p_minus_s_and_m():
    for p, m in GRID:
        assert _simulated("1f1b", p, m).peak_stash == \
            [min(p - s, m) for s in range(p)], (p, m)


def test_stash_gpipe_is_m():
    for p, m in GRID:
        assert _simulated("gpipe", p, m).peak_stash == [m] * p, (p, m)


def test_bubble_with_unequal_forward_and_backward_times():
    # With backward = 2 x forward the bubble fraction is unchanged: both scale the same ramps.
    for p, m in [(2, 8), (4, 4), (4, 16)]:
        r = simulate(build_schedule("1f1b", p, m), forward_time=1.0, backward_time=2.0)
        assert r.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_simulator_finds_a_deadlock():
    # Both stages wait for the other's message before sending their own.
    programs = [[Action(FORWARD, 0), Action("RG", 0), Action(SEND_ACT, 0), Action(BACKWARD, 0)],
                [Action(RECV_ACT, 0), Action(FORWARD, 0), Action(BACKWARD, 0),
                 Action("SG", 0)]]
    with pytest.raises(ScheduleError, match="deadlock.*stage 0 at RG0.*stage 1 at RA0"):
        simulate(programs)


def test_simulator_finds_a_send_with_no_receive():
    programs = build_schedule("1f1b", 2, 2)
    programs[0] = programs[0] + [Action(SEND_ACT, 5)]
    with pytest.raises(ScheduleError, match="send with no matching receive.*micro-batch 5"):
        simulate(programs)


def test_simulator_rejects_missing_backward_and_early_forward():
    programs = build_schedule("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match="stage 1.*backwards \\[0\\]"):
        simulate([programs[0], [a for a in programs[1] if a != Action(BACKWARD, 1)]])
    bad = [a for a in programs[1] if a != Action(RECV_ACT, 0)]
    with pytest.raises(ScheduleError, match="F0 before receiving its input"):
        simulate([programs[0], bad])


def test_unknown_schedule_and_bad_sizes():
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        build_schedule("zb", 2, 2)
    with pytest.raises(ScheduleError, match="microbatches >= 1"):
        build_schedule("1f1b", 2, 0)


def test_table_shows_one_column_per_stage():
    table = format_table(build_schedule("1f1b", 3, 4)).splitlines()
    assert table[0].split() == ["time", "|", "s0", "s1", "s2"]
    assert table[2].split() == ["0", "|", "F0", ".", "."]
    assert len(table) == 2 + 12


INTERLEAVED = [(p, m, v) for p in range(2, 9) for m in range(p, 33, p) for v in (2, 3, 4)]


def test_interleaved_runs_each_chunk_once_without_deadlock_and_divides_the_bubble():
    for p, m, v in INTERLEAVED:
        programs = build_schedule("interleaved", p, m, chunks=v)
        for prog in programs:
            for c in range(v):
                assert sorted(a.mb for a in prog if a.op == FORWARD and a.chunk == c) == \
                    list(range(m))
        result = simulate(programs)
        # Interleaving v chunks divides the bubble by about v (Narayanan et al. 2021).
        assert result.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)


def test_interleaved_stash_is_warmup_plus_one_chunk():
    for p, m, v in INTERLEAVED:
        peak = simulate(build_schedule("interleaved", p, m, chunks=v)).peak_stash
        warmup = [m * v if m == p else min((p - r - 1) * 2 + (v - 1) * p, m * v)
                  for r in range(p)]
        assert peak == [min(w + 1, m * v) for w in warmup], (p, m, v)


def test_interleaved_needs_whole_groups_and_only_it_takes_chunks():
    with pytest.raises(ScheduleError, match="microbatches must be a multiple of 4, found 6"):
        build_schedule("interleaved", 4, 6, chunks=2)
    with pytest.raises(ScheduleError, match="use schedule 'interleaved'"):
        build_schedule("1f1b", 4, 8, chunks=2)
    with pytest.raises(ScheduleError, match="'zbv' runs exactly 2 model chunks"):
        build_schedule("zbv", 4, 8, chunks=3)
    assert [repr(a) for a in build_schedule("interleaved", 2, 2, chunks=2)[0][:6]] == \
        ["F0", "SA0", "F1", "SA1", "RA0.1", "F0.1"]


# --- split backward: B (input gradient) and W (weight gradient) --------------------------

# Read from the registry: a new schedule joins these tests by its registry line alone.
ZERO_BUBBLE = [n for n in schedule.names() if schedule.get(n).split_backward]
# Building V-Half and V-Min over all of GRID takes about 8 s each on a quiet core: their grid
# sweeps are `slow`, run by `make test`, left out of `make check` (tests/check.sh).
SLOW_TO_BUILD = {"v-half", "v-min"}


def _sweep(names: list[str]) -> list:
    """The schedule names of a sweep over GRID, those slow to build marked `slow`."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TO_BUILD else n
            for n in names]


def _one_f_one_b_bubble(p, m):
    return (p - 1) / (m + p - 1)


@pytest.mark.parametrize("name", schedule.names())
def test_every_action_prints_and_parses_back(name):
    for p, m in [(1, 1), (2, 4), (3, 6), (4, 8)]:
        if p < schedule.get(name).min_stages:
            continue
        for prog in build_schedule(name, p, m):
            assert [Action.from_str(repr(a)) for a in prog] == prog
    assert Action.from_str(" W3.1 ") == Action(WEIGHT, 3, 1)
    assert Action.from_str("RG12") == Action("RG", 12, 0)
    for bad in ["X3", "F", "F3.", "3F", "W-1", "F3.1.2"]:
        with pytest.raises(ScheduleError, match=f"cannot read {bad!r} as an action"):
            Action.from_str(bad)


@pytest.mark.parametrize("name", _sweep(ZERO_BUBBLE))
def test_each_f_b_and_w_runs_once_per_microbatch_and_stage_in_order(name):
    for p, m in GRID:
        programs = _built(name, p, m)
        virtuals = []
        for r, prog in enumerate(programs):
            for chunk, virtual in enumerate(programs.layout[r]):
                virtuals.append(virtual)
                pos = {a: i for i, a in enumerate(prog)}
                at = {op: [pos[Action(op, mb, chunk)] for mb in range(m)]
                      for op in (FORWARD, BACKWARD, WEIGHT)}
                assert all(at[FORWARD][mb] < at[BACKWARD][mb] < at[WEIGHT][mb]
                           for mb in range(m)), (name, p, m, r, chunk)
            assert len([a for a in prog if a.op in (FORWARD, BACKWARD, WEIGHT)]) == \
                3 * m * len(programs.layout[r])
        assert sorted(virtuals) == list(range(len(virtuals)))    # every virtual stage once


@pytest.mark.parametrize("name", _sweep(schedule.names()))
def test_no_deadlock_and_every_link_receives_in_send_order(name):
    for p, m in GRID:
        if schedule.get(name).problem(p, m):
            continue
        programs = _built(name, p, m)
        _simulated(name, p, m)  # raises on a deadlock, a lost send or a link out of order
        sent, received = link_orders(programs, programs.layout)
        assert sent == received, (name, p, m)


def test_link_order_check_fails_when_receives_are_swapped():
    # ZBV's own order receives a gradient ahead of an activation sent before it on one link:
    # with NCCL (order-matched) that would pair the wrong buffers.
    p, m = 2, 4
    raw = [schedule.get("zbv").program(r, p, m) for r in range(p)]
    with pytest.raises(ScheduleError, match="link rank 0 -> rank 1: message 2 is sent as act "
                       "of micro-batch 2 .* received as grad of micro-batch 0"):
        simulate(raw, layout=schedule.stage_layout("zbv", p))
    # build_schedule moves that receive ahead, and nothing waits longer for it.
    fixed = build_schedule("zbv", p, m)
    assert fixed[1] != raw[1] and fixed[0] == raw[0]
    times = {FORWARD: 0.5, BACKWARD: 0.5, WEIGHT: 0.5}
    per_stage = {v: times for v in range(2 * p)}
    assert _replay(raw, fixed.layout, per_stage, 0.0, True).makespan == \
        simulate(fixed).makespan


def test_zb_h1_keeps_1f1b_memory_and_takes_p_minus_1_units_of_bubble():
    for p, m in GRID:
        result = _simulated("zb-h1", p, m)      # F = B = W = 1
        assert result.peak_stash == [min(p - s, m) for s in range(p)], (p, m)
        # With the micro-batches waiting for W, no stage holds more than 1F1B's stage 0.
        assert result.peak_held == [min(p, m)] * p, (p, m)
        assert result.makespan == 3 * m + p - 1 + max(0, p - m), (p, m)
        one_f_one_b = _simulated("1f1b", p, m)  # its backward: B + W = 2
        if p > 1:
            assert result.bubble < one_f_one_b.bubble, (p, m)
        if m >= p:
            assert result.bubble == pytest.approx((p - 1) / (3 * m + p - 1)), (p, m)


def test_zb_h1_bubble_is_about_a_third_of_1f1b_for_large_m():
    for p in (2, 4, 8):
        m = 256
        ratio = simulate(build_schedule("zb-h1", p, m)).bubble / _one_f_one_b_bubble(p, m)
        assert ratio == pytest.approx((m + p - 1) / (3 * m + p - 1))    # -> 1/3
        assert 1 / 3 < ratio < 0.345, (p, ratio)


@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 1.5, 0.5), (1, 2, 1), (2, 1, 1),
                                   (1, 1, 2), (1, 0.5, 1.5)])
def test_zb_h1_bubble_with_unequal_times_is_qi_et_al_formula(f, b, w):
    # (p - 1)(F + B - W) (Qi et al. 2024) while W <= B; a W longer than that cannot shrink
    # the ramps below one forward a stage.
    for p, m in [(2, 8), (4, 8), (4, 16), (8, 32)]:
        r = simulate(build_schedule("zb-h1", p, m), forward_time=f, backward_input_time=b,
                     weight_time=w)
        assert r.makespan - m * (f + b + w) == pytest.approx((p - 1) * max(f + b - w, f))
        # 1F1B with the same whole backward (B + W) idles (p - 1)(F + B + W).
        full = simulate(build_schedule("1f1b", p, m), forward_time=f,
                        backward_input_time=b, weight_time=w)
        assert full.makespan - m * (f + b + w) == pytest.approx((p - 1) * (f + b + w))


def test_zbv_layout_is_a_v_with_both_ends_on_rank_0():
    for p in range(1, 9):
        layout = build_schedule("zbv", p, 4).layout
        assert layout == [[r, 2 * p - 1 - r] for r in range(p)]
        assert 0 in layout[0] and 2 * p - 1 in layout[0]


def test_zbv_bubble_halves_zb_h1s_at_1f1b_memory():
    for p, m in GRID:
        result = _simulated("zbv", p, m)
        assert max(result.peak_held) <= 2 * p, (p, m)      # chunks: p stages' worth
        if m >= 2 * p - 1:
            # p - 1 chunk units of bubble: (p - 1)/2 of a stage's F, B or W.
            assert result.makespan == 3 * m + (p - 1) / 2, (p, m)
            assert result.bubble == pytest.approx((p - 1) / (6 * m + p - 1)), (p, m)
            assert result.peak_held == [2 * p] * p, (p, m)
            if p > 1:
                assert result.bubble < _simulated("zb-h1", p, m).bubble


def test_simulator_counts_pending_w_and_rejects_w_out_of_place():
    result = simulate(build_schedule("zb-h1", 4, 8))
    assert result.peak_pending_w == [1, 2, 3, 4]     # stage s defers W by s backwards
    assert simulate(build_schedule("1f1b", 4, 8)).peak_pending_w == [0] * 4
    programs = build_schedule("zb-h1", 2, 2)
    with pytest.raises(ScheduleError, match="stage 1: expected one forward and one backward "
                       "and one W .* W's \\[1\\]"):
        simulate([programs[0], [a for a in programs[1] if a != Action(WEIGHT, 0)]])
    early = [a for a in programs[1] if a != Action(WEIGHT, 0)]
    early.insert(0, Action(WEIGHT, 0))
    with pytest.raises(ScheduleError, match="stage 1 runs W0 before its B"):
        simulate([programs[0], early])
    # One W makes a schedule split: then every stage needs its W's.
    with pytest.raises(ScheduleError, match="stage 0: expected .* and one W .* W's \\[0\\]"):
        simulate([build_schedule("1f1b", 2, 2)[0] + [Action(WEIGHT, 0)],
                  build_schedule("1f1b", 2, 2)[1]])


def test_table_and_command_show_the_ws(capsys):
    table = format_table(build_schedule("zb-h1", 3, 4)).splitlines()
    assert table[2 + 6].split() == ["6", "|", "W0", "B1", "F2"]
    assert len(table) == 2 + 14      # 3m + p - 1 units
    assert main(["schedule", "-s", "zb-h1", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "W7" in out and "bubble 0.111 (F = B = W; 1F1B with the same times: 0.273)" in out
    assert "waiting for W [1, 2, 3, 4], held in all [4, 4, 4, 4]" in out
    assert main(["schedule", "-s", "zbv", "-p", "4", "-m", "8"]) == 0
    assert "bubble 0.059" in capsys.readouterr().out


def test_config_knows_the_zero_bubble_schedules():
    assert Config(pipeline=4, microbatches=8, schedule="zb-h1").virtual_stages == 1
    assert Config(pipeline=4, microbatches=8, schedule="ZBV").virtual_stages == 2
    assert Config(pipeline=4, microbatches=8, schedule="zbv", virtual_stages=2).schedule == "zbv"
    with pytest.raises(ConfigError, match="'zbv' runs exactly 2 model chunks per rank"):
        Config(pipeline=4, microbatches=8, schedule="zbv", virtual_stages=3)
    with pytest.raises(ConfigError, match="'zb-h1' runs exactly 1 model chunk per rank"):
        Config(pipeline=4, microbatches=8, schedule="zb-h1", virtual_stages=2)


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_link_receives_in_the_order_of_its_sends(name, chunks, stages):
    # NCCL matches point-to-point messages by order only: the simulator's link check passes
    # for every built-in schedule (it runs inside simulate).
    for m in (stages, 2 * stages, 3 * stages + (0 if chunks > 1 else 1)):
        simulate(build_schedule(name, stages, m, chunks=chunks))




@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2),
                                         ("zb-h1", 1), ("zbv", 2)])
def test_stage_times_equal_to_the_scalar_times_replay_alike(name, chunks):
    # Per-virtual-stage times that are all one rank's share per chunk give the scalar run.
    for p, m in [(2, 4), (3, 6), (4, 8), (4, 3)]:
        if name == "interleaved" and m % p:
            continue
        programs = build_schedule(name, p, m, chunks)
        scalar = simulate(programs, forward_time=1.0, backward_input_time=1.5, weight_time=0.5)
        b = 1.5 if name in ("zb-h1", "zbv") else 2.0
        w = 0.5 if name in ("zb-h1", "zbv") else 0.0
        per_stage = simulate(programs, stage_times=[(1.0 / chunks, b / chunks, w / chunks)]
                             * (p * chunks))
        assert per_stage.makespan == pytest.approx(scalar.makespan), (name, p, m)
        assert per_stage.peak_held == scalar.peak_held


def test_stage_times_make_the_slowest_stage_the_bottleneck():
    # 2 stages, 1 micro-batch: F on s0 (1), F on s1 (3), B on s1 (6), B on s0 (2).
    programs = build_schedule("1f1b", 2, 1)
    assert simulate(programs, stage_times=[(1, 2, 0), (3, 6, 0)]).makespan == 12
    # Many micro-batches: the last stage's F + B, 9 units each, set the pace.
    m = 16
    r = simulate(build_schedule("1f1b", 2, m), stage_times=[(1, 2, 0), (3, 6, 0)])
    assert r.busy == [3 * m, 9 * m]
    assert 9 * m < r.makespan <= 9 * m + 3
    # Without W in the schedule, B takes B + W.
    assert simulate(programs, stage_times=[(1, 1, 1), (3, 3, 3)]).makespan == 12
    # With W, B alone sends the gradient: stage 0's B and W (1 + 1) overlap stage 1's W (3).
    assert simulate(build_schedule("zb-h1", 2, 1),
                    stage_times=[(1, 1, 1), (3, 3, 3)]).makespan == 1 + 3 + 3 + 3


def test_stage_times_of_the_wrong_length_are_refused():
    with pytest.raises(ScheduleError, match="one \\(F, B, W\\) triple .* per virtual stage, "
                                            "4 in all"):
        simulate(build_schedule("zbv", 2, 4), stage_times=[(1, 1, 1)] * 2)


def test_naive_batching_on_one_shared_stream_deadlocks_only_the_multi_chunk_schedules():
    # Why the torch.distributed path splits its links by direction (comm.py): on one group
    # per pipeline (a stream both directions share, a send waiting for its receive) each
    # run of consecutive sends and receives batched together stalls interleaved and ZBV
    # programs, while GPipe, 1F1B and ZB-H1 go through.
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p in range(2, 9):
            for m in (1, 3, p, 2 * p + 1, 32):
                assert batched_rendezvous_stalls(build_schedule(name, p, m)) == [], (name, p, m)
    assert batched_rendezvous_stalls(build_schedule("interleaved", 2, 4, 2)) == [0, 1]
    assert batched_rendezvous_stalls(build_schedule("zbv", 4, 8)) != []
    # A hand-made deadlock: each rank sends first, then receives, in two separate batches
    # (a compute between): both sends wait for a receive that is posted only afterwards.
    crossed = Programs([[Action(SEND_ACT, 0), Action(FORWARD, 1), Action(RECV_GRAD, 0)],
                        [Action(SEND_GRAD, 0), Action(FORWARD, 1), Action(RECV_ACT, 0)]],
                       [[0], [1]])
    assert batched_rendezvous_stalls(crossed) == [0, 1]


NCCL_GRID = [(p, m) for p in range(2, 9) for m in range(1, 17)]


@pytest.mark.parametrize("name", _sweep(schedule.names()))
def test_the_nccl_programs_never_stall_with_two_kernels_resident(name):
    # NCCL does not promise that operations of several communicators progress together: at
    # most K blocking kernels run at once on a GPU (NVIDIA/nccl#783). The engine posts each
    # receive a compute early, holding a kernel from its post; with the data group's
    # reductions in the last backward, two kernels resident suffice for every program.
    # Not posting ahead is no safer: two sends resident then starve a receive.
    for p, m in NCCL_GRID:
        if schedule.get(name).problem(p, m):
            continue
        programs = _built(name, p, m)
        for reductions in (False, True):
            assert device_stalls(programs, 2, ahead=1, reductions=reductions) == [], \
                (name, p, m, reductions)


def test_one_kernel_at_a_time_stalls_what_posting_ahead_would_block():
    # CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue. A posted gradient receive on stage 0
    # (before F0) holds the only kernel; the activation send behind it never launches; stage
    # 1 waits for it: even GPipe deadlocks posted ahead, and runs when nothing is.
    gpipe, one_f_one_b = _built("gpipe", 2, 1), _built("1f1b", 4, 8)
    assert device_stalls(gpipe, 1, ahead=1) == [0, 1]
    assert device_stalls(gpipe, 1, ahead=0) == []
    assert device_stalls(one_f_one_b, 1, ahead=0) != []
    assert device_stalls(one_f_one_b, 2, ahead=1) == []
    assert posting_order(gpipe[0], 0, gpipe.layout) == [(0, [Action(RECV_GRAD, 0, 0)])]
    assert posting_order(gpipe[0], 0, gpipe.layout, ahead=0) == []
