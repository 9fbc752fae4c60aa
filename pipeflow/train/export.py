"""Writing an export folder without destroying what pipeflow did not write.

`pipeflow export CKPT --hf OUT` and `[train] export_hf = OUT` write two files of their own,
`config.json` and `model.safetensors` (marked as pipeflow's in the safetensors metadata).
Into an existing folder they add or replace only those: every other file (a README, a
tokenizer) stays, and weights that another writer left (a `model.safetensors` without the
mark, a sharded index, `pytorch_model.bin`) are refused by name unless `overwrite`, since
transformers would load them, or mix them, instead. A checkpoint or save folder (or a folder
holding one, or inside one) is never an export folder.

The new folder is staged beside OUT (`.OUT.export-*`: the new files, and hard links to the
files it keeps) and swapped with OUT in one `renameat2(RENAME_EXCHANGE)`, so a kill at any
point leaves the old OUT or the new one whole. Where the file system cannot exchange, two
renames are used (`.OUT.old-*` holds the old folder between them); the next export restores
it if OUT is missing. Either way the leftovers are named and removed by the next export.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fnmatch
import json
import os
import shutil
import tempfile
from typing import Callable

from pipeflow._io import fsync_dir, make_temp_dir

__all__ = ["ExportError", "Export", "check_target", "publish", "MARK", "OWN"]

SINGLE, CONFIG, INDEX = "model.safetensors", "config.json", "model.safetensors.index.json"
OWN = (CONFIG, SINGLE)
MARK = "pipeflow_export"            # the safetensors metadata key of pipeflow's own files
# Weights transformers may load instead of (or beside) ours.
FOREIGN_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
STAGE, OLD = "export", "old"


class ExportError(ValueError):
    """An export refused or failed; the message names the folder and what to do."""


@dataclasses.dataclass
class Export:
    """What an export did: the folder, the files it kept, those it replaced, the leftovers of
    an interrupted export it restored or removed."""

    path: str
    kept: list[str] = dataclasses.field(default_factory=list)
    replaced: list[str] = dataclasses.field(default_factory=list)
    cleaned: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        parts = []
        if self.kept:
            parts.append(f"kept {self.kept}")
        if self.replaced:
            parts.append(f"replaced {self.replaced}")
        if self.cleaned:
            parts.append(f"removed the leftovers of an interrupted export {self.cleaned}")
        return "; ".join(parts)


def _is_checkpoint(folder: str) -> str:
    """What checkpoint-like thing `folder` is ("" when none)."""
    if os.path.isfile(os.path.join(folder, "engine.json")):
        return "a checkpoint (it holds engine.json)"
    for marker in ("latest", ".pipeflow.lock"):
        if os.path.isfile(os.path.join(folder, marker)):
            return f"a save folder of checkpoints (it holds {marker!r})"
    return ""


def _checkpoint_near(out: str, avoid: tuple[str, ...]) -> str:
    """Why `out` may not be an export folder: it is, holds or sits in a checkpoint or save
    folder, or is, holds or sits in one of `avoid` (the run's own save_dir)."""
    for other in avoid:
        other = os.path.abspath(other)
        if out == other or out.startswith(other + os.sep) or other.startswith(out + os.sep):
            return f"the run's save_dir {other!r}, inside it, or a folder holding it"
    if os.path.isdir(out):
        what = _is_checkpoint(out)
        if what:
            return what
        for entry in sorted(os.listdir(out)):
            inner = os.path.join(out, entry)
            if os.path.isdir(inner) and _is_checkpoint(inner):
                return f"a folder holding checkpoints (its {entry!r} is {_is_checkpoint(inner)})"
    parent = os.path.dirname(out)
    while parent != os.path.dirname(parent):
        if _is_checkpoint(parent):
            return f"inside {parent!r}, {_is_checkpoint(parent)}"
        parent = os.path.dirname(parent)
    return ""


def _ours(out: str, entries: list[str]) -> bool:
    """Whether the weights in `out` are a pipeflow export's: a marked model.safetensors, or a
    shard index whose metadata carries the mark (a sharded export)."""
    try:
        if INDEX in entries:
            with open(os.path.join(out, INDEX)) as f:
                return MARK in (json.load(f).get("metadata") or {})
        if SINGLE in entries:
            from safetensors import safe_open
            with safe_open(os.path.join(out, SINGLE), framework="pt") as f:
                return MARK in (f.metadata() or {})
    except Exception:            # unreadable: not known to be ours (safetensors' own error)
        return False
    return False


def _weights(entry: str) -> bool:
    """An entry an export replaces whoever wrote it: the config and any weights file."""
    return entry in OWN or any(fnmatch.fnmatch(entry, p) for p in FOREIGN_WEIGHTS)


def _foreign(out: str) -> list[str]:
    """The entries of `out` an export would replace or contradict and did not write."""
    if not os.path.isdir(out):
        return []
    entries = sorted(os.listdir(out))
    if _ours(out, entries):
        return []
    return [e for e in entries if _weights(e)]


def check_target(out: str, overwrite: bool = False, avoid: tuple[str, ...] = (),
                 where: str = "export folder") -> None:
    """Refuse `out` (ExportError) before anything is written: a file, a checkpoint or save
    folder (or near one), or a folder holding weights pipeflow did not write (unless
    `overwrite`)."""
    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{where} {out!r} is a file; expected a folder (or nothing) there: "
                          f"choose another path or remove the file")
    near = _checkpoint_near(out, avoid)
    if near:
        raise ExportError(f"{where} {out!r} is {near}: an export there would mix with the "
                          f"checkpoints (and a replaced folder would delete them); export to "
                          f"a folder of its own (e.g. {out.rstrip(os.sep) + '-hf'!r})")
    foreign = _foreign(out)
    if foreign and not overwrite:
        raise ExportError(f"{where} {out!r} holds {foreign}, which pipeflow did not write and "
                          f"the export would replace (transformers would load them instead "
                          f"of, or mixed with, the export); other files stay as they are. Pass "
                          f"--overwrite (export_overwrite = true) to replace them, or choose "
                          f"another folder")


def _leftovers(out: str) -> list[str]:
    parent, name = os.path.dirname(out), os.path.basename(out)
    prefixes = tuple(f".{name}.{kind}-" for kind in (STAGE, OLD, "tmp"))
    try:
        return sorted(e for e in os.listdir(parent) if e.startswith(prefixes))
    except OSError:
        return []


def _clean(out: str) -> list[str]:
    """Remove what an interrupted export left beside `out`; restore the old folder first
    where the two-rename swap stopped between its renames. Returns what it handled."""
    parent = os.path.dirname(out)
    handled = []
    for left in _leftovers(out):
        path = os.path.join(parent, left)
        if f".{OLD}-" in left and not os.path.lexists(out):
            inner = os.path.join(path, "x")          # earlier pipeflow kept it one deeper, in x/
            os.rename(inner if os.listdir(path) == ["x"] else path, out)
            shutil.rmtree(path, ignore_errors=True)
            handled.append(f"{left} (restored as {os.path.basename(out)})")
            continue
        shutil.rmtree(path, ignore_errors=True)
        handled.append(left)
    return handled


def _keep(src: str, dst: str) -> None:
    """`src` (a file, link or folder of the old export folder) at `dst` in the new one: files
    as hard links (no copy, no second disk's worth), copies where a link fails."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        os.makedirs(dst)
        for entry in os.listdir(src):
            _keep(os.path.join(src, entry), os.path.join(dst, entry))
    else:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap the folders `a` and `b` in one step (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def _swap(staging: str, out: str) -> None:
    """Put the whole staged folder at `out`; the old one, if any, is removed after."""
    if not os.path.lexists(out):
        os.rename(staging, out)
        return
    if _exchange(staging, out):
        old = staging                      # the old folder now sits at the staging name
    else:
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.{OLD}-",
                               dir=os.path.dirname(out))
        os.rmdir(old)
        os.rename(out, old)                # a kill here: the next export restores `old`
        os.rename(staging, out)
    fsync_dir(os.path.dirname(out))
    shutil.rmtree(old, ignore_errors=True)


def _problem(exc: OSError, out: str) -> str:
    """One line for an OSError of the export: what happened, and what to do."""
    parent = os.path.dirname(out)
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return (f"cannot write the export folder {out!r}: the disk is full ({reason}); "
                f"{out!r} is as it was. Free space on that disk (the export needs about the "
                f"model's size again beside the folder) or export elsewhere")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"cannot write the export folder {out!r}: {reason} (the export is staged "
                f"in {parent!r} and swapped in, so that folder must be writable); {out!r} is "
                f"as it was. Choose a folder you can write, or fix its permissions")
    return (f"cannot write the export folder {out!r}: {reason} ({exc.filename or parent}); "
            f"{out!r} is as it was. Choose another folder")


def publish(out: str, write: Callable[[str], None], overwrite: bool = False,
            avoid: tuple[str, ...] = ()) -> Export:
    """`write(staging)` writes pipeflow's own files into a fresh staging folder; the files of
    `out` that are not replaced are kept (linked in), and the staged folder swapped in whole.
    ExportError, naming the folder and what to do, on a refusal or a failed write."""
    out = os.path.abspath(os.fspath(out))
    check_target(out, overwrite, avoid)
    parent = os.path.dirname(out)
    result = Export(out)
    staging = None
    try:
        os.makedirs(parent, exist_ok=True)
        result.cleaned = _clean(out)
        check_target(out, overwrite, avoid)        # a restored folder is checked too
        staging = make_temp_dir(f".{os.path.basename(out)}.{STAGE}-", parent)
        write(staging)
        if os.path.isdir(out):
            for entry in sorted(os.listdir(out)):
                # Weights and config (ours, or foreign with overwrite) and whatever the new
                # export wrote itself (a source folder's tokenizer) are replaced.
                if _weights(entry) or os.path.lexists(os.path.join(staging, entry)):
                    result.replaced.append(entry)
                    continue
                result.kept.append(entry)
                _keep(os.path.join(out, entry), os.path.join(staging, entry))
        _swap(staging, out)
        staging = None
    except OSError as exc:
        raise ExportError(_problem(exc, out)) from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return result
