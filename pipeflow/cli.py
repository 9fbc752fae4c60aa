"""The command line: `pipeflow train CONFIG`, `plan`, `schedule`, `trace`, `plot`, `prepare`,
`export`, `sample`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

__all__ = ["main", "LEVELS"]


def _error(text: str | BaseException) -> int:
    """The error on stderr as written (a KeyError's message without the quotes `str` adds)."""
    if isinstance(text, KeyError) and len(text.args) == 1 and isinstance(text.args[0], str):
        text = text.args[0]
    print(f"pipeflow: error: {text}", file=sys.stderr)
    return 2


def _train_overrides(args: argparse.Namespace) -> list[str]:
    """The shorthand options as `--set` items, after the explicit ones."""
    sets = list(args.set or [])
    if args.steps is not None:
        sets.append(f"train.steps={args.steps}")
    if args.save_dir is not None:
        sets.append(f"train.save_dir={json.dumps(args.save_dir)}")
    if args.resume:
        sets.append("train.resume=true")
    return sets


def _train(args: argparse.Namespace) -> int:
    import signal

    from mpi4py import MPI

    from pipeflow.config import ConfigError
    from pipeflow.train.loop import load_run_config, train

    rank0 = MPI.COMM_WORLD.rank == 0
    try:
        run = load_run_config(args.config, _train_overrides(args))
        if args.print_config:
            if rank0:
                print(run.to_toml(), end="")
            return 0
        train(run, trace=args.trace)
        # Slurm's warning signal may come after the last step: it must not kill a finished
        # rank (and fail the job) on its way out.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    except ConfigError as exc:
        # Raised alike on every rank (grid, batch and config checks agree before any
        # message moves): one report from rank 0, a clean exit everywhere.
        return _error(exc) if rank0 else 2
    return 0


def _positive(name: str, value: int) -> str | None:
    if value < 1:
        return f"{name} must be a positive integer, found {value}"
    return None


def _schedule(args: argparse.Namespace) -> int:
    from pipeflow.schedules import (SCHEDULES, ScheduleError, build_schedule, format_table,
                                    simulate)

    if args.list:
        for name, spec in SCHEDULES.items():
            print(f"{name:12} {spec.summary}")
        return 0
    p, m, v = args.stages, args.microbatches, args.chunks
    for problem in (_positive("--stages/-p (pipeline stages)", p),
                    _positive("--microbatches/-m", m),
                    _positive("--chunks/-v", v) if v is not None else None):
        if problem:
            return _error(problem + "; e.g. pipeflow schedule -p 4 -m 8")
    try:
        programs = build_schedule(args.schedule, p, m, v)
        result = simulate(programs)
    except ScheduleError as exc:
        return _error(exc)
    v = len(programs.layout[0])
    print(format_table(programs))
    chunks = f" (in chunks: 1/{v} of a stage's layers each)" if v > 1 else ""
    if any(a.op == "W" for a in programs[0]):
        # Split backward: F = B = W = 1 unit; 1F1B's whole backward takes B + W = 2.
        print(f"\nbubble {result.bubble:.3f} (F = B = W; 1F1B with the same times: "
              f"{simulate(build_schedule('1f1b', p, m)).bubble:.3f}); peak stash per stage "
              f"{result.peak_stash}, waiting for W {result.peak_pending_w}, held in all "
              f"{result.peak_held}{chunks}")
    else:
        print(f"\nbubble {result.bubble:.3f} (formula (p-1)/(v·m+p-1) = "
              f"{(p - 1) / (v * m + p - 1):.3f}); peak stash per stage {result.peak_stash}"
              f"{chunks}")
    if args.png:
        from pipeflow.train import plot
        title = f"{args.schedule}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
        return _picture(lambda: plot.schedule_png(programs, args.png, title=title), args.png)
    return 0


def _picture(draw, path: str) -> int:
    try:
        draw()
    except (ImportError, OSError, ValueError, KeyError) as exc:
        return _error(f"cannot draw {path}: {exc}")
    print(f"wrote {path}")
    return 0


def _trace(args: argparse.Namespace) -> int:
    from pipeflow.train import plot
    return _picture(lambda: plot.trace_png(args.trace, args.png), args.png)


def _plot(args: argparse.Namespace) -> int:
    from pipeflow.train import plot
    if not 0 <= args.smooth < 1:
        return _error(f"--smooth must be a weight 0 <= w < 1 (0: no smoothing), found "
                      f"{args.smooth:g}")
    return _picture(lambda: plot.metrics_png(args.metrics, args.png, args.smooth), args.png)


def _prepare(args: argparse.Namespace) -> int:
    import signal
    import threading

    from pipeflow.train.prepare import prepare
    if threading.current_thread() is threading.main_thread():
        # A SIGTERM (a job's time limit, `kill`) unwinds: the temporary stream is removed.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        meta = prepare(args.texts, args.out, args.tokenizer, args.val_fraction,
                       field=args.field, dataset=args.dataset or "", split=args.split,
                       workers=args.workers, progress=not args.no_progress)
    except (OSError, ValueError) as exc:
        return _error(exc)
    if meta.get("cleaned"):
        print(f"removed the leftovers of an interrupted prepare in {args.out}: "
              f"{', '.join(meta['cleaned'])}")
    print(f"read the inputs as UTF-8 with their newlines as written (CR and CRLF kept, as in "
          f"JSONL and Parquet strings); {meta['documents']} document(s)")
    print(f"wrote {args.out}/train.bin ({meta['train_tokens']} tokens) and val.bin "
          f"({meta['val_tokens']}), {meta['dtype']}, vocabulary {meta['vocab_size']}; train "
          f"with [data] train = \"{args.out}/train.bin\", val = \"{args.out}/val.bin\", "
          f"dtype = \"{meta['dtype']}\"")
    return 0


def _export(args: argparse.Namespace) -> int:
    """`pipeflow export CKPT --hf OUT`: a checkpoint of an HF-kind run as a Hub folder, in one
    process (no MPI launch)."""
    from pipeflow.config import ConfigError
    from pipeflow.runtime.checkpoint import CheckpointError, read_params
    from pipeflow.train import hub
    from pipeflow.train.export import check_target
    try:
        check_target(args.hf, args.overwrite)      # before the checkpoint is read
        params, folder = read_params(args.checkpoint)
        hf_config = _checkpoint_hf_config(folder, args.config)
        done = hub.write_folder(params, hf_config, args.hf, args.overwrite,
                                avoid=(args.checkpoint,), **_export_options(folder, args))
    except (CheckpointError, ConfigError, OSError, ValueError, KeyError) as exc:
        return _error(exc)
    more = done.describe()
    print(f"wrote {done.path} from {folder}: {', '.join(sorted(os.listdir(done.path)))} "
          f"(AutoModelForCausalLM.from_pretrained({done.path!r}))" + (f"; {more}" if more else ""))
    return 0


def _export_options(folder: str, args: argparse.Namespace) -> dict:
    """What `pipeflow export` writes as the run's `export_hf` would (the source folder's other
    files, the run's precision, its shard size: recorded in the checkpoint's data.json, else
    read from --config RUN.toml), each overridden by its flag."""
    from pipeflow.runtime.checkpoint import read_sealed_json
    from pipeflow.train import hub
    from pipeflow.train.run_config import DATA_STATE
    path = os.path.join(folder, DATA_STATE)
    saved = read_sealed_json(path) if os.path.isfile(path) else {}
    source, dtype = saved.get("hf_source", ""), saved.get("hf_export_dtype", "")
    shard = saved.get("hf_max_shard_size", hub.DEFAULT_SHARD)
    if args.config and "hf_export_dtype" not in saved:
        from pipeflow.train.model_table import build_model
        from pipeflow.train.run_config import load_run_config
        run = load_run_config(args.config)
        source = build_model(run.model, run.source).hf_source
        dtype = str(hub.export_dtype(run.train.export_dtype, run.engine.precision))
        dtype, shard = dtype.removeprefix("torch."), run.train.max_shard_size
    return {"source": args.source if args.source is not None else source,
            "dtype": hub.export_dtype(args.dtype or dtype, "fp32"),
            "max_shard_size": args.max_shard_size or shard}


def _checkpoint_hf_config(folder: str, run_toml: str | None):
    """The transformers config of the run that wrote the checkpoint `folder`: the one
    `pipeflow train` saved in its data.json, else the [model] table of `--config RUN.toml`."""
    import os

    from pipeflow.config import ConfigError
    from pipeflow.runtime.checkpoint import read_sealed_json
    from pipeflow.train.run_config import DATA_STATE
    saved = None
    path = os.path.join(folder, DATA_STATE)
    if os.path.isfile(path):
        saved = read_sealed_json(path).get("hf_config")
    if saved is not None and run_toml is None:
        from pipeflow.train.model_table import hf_config_of
        return hf_config_of(saved)
    if run_toml is None:
        raise ConfigError(f"{folder!r} records no Hugging Face config (its {DATA_STATE} has no "
                          f"\"hf_config\": not written by `pipeflow train` of a [model] kind = "
                          f"\"hf\" run); pass the run's TOML with --config RUN.toml")
    from pipeflow.train.model_table import build_model
    from pipeflow.train.run_config import load_run_config
    run = load_run_config(run_toml)
    model = build_model(run.model, run.source)
    if model.hf_config is None:
        raise ConfigError(f"--config {run_toml!r}: its [model] is not kind = \"hf\"; "
                          f"`pipeflow export --hf` writes Hugging Face models only")
    return model.hf_config


def _add_export(sub) -> None:
    export = sub.add_parser("export", help="write a checkpoint of an HF model as a Hugging "
                            "Face folder (config.json + model.safetensors)")
    export.add_argument("checkpoint", metavar="CKPT",
                        help="a checkpoint folder, or the save_dir whose latest it is")
    export.add_argument("--hf", required=True, metavar="OUT",
                        help="the folder to write: config.json and model.safetensors are "
                        "added or replaced in one step, its other files kept")
    export.add_argument("--overwrite", action="store_true",
                        help="replace weights in OUT that pipeflow did not write (another "
                        "model.safetensors, a sharded index, pytorch_model.bin)")
    export.add_argument("--config", metavar="RUN.toml",
                        help="the run's TOML, for a checkpoint that records no HF config")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="the weights' dtype (default: the run's precision)")
    export.add_argument("--max-shard-size", metavar="SIZE",
                        help="shard the weights past SIZE, e.g. 500MB (default: the run's, 5GB)")
    export.add_argument("--source", metavar="FOLDER",
                        help="the Hub folder whose tokenizer and other non-weight files to "
                        "copy (default: the run's pretrained folder)")
    export.set_defaults(func=_export)


def _sample(args: argparse.Namespace) -> int:
    """`pipeflow sample CKPT --prompt TEXT`: text on stdout, rank 0 only; one report of an
    error (raised alike on every rank) from rank 0."""
    from mpi4py import MPI

    from pipeflow.config import ConfigError
    from pipeflow.train.sample import SampleArgs, sample
    rank0 = MPI.COMM_WORLD.rank == 0
    try:
        sample(SampleArgs(args.checkpoint, args.prompt or ["\n"], args.max_new_tokens,
                          args.temperature, args.top_k, args.top_p, args.seed, args.eos or [],
                          args.tokenizer or "", args.config or "", args.pipeline, args.ids,
                          tensor=args.tensor))
    except (ConfigError, OSError, ValueError) as exc:
        return _error(exc) if rank0 else 2
    return 0


def _add_sample(sub) -> None:
    sample = sub.add_parser("sample", help="generate text from a checkpoint or a Hugging Face "
                            "folder, on any grid (mpirun -n N) or in one process")
    sample.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder, the save_dir "
                        "whose latest it is, or a Hugging Face folder")
    sample.add_argument("--prompt", action="append", metavar="TEXT",
                        help="the text to continue (repeatable: one micro-batch each; "
                        "default a newline)")
    sample.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    sample.add_argument("--temperature", type=float, default=0.8,
                        help="0: greedy (default 0.8)")
    sample.add_argument("--top-k", type=int, default=None, metavar="K")
    sample.add_argument("--top-p", type=float, default=None, metavar="P")
    sample.add_argument("--seed", type=int, default=0,
                        help="the draw's seed: the same text on every grid")
    sample.add_argument("--eos", type=int, action="append", metavar="ID",
                        help="stop a prompt at this token id (repeatable)")
    sample.add_argument("--tokenizer", metavar="SPEC", help="byte, tiktoken:NAME or hf:FILE "
                        "(default: the run's data's meta.json, or the folder's tokenizer.json)")
    sample.add_argument("--config", metavar="RUN.toml",
                        help="the run's TOML, for a checkpoint that records none")
    sample.add_argument("--pipeline", type=int, default=0, metavar="P",
                        help="pipeline stages (default: every rank of the launch over "
                        "--tensor)")
    sample.add_argument("--tensor", type=int, default=1, metavar="T",
                        help="tensor degree: each layer cut over T ranks, its key/value "
                        "cache 1/T of the heads a rank (default 1)")
    sample.add_argument("--ids", action="store_true",
                        help="print each prompt's new token ids (JSON) instead of the text")
    sample.set_defaults(func=_sample)


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="train the model described by a TOML file")
    train.add_argument("config", help="TOML file with [engine], [model], [train], [data]")
    train.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                       help="override any key, the value parsed as TOML (repeatable): "
                       "--set engine.microbatches=16 --set train.lr=1e-3")
    train.add_argument("--print-config", action="store_true",
                       help="print the merged configuration (file + overrides) and exit")
    train.add_argument("--steps", type=int, help="override [train] steps")
    train.add_argument("--save-dir", help="override [train] save_dir (checkpoint folder)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in save_dir")
    train.add_argument("--trace", metavar="FILE.json",
                       help="write the last step's per-rank instruction timeline as a "
                       "Chrome/Perfetto trace")
    train.set_defaults(func=_train)


def _add_pictures(sub) -> None:
    show = sub.add_parser("schedule", help="print a schedule's pipeline order, bubble and stash")
    show.add_argument("--stages", "-p", type=int, default=4)
    show.add_argument("--microbatches", "-m", type=int, default=8)
    show.add_argument("--schedule", "-s", default="1f1b",
                      help="a registered schedule (--list shows them)")
    show.add_argument("--chunks", "-v", type=int, default=None,
                      help="model chunks per rank where the schedule lets you choose "
                           "(interleaved; default 2)")
    show.add_argument("--list", action="store_true", help="list the schedules and stop")
    show.add_argument("--png", metavar="OUT.png", help="also draw it (needs matplotlib)")
    show.set_defaults(func=_schedule)
    trace = sub.add_parser("trace", help="draw a measured timeline (pipeflow train --trace)")
    trace.add_argument("trace", help="trace JSON written by pipeflow train --trace")
    trace.add_argument("--png", metavar="OUT.png", required=True)
    trace.set_defaults(func=_trace)
    plot = sub.add_parser("plot", help="draw a run's loss (raw, smoothed, validation), learning "
                          "rate, tokens/s, gradient norm and loss scale from its metrics JSONL")
    plot.add_argument("metrics", help="metrics JSONL written by pipeflow train")
    plot.add_argument("--png", metavar="OUT.png", required=True)
    plot.add_argument("--smooth", type=float, default=0.8, metavar="W",
                      help="the smoothed loss's moving-average weight, 0 <= W < 1 (default 0.8)")
    plot.set_defaults(func=_plot)


def _add_prepare(sub) -> None:
    prep = sub.add_parser("prepare", help="tokenize documents (text, JSONL, Parquet, a "
                          "Hugging Face dataset) into train.bin / val.bin")
    prep.add_argument("texts", nargs="*", metavar="INPUT", help="files in order, by suffix: "
                      ".jsonl and .parquet (a document a record), else text (a document a "
                      "file)")
    prep.add_argument("--out", required=True, metavar="DIR")
    prep.add_argument("--tokenizer", default="byte",
                      help="byte (default), tiktoken:NAME (e.g. tiktoken:gpt2) or hf:NAME")
    prep.add_argument("--val-fraction", type=float, default=0.05)
    prep.add_argument("--field", default="text",
                      help="the text's field of a JSONL / Parquet / dataset record")
    prep.add_argument("--dataset", metavar="NAME_OR_FOLDER",
                      help="a Hugging Face dataset: a save_to_disk folder or a Hub name "
                      "(needs pipeflow[data])")
    prep.add_argument("--split", default="train", help="the dataset's split (default train)")
    prep.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)),
                      help="tokenizing processes (default: the cores less one, at most 8)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(func=_prepare)


def _add_verbosity(parser: argparse.ArgumentParser) -> None:
    """`--quiet` / `--verbose`, before the command or after it (`pipeflow train X --quiet`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quiet", dest="verbosity", action="store_const", const=-1,
                       default=argparse.SUPPRESS,
                       help="warnings and errors only: no info lines (a run's own progress "
                       "lines and a command's output stay)")
    group.add_argument("--verbose", dest="verbosity", action="store_const", const=1,
                       default=argparse.SUPPRESS, help="debug lines too")


# The `pipeflow` logger's level for each verbosity (pipeflow.logs: the rank in each line).
LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeflow", description="Pipeline-parallel training across MPI ranks. "
        "Launch training as `mpirun -n N pipeflow train CONFIG.toml`. Messages other than a "
        "run's progress and a command's output go through `logging` to stderr, each line "
        "naming its rank.")
    _add_verbosity(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_pictures(sub)
    _add_prepare(sub)
    _add_export(sub)
    _add_sample(sub)
    try:
        from pipeflow.planner import cli as planner_cli
    except ImportError:  # pragma: no cover - the planner is optional at import time
        planner_cli = None
    if planner_cli is not None:
        plan = sub.add_parser("plan", help="from a compute budget and a cluster to a launch "
                              "command (Chinchilla sizing, cost model, search)")
        planner_cli.add_arguments(plan)
        plan.set_defaults(func=planner_cli.run)
    for command in sub.choices.values():
        _add_verbosity(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pipeflow.logs import configured
    with configured(LEVELS[getattr(args, "verbosity", 0)]):
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
