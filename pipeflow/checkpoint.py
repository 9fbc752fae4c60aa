"""Checkpoints as per-layer shards, written atomically; resumable onto a different grid.

    ckpt/
      latest                  "step-00000120", replaced atomically once a save is whole
      step-00000120/
        engine.json           step, layer count, config: written last
        layer-00000.pt        layer 0's parameters and their optimizer state, by name
        ...

A crash mid-save leaves `latest` naming the previous whole checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch

from pipeflow._io import atomic_write, atomic_write_bytes

if TYPE_CHECKING:
    from pipeflow.engine import Engine

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "resolve_checkpoint"]

FORMAT = 1
KEEP = 2          # whole checkpoints kept in a folder; older ones are removed


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the model."""


def _layer_file(folder: str, index: int) -> str:
    return os.path.join(folder, f"layer-{index:05d}.pt")


def _split_name(name: str) -> tuple[int, str]:
    head, _, rest = name.partition(".")
    return int(head), rest


def save_checkpoint(engine: "Engine", directory: str | os.PathLike) -> str:
    directory = os.fspath(directory)
    topo = engine.topo
    folder = os.path.join(directory, f"step-{engine.step_count:08d}")
    if topo.replica == 0:        # replicas hold identical copies: one writes
        by_layer: dict[int, dict[str, Any]] = {
            i: {"params": {}, "optim": {}, "groups": {}} for i in engine.module.indices}
        # Full-precision values: the fp32 masters under mixed precision.
        for name, tensor in engine.master_state_dict().items():
            i, local = _split_name(name)
            by_layer[i]["params"][local] = tensor.detach().to("cpu")
        opt = engine.optimizer
        if opt is not None:
            group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
            for name, p in engine.named_master_parameters():
                i, local = _split_name(name)
                if p in opt.state:
                    by_layer[i]["optim"][local] = {
                        k: v.detach().to("cpu") if torch.is_tensor(v) else v
                        for k, v in opt.state[p].items()}
                if id(p) in group_of:
                    by_layer[i]["groups"][local] = {
                        k: v for k, v in group_of[id(p)].items() if k != "params"}
        for i, shard in by_layer.items():
            atomic_write(_layer_file(folder, i), lambda f, shard=shard: torch.save(shard, f))
    topo.world.Barrier()
    if topo.rank == 0:
        scaler = engine.precision.scaler
        meta = {"format": FORMAT, "step": engine.step_count, "n_layers": engine.n_layers,
                "config": engine.config.to_dict(),
                "loss_scaler": dataclasses.asdict(scaler) if scaler is not None else None}
        atomic_write_bytes(os.path.join(folder, "engine.json"),
                           json.dumps(meta, indent=2).encode())
        atomic_write_bytes(os.path.join(directory, "latest"), os.path.basename(folder).encode())
        old = sorted(d for d in os.listdir(directory)
                     if d.startswith("step-") and os.path.isdir(os.path.join(directory, d)))
        for stale in old[:-KEEP]:
            shutil.rmtree(os.path.join(directory, stale), ignore_errors=True)
    topo.world.Barrier()
    return folder


def resolve_checkpoint(directory: str | os.PathLike) -> str:
    """The whole checkpoint a folder names: itself, or the one its `latest` file names."""
    directory = os.fspath(directory)
    if os.path.exists(os.path.join(directory, "engine.json")):
        return directory
    latest = os.path.join(directory, "latest")
    if not os.path.exists(latest):
        raise CheckpointError(
            f"no checkpoint in {directory!r}: expected a 'latest' file or an 'engine.json' "
            f"(written by Engine.save)")
    with open(latest) as f:
        folder = os.path.join(directory, f.read().strip())
    if not os.path.exists(os.path.join(folder, "engine.json")):
        raise CheckpointError(f"checkpoint {folder!r} named by {latest!r} is incomplete")
    return folder


def load_checkpoint(engine: "Engine", directory: str | os.PathLike) -> None:
    folder = resolve_checkpoint(directory)
    with open(os.path.join(folder, "engine.json")) as f:
        meta = json.load(f)
    where = engine.topo.describe()
    if meta.get("n_layers") != engine.n_layers:
        raise CheckpointError(
            f"{where}: checkpoint {folder!r} holds {meta.get('n_layers')} layers, the model has "
            f"{engine.n_layers}; load it into the same layer list")
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for i in engine.module.indices:
        with open(_layer_file(folder, i), "rb") as f:
            shard = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False)
        params.update({f"{i}.{k}": v for k, v in shard["params"].items()})
        optim.update({f"{i}.{k}": v for k, v in shard["optim"].items()})
        groups.update({f"{i}.{k}": v for k, v in shard["groups"].items()})
    engine.module.load_state_dict(params)       # cast to the working precision
    engine.precision.load_masters({id(p): params[n].to(engine.device) for n, p in
                                   engine.module.named_parameters() if n in params})
    scaler = engine.precision.scaler
    if scaler is not None and meta.get("loss_scaler"):
        for k, v in meta["loss_scaler"].items():
            setattr(scaler, k, v)
    opt = engine.optimizer
    if opt is not None:
        name_of = {id(p): n for n, p in engine.named_master_parameters()}
        state = opt.state_dict()
        new_state: dict[int, Any] = {}
        index = 0
        for group, saved_group in zip(opt.param_groups, state["param_groups"]):
            for p in group["params"]:
                name = name_of.get(id(p))
                if name in optim:
                    new_state[index] = optim[name]
                if name in groups:
                    saved_group.update(groups[name])
                index += 1
        state["state"] = new_state
        opt.load_state_dict(state)
    engine.step_count = int(meta["step"])
