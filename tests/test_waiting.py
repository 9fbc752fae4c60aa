"""The wait policy's choice (`pipeflow.comm.waiting`), without MPI ranks."""

from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

from pipeflow.comm import waiting


@pytest.mark.parametrize("ranks,cores,expected", [(4, 2, "yield"), (2, 2, "spin"),
                                                  (1, 16, "spin"), (17, 16, "yield")])
def test_auto_yields_only_where_ranks_outnumber_cores(ranks, cores, expected):
    assert waiting.choose("auto", ranks, cores) == expected
    assert waiting.choose("spin", ranks, cores) == "spin"
    assert waiting.choose("yield", ranks, cores) == "yield"


def test_a_node_has_the_cores_its_ranks_may_run_on():
    assert waiting.node_cores(MPI.COMM_SELF) == len(os.sched_getaffinity(0))


def test_use_takes_a_resolved_policy_only():
    before = waiting.policy()
    with pytest.raises(ValueError, match="'spin' or 'yield', found 'auto'"):
        waiting.use("auto")
    assert waiting.policy() == before


def test_a_hang_report_names_spinning_ranks_that_outnumber_cores():
    import pipeflow as pf
    from toy import adamw, loss_fn, toy_layers

    before = waiting.policy()
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(wait="spin"))
    try:
        assert waiting.policy() == "spin"
        assert "spin while they wait" not in engine._report_where()
        engine.stage.topo.local_cores = 0
        report = engine._report_where()
        assert (f"this node runs {engine.stage.topo.local_size} ranks on "
                f"{engine.stage.topo.local_cores} cores") in report
        assert "set wait = 'auto' or 'yield'" in report
        waiting.use("yield")
        assert "spin while they wait" not in engine._report_where()
    finally:
        engine.close()
        waiting.use(before)


class _LateRequest:
    """A posted receive that completes at its third test."""

    def __init__(self) -> None:
        self.tests = 0

    def test(self) -> bool:
        self.tests += 1
        return self.tests >= 3

    def wait(self) -> list:
        return ["arrived"]


@pytest.mark.parametrize("wait", ["spin", "yield"])
def test_spin_never_sleeps_and_yield_naps_between_tests(wait, monkeypatch):
    # The policy's promise: "spin" keeps the core (the lowest latency where each rank has
    # one), "yield" gives it up between tests (ranks outnumber cores), with naps that grow
    # from 20 us to at most 200 us. For the engine's posted receives too (`recv_posted`
    # waits on either the posted buffers or an announcement, by `waiting.until`).
    from pipeflow.comm.mpi import MpiCommunicator
    naps: list[float] = []
    monkeypatch.setattr(waiting.time, "sleep", naps.append)
    before = waiting.policy()
    waiting.use(wait)
    try:
        answers = iter([None, False, None, False, None, "done"])
        assert waiting.until(lambda: next(answers)) == "done"
        until_naps, naps[:] = list(naps), []
        comm = MpiCommunicator(MPI.COMM_SELF)
        request = _LateRequest()
        header = object()
        got = comm.recv_posted(request, 0, 5, header, torch.device("cpu"))
        assert got == (header, ["arrived"]) and request.tests == 3
    finally:
        waiting.use(before)
    if wait == "spin":
        assert until_naps == [] and naps == []
    else:
        assert len(until_naps) == 5 and until_naps == sorted(until_naps)
        assert len(naps) == 2
        assert all(0 < t <= 2e-4 for t in until_naps + naps)
