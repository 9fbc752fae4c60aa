"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Files and folders made here get the modes `open` and `os.makedirs` would give them (0666 and
0777 less the umask): `tempfile` makes its files 0600 and its folders 0700, which kept token
files and checkpoints from the job's other users and a team's readers.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

__all__ = ["atomic_write_bytes", "atomic_write", "fsync_dir", "umask", "make_temp_dir"]


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None],
                 sync_dir: bool = True) -> None:
    """Call `write(file)` on a temporary file beside `path`, then rename it over `path`.

    The file is fsynced before the rename and its folder after it, so once this returns the
    new file is on disk under its name. With `sync_dir=False` the caller fsyncs the folder
    (once for many files).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask())     # as open() would: mkstemp's is 0600
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if sync_dir:
            fsync_dir(directory)  # the rename itself survives a power loss
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def umask() -> int:
    """The process's umask (read without changing it where /proc says it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_temp_dir(prefix: str, directory: str | os.PathLike) -> str:
    """`tempfile.mkdtemp(prefix=, dir=)` with the mode `os.makedirs` gives (0777 less the
    umask), not 0700: the folder is renamed into place and kept."""
    path = tempfile.mkdtemp(prefix=prefix, dir=directory)
    os.chmod(path, 0o777 & ~umask())
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, sync_dir: bool = True) -> None:
    atomic_write(path, lambda f: f.write(data), sync_dir)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the entries of `directory` (files renamed or created in it) durable."""
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY)
    except OSError:            # a platform without directory handles (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:            # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)
