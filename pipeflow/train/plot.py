"""Pictures (matplotlib, the optional extra `plot`): a schedule, a measured timeline, a run's
loss and throughput."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from pipeflow.train.trace import COMPUTE_KINDS, parse_instruction

__all__ = ["draw_lanes", "schedule_png", "trace_png", "metrics_png", "FIGURE_SIZE", "DPI"]

FIGURE_SIZE = (12.0, 4.0)     # inches
DPI = 100                     # so a PNG is 1200 x 400 pixels
_SHADE = {"F": 1.0, "B": 0.6, "W": 0.35}     # forward full colour, backward darker, W darker


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install 'pipeflow[plot]'") from None
    matplotlib.use("Agg")     # files only: no screen needed
    import matplotlib.pyplot as plt
    return plt


def _colour(plt, kind: str, mb: int):
    r, g, b, _ = plt.get_cmap("tab10")(mb % 10)
    k = _SHADE.get(kind, 0.8)
    return (r * k, g * k, b * k)


def draw_lanes(ax, lanes: Sequence[Sequence[tuple[str, float, float]]],
               names: Sequence[str], unit: str) -> None:
    """One lane a rank, top to bottom; one box an instruction, coloured by micro-batch.

    Forward boxes take the micro-batch's colour, backward (B) a darker shade of it, weight
    gradient (W) darker still; communication is drawn thin and grey, the optimizer step
    hatched; white is the bubble.
    """
    plt = _pyplot()
    for row, events in enumerate(lanes):
        y = len(lanes) - 1 - row
        for name, t0, t1 in events:
            kind, mb, _chunk = parse_instruction(name)
            if kind in COMPUTE_KINDS and mb is not None:
                ax.broken_barh([(t0, t1 - t0)], (y - 0.4, 0.8), facecolors=_colour(plt, kind, mb),
                               edgecolors="black", linewidth=0.5)
                if len(events) <= 200:
                    ax.text((t0 + t1) / 2, y, name, ha="center", va="center", fontsize=7,
                            color="white")
            elif kind == "optimizer step":
                ax.broken_barh([(t0, t1 - t0)], (y - 0.4, 0.8), facecolors="0.85",
                               edgecolors="0.5", hatch="//", linewidth=0.5)
            else:
                ax.broken_barh([(t0, t1 - t0)], (y - 0.1, 0.2), facecolors="0.75")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_xlabel(unit)
    ax.set_ylim(-0.6, len(lanes) - 0.4)


def _save(plt, fig, path: str | os.PathLike) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def schedule_png(programs, path: str | os.PathLike, title: str = "") -> None:
    """The simulated schedule: one lane a stage (rank), in units of one forward's time."""
    from pipeflow.schedules import simulate
    plt = _pyplot()
    result = simulate(programs)
    lanes = [[(repr(act), t0, t1) for t0, t1, act in events] for events in result.timeline]
    fig, ax = plt.subplots(figsize=FIGURE_SIZE)
    draw_lanes(ax, lanes, [f"rank {s}" for s in range(len(lanes))], "time (forwards)")
    ax.set_title(f"{title}  bubble {result.bubble:.1%} (white)".strip())
    _save(plt, fig, path)


def trace_png(trace_path: str | os.PathLike, path: str | os.PathLike) -> None:
    """A measured timeline written by `pipeflow train --trace`, drawn like a schedule."""
    from pipeflow.train.metrics import bubble_fraction
    from pipeflow.train.trace import load_trace_lanes
    plt = _pyplot()
    names, lanes = load_trace_lanes(trace_path)
    origin = min((e[1] for lane in lanes for e in lane), default=0.0)
    ms = [[(n, (t0 - origin) * 1e3, (t1 - origin) * 1e3) for n, t0, t1 in lane] for lane in lanes]
    fig, ax = plt.subplots(figsize=FIGURE_SIZE)
    draw_lanes(ax, ms, names, "time (ms)")
    bubbles = ", ".join(f"{bubble_fraction(lane):.0%}" for lane in lanes)
    ax.set_title(f"measured step {os.path.basename(os.fspath(trace_path))}; bubble per rank "
                 f"{bubbles}")
    _save(plt, fig, path)


def _read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def metrics_png(metrics_path: str | os.PathLike, path: str | os.PathLike) -> None:
    """Training (and validation) loss and tokens/s against the step, from a metrics JSONL."""
    plt = _pyplot()
    records = _read_jsonl(metrics_path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train:
        raise ValueError(f"{os.fspath(metrics_path)} has no training records (lines with "
                         f"\"loss\"); is it a pipeflow metrics file?")
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGURE_SIZE)
    nan = float("nan")       # a non-finite loss is written as null (`metrics.strict_record`)
    left.plot([r["step"] for r in train], [nan if r["loss"] is None else r["loss"]
                                           for r in train], label="train")
    if evals:
        left.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                  label="validation")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.legend()
    right.plot([r["step"] for r in train], [nan if r.get("tokens_per_s") is None
                                            else r["tokens_per_s"] for r in train])
    right.set_xlabel("step")
    right.set_ylabel("tokens/s")
    _save(plt, fig, path)
