"""Atomic file writes (a temp file in the same directory, then a rename, so a reader never sees a partial file), and
JSON-lines reading that names the file and line of what is wrong.

A floor module (it imports nothing of quantkit), so that the model sources' caches and the artifact writer share
one implementation. Finished files get the mode a plain `open` would give them under the process's umask.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() gives a new file
DIR_MODE = 0o777 & ~_umask()  # what mkdir() gives a new directory


def owner_stamp() -> str:
    """This process as a lock file records it: {"pid": ..., "host": ...}."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname()})


def stamped_owner(path: Path) -> str | None:
    """The live process that wrote `owner_stamp()` into `path` ("pid N on HOST"), or None: no readable stamp, this
    process, or one that has ended (a kill leaves its stamp behind). Another host's counts as live: its pid cannot be
    checked."""
    try:
        stamp = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(stamp, dict) or not isinstance(stamp.get("pid"), int):
        return None
    if stamp.get("host") == socket.gethostname():
        if stamp["pid"] == os.getpid():
            return None
        try:
            os.kill(stamp["pid"], 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            pass
    return f"pid {stamp['pid']} on {stamp.get('host')}"


def take_lock(path: Path) -> int | None:
    """Hold an exclusive advisory lock (flock) on `path`, created if missing, and write this process's
    `owner_stamp()` into it. Returns the open descriptor, which holds the lock until it is closed or the process
    ends, a kill included; None if another open of the file holds it. On a filesystem without flock the stamp alone
    remains (`stamped_owner`)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        for attempt in range(3):  # another run's `lock_held` probe holds it for an instant: try again, briefly
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 2:
                    os.close(fd)
                    return None
                time.sleep(0.05)
            except OSError:  # no flock here (ENOLCK, EINVAL): the stamp is the lock
                break
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner_stamp().encode(), 0)
    os.fsync(fd)
    return fd


def lock_held(path: Path) -> bool:
    """Whether some open of `path` holds the flock `take_lock` takes (a live run: a process's locks end with it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases the probe's own lock
    return False


def lock_owner(path: Path) -> str | None:
    """The live process holding `path`'s lock ("pid N on HOST"), or None: no one, this process, or one that has
    ended. On this host the flock of `take_lock` decides where it is held (a kill frees it); otherwise the stamp
    (`stamped_owner`), by which another host's counts as live."""
    if lock_held(path):
        return stamped_owner(path) or "a process of this host"
    return stamped_owner(path)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` via a temp file in the same directory (fsynced) and a rename."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    atomic_write_with(path, write)


def atomic_write_with(path: Path, write: Callable[[str], None]) -> None:
    """`write(tmp_path)` creates the file (a library's own writer, say), which is then fsynced and renamed onto
    `path`: the name never points at bytes a crash of the machine could still lose."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cannot_write(path: Path) -> str | None:
    """Why `atomic_write(path, ...)` would fail, found by creating and removing a temp file beside it; None if it
    would not. A check to run before long work whose result goes to `path`."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(tmp)
    return None


def _json_lines_hint(line: str) -> str:
    """How to mend a line that opens a JSON document spread over lines (an array, or a pretty-printed object)."""
    if line.lstrip().startswith("["):
        return " (a JSON array? convert it to JSON lines, one object per line)"
    if line.strip() == "{":
        return " (a pretty-printed JSON object? write each object on one line)"
    return ""


def json_objects(lines: Iterable[str], path: Path, fields: Sequence[str], error: Callable[[str], Exception],
                 fix: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """The line number and JSON object of each non-blank line of `lines` (read from `path`), each object holding
    every one of `fields`; a line that is not such an object raises `error(message)` naming the file and line (and
    `fix`, how to mend it)."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}, line {number}: not a JSON object per line{_json_lines_hint(line)}: {exc}") from None
        if isinstance(row, list):
            raise error(f"{path}, line {number}: a JSON array, not one object per line; convert it to JSON lines")
        missing = [field for field in fields if field not in row] if isinstance(row, dict) else list(fields)
        if missing:
            found = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
            raise error(f"{path}, line {number}: no field {', '.join(map(repr, missing))} (found {found})"
                        + (f"; {fix}" if fix else ""))
        yield number, row


DATA_DIR_ENV = "QUANTKIT_DATA_DIR"


def resolve_data_dir(data_dir: str | Path | None = None) -> Path | None:
    """Where local data files are looked up (calibration sets, eval tasks): `data_dir` if given, else
    $QUANTKIT_DATA_DIR, else None; "~" expanded and made absolute, an empty value taken as unset. One rule for
    every reader, so that one command never finds one task's files and misses another's."""
    value = str(data_dir) if data_dir is not None and str(data_dir) != "" else os.environ.get(DATA_DIR_ENV, "")
    return Path(value).expanduser().resolve() if value else None
