"""Hugging Face Hub folders in and out: `[model] pretrained = "folder"` (each rank reads only
its own layers' tensors from the safetensors files) and `export_hf` / `pipeflow export`
(`config.json` + `model.safetensors`, `pipeflow.train.export`: never destroying what it
did not write).

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
from typing import Any, Iterable, Iterator, Mapping

import torch

from pipeflow._io import atomic_write_bytes
from pipeflow.train import export
from pipeflow.train.export import Export

__all__ = ["SINGLE", "INDEX", "has_weights", "weight_index", "layer_keys", "read_layers",
           "read_tensor", "hf_tensors", "write_folder"]

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


def _tensor(f: Any, path: str, key: str) -> torch.Tensor:
    from safetensors import SafetensorError
    try:
        return f.get_tensor(key)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path!r}: cannot read tensor {key!r} ({exc}); the file is "
                         f"truncated or damaged, or its index names a tensor it lacks: "
                         f"download or save the folder again") from None


def read_tensor(path: str, key: str) -> torch.Tensor:
    """One tensor of a safetensors file (errors as `read_layers` gives them)."""
    with _opened(path) as f:
        return _tensor(f, path, key)


def layer_keys(hf_keys: Iterable[str], hf_config: Any) -> dict[str, str]:
    """pipeflow key (`build_sequential`'s) -> the HF key its value is read from, by
    `from_hf_state_dict`'s own map (a tied head missing from the files reads the embedding)."""
    from pipeflow.models import hf
    try:
        return hf.from_hf_state_dict({k: k for k in hf_keys}, hf_config)
    except KeyError as exc:
        raise ValueError(str(exc).strip("'\"")) from None


def _layer_of(key: str) -> int:
    return int(key.partition(".")[0])


def read_layers(folder: str, hf_config: Any, layers: Iterable[int]) -> tuple[
        dict[str, torch.Tensor], list[str]]:
    """The tensors of `layers` only, from the folder's safetensors files, keyed as
    `build_sequential`; and the HF keys read (each file opened once, only these keys read)."""
    index = weight_index(folder)
    wanted = set(layers)
    mine = {pf: src for pf, src in layer_keys(index, hf_config).items()
            if _layer_of(pf) in wanted}
    by_file: dict[str, list[str]] = {}
    for src in sorted(set(mine.values())):
        by_file.setdefault(index[src], []).append(src)
    read: dict[str, torch.Tensor] = {}
    for path, keys in sorted(by_file.items()):
        with _opened(path) as f:
            for key in keys:
                read[key] = _tensor(f, path, key)
    return {pf: read[src] for pf, src in mine.items()}, sorted(read)


def hf_tensors(state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """A whole model's state (`build_sequential` keys) as the tensors of a `model.safetensors`:
    HF keys, contiguous, each stored once (a tied head is left to `tie_word_embeddings`, as
    `save_pretrained` does)."""
    from pipeflow.models import hf
    out = hf.to_hf_state_dict(dict(state), hf_config)
    tied = hf._tied_keys(hf_config)
    if tied is not None:
        out.pop(tied[1], None)
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def write_folder(state: Mapping[str, torch.Tensor], hf_config: Any, out: str,
                 overwrite: bool = False, avoid: tuple[str, ...] = ()) -> Export:
    """Write `out/config.json` and `out/model.safetensors` that
    `AutoModelForCausalLM.from_pretrained(out)` loads, keeping every other file of `out`
    and refusing a checkpoint folder or weights pipeflow did not write (`export.publish`:
    the folder is swapped in whole, so `out` is the old folder or the new one, never half)."""
    tensors = hf_tensors(state, hf_config)
    config = json.loads(hf_config.to_json_string(use_diff=False))
    config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")

    def write(staging: str) -> None:
        _save_safetensors(tensors, os.path.join(staging, SINGLE))
        atomic_write_bytes(os.path.join(staging, "config.json"),
                           (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
                           sync_dir=False)

    return export.publish(out, write, overwrite, avoid)


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
