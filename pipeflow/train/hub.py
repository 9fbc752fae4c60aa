"""Hugging Face Hub folders in and out: `[model] pretrained = "folder"` (each rank reads only
its own layers' tensors from the safetensors files) and `export_hf` / `pipeflow export`
(`config.json` + `model.safetensors`, written atomically).

A Hub folder, as `save_pretrained` writes it:

    folder/
      config.json
      model.safetensors                       one file, or
      model.safetensors.index.json            {"weight_map": {hf key: shard file}} and
      model-00001-of-00002.safetensors ...    the shards it names
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Iterable, Mapping

import torch

__all__ = ["SINGLE", "INDEX", "has_weights", "weight_index", "layer_keys", "read_layers",
           "hf_tensors", "write_folder"]

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
        from safetensors import safe_open
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    found = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    raise ValueError(f"{folder!r} holds no safetensors weights: expected {SINGLE} or {INDEX} "
                     f"(save_pretrained(..., safe_serialization=True)), found {found[:8]}; "
                     f"convert .bin weights to safetensors first")


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
    from safetensors import safe_open
    index = weight_index(folder)
    wanted = set(layers)
    mine = {pf: src for pf, src in layer_keys(index, hf_config).items()
            if _layer_of(pf) in wanted}
    by_file: dict[str, list[str]] = {}
    for src in sorted(set(mine.values())):
        by_file.setdefault(index[src], []).append(src)
    read: dict[str, torch.Tensor] = {}
    for path, keys in sorted(by_file.items()):
        with safe_open(path, framework="pt") as f:
            for key in keys:
                read[key] = f.get_tensor(key)
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


def write_folder(state: Mapping[str, torch.Tensor], hf_config: Any, out: str) -> str:
    """Write `out/config.json` and `out/model.safetensors` that
    `AutoModelForCausalLM.from_pretrained(out)` loads. Staged in a hidden folder beside `out`
    and renamed into place, so `out` is whole or absent (an older export is replaced only once
    the new one is written)."""
    from safetensors.torch import save_file
    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"export folder {out!r} is a file; expected a folder (or nothing) "
                         f"there: choose another path or remove the file")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        tensors = hf_tensors(state, hf_config)
        save_file(tensors, os.path.join(staging, SINGLE), metadata={"format": "pt"})
        config = json.loads(hf_config.to_json_string(use_diff=False))
        config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        old = None
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
            os.rename(out, os.path.join(old, "x"))
        os.rename(staging, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
