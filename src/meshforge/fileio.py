"""Small file helpers shared across layers (no torch import)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` so that readers see the old file or the new one, never half of it.
    The temporary name is unique per host and process: several nodes may write the same
    file on shared storage."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike[str], replace: bool = False) -> Iterator[Path]:
    """A new directory beside `final` to fill; when the block ends without an exception
    its files are flushed to disk and it is renamed to `final`, else it is removed. So
    readers see the old `final` or the complete new one, never half of it.

    An existing `final` raises FileExistsError unless `replace`: then it is moved aside,
    removed only once the new directory is in place, and put back if the rename fails."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = final.with_name(f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    _remove(stage)
    stage.mkdir()
    try:
        yield stage
        for path in stage.rglob("*"):
            if path.is_file():
                _fsync(path)
        if final.exists() and not replace:
            raise FileExistsError(errno.EEXIST, "exists", str(final))
        aside = None
        if final.exists() or final.is_symlink():
            aside = final.with_name(f".{final.name}.old-{socket.gethostname()}-{os.getpid()}")
            _remove(aside)
            os.replace(final, aside)
        try:
            os.replace(stage, final)
        except OSError:
            if aside is not None:
                os.replace(aside, final)
            raise
        fsync_dir(final.parent)
        if aside is not None:
            _remove(aside)
    finally:
        _remove(stage)


def fsync_dir(path: str | os.PathLike[str], best_effort: bool = False) -> None:
    """Flush a directory's entries to disk (a file renamed into it or removed from it
    survives a crash then). `best_effort`: a directory that cannot be opened or synced
    (some file systems refuse) is passed over instead of raising OSError."""
    try:
        _fsync(Path(path))
    except OSError:
        if not best_effort:
            raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove a file, link or directory tree if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
