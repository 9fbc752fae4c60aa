"""`pipeflow sample CKPT --prompt TEXT`: what a trained model writes, on any grid.

`CKPT` is a checkpoint folder (or the save_dir whose latest it is) written by `pipeflow
train`, which records the run's tables in its `data.json`, or a Hugging Face folder
(`config.json` and safetensors weights). Every rank builds its own layers on the grid of
this launch (`--tensor T` ranks cut each layer, `--pipeline P` stages, default every tensor
group of the launch; the rest are replicas), reads only their tensors, and `engine.generate`
writes the continuation. The tokenizer is the run's data's
(`meta.json` beside `[data] train`, written by `pipeflow prepare`), the Hugging Face
folder's `tokenizer.json`, or bytes for a run on the byte corpus; `--tokenizer` overrides.
The text goes to stdout on rank 0 only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Sequence

import torch
from mpi4py import MPI

from pipeflow.comm import waiting
from pipeflow.config import Config, ConfigError

__all__ = ["Tokenizer", "load_tokenizer", "data_tokenizer", "SampleArgs", "sample"]


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text to token ids and back; `spec` as `pipeflow prepare --tokenizer` names it."""

    spec: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte`, `tiktoken:NAME` or `hf:NAME_OR_tokenizer.json` (the kinds of `pipeflow
    prepare`); a ValueError naming the extra to install where a package is missing."""
    if spec == "byte":
        return Tokenizer(spec, lambda text: list(text.encode("utf-8")),
                         lambda ids: bytes(i if i < 256 else 63 for i in ids).decode(
                             "utf-8", errors="replace"))
    kind, _, name = spec.partition(":")
    try:
        if kind == "tiktoken" and name:
            import tiktoken
            enc = tiktoken.get_encoding(name)
            return Tokenizer(spec, enc.encode_ordinary, enc.decode)
        if kind == "hf" and name:
            from pipeflow.train.prepare import hf_tokenizer
            tok = hf_tokenizer(name)
            return Tokenizer(spec, lambda text: tok.encode(text).ids,
                             lambda ids: tok.decode(list(ids), skip_special_tokens=False))
    except ImportError:
        package = "tiktoken" if kind == "tiktoken" else "tokenizers"
        raise ValueError(f"tokenizer {spec!r} needs the {package!r} package: pip install "
                         f"'pipeflow[tokenizers]'") from None
    raise ValueError(f"tokenizer must be 'byte', 'tiktoken:NAME' or 'hf:NAME_OR_FILE', "
                     f"found {spec!r}")


@dataclasses.dataclass
class SampleArgs:
    """What `pipeflow sample` was asked."""

    checkpoint: str
    prompts: list[str]
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    eos: list[int] = dataclasses.field(default_factory=list)
    tokenizer: str = ""
    config: str = ""              # the run's TOML, for a checkpoint that records none
    pipeline: int = 0             # 0: every rank of the launch (over the tensor degree)
    ids: bool = False             # print the new token ids (JSON) instead of the text
    tensor: int = 1               # the tensor degree: each layer cut over this many ranks


@dataclasses.dataclass
class _Source:
    """Where the model, its weights and its tokenizer come from."""

    model: Any                    # pipeflow.train.model_table.Model
    precision: str
    tokenizer: str
    # (layers, Engine.kept_ranges) -> their tensors: a Hub folder's in this tensor rank's
    # slices, a checkpoint's whole (its shards hold whole layers; load_state_dict cuts them)
    read: Callable[[list[int], Any], dict[str, torch.Tensor]]
    folder: str | None = None     # the checkpoint read (None: a Hugging Face folder)


def sample(args: SampleArgs, comm: MPI.Comm | None = None,
           out: Callable[[str], None] = print) -> list[list[int]]:
    """Generate from `args.checkpoint` on the ranks of `comm`; the new tokens of each
    prompt (alike on every rank), the text written by `out` on rank 0."""
    from pipeflow.engine import Engine

    comm = comm if comm is not None else MPI.COMM_WORLD
    source = _source(args, comm)
    if not (args.tokenizer or source.tokenizer):
        raise ConfigError(f"{args.checkpoint!r}: no tokenizer found (no meta.json beside the "
                          f"run's [data] train, no tokenizer.json); pass --tokenizer byte, "
                          f"tiktoken:NAME or hf:FILE")
    try:
        tokenizer = load_tokenizer(args.tokenizer or source.tokenizer)
    except ValueError as exc:
        if args.tokenizer:
            raise ConfigError(f"--tokenizer: {exc}") from None
        raise ConfigError(f"{exc} (the tokenizer {args.checkpoint!r} records: the run's "
                          f"meta.json or its Hub folder); pass --tokenizer SPEC to give it "
                          f"where it is now") from None
    prompts = [tokenizer.encode(p) for p in args.prompts]
    empty = [repr(p) for p, ids in zip(args.prompts, prompts) if not ids]
    if empty:
        raise ConfigError(f"--prompt {empty[0]} is no token with tokenizer "
                          f"{tokenizer.spec!r}; give at least one character")
    config = _grid(args.pipeline, args.tensor, comm.size, source.precision)
    engine = Engine(source.model.layers, source.model.loss_fn,
                    lambda ps: torch.optim.SGD(ps, lr=0.0), config, comm=comm)
    from pipeflow.runtime.generate import VocabularyError
    try:
        for attempt in range(_ATTEMPTS):
            if not _load(engine, source, comm, args):
                break
            if attempt + 1 == _ATTEMPTS:
                raise ConfigError(
                    f"{args.checkpoint!r}: the latest checkpoint was removed while it was read, "
                    f"{_ATTEMPTS} times over (a run writing there keeps only its newest "
                    f"checkpoints); try again, or sample from a copy of a checkpoint folder")
            source = _source(args, comm)          # the run's newer latest
        new = engine.generate(prompts, args.max_new_tokens, args.temperature, args.top_k,
                              args.top_p, args.eos or None, args.seed)
    except VocabularyError as exc:
        raise ConfigError(f"{exc}: the tokenizer {tokenizer.spec!r} gives ids the model in "
                          f"{args.checkpoint!r} does not have; pass --tokenizer with the "
                          f"model's own tokenizer") from None
    finally:
        engine.close()
    if comm.rank == 0:
        for i, (prompt, tokens) in enumerate(zip(prompts, new)):
            out(json.dumps(tokens) if args.ids else tokenizer.decode(prompt + tokens))
            if not args.ids and i + 1 < len(new):
                out("---")
    return new


def _grid(pipeline: int, tensor: int, ranks: int, precision: str) -> Config:
    if tensor < 1 or ranks % tensor:
        raise ConfigError(f"--tensor {tensor}: the launch has {ranks} rank(s), which must be "
                          f"a multiple of the tensor degree; use a divisor of {ranks}")
    groups = ranks // tensor              # the launch's ranks in tensor groups
    p = pipeline or groups
    if p < 1 or groups % p:
        raise ConfigError(f"--pipeline {pipeline}: the launch has {ranks} rank(s), which must "
                          f"be a multiple of the pipeline's stages"
                          f"{f' times --tensor {tensor}' if tensor > 1 else ''}; use a "
                          f"divisor of {groups}")
    return Config(pipeline=p, data=groups // p, tensor=tensor, microbatches=1,
                  precision=precision)


_ATTEMPTS = 4    # reads of a save_dir's latest checkpoint, where a run removes it meanwhile


def _load(engine: Any, source: _Source, comm: MPI.Comm, args: SampleArgs) -> bool:
    """Each rank reads its own layers' tensors; a problem on any rank raised on all. True
    (on every rank) where the checkpoint's folder vanished while it was read (a run writing
    the save_dir removed it): read the new latest then."""
    problem, vanished = None, False
    try:
        engine.load_state_dict(source.read(list(engine.stage.module.indices),
                                           engine.kept_ranges))
    except (ConfigError, OSError, ValueError, KeyError, RuntimeError) as exc:
        problem = f"rank {comm.rank}: {exc}"
        vanished = source.folder is not None and not os.path.isdir(source.folder)
    views = waiting.allgather(comm, (problem, vanished))
    if any(v for _, v in views):
        return True
    problems = [p for p, _ in views if p]
    if problems:
        hint = ""
        if args.config and "another shape" in problems[0]:
            hint = (f"; the model comes from --config {args.config}, which describes another "
                    f"model than the checkpoint's: pass the TOML of the run that wrote it, or "
                    f"leave --config out where the checkpoint records its run")
        raise ConfigError(f"cannot load the weights of {source.folder or args.checkpoint!r} "
                          f"({problems[0]}){hint}")
    return False


def _source(args: SampleArgs, comm: MPI.Comm) -> _Source:
    """The model, weights and tokenizer of `args.checkpoint`: a Hugging Face folder, or the
    checkpoint it names, resolved once on rank 0 (a save_dir's `latest` moves while a run
    writes there: every rank reads the same one), read again where a run removed it first."""
    from pipeflow.train import hub
    path = args.checkpoint
    if os.path.isfile(os.path.join(path, "config.json")) and hub.has_weights(path):
        return _hub_source(path)
    for _ in range(_ATTEMPTS):
        folder, problem = None, None
        if comm.rank == 0:
            try:
                folder = _resolve(path)
            except ConfigError as exc:
                problem = str(exc)
        folder, problem = waiting.bcast(comm, (folder, problem), 0)
        if problem:
            raise ConfigError(problem)
        source, vanished = None, False
        try:
            source = _checkpoint_source(folder, args.config)
        except (ConfigError, OSError) as exc:
            problem, vanished = str(exc), not os.path.isdir(folder)
        views = waiting.allgather(comm, (problem, vanished))
        if not any(v for _, v in views):
            problems = [p for p, _ in views if p]
            if problems:
                raise ConfigError(problems[0])
            return source
    raise ConfigError(f"{path!r}: the latest checkpoint was removed while it was read, "
                      f"{_ATTEMPTS} times over (a run writing there keeps only its newest "
                      f"checkpoints); try again, or sample from a copy of a checkpoint folder")


def _resolve(path: str) -> str:
    from pipeflow.runtime.checkpoint import CheckpointError, resolve_checkpoint
    try:
        return resolve_checkpoint(path)
    except CheckpointError as exc:
        raise ConfigError(f"{exc}; or give a Hugging Face folder (config.json and "
                          f"model.safetensors)") from None


def _hub_source(folder: str) -> _Source:
    """A Hugging Face folder: its config's layers, its weights, its tokenizer.json."""
    from pipeflow.train import hub
    from pipeflow.train.model_table import build_model
    model = build_model({"kind": "hf", "pretrained": folder})
    tok = os.path.join(folder, "tokenizer.json")
    return _Source(model, "fp32", f"hf:{tok}" if os.path.isfile(tok) else "",
                   lambda layers, ranges: hub.read_layers(folder, model.hf_config, layers,
                                                          ranges)[0])


def _checkpoint_source(path: str, run_toml: str) -> _Source:
    """A checkpoint of `pipeflow train`: the run's tables from its data.json (or
    `--config RUN.toml`), its layers' shards, the run's data's tokenizer."""
    from pipeflow.runtime.checkpoint import read_params
    from pipeflow.train.model_table import build_model
    folder = _resolve(path)
    run = _run_of(folder, run_toml)
    model = build_model(run.model, run.source)

    def read(layers: list[int], _ranges: Any) -> dict[str, torch.Tensor]:
        return read_params(folder, layers)[0]
    return _Source(model, run.engine.precision, data_tokenizer(run), read, folder)


def _run_of(folder: str, run_toml: str) -> Any:
    from pipeflow.runtime.checkpoint import read_sealed_json
    from pipeflow.train.run_config import DATA_STATE, load_run_config, run_config_from
    if run_toml:
        return load_run_config(run_toml)
    path = os.path.join(folder, DATA_STATE)
    saved = read_sealed_json(path).get("run") if os.path.isfile(path) else None
    if not isinstance(saved, str):
        raise ConfigError(f"{folder!r} does not record its run's tables (no \"run\" in its "
                          f"{DATA_STATE}: written by the library or an older pipeflow); pass "
                          f"the run's TOML with --config RUN.toml")
    return run_config_from(_toml_loads(saved), os.path.join(folder, DATA_STATE))


def _toml_loads(text: str) -> dict[str, Any]:
    import sys
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads(text)


def data_tokenizer(run: Any) -> str:
    """The tokenizer of the run's data: `meta.json` beside `[data] train`, the pretrained
    folder's tokenizer.json, or bytes for the byte corpus."""
    if run.data.train:
        meta = os.path.join(os.path.dirname(os.path.abspath(run.data.train)), "meta.json")
        if os.path.isfile(meta):
            with open(meta) as f:
                spec = json.load(f).get("tokenizer")
            if isinstance(spec, str):
                return spec
    pretrained = run.model.get("pretrained") if run.model.get("kind") == "hf" else None
    if pretrained and os.path.isfile(os.path.join(pretrained, "tokenizer.json")):
        return f"hf:{os.path.join(pretrained, 'tokenizer.json')}"
    if not run.data.train:
        return "byte"
    return ""
