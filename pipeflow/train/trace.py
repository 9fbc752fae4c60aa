"""Per-rank timelines of executed instructions → Chrome/Perfetto trace JSON."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from pipeflow.comm import waiting
from pipeflow._io import atomic_write_bytes
from pipeflow.schedules.ir import Action, ScheduleError

if TYPE_CHECKING:
    from pipeflow.engine import Engine

__all__ = ["gather_trace", "write_trace", "op_kind", "parse_instruction", "COMPUTE_KINDS",
           "load_trace_lanes"]

COMPUTE_KINDS = frozenset({"F", "B", "W"})     # forward, backward (input), weight gradient


def parse_instruction(name: str) -> tuple[str, int | None, int]:
    """`F3.1` → ("F", 3, 1); `SA2` → ("SA", 2, 0); `optimizer step` → (name, None, 0): the
    schedule IR's own reading of an action (`Action.from_str`), or the engine's own span."""
    try:
        act = Action.from_str(name)
    except ScheduleError:
        return name, None, 0
    return act.op, act.mb, act.chunk


def op_kind(name: str) -> str:
    """The instruction's category: its op letters (`F3.1` → `F`), or the whole name."""
    return parse_instruction(name)[0]


def gather_trace(engine: "Engine") -> dict[str, Any] | None:
    """The last step's instructions on every rank, as a Chrome trace (on world rank 0).

    Each rank's clock is aligned at a barrier, so the lanes line up to within the barrier's
    skew (microseconds on one node). Open the file in https://ui.perfetto.dev or
    chrome://tracing: one lane a rank, one box an instruction (F3, B3, SA3, ...).
    """
    topo = engine.stage.topo
    world = topo.world
    waiting.barrier(world)
    origin = time.perf_counter()
    lane = {"rank": topo.rank, "stage": topo.stage, "replica": topo.replica,
            "events": [(name, start - origin, end - origin)
                       for name, start, end in engine.runner.timeline]}
    lanes = waiting.gather(world, lane, 0)
    if world.rank != 0:
        return None
    start = min((e[1] for ln in lanes for e in ln["events"]), default=0.0)
    events: list[dict[str, Any]] = []
    for ln in lanes:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": ln["rank"],
                       "args": {"name": f"rank {ln['rank']} (stage {ln['stage']}, "
                                        f"replica {ln['replica']})"}})
        for name, t0, t1 in ln["events"]:
            events.append({"name": name, "cat": op_kind(name), "ph": "X", "pid": 0,
                           "tid": ln["rank"], "ts": (t0 - start) * 1e6,
                           "dur": max(0.0, t1 - t0) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(engine: "Engine", path: str | os.PathLike) -> None:
    """Gather the last step's trace and write it atomically on world rank 0."""
    trace = gather_trace(engine)
    if trace is not None:
        atomic_write_bytes(path, json.dumps(trace).encode())


def load_trace_lanes(path: str | os.PathLike) -> tuple[list[str], list[list[tuple]]]:
    """A trace file written by `write_trace` → lane names and (name, start s, end s) per lane."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    lanes: dict[int, list[tuple]] = {tid: [] for tid in names}
    for e in events:
        if e.get("ph") == "X":
            t0 = e["ts"] / 1e6
            lanes.setdefault(e["tid"], []).append((e["name"], t0, t0 + e["dur"] / 1e6))
    order = sorted(lanes)
    return [names.get(t, f"lane {t}") for t in order], [lanes[t] for t in order]
