"""Hugging Face Hub folders in and out: `[model] pretrained = "folder"` (each rank reads only
its own layers' tensors from the safetensors files, at `tensor > 1` only the slices it keeps,
converted from the layout `save_pretrained` writes) and `export_hf` / `pipeflow export`
(weights in that layout, in the run's precision, sharded past `max_shard_size`,
`config.json`, and the source folder's tokenizer and other files; `pipeflow.train.export`:
never destroying what it did not write).

A Hub folder, as `save_pretrained` writes it:

    folder/
      config.json
      model.safetensors                       one file, or
      model.safetensors.index.json            {"weight_map": {hf key: shard file}} and
      model-00001-of-00002.safetensors ...    the shards it names
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from pipeflow._io import atomic_write_bytes
from pipeflow.train import export
from pipeflow.train.export import Export

__all__ = ["SINGLE", "INDEX", "DEFAULT_SHARD", "export_dtype", "has_weights", "weight_index",
           "layer_keys", "layer_sources", "read_layers", "read_tensor", "hf_tensors",
           "extra_files", "write_weights", "write_contents", "write_folder"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def has_weights(folder: str) -> bool:
    """Whether `folder` holds safetensors weights (one file or a sharded index)."""
    return any(os.path.isfile(os.path.join(folder, n)) for n in (SINGLE, INDEX))


def weight_index(folder: str) -> dict[str, str]:
    """Every tensor of the folder's weights: HF key -> the safetensors file holding it.

    A ValueError saying what was expected where the folder holds no readable weights."""
    index_path, single = os.path.join(folder, INDEX), os.path.join(folder, SINGLE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path!r} is not a safetensors index ({type(exc).__name__}: "
                             f"{exc}); expected {{\"weight_map\": {{key: file}}}} as "
                             f"save_pretrained writes it") from None
        return {k: os.path.join(folder, v) for k, v in weight_map.items()}
    if os.path.isfile(single):
        with _opened(single) as f:
            return {k: single for k in f.keys()}
    found = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    raise ValueError(f"{folder!r} holds no safetensors weights: expected {SINGLE} or {INDEX} "
                     f"(save_pretrained(..., safe_serialization=True)), found {found[:8]}; "
                     f"convert .bin weights to safetensors first")


@contextlib.contextmanager
def _opened(path: str) -> Iterator[Any]:
    """`safe_open(path)`, its errors (a truncated or damaged file, a shard the index names
    that is missing) as one ValueError naming the file and what to do."""
    from safetensors import SafetensorError, safe_open
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        what = "missing" if isinstance(exc, FileNotFoundError) else \
            "not a readable safetensors file (truncated or damaged?)"
        raise ValueError(f"{path!r} is {what}: {exc}; download or save the folder again "
                         f"(save_pretrained(..., safe_serialization=True))") from None
    with handle as f:
        yield f


@contextlib.contextmanager
def _reading(path: str, key: str) -> Iterator[None]:
    """A tensor's read (whole, its shape, or a slice), its errors as one ValueError naming
    the file and what to do."""
    from safetensors import SafetensorError
    try:
        yield
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path!r}: cannot read tensor {key!r} ({exc}); the file is "
                         f"truncated or damaged, or its index names a tensor it lacks: "
                         f"download or save the folder again") from None


def _tensor(f: Any, path: str, key: str) -> torch.Tensor:
    with _reading(path, key):
        return f.get_tensor(key)


def read_tensor(path: str, key: str) -> torch.Tensor:
    """One tensor of a safetensors file (errors as `read_layers` gives them)."""
    with _opened(path) as f:
        return _tensor(f, path, key)


def layer_keys(memory_keys: Iterable[str], hf_config: Any) -> dict[str, str]:
    """pipeflow key (`build_sequential`'s) -> the transformers model's key its value is (a tied
    head missing from the files reads the embedding)."""
    from pipeflow.models import hf
    try:
        return hf.pipeflow_keys({k: k for k in memory_keys}, hf_config)
    except KeyError as exc:
        raise ValueError(str(exc).strip("'\"")) from None


def _layer_of(key: str) -> int:
    return int(key.partition(".")[0])


def layer_sources(index: Iterable[str], hf_config: Any) -> tuple[dict[str, list[str]], Any]:
    """pipeflow key -> the files' keys its tensor is made of (one, or every expert's for a
    merged tensor), by transformers' conversions of the family (`hf_checkpoint.load_plan`);
    and the plan and model `hf_checkpoint.realize` needs, as a pair."""
    from pipeflow.models import hf_checkpoint
    plan, model = hf_checkpoint.load_plan(index, hf_config)
    names = layer_keys(plan, hf_config)
    return {pf: list(plan[mem].keys) for pf, mem in names.items()}, (plan, model, names)


# (pipeflow key, the file tensor's shape) -> the ranges along one dimension a rank keeps
# (`Engine.kept_ranges`), or None: the whole tensor.
Ranges = Callable[[str, Sequence[int]], "tuple[int, list[tuple[int, int]]] | None"]


def read_layers(folder: str, hf_config: Any, layers: Iterable[int],
                ranges: Ranges | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of `layers` only, from the folder's safetensors files, keyed as
    `build_sequential`; and the files' keys read (each file opened once, only these keys read).

    With `ranges` (`Engine.kept_ranges`: tensor-parallel), each tensor is read only in the
    rows or columns this tensor rank keeps (`safe_open(...).get_slice(key)[...]`), never
    whole and then cut: a rank's share of the folder's bytes is about `1/(p·t)`, plus what
    it keeps whole (norms, a replicated embedding).

    The files may hold the layout `save_pretrained` writes (per-expert tensors, renamed heads):
    they are converted as `from_pretrained` converts them (`hf_checkpoint`)."""
    from pipeflow.models import hf_checkpoint
    index = weight_index(folder)
    _, (plan, model, names) = layer_sources(index, hf_config)
    wanted = set(layers)
    mine = {pf: mem for pf, mem in names.items() if _layer_of(pf) in wanted}
    # A renamed tensor is the file's tensor as it is: read in this rank's ranges. One a
    # conversion makes of several (experts merged into one bank) is read whole and
    # converted; `Engine.load_state_dict` cuts it (its ranges are the merged tensor's, not
    # the files'; reading each expert's rows is the step past this).
    direct = {pf: mem for pf, mem in mine.items() if plan[mem].converter is None}
    wants = {pf: (hf_checkpoint.renamed_key(mem, plan[mem]), ranges)
             for pf, mem in direct.items()}
    converted = sorted({mem for pf, mem in mine.items() if pf not in direct})
    wants.update({key: (key, None) for mem in converted for key in plan[mem].keys})  # file keys
    read = _read_keys(index, wants)
    out = {pf: read.pop(pf) for pf in direct}
    memory: dict[str, torch.Tensor] = {}
    for mem in converted:
        memory.update(hf_checkpoint.realize(mem, plan[mem], read, model))
    out.update({pf: memory[mem] for pf, mem in mine.items() if pf not in direct})
    return out, sorted({key for key, _ in wants.values()})


def _read_keys(index: Mapping[str, str], wants: Mapping[str, tuple[str, Ranges | None]]
               ) -> dict[str, torch.Tensor]:
    """name -> the file tensor `key` of `wants[name] = (key, ranges)`: whole, or only the
    pieces `ranges(name, shape)` names, concatenated. Each file is opened once, and a piece
    two names want alike (a tied embedding and head) is read once."""
    by_file: dict[str, list[str]] = {}
    for name, (key, _) in wants.items():
        by_file.setdefault(index[key], []).append(name)
    read: dict[str, torch.Tensor] = {}
    for path, names in sorted(by_file.items()):
        with _opened(path) as f:
            done: dict[Any, torch.Tensor] = {}
            for name in names:
                key, ranges = wants[name]
                kept = None if ranges is None else ranges(name, _shape(f, path, key))
                at = (key, None if kept is None else (kept[0], tuple(kept[1])))
                if at not in done:
                    done[at] = _tensor(f, path, key) if kept is None else \
                        _pieces(f, path, key, *kept)
                read[name] = done[at]
    return read


def _pieces(f: Any, path: str, key: str, dim: int,
            spans: list[tuple[int, int]]) -> torch.Tensor:
    """The ranges `spans` along `dim` of the file tensor `key`, concatenated: only their
    bytes are read (`get_slice`)."""
    lead = (slice(None),) * dim
    with _reading(path, key):
        view = f.get_slice(key)
        parts = [view[(*lead, slice(start, stop))] for start, stop in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _shape(f: Any, path: str, key: str) -> list[int]:
    with _reading(path, key):
        return list(f.get_slice(key).get_shape())


def hf_tensors(state: Mapping[str, torch.Tensor], hf_config: Any,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A whole model's state (`build_sequential` keys) as the tensors `save_pretrained` writes:
    the checkpoint layout of the family (`hf_checkpoint.to_checkpoint`: Mixtral's experts
    split again, GPT-NeoX's `embed_out`), contiguous, floating tensors in `dtype` (None: as
    they are), each stored once (a tied head is left to `tie_word_embeddings`)."""
    from pipeflow.models import hf, hf_checkpoint
    out = hf.to_hf_state_dict(dict(state), hf_config)
    tied = hf._tied_keys(hf_config)
    if tied is not None:
        out.pop(tied[1], None)
    out = hf_checkpoint.to_checkpoint(out, hf_config)
    return {k: _cast(v.detach(), dtype).to("cpu").contiguous().clone() for k, v in out.items()}


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


DEFAULT_SHARD = "5GB"     # save_pretrained's max_shard_size
_PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export_dtype(name: str, precision: str) -> torch.dtype:
    """The dtype an export writes: `name` ("float32", "bfloat16", "float16"), or where it is
    empty the run's working precision (`precision` "bf16" -> bfloat16: the weights the run
    computed with, as a bf16 folder it started from)."""
    chosen = name or _PRECISION_DTYPE.get(precision, "float32")
    dtype = getattr(torch, chosen, None)
    if chosen not in _PRECISION_DTYPE.values() or dtype is None:
        raise ValueError(f"export dtype must be one of {sorted(_PRECISION_DTYPE.values())}, "
                         f"found {chosen!r}")
    return dtype
# A source folder's files that are weights (written anew, in the run's layout) or the config
# (written from the run's), never copied into an export.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
               ".onnx", ".index.json")


def extra_files(source: str) -> list[str]:
    """The files of the Hub folder `source` an export carries over: every plain file that is
    not weights nor `config.json` (generation_config.json, tokenizer files, chat template,
    README), hidden files left out."""
    if not source or not os.path.isdir(source):
        return []
    return sorted(n for n in os.listdir(source)
                  if os.path.isfile(os.path.join(source, n)) and not n.startswith(".")
                  and n != "config.json" and not n.endswith(_NOT_COPIED))


def write_weights(tensors: Mapping[str, torch.Tensor], folder: str,
                  max_shard_size: int | str = DEFAULT_SHARD) -> list[str]:
    """`model.safetensors`, or shards and their index past `max_shard_size`, as
    `save_pretrained` names them; the file names written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    split = split_torch_state_dict_into_shards(
        dict(tensors), filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size)
    for name, keys in split.filename_to_tensors.items():
        _save_safetensors({k: tensors[k] for k in keys}, os.path.join(folder, name))
    written = sorted(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": {**split.metadata, export.MARK: "1"},
                 "weight_map": dict(split.tensor_to_filename)}
        _write_json(os.path.join(folder, INDEX), index)
        written.append(INDEX)
    return written


def write_contents(folder: str, tensors: Mapping[str, torch.Tensor], hf_config: Any,
                   source: str = "", max_shard_size: int | str = DEFAULT_SHARD) -> list[str]:
    """Everything an export folder holds, written into `folder`: the weights (`write_weights`),
    `config.json` whose `dtype` is the weights', and the source folder's other files
    (`extra_files`). The file names written."""
    written = write_weights(tensors, folder, max_shard_size)
    config = json.loads(hf_config.to_json_string(use_diff=False))
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    if floating:
        config["dtype"] = str(floating[0]).removeprefix("torch.")
    _write_json(os.path.join(folder, "config.json"), config)
    for name in extra_files(source):
        shutil.copy2(os.path.join(source, name), os.path.join(folder, name))
    return sorted([*written, "config.json", *extra_files(source)])


def _write_json(path: str, value: Any) -> None:
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode(),
                       sync_dir=False)


def write_folder(state: Mapping[str, torch.Tensor], hf_config: Any, out: str,
                 overwrite: bool = False, avoid: tuple[str, ...] = (), *, source: str = "",
                 dtype: torch.dtype | None = None,
                 max_shard_size: int | str = DEFAULT_SHARD) -> Export:
    """Write the folder `AutoModelForCausalLM.from_pretrained(out)` and
    `AutoTokenizer.from_pretrained(out)` load (`write_contents`: weights in `dtype`, sharded
    past `max_shard_size`, and the non-weight files of the Hub folder `source`), keeping every
    other file of `out` and refusing a checkpoint folder or weights pipeflow did not write
    (`export.publish`: the folder is swapped in whole, so `out` is the old folder or the new
    one, never half)."""
    tensors = hf_tensors(state, hf_config, dtype)
    return export.publish(out, lambda staging: write_contents(
        staging, tensors, hf_config, source, max_shard_size), overwrite, avoid)


def _save_safetensors(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """`safetensors.torch.save_file`, marked as pipeflow's, fsynced; its I/O errors (a full
    disk) raised as the OSError they are."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    try:
        save_file(dict(tensors), path, metadata={"format": "pt", export.MARK: "1"})
    except SafetensorError as exc:
        found = re.search(r"os error (\d+)", str(exc))
        if found:
            code = int(found.group(1))
            raise OSError(code, os.strerror(code), path) from None
        raise OSError(errno.EIO, str(exc), path) from None
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

