"""Per-rank timelines of executed instructions → Chrome/Perfetto trace JSON."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from pipeflow._io import atomic_write_bytes

if TYPE_CHECKING:
    from pipeflow.engine import Engine

__all__ = ["gather_trace", "write_trace"]


def gather_trace(engine: "Engine") -> dict[str, Any] | None:
    """The last step's instructions on every rank, as a Chrome trace (on world rank 0).

    Each rank's clock is aligned at a barrier, so the lanes line up to within the barrier's
    skew (microseconds on one node). Open the file in https://ui.perfetto.dev or
    chrome://tracing: one lane a rank, one box an instruction (F3, B3, SA3, ...).
    """
    world = engine.topo.world
    world.Barrier()
    origin = time.perf_counter()
    lane = {"rank": engine.topo.rank, "stage": engine.stage, "replica": engine.topo.replica,
            "events": [(name, start - origin, end - origin)
                       for name, start, end in engine.timeline]}
    lanes = world.gather(lane, root=0)
    if world.rank != 0:
        return None
    start = min((e[1] for ln in lanes for e in ln["events"]), default=0.0)
    events: list[dict[str, Any]] = []
    for ln in lanes:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": ln["rank"],
                       "args": {"name": f"rank {ln['rank']} (stage {ln['stage']}, "
                                        f"replica {ln['replica']})"}})
        for name, t0, t1 in ln["events"]:
            kind = name.rstrip("0123456789") or name
            events.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": ln["rank"],
                           "ts": (t0 - start) * 1e6, "dur": max(0.0, t1 - t0) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(engine: "Engine", path: str | os.PathLike) -> None:
    """Gather the last step's trace and write it atomically on world rank 0."""
    trace = gather_trace(engine)
    if trace is not None:
        atomic_write_bytes(path, json.dumps(trace).encode())
