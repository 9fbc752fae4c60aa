"""Checkpoints as per-layer shards, written atomically, verified on load; resumable onto a
different grid.

    ckpt/
      latest                  "step-00000120", replaced atomically once a save is whole
      step-00000120/
        engine.json           step, layer count, config, grid, sha256 of every file: last
        layer-00000.pt        layer 0's parameters and their optimizer state, by name
        ...
        rng-rank00000.pt      rank 0's random state (torch CPU/CUDA, random, NumPy)
        ...

A save is staged in a hidden folder (`.step-00000120.tmp-*`) and published under its step's
name only once every rank's files are written and verified; a step saved again keeps its old
copy until the new one is whole. A crash or a failure (a full disk on any rank) mid-save
leaves `latest` naming the previous whole checkpoint. Every file is checked
against the sha256 that `engine.json` records before it is read, and read with
`torch.load(weights_only=True)`. Cleanup keeps the `KEEP` most recently written checkpoints
(by a sequence number in `engine.json`, not by step), so a run that restarts from step 0 in a
folder holding higher steps never deletes what it just wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import warnings
from typing import Any, Callable, Sequence

import torch

from pipeflow.comm import waiting
from pipeflow._io import atomic_write_bytes, fsync_dir, make_temp_dir
from pipeflow.logs import get_logger
from pipeflow.runtime.rng import get_rng_state, set_rng_state
from pipeflow.comm.topology import Topology

__all__ = ["CheckpointState", "save_checkpoint", "load_checkpoint", "CheckpointError",
           "ModelMismatch",
           "resolve_checkpoint", "check_save_dir", "sealed_json", "read_sealed_json", "saved_plan",
           "step_name", "read_params"]

_log = get_logger(__name__)

FORMAT = 3        # 2: checksums, grid, sequence, per-rank random state; 3: sealed, model
KEEP = 2          # whole checkpoints kept in a folder; older ones are removed
META = "engine.json"

Tensors = dict[str, torch.Tensor]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


class ModelMismatch(CheckpointError):
    """A checkpoint of another model (layer count, classes, arguments): found alike on every
    rank, from the checkpoint's own record, so every rank may report it as a config error."""


@dataclasses.dataclass
class CheckpointState:
    """What a checkpoint reads and writes of one rank's engine, and nothing else of it.

    `load_params` takes full-precision values by `build_sequential` name for this rank's
    layers and sets both the working weights and the masters.
    """

    topo: Topology
    n_layers: int
    step: int
    config: dict[str, Any]
    layer_indices: Sequence[int]
    master_state_dict: Callable[[], Tensors]
    named_master_parameters: Callable[[], list[tuple[str, torch.nn.Parameter]]]
    load_params: Callable[[Tensors], None]
    optimizer: torch.optim.Optimizer | None = None
    scaler: Any = None            # a precision.LossScaler (a dataclass) under fp16
    device: torch.device | str = "cpu"     # whose CUDA random state is this rank's
    model: list[str] | None = None         # layers.fingerprint: each layer's class and args
    plan: dict[str, Any] | None = None     # what ran: schedule ("auto" resolved), chunks,
                                           # boundaries ("time" resolved), for a resume
    # Sharded optimizer (Config.shard_optimizer): whole optimizer state and group settings by
    # name, gathered over the data group (so every replica calls it, and `master_state_dict`),
    # and the loader that cuts them into this replica's blocks. None: read `optimizer`.
    optimizer_entries: Callable[[], tuple[dict[str, dict], dict[str, dict]]] | None = None
    load_optimizer_entries: Callable[[dict[str, dict], dict[str, dict]], None] | None = None


def _layer_name(index: int) -> str:
    return f"layer-{index:05d}.pt"


def _rng_name(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def _split_name(name: str) -> tuple[int, str]:
    head, _, rest = name.partition(".")
    return int(head), rest


# -- save -----------------------------------------------------------------------------------

def save_checkpoint(state: CheckpointState, directory: str | os.PathLike) -> str:
    """Write a checkpoint that either appears whole or not at all; returns its folder.

    Every rank writes its shards and random state into a new temporary folder; rank 0 then
    writes `engine.json` there, verifies that every file is in place, and only then publishes
    the folder under its step's name (a checkpoint of the same step is replaced only now) and
    moves `latest`. A failure on any rank (a full disk, a file size limit, permissions) is
    agreed: the save is abandoned on every rank, which raise `CheckpointError` naming the rank
    and the OS error, and the previous checkpoint is left as it was.
    """
    directory = os.fspath(directory)
    topo = state.topo
    name = step_name(state.step)
    staging = _agreed(topo, lambda: _make_staging(directory, name, topo.describe()))
    folder = os.path.join(directory, staging)
    written: dict[str, tuple[str, int]] = {}
    problem = None
    try:
        # Replicas hold identical copies (sharded: blocks, gathered by every replica): one
        # writes, the same per-layer files either way.
        # Tensor-parallel: whole tensors, gathered over the tensor group, its rank 0 writes.
        layers = _shards(state) if topo.replica == 0 or state.optimizer_entries else {}
        if topo.replica == 0 and topo.tensor_rank == 0:
            for i, shard in layers.items():
                written[_layer_name(i)] = _write(os.path.join(folder, _layer_name(i)), shard)
        rng = _rng_name(topo.rank)
        written[rng] = _write(os.path.join(folder, rng), get_rng_state(state.device))
        fsync_dir(folder)             # the renames of this rank's files, once
    except OSError as exc:
        problem = f"{topo.describe()} could not write {exc.filename or folder!r}: {exc}"
    parts = waiting.gather(topo.world, (written, problem), 0)
    final = _agreed(topo, lambda: _publish(state, directory, folder, name, parts))
    _log.debug("%s: step %d saved to %s (%d files of this rank, %d bytes)", topo.describe(),
               state.step, os.path.join(directory, final), len(written),
               sum(n for _, n in written.values()))
    return os.path.join(directory, final)


def step_name(step: int) -> str:
    """The folder a checkpoint of `step` is published as."""
    return f"step-{step:08d}"


def _agreed(topo: Topology, decide: Callable[[], str]) -> str:
    """`decide()` on rank 0, its answer (or its CheckpointError) on every rank."""
    verdict: tuple[str, str | None] = ("", None)
    if topo.rank == 0:
        try:
            verdict = (decide(), None)
        except CheckpointError as exc:
            verdict = ("", str(exc))
    answer, problem = waiting.bcast(topo.world, verdict, 0)
    if problem:
        raise CheckpointError(problem)
    return answer


def _make_staging(directory: str, name: str, where: str) -> str:
    check_save_dir(directory, where)
    try:
        os.makedirs(directory, exist_ok=True)
        return os.path.basename(make_temp_dir(f".{name}.tmp-", directory))
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot start a checkpoint in {directory!r}: {exc}; "
                              f"free space or choose another save directory") from None


def _publish(state: CheckpointState, directory: str, staging: str, name: str,
             parts: list[tuple[dict[str, tuple[str, int]], str | None]]) -> str:
    """On rank 0: verify the staged checkpoint, give it its step's name, move `latest`."""
    problems = [p for _, p in parts if p]
    final, old = os.path.join(directory, name), None
    try:
        if problems:
            raise OSError(problems[0])
        files = {n: f for written, _ in parts for n, f in written.items()}
        _write_meta(state, directory, staging, {n: digest for n, (digest, _) in files.items()})
        _verify(staging, files)
        if os.path.lexists(final):    # the same step saved again: replaced only now
            old = make_temp_dir(f".{name}.old-", directory)
            os.replace(final, os.path.join(old, name))
        os.replace(staging, final)
        atomic_write_bytes(os.path.join(directory, "latest"), name.encode())
        fsync_dir(os.path.dirname(os.path.abspath(directory)))   # a save folder made now
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        if old is not None and not os.path.exists(final):     # put the replaced copy back
            os.replace(os.path.join(old, name), final)
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        previous = _latest_name(directory)
        kept = (f"the previous checkpoint {previous!r} is untouched" if previous else
                "no earlier checkpoint exists")
        raise CheckpointError(
            f"the checkpoint of step {state.step} was not saved: {exc}; {kept}. Free space "
            f"(or raise the file size limit), or choose another save directory") from None
    _remove_old(directory, final)
    return name


def _verify(folder: str, files: dict[str, tuple[str, int]]) -> None:
    """Every file the ranks wrote is there with the size they wrote (a lost rename or a
    truncation by a full disk fails the save instead of the next load)."""
    for file, (_, size) in files.items():
        path = os.path.join(folder, file)
        found = os.path.getsize(path) if os.path.exists(path) else None
        if found != size:
            raise OSError(f"{path!r} holds {found} bytes after the save, {size} were written")


def _latest_name(directory: str) -> str:
    try:
        with open(os.path.join(directory, "latest"), "rb") as f:
            return f.read().decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def check_save_dir(directory: str | os.PathLike, where: str = "") -> None:
    """Fail at start-up, not at the first save, when `directory` cannot hold checkpoints: a
    file in its place, or a nearest existing folder this process cannot write to."""
    directory = os.fspath(directory)
    prefix = f"{where}: " if where else ""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{prefix}the checkpoint folder {directory!r} is a file, expected "
                              f"a folder for checkpoints; choose another save directory or "
                              f"remove the file")
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"{prefix}cannot create checkpoints in {directory!r}: "
                              f"{existing!r} is not a writable folder; choose another save "
                              f"directory or fix its permissions")


def _shards(state: CheckpointState) -> dict[int, dict[str, Any]]:
    """Per layer: full-precision values (the fp32 masters under mixed precision), their
    optimizer state and their parameter group's settings, by local name."""
    by_layer: dict[int, dict[str, Any]] = {
        i: {"params": {}, "optim": {}, "groups": {}} for i in state.layer_indices}
    for name, tensor in state.master_state_dict().items():
        i, local = _split_name(name)
        by_layer[i]["params"][local] = tensor.detach().to("cpu")
    opt = state.optimizer
    if state.optimizer_entries is not None:
        optim, groups = state.optimizer_entries()
        for name in optim.keys() | groups.keys():
            i, local = _split_name(name)
            if name in optim:
                by_layer[i]["optim"][local] = {k: v.detach().to("cpu") if torch.is_tensor(v)
                                               else v for k, v in optim[name].items()}
            if name in groups:
                by_layer[i]["groups"][local] = groups[name]
    elif opt is not None:
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for name, p in state.named_master_parameters():
            i, local = _split_name(name)
            if p in opt.state:
                by_layer[i]["optim"][local] = {
                    k: v.detach().to("cpu") if torch.is_tensor(v) else v
                    for k, v in opt.state[p].items()}
            if id(p) in group_of:
                by_layer[i]["groups"][local] = {
                    k: v for k, v in group_of[id(p)].items() if k != "params"}
    return by_layer


def _write(path: str, obj: Any) -> tuple[str, int]:
    """Write `obj` to `path` atomically; its sha256 and size."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    atomic_write_bytes(path, data, sync_dir=False)
    return hashlib.sha256(data).hexdigest(), len(data)


def _write_meta(state: CheckpointState, directory: str, folder: str,
                checksums: dict[str, str]) -> None:
    topo = state.topo
    scaler = state.scaler
    meta = {"format": FORMAT, "step": state.step, "n_layers": state.n_layers,
            "sequence": 1 + max([-1, *(_written(os.path.join(directory, d))[0]
                                       for d in _step_folders(directory))]),
            "grid": _grid_of(topo),
            "config": state.config,
            "loss_scaler": dataclasses.asdict(scaler) if scaler is not None else None,
            "model": state.model, "plan": state.plan,
            "checksums": dict(sorted(checksums.items()))}
    atomic_write_bytes(os.path.join(folder, META), sealed_json(meta))


def _step_folders(directory: str) -> list[str]:
    return [d for d in os.listdir(directory)
            if d.startswith("step-") and os.path.isdir(os.path.join(directory, d))]


def _written(folder: str) -> tuple[int, int]:
    """(sequence, mtime) of a checkpoint, for "most recently written"; (-2, 0) when it has no
    readable `engine.json` (an interrupted save), -1 for a checkpoint of format 1."""
    path = os.path.join(folder, META)
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
        return int(meta.get("sequence", -1)), os.stat(path).st_mtime_ns
    except (OSError, ValueError, TypeError, AttributeError):
        return -2, 0


def _remove_old(directory: str, new: str) -> None:
    """Keep the KEEP most recently written whole checkpoints, always the new one (`latest`
    names it); remove the rest, and what interrupted saves left behind."""
    folders = _step_folders(directory)
    whole = [d for d in folders if _written(os.path.join(directory, d))[0] > -2]
    recent = sorted(whole, key=lambda d: _written(os.path.join(directory, d)), reverse=True)
    keep = {os.path.basename(new), *recent[:KEEP]}
    for stale in folders:
        if stale not in keep:
            shutil.rmtree(os.path.join(directory, stale), ignore_errors=True)
    for left in os.listdir(directory):      # staging folders of saves that never finished
        if left.startswith(".step-") and (".tmp-" in left or ".old-" in left):
            _remove_leftover(directory, left)


def _remove_leftover(directory: str, left: str) -> None:
    """A staging folder of a save that never finished, or the replaced copy of a step saved
    again: removed, but for a replaced copy whose successor never got its name (the one
    `resolve_checkpoint` then falls back to)."""
    step = left[1:].split(".", 1)[0]
    if ".old-" in left and _written(os.path.join(directory, step))[0] == -2:
        return
    shutil.rmtree(os.path.join(directory, left), ignore_errors=True)


def _replaced_copy(directory: str, name: str) -> str | None:
    """Where a save of step `name` again, stopped between its two renames, left the previous
    copy (`.name.old-*/name`), if it is whole."""
    for left in sorted(os.listdir(directory)):
        if left.startswith(f".{name}.old-"):
            folder = os.path.join(directory, left, name)
            if os.path.exists(os.path.join(folder, META)):
                return folder
    return None


# -- load -----------------------------------------------------------------------------------

def resolve_checkpoint(directory: str | os.PathLike) -> str:
    """The whole checkpoint a folder names: itself, or the one its `latest` file names."""
    directory = os.fspath(directory)
    if os.path.exists(os.path.join(directory, META)):
        return directory
    latest = os.path.join(directory, "latest")
    if not os.path.exists(latest):
        found = "" if os.path.isdir(directory) else " (the folder does not exist)"
        raise CheckpointError(
            f"no checkpoint in {directory!r}{found}: expected a 'latest' file or an "
            f"'{META}' (written by Engine.save); give the folder a save wrote to")
    try:
        with open(latest, "rb") as f:
            name = f.read().decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {latest!r} ({e}): load a checkpoint by its folder "
                              f"({_whole_list(directory)})") from None
    folder = os.path.join(directory, name)
    if name and not os.path.exists(os.path.join(folder, META)):
        folder = _replaced_copy(directory, name) or folder
    if not name or not os.path.exists(os.path.join(folder, META)):
        raise CheckpointError(
            f"checkpoint {folder!r} named by {latest!r} is incomplete or missing (no {META}); "
            f"load a whole one by its folder ({_whole_list(directory)})")
    return folder


def _whole_list(directory: str) -> str:
    try:
        whole = sorted(d for d in _step_folders(directory)
                       if _written(os.path.join(directory, d))[0] > -2)
    except OSError:
        whole = []
    return f"whole checkpoints here: {whole}" if whole else "none is whole here"


def load_checkpoint(state: CheckpointState, directory: str | os.PathLike) -> int:
    """Restore this rank's layers, optimizer state, loss scale and (on the grid that wrote
    it) random state from the checkpoint `directory` names; returns its step."""
    folder = resolve_checkpoint(directory)
    where = state.topo.describe()
    meta = _read_meta(folder, where)
    if meta.get("n_layers") != state.n_layers:
        raise ModelMismatch(
            f"{where}: checkpoint {folder!r} holds {meta.get('n_layers')} layers, the model has "
            f"{state.n_layers}; load it into the same layer list")
    _check_model(meta.get("model"), state.model, folder, where)
    checksums = meta.get("checksums")        # None in a checkpoint of format 1
    params: Tensors = {}
    optim: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for i in state.layer_indices:
        shard = _read(folder, _layer_name(i), checksums, where)
        if not (isinstance(shard, dict) and {"params", "optim", "groups"} <= set(shard)):
            raise CheckpointError(f"{where}: {os.path.join(folder, _layer_name(i))!r} is not a "
                                  f"layer shard written by Engine.save")
        params.update({f"{i}.{k}": v for k, v in shard["params"].items()})
        optim.update({f"{i}.{k}": v for k, v in shard["optim"].items()})
        groups.update({f"{i}.{k}": v for k, v in shard["groups"].items()})
    state.load_params(params)
    if state.scaler is not None and meta.get("loss_scaler"):
        for k, v in meta["loss_scaler"].items():
            setattr(state.scaler, k, v)
    if state.load_optimizer_entries is not None:
        state.load_optimizer_entries(optim, groups)
    elif state.optimizer is not None:
        _load_optimizer(state, optim, groups)
    _restore_rng(state, folder, meta, checksums)
    _log.debug("%s: step %s loaded from %s (layers %s)", where, meta["step"], folder,
               list(state.layer_indices))
    return int(meta["step"])


def read_params(directory: str | os.PathLike,
                layers: Sequence[int] | None = None) -> tuple[Tensors, str]:
    """The whole model's full-precision values (keys as in `build_sequential`) from the
    checkpoint `directory` names, every shard checked against its checksum, in one process
    (`pipeflow export`), or only those of `layers` (`pipeflow sample`: a rank's own); and
    the checkpoint's folder."""
    folder = resolve_checkpoint(directory)
    meta = _read_meta(folder, "")
    checksums = meta.get("checksums")
    params: Tensors = {}
    for i in range(int(meta["n_layers"])) if layers is None else layers:
        shard = _read(folder, _layer_name(i), checksums, "pipeflow export")
        if not (isinstance(shard, dict) and "params" in shard):
            raise CheckpointError(f"{os.path.join(folder, _layer_name(i))!r} is not a layer "
                                  f"shard written by Engine.save")
        params.update({f"{i}.{k}": v for k, v in shard["params"].items()})
    return params, folder


def sealed_json(record: dict[str, Any]) -> bytes:
    """`record` as JSON with a sha256 of its own content (key "sha256"), so that a changed
    byte (a step 4 edited to 5) is found on reading, not trusted."""
    body = json.dumps(record, indent=2, sort_keys=True)
    digest = hashlib.sha256(body.encode()).hexdigest()
    return json.dumps({**record, "sha256": digest}, indent=2, sort_keys=True).encode()


def read_sealed_json(path: str) -> Any:
    """A record written by `sealed_json`; ValueError when it was changed (a record without a
    seal, from an older pipeflow, or JSON that is no record at all, is returned as it is)."""
    with open(path, "rb") as f:
        record = json.loads(f.read())
    if isinstance(record, dict) and "sha256" in record:
        digest = record.pop("sha256")
        body = json.dumps(record, indent=2, sort_keys=True)
        if hashlib.sha256(body.encode()).hexdigest() != digest:
            raise ValueError("its content does not match its sha256: it was changed after "
                             "the save")
    return record


def saved_plan(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The schedule, chunks per rank and stage boundaries the latest checkpoint in
    `directory` ran with (None for a checkpoint that does not record them)."""
    folder = resolve_checkpoint(directory)
    plan = _read_meta(folder, "").get("plan")
    return plan if isinstance(plan, dict) else None


def _check_model(saved: list[str] | None, model: list[str] | None, folder: str,
                 where: str) -> None:
    """The checkpoint's layers are this model's: same classes, same constructor arguments
    (a checkpoint of format 2 records none: not checked)."""
    if not saved or not model:
        return
    for i, (a, b) in enumerate(zip(saved, model)):
        if a != b:
            raise ModelMismatch(
                f"{where}: checkpoint {folder!r} is of another model: its layer {i} is {a}, "
                f"this model's is {b}; load it into the layer list that wrote it (or load "
                f"only its weights with load_state_dict, where the shapes fit)")


def _read_meta(folder: str, where: str) -> dict[str, Any]:
    path = os.path.join(folder, META)
    try:
        meta = read_sealed_json(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{where}: cannot read {path!r} ({type(e).__name__}: {e}): the file is truncated or "
            f"corrupt, or was edited; load an earlier checkpoint by its folder") from None
    if not isinstance(meta, dict) or not {"step", "n_layers"} <= set(meta):
        raise CheckpointError(f"{where}: {path!r} lacks 'step' and 'n_layers': not written by "
                              f"Engine.save, or damaged; load an earlier checkpoint")
    if int(meta.get("format", 1)) > FORMAT:
        raise CheckpointError(f"{path!r} has format {meta['format']}, this pipeflow reads up "
                              f"to {FORMAT}: upgrade pipeflow")
    return meta


def _read(folder: str, name: str, checksums: dict[str, str] | None, where: str) -> Any:
    """One file of the checkpoint, checked against its recorded sha256, then unpickled with
    `weights_only=True` (tensors and plain values only: no code runs)."""
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read {path!r} ({e.strerror or e}): the "
                              f"checkpoint is incomplete; load an earlier one") from None
    if checksums is not None:
        expected = checksums.get(name)
        found = hashlib.sha256(data).hexdigest()
        if expected is None:
            raise CheckpointError(f"{where}: {path!r} is not listed in {META}'s checksums: "
                                  f"the checkpoint was written on another grid or damaged")
        if found != expected:
            raise CheckpointError(
                f"{where}: {path!r} fails its checksum: sha256 {found[:16]}... of {len(data)} "
                f"bytes, {META} recorded {expected[:16]}...; the file was changed or "
                f"truncated after the save: restore it, or load an earlier checkpoint")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:   # noqa: BLE001 - unpickling fails in many ways; name the file
        lines = str(e).splitlines() or [""]
        detail = next((line for line in lines if "GLOBAL" in line), lines[0]).strip()
        raise CheckpointError(f"{where}: cannot read {path!r} ({type(e).__name__}: {detail}); "
                              f"the file is truncated or corrupt, or holds more than tensors "
                              f"and plain values: load an earlier checkpoint") from None


def _load_optimizer(state: CheckpointState, optim: dict[str, dict[str, Any]],
                    groups: dict[str, dict[str, Any]]) -> None:
    load_optimizer_by_name(state.optimizer, state.named_master_parameters(), optim, groups)


def load_optimizer_by_name(opt: torch.optim.Optimizer,
                           named: list[tuple[str, torch.nn.Parameter]],
                           optim: dict[str, dict[str, Any]],
                           groups: dict[str, dict[str, Any]]) -> None:
    """Optimizer state and group settings by parameter name, so a checkpoint of any grid
    (other partitions, other groupings of parameters into ranks) lands on the right ones."""
    name_of = {id(p): n for n, p in named}
    saved = opt.state_dict()
    new_state: dict[int, Any] = {}
    index = 0
    for group, saved_group in zip(opt.param_groups, saved["param_groups"]):
        for p in group["params"]:
            name = name_of.get(id(p))
            if name in optim:
                new_state[index] = optim[name]
            if name in groups:
                saved_group.update(groups[name])
            index += 1
    saved["state"] = new_state
    opt.load_state_dict(saved)


def _grid_of(topo: Topology) -> dict[str, int]:
    """The grid as a checkpoint records it (`tensor` only where it is > 1, as before it was)."""
    grid = {"pipeline": topo.pipeline, "data": topo.data}
    if topo.tensor > 1:
        grid["tensor"] = topo.tensor
    return grid


def _restore_rng(state: CheckpointState, folder: str, meta: dict[str, Any],
                 checksums: dict[str, str] | None) -> None:
    """This rank's random state, when the checkpoint was written on the same grid (so rank
    r held the same stage and replica); otherwise a warning on rank 0."""
    topo = state.topo
    here = _grid_of(topo)
    name = _rng_name(topo.rank)
    if meta.get("grid") != here or checksums is None or name not in checksums:
        if topo.rank == 0:
            warnings.warn(
                f"checkpoint {folder!r} was written on grid {meta.get('grid')}, this run is "
                f"{here}: the random state is not restored, so dropout draws other masks than "
                f"an uninterrupted run would", RuntimeWarning, stacklevel=3)
        return
    skipped = set_rng_state(_read(folder, name, checksums, topo.describe()), state.device)
    if skipped:
        warnings.warn(f"{topo.describe()}: not restored from {folder!r}: {', '.join(skipped)}",
                      RuntimeWarning, stacklevel=3)
