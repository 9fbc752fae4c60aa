"""A training run's TOML file: `[engine]`, `[model]`, `[train]`, `[data]`, checked and merged
with `--set table.key=value` overrides before anything is built."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Mapping, Sequence

import tomli_w

from pipeflow.config import Config, ConfigError, read_toml, refuse_renamed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["TrainConfig", "DataConfig", "RunConfig", "load_run_config", "run_config_from",
           "apply_overrides",
           "check_fields", "TABLES", "DATA_STATE"]

TABLES = ("engine", "model", "train", "data")
DATA_STATE = "data.json"     # beside the engine's shards in each checkpoint folder: the data
                             # position and the run's tables (`pipeflow sample` reads them)


@dataclasses.dataclass
class TrainConfig:
    """The `[train]` table: the loop around the engine."""

    steps: int = 200
    batch_size: int = 16          # global batch in sequences, split into micro-batches
    lr: float = 2e-3              # peak learning rate
    min_lr_ratio: float = 0.1     # linear, cosine and wsd decay end at min_lr_ratio x lr
    warmup: int = 10
    lr_schedule: str = "cosine"   # constant | linear | cosine | inverse-sqrt | wsd (recipe.py)
    decay_fraction: float = 0.2   # wsd: the last fraction of the steps decays
    optimizer: str = "AdamW"      # any torch.optim class by name (SGD, Adam, Adafactor, ...)
    optimizer_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # its arguments
    weight_decay: float = 0.1     # on matrices only (parameters with 2 or more dimensions)
    beta1: float = 0.9
    beta2: float = 0.95
    log_every: int = 10
    eval_every: int = 0           # 0: evaluate once, at the end
    eval_batches: int = 4
    threads: int = 1              # torch threads per rank: one core per rank
    corpus: str = ""              # a byte file to train on; empty: the Python stdlib source
    save_dir: str = ""            # checkpoint folder; empty: no checkpoints
    save_every: int = 0           # 0: only at the end (when save_dir is set)
    resume: bool = False          # continue from the latest checkpoint in save_dir
    metrics: str = ""             # JSONL file, one line a logged step; empty: none
    tensorboard: str = ""         # TensorBoard log folder (needs the `tensorboard` package)
    # Where metrics go, rank 0 only: "jsonl", "tensorboard", "wandb" (pipeflow.train.trackers)
    trackers: list[str] = dataclasses.field(default_factory=list)
    wandb_project: str = "pipeflow"   # the W&B project of "wandb" (WANDB_MODE=offline: local)
    peak_tflops: float = 0.0      # per rank, for MFU; 0: a known GPU's bf16 peak, or measured
    progress: bool = True         # a progress bar on rank 0 when stdout is a terminal (tqdm)
    sample_prompt: str = ""       # at the end, rank 0 prints this prompt's greedy continuation
    sample_tokens: int = 64       # ... of this many tokens
    export_hf: str = ""           # [model] kind "hf": a Hub folder written at the end of the run
    export_overwrite: bool = False  # export_hf may replace weights pipeflow did not write there
    export_dtype: str = ""        # "float32" | "bfloat16" | "float16"; "": the run's precision
    max_shard_size: str = "5GB"   # export_hf: one safetensors file up to this, shards past it


@dataclasses.dataclass
class DataConfig:
    """The `[data]` table: flat token files (nanoGPT's `.bin`), or bytes when `train` is empty."""

    train: str = ""               # token file; empty: the byte corpus of [train] corpus
    val: str = ""                 # token file for the validation loss; empty: none
    dtype: str = "uint16"         # "uint16" (vocabularies up to 65536) or "uint32"
    seq_len: int = 0              # tokens per sample; 0: the model's seq_len
    packed: bool = False          # position_ids restart after each end-of-text token
    eot: int = -1                 # the end-of-text id; -1: meta.json's "eot" (packed only)


# Lower bounds (inclusive) of numeric fields; a tuple adds an upper bound (exclusive).
_BOUNDS: dict[str, dict[str, Any]] = {
    "train": {"steps": 1, "batch_size": 1, "lr": 0.0, "min_lr_ratio": (0.0, 1.0000001),
              "decay_fraction": (0.0, 1.0000001),
              "warmup": 0, "weight_decay": 0.0, "beta1": (0.0, 1.0), "beta2": (0.0, 1.0),
              "log_every": 1, "eval_every": 0, "eval_batches": 1, "threads": 1,
              "save_every": 0, "peak_tflops": 0.0, "sample_tokens": 1},
    "data": {"seq_len": 0, "eot": -1},
}
_STRICT = {("train", "lr")}       # must be > the bound, not >=


# A field's annotation -> (the Python types TOML values may take, the words an error uses).
_TYPE_WORDS = {"int": ((int,), "an integer"), "float": ((int, float), "a number"),
               "str": ((str,), "a string"), "bool": ((bool,), "true or false"),
               "list[str]": ((list,), "a list of strings"),
               "dict[str, Any]": ((dict,), "a table")}


def _example(cls, name: str) -> str:
    default = getattr(cls(), name)
    return tomli_w.dumps({name: default}).strip() if default != "" else f'{name} = "..."'


def check_fields(obj: Any, table: str) -> None:
    """Each field of a `[table]` dataclass has its declared type and lies in its bounds."""
    cls = type(obj)
    for field in dataclasses.fields(cls):
        value = getattr(obj, field.name)
        types, what = _TYPE_WORDS[str(field.type)]
        wrong_type = (not isinstance(value, types)
                      or (isinstance(value, bool) and field.type != "bool")
                      or (field.type == "list[str]" and not all(isinstance(v, str)
                                                                for v in value)))
        bound = _BOUNDS.get(table, {}).get(field.name)
        low, high = bound if isinstance(bound, tuple) else (bound, None)
        out = not wrong_type and low is not None and (
            value < low or (high is not None and value >= high)
            or ((table, field.name) in _STRICT and value == low))
        if wrong_type or out:
            rule = what
            if low is not None:
                rule += (f" > {low}" if (table, field.name) in _STRICT else f" >= {low}")
                rule += f" and < {high:g}" if high is not None else ""
            raise ConfigError(
                f"[{table}] {field.name} must be {rule}, found {value!r} "
                f"({type(value).__name__}); change it in the [{table}] table (for example "
                f"`{_example(cls, field.name)}`) or with --set {table}.{field.name}=...")


@dataclasses.dataclass
class RunConfig:
    """Every table of a run, checked: engine `Config`, the `[model]` table, train, data."""

    engine: Config
    model: dict[str, Any]
    train: TrainConfig
    data: DataConfig
    source: str = ""

    def tables(self) -> dict[str, Any]:
        """Every table as plain values (a tracker's run config, the TOML below)."""
        return {"engine": self.engine.to_dict(), "model": self.model,
                "train": dataclasses.asdict(self.train), "data": dataclasses.asdict(self.data)}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.tables())


def _allowed(annotation: str) -> tuple[tuple[type, ...], str] | None:
    """`"str | list[int]"` → ((str, list), "a string or a list"); None for other types."""
    types: list[type] = []
    words = []
    for part in (p.strip() for p in annotation.split("|")):
        kind = ((list,), "a list") if part.startswith("list") else _TYPE_WORDS.get(part)
        if kind is None:
            return None
        types += kind[0]
        words.append(kind[1])
    return tuple(types), " or ".join(words)


def _check_engine_types(table: Mapping[str, Any]) -> None:
    """`[engine]` values of the wrong TOML type, and renamed keys, named before `Config`
    sees them."""
    try:
        refuse_renamed(table, toml=True)
    except ConfigError as exc:
        raise ConfigError(f"[engine] {exc}") from None
    fields = {f.name: _allowed(str(f.type)) for f in dataclasses.fields(Config)}
    for key, value in table.items():
        if fields.get(key) is None:
            continue          # unknown keys: Config.from_dict names them; odd types: Config
        types, words = fields[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            default = getattr(Config(), key)
            raise ConfigError(
                f"[engine] {key} must be {words}, found {value!r} ({type(value).__name__}); "
                f"change it in the [engine] table (the default is "
                f"`{tomli_w.dumps({key: default}).strip()}`) or with --set engine.{key}=...")


def _dataclass_from(cls, table: Mapping[str, Any], name: str):
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{name}] must be a table, found {table!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{name}]; known keys: {sorted(known)}")
    obj = cls(**table)
    check_fields(obj, name)
    return obj


def _parse_value(text: str) -> Any:
    """A TOML value (`16`, `1e-3`, `"a"`, `[0, 2, 4]`, `true`); a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(doc: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`table.key=value` (dots go deeper: `model.config.n_layer=2`), values parsed as TOML."""
    for item in overrides:
        key, sep, text = item.partition("=")
        path = key.strip().split(".")
        if not sep or len(path) < 2 or not all(path):
            raise ConfigError(f"--set expects table.key=value (e.g. --set train.lr=1e-3), "
                              f"found {item!r}")
        if path[0] not in TABLES:
            raise ConfigError(f"--set {item!r}: unknown table [{path[0]}]; the tables are "
                              f"{list(TABLES)}")
        node = doc
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part} is a value, not a table")
        node[path[-1]] = _parse_value(text.strip())
    return doc


def load_run_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunConfig:
    """The tables of a run's TOML file with `overrides` applied, every value checked."""
    return run_config_from(apply_overrides(read_toml(path), overrides), os.fspath(path))


def run_config_from(doc: Mapping[str, Any], path: str) -> RunConfig:
    """The tables of a run (a parsed TOML document from `path`), every value checked."""
    extra = sorted(set(doc) - set(TABLES))
    if extra:
        raise ConfigError(f"unknown table(s) {extra} in {os.fspath(path)!r}; expected "
                          f"{', '.join(f'[{t}]' for t in TABLES)}")
    engine = doc.get("engine", {})
    if not isinstance(engine, Mapping):
        raise ConfigError(f"[engine] must be a table, found {engine!r}")
    _check_engine_types(engine)
    try:
        config = Config.from_dict(engine)
    except (TypeError, AttributeError) as exc:
        # A value of the wrong type that Config's checks stumble on (e.g. schedule = 3).
        raise ConfigError(f"[engine]: a value has the wrong type ({exc}); see the README's "
                          f"Configuration section for each setting's type") from None
    model = doc.get("model", {})
    if not isinstance(model, Mapping):
        raise ConfigError(f"[model] must be a table, found {model!r}")
    run = RunConfig(config, dict(model), _dataclass_from(TrainConfig, doc.get("train", {}),
                                                         "train"),
                    _dataclass_from(DataConfig, doc.get("data", {}), "data"),
                    source=os.fspath(path))
    _check_together(run)
    return run


def _check_shard_size(size: str) -> None:
    try:
        from huggingface_hub.serialization._base import parse_size_to_int
        parse_size_to_int(size)
    except ImportError:             # pragma: no cover - the hub comes with transformers
        return
    except (ValueError, TypeError):
        raise ConfigError(f"[train] max_shard_size must be a size like \"5GB\" or \"500MB\" "
                          f"(save_pretrained's), found {size!r}") from None


def _check_together(run: RunConfig) -> None:
    from pipeflow.train.recipe import check_recipe
    t, d = run.train, run.data
    check_recipe(t)
    if t.resume and not t.save_dir:
        raise ConfigError("[train] resume = true needs a checkpoint folder: set [train] save_dir "
                          "(or --save-dir DIR), found save_dir empty")
    if d.dtype not in ("uint16", "uint32"):
        raise ConfigError(f"[data] dtype must be \"uint16\" or \"uint32\", found {d.dtype!r}")
    if d.val and not d.train:
        raise ConfigError(f"[data] val = {d.val!r} needs [data] train (a token file) as well")
    if d.eot != -1 and not d.packed:
        raise ConfigError(f"[data] eot = {d.eot} is read only with packed = true; set [data] "
                          f"packed = true, or remove eot")
    if t.export_hf and run.model.get("kind") != "hf":
        raise ConfigError(f"[train] export_hf = {t.export_hf!r} writes a Hugging Face folder, "
                          f"which needs [model] kind = \"hf\", found kind = "
                          f"{run.model.get('kind', 'gpt')!r}; remove export_hf or use an HF "
                          f"model")
    if t.export_dtype not in ("", "float32", "bfloat16", "float16"):
        raise ConfigError(f"[train] export_dtype must be \"float32\", \"bfloat16\", \"float16\" "
                          f"or \"\" (the run's precision), found {t.export_dtype!r}")
    _check_shard_size(t.max_shard_size)
    if d.train and t.corpus:
        raise ConfigError(f"[train] corpus = {t.corpus!r} (bytes) and [data] train = "
                          f"{d.train!r} (tokens) both name training data: keep one")
