"""Property tests of the schedules through the simulator: no MPI, no torch."""

import pytest

from pipeflow.schedule import (Action, BACKWARD, FORWARD, RECV_ACT, SEND_ACT, ScheduleError,
                               build_schedule, format_table, simulate)

GRID = [(p, m) for p in range(1, 9) for m in range(1, 33)]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_every_microbatch_runs_forward_then_backward_once_per_stage(name):
    for p, m in GRID:
        for s, prog in enumerate(build_schedule(name, p, m)):
            fwd = [a.mb for a in prog if a.op == FORWARD]
            bwd = [a.mb for a in prog if a.op == BACKWARD]
            assert sorted(fwd) == list(range(m)) == sorted(bwd), (name, p, m, s)
            for mb in range(m):
                assert prog.index(Action(FORWARD, mb)) < prog.index(Action(BACKWARD, mb))


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_no_deadlock_and_bubble_matches_formula(name):
    for p, m in GRID:
        result = simulate(build_schedule(name, p, m))   # raises on deadlock or lost sends
        assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
        assert result.makespan == 2 * (m + p - 1)


def test_stash_1f1b_is_min_p_minus_s_and_m():
    for p, m in GRID:
        assert simulate(build_schedule("1f1b", p, m)).peak_stash == \
            [min(p - s, m) for s in range(p)], (p, m)


def test_stash_gpipe_is_m():
    for p, m in GRID:
        assert simulate(build_schedule("gpipe", p, m)).peak_stash == [m] * p, (p, m)


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


INTERLEAVED = [(p, m, v) for p in range(1, 9) for m in range(p, 33, p) for v in (2, 3, 4)]


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
    assert [repr(a) for a in build_schedule("interleaved", 2, 2, chunks=2)[0][:6]] == \
        ["F0", "SA0", "F1", "SA1", "RA0.1", "F0.1"]


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_link_receives_in_the_order_of_its_sends(name, chunks, stages):
    # NCCL matches point-to-point messages by order only: the simulator's link check passes
    # for every built-in schedule (it runs inside simulate).
    for m in (stages, 2 * stages, 3 * stages + (0 if chunks > 1 else 1)):
        simulate(build_schedule(name, stages, m, chunks=chunks))


def test_simulator_finds_receives_out_of_send_order():
    programs = build_schedule("gpipe", 2, 2)
    swapped = list(programs[1])
    first, second = swapped.index(Action(RECV_ACT, 0)), swapped.index(Action(RECV_ACT, 1))
    # Both activations received before either forward: no deadlock, the tags would match
    # them under MPI, but NCCL would hand micro-batch 0's tensor to micro-batch 1.
    swapped.remove(Action(RECV_ACT, 1))
    swapped.insert(first, Action(RECV_ACT, 1))
    assert second > first
    with pytest.raises(ScheduleError, match=r"link stage 0 -> stage 1: message 0 is sent as "
                                            r"act of micro-batch 0 .* received as act of "
                                            r"micro-batch 1"):
        simulate([programs[0], swapped])
