"""Atomic file writes: a temp file in the same directory, then a rename, so a reader never sees a partial file.

A floor module (it imports nothing of quantkit), so that the model sources' caches and the artifact writer share
one implementation. Finished files get the mode a plain `open` would give them under the process's umask.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() gives a new file
DIR_MODE = 0o777 & ~_umask()  # what mkdir() gives a new directory


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` via a temp file in the same directory (fsynced) and a rename."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())

    atomic_write_with(path, write)


def atomic_write_with(path: Path, write: Callable[[str], None]) -> None:
    """`write(tmp_path)` creates the file (a library's own writer, say), which is then renamed onto `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
