"""benchmarks/bench_peer.py's pure pieces: the peer's stash count and the bounds."""

import os
import sys

import pytest

pytest.importorskip("torch.distributed.pipelining")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from torch.distributed.pipelining.schedules import _Action, _ComputationType  # noqa: E402

import bench_peer  # noqa: E402
from pipeflow.schedules import BACKWARD, FORWARD, WEIGHT, build_schedule, simulate  # noqa: E402


def as_peer_order(programs) -> dict[int, list]:
    """pipeflow's programs in the peer's `pipeline_order` form: compute actions only (B is
    the peer's I, input backward, where the schedule splits off W), and idle steps (None)."""
    split = any(a.op == WEIGHT for prog in programs for a in prog)
    kinds = {FORWARD: "F", BACKWARD: "I" if split else "B", WEIGHT: "W"}
    order = {}
    for rank, prog in enumerate(programs):
        order[rank] = [None]
        for a in prog:
            if a.op in kinds:
                kind = _ComputationType.from_str(kinds[a.op])
                order[rank].append(_Action(programs.layout[rank][a.chunk], kind, a.mb))
    return order


@pytest.mark.parametrize("name,chunks", [("1f1b", None), ("interleaved", 2), ("zb-h1", None),
                                         ("zbv", None), ("gpipe", None)])
@pytest.mark.parametrize("p,m", [(2, 8), (3, 6), (4, 8)])
def test_peer_stash_counts_as_the_simulator(name, chunks, p, m):
    programs = build_schedule(name, p, m, chunks)
    sim = simulate(programs)
    stash, held = bench_peer.order_stash(as_peer_order(programs))
    assert stash == sim.peak_stash, (name, p, m)
    assert held == sim.peak_held, (name, p, m)


def test_bounds_order_and_formulas():
    t1, p, m = 8.0, 2, 8
    b = bench_peer.bounds_of(t1, p, m)
    assert b["zero-bubble"] == pytest.approx(t1 / p)
    assert b["1f1b"] == pytest.approx(t1 / p * (m + p - 1) / m)
    assert b["interleaved"] == pytest.approx(t1 / p * (2 * m + p - 1) / (2 * m))
    assert b["zero-bubble"] < b["interleaved"] < b["1f1b"]


@pytest.mark.parametrize("chosen,bound", [("zbv", "zero-bubble"), ("interleaved", "interleaved"),
                                          ("gpipe", "1f1b")])
def test_the_auto_row_takes_the_chosen_schedules_layout_and_bound(monkeypatch, chosen, bound):
    from types import SimpleNamespace

    monkeypatch.setitem(bench_peer.PIPEFLOW, "auto", bench_peer.PIPEFLOW["auto"])
    monkeypatch.setattr(bench_peer, "AUTO_WHY", [])
    engine = SimpleNamespace(schedule=chosen, schedule_choice=f"pipeflow: chose {chosen!r}")
    assert bench_peer.resolve_auto(engine) == chosen
    kind = bench_peer.PIPEFLOW["auto"]
    assert (kind.label, kind.bound) == (f"pipeflow auto (chose {chosen})", bound)
    assert kind.chunks == (2 if chosen in ("zbv", "interleaved") else 1)
    stash, held, _ = bench_peer.pipeflow_stash(chosen, 2, 8)
    assert stash == simulate(build_schedule(chosen, 2, 8, 2 if chosen == "interleaved"
                                            else None)).peak_stash
