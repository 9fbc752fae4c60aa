"""Pictures (matplotlib, the optional extra `plot`): a schedule, a measured timeline, each with
a legend of its instruction kinds and idle time, and a run's panels (loss raw, smoothed and
validation; learning rate; tokens/s; the gradient norm and the loss scale when recorded)."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from pipeflow.schedules.ir import RECVS, SENDS
from pipeflow.train.trace import COMPUTE_KINDS, parse_instruction

__all__ = ["draw_lanes", "schedule_png", "trace_png", "metrics_png", "metrics_figure", "smoothed",
           "FIGURE_SIZE", "DPI"]

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


_SEND, _RECV = "0.35", "0.75"     # thin bars: a send dark grey, a receive (or wait) light
_LEGEND = {"F": "F forward (colour: micro-batch)", "B": "B backward (input gradient)",
           "W": "W weight gradient", "send": "send (SA, SG)",
           "recv": "receive (RA, RG); long: a wait", "optimizer step": "optimizer step",
           "other": "other", "idle": "idle: the bubble"}


def _category(kind: str) -> str:
    if kind in COMPUTE_KINDS or kind == "optimizer step":
        return kind
    return "send" if kind in SENDS else "recv" if kind in RECVS else "other"


def _legend_handles(categories: set[str]) -> list:
    """One legend entry for each kind of box drawn, in `_LEGEND`'s order, and idle time."""
    from matplotlib.patches import Patch
    plt = _pyplot()
    style = {"F": dict(facecolor=_colour(plt, "F", 0), edgecolor="black"),
             "B": dict(facecolor=_colour(plt, "B", 0), edgecolor="black"),
             "W": dict(facecolor=_colour(plt, "W", 0), edgecolor="black"),
             "send": dict(facecolor=_SEND), "recv": dict(facecolor=_RECV),
             "optimizer step": dict(facecolor="0.85", edgecolor="0.5", hatch="//"),
             "other": dict(facecolor="0.6"),
             "idle": dict(facecolor="white", edgecolor="0.5")}
    return [Patch(label=_LEGEND[c], linewidth=0.5, **style[c]) for c in _LEGEND
            if c in categories or c == "idle"]


def draw_lanes(ax, lanes: Sequence[Sequence[tuple[str, float, float]]],
               names: Sequence[str], unit: str) -> None:
    """One lane a rank, top to bottom; one box an instruction, coloured by micro-batch; a
    legend below it names every kind of box drawn and the idle time.

    Forward boxes take the micro-batch's colour, backward (B) a darker shade of it, weight
    gradient (W) darker still; sends are drawn thin and dark grey, receives thin and light
    grey (a long one is a wait), the optimizer step hatched; white is the bubble.
    """
    plt = _pyplot()
    drawn: set[str] = set()
    for row, events in enumerate(lanes):
        y = len(lanes) - 1 - row
        for name, t0, t1 in events:
            kind, mb, _chunk = parse_instruction(name)
            category = _category(kind)
            drawn.add(category)
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
                colour = {"send": _SEND, "recv": _RECV}.get(category, "0.6")
                ax.broken_barh([(t0, t1 - t0)], (y - 0.1, 0.2), facecolors=colour)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_xlabel(unit)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    handles = _legend_handles(drawn)
    ax.figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
                     frameon=False)


def _save(plt, fig, path: str | os.PathLike) -> None:
    # Room at the bottom for a figure legend (the lanes'), none elsewhere.
    fig.tight_layout(rect=(0, 0.07 if fig.legends else 0, 1, 1))
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


def smoothed(values: Sequence[float | None], weight: float) -> list[float]:
    """An exponential moving average with TensorBoard's bias correction: point i is the
    weighted mean of the finite values up to i, weights `weight ** age`. A missing value (a
    non-finite loss, written as null) is left out and gives NaN at its step."""
    out, mean, total = [], 0.0, 0.0
    for v in values:
        if v is None:
            out.append(float("nan"))
            continue
        mean, total = weight * mean + (1 - weight) * v, weight * total + (1 - weight)
        out.append(mean / total)
    return out


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key` where recorded; a null (non-finite) value is NaN."""
    rows = [r for r in records if key in r]
    return [r["step"] for r in rows], [float("nan") if r[key] is None else r[key] for r in rows]


def metrics_figure(records: list[dict[str, Any]], smoothing: float = 0.8):
    """The panels of a run's records (a metrics JSONL's lines), one x axis of steps shared:
    loss (each logged step, its smoothed curve, validation points), learning rate, tokens/s,
    and where recorded the gradient norm and (when the loss was scaled) the loss scale."""
    plt = _pyplot()
    train = [r for r in records if "loss" in r]
    if not train:
        raise ValueError("no training records (lines with \"loss\")")
    panels = ["loss", "lr", "tokens_per_s"]
    if any(r.get("grad_norm") is not None for r in train):
        panels.append("grad_norm")
    if any(r.get("loss_scale") not in (None, 1.0) for r in train):
        panels.append("loss_scale")
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(FIGURE_SIZE[0], 3.2 * rows), sharex=True,
                             squeeze=False)
    flat = list(axes.flat)
    for ax, key in zip(flat, panels):
        _panel(ax, key, records, smoothing)
    for ax in flat[len(panels):]:
        ax.remove()
    for ax in flat[:len(panels)]:
        ax.xaxis.set_tick_params(labelbottom=True)     # sharex hides them above the last row
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return fig


_UNITS = {"loss": "loss (nats/token)", "lr": "learning rate", "tokens_per_s": "tokens/s",
          "grad_norm": "gradient norm (L2, whole grid)", "loss_scale": "loss scale (fp16)"}


def _panel(ax, key: str, records: list[dict[str, Any]], smoothing: float) -> None:
    steps, values = _series([r for r in records if "loss" in r], key)
    ax.set_ylabel(_UNITS[key])
    if key != "loss":
        ax.plot(steps, values)
        if key == "loss_scale":
            ax.set_yscale("log", base=2)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        return
    ax.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=1, label="train")
    raw = [None if v != v else v for v in values]       # NaN (null in the file) left out
    ax.plot(steps, smoothed(raw, smoothing), color="tab:blue", linewidth=2,
            label=f"train, smoothed ({smoothing:g})")
    val_steps, val = _series(records, "eval_loss")
    if val_steps:
        ax.plot(val_steps, val, "o", color="tab:orange", label="validation")
    ax.legend(fontsize=8)


def metrics_png(metrics_path: str | os.PathLike, path: str | os.PathLike,
                smoothing: float = 0.8) -> None:
    """`metrics_figure` of a metrics JSONL, written as a PNG."""
    plt = _pyplot()
    try:
        fig = metrics_figure(_read_jsonl(metrics_path), smoothing)
    except ValueError as exc:
        raise ValueError(f"{os.fspath(metrics_path)} has {exc}; is it a pipeflow metrics "
                         f"file?") from None
    _save(plt, fig, path)
