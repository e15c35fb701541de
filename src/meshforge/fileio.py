"""Small file helpers shared across layers (no torch import).

Lock and temporary files are opened here, and only here, so that each is opened the
same safe way:

- never through a symbolic link (O_NOFOLLOW): a link planted at a lock or temporary
  path (in a shared run directory, a cache on a multi-user machine) would otherwise
  make meshforge create, truncate or write the file it points to. A link there is
  refused (`SymlinkRefused`, one line naming the path);
- a temporary file is always new (O_CREAT | O_EXCL under a fresh random name), so two
  writers never share one and an existing file or link is never written through;
- created with mode 0o666 (files) or 0o777 (directories) *through* the user's umask,
  as `open()` and `mkdir` do: never widened by chmod afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# The mode a new file asks for; the umask takes away what the user does not grant.
FILE_MODE = 0o666
# Fresh names a temporary file tries before giving up: each is random, so a second
# attempt fails only if someone else is creating files of the same names on purpose.
_TEMP_ATTEMPTS = 100


class SymlinkRefused(OSError):
    """A lock or temporary path is a symbolic link; meshforge does not write through it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(
            errno.ELOOP,
            f"{os.fspath(path)} is a symbolic link; meshforge does not follow links for "
            "lock and temporary files (remove it)",
            os.fspath(path),
        )

    def __str__(self) -> str:
        return str(self.strerror)


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = FILE_MODE) -> int:
    """os.open(PATH, FLAGS | O_NOFOLLOW | O_CLOEXEC, MODE): a descriptor of PATH itself,
    never of what a symbolic link there points to (SymlinkRefused). A created file gets
    MODE less the umask."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (
            exc.errno == errno.EEXIST and flags & os.O_EXCL and os.path.islink(path)
        ):
            raise SymlinkRefused(path) from None
        raise


def open_lock_file(
    path: str | os.PathLike[str], readonly: bool = False, create: bool = True
) -> int:
    """A descriptor of a lock file for flock: read-write (or READONLY), created if
    missing (CREATE); a symbolic link at PATH raises SymlinkRefused."""
    flags = os.O_RDONLY if readonly else os.O_RDWR
    if create:
        flags |= os.O_CREAT
    return open_nofollow(path, flags)


def read_text_nofollow(path: str | os.PathLike[str], max_bytes: int) -> str:
    """The first MAX_BYTES bytes of a small file written by meshforge (a lock file's
    holder), as text; OSError (SymlinkRefused for a link) where it cannot be read."""
    fd = open_nofollow(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes).decode("utf-8", "replace")


def _temp_token() -> str:
    return secrets.token_hex(4)


def create_temp_beside(path: str | os.PathLike[str]) -> tuple[int, Path]:
    """A new, empty file beside PATH to write and then rename onto it: (descriptor open
    for writing, its path). Its name, `.NAME.HOST.PID.RANDOM.tmp`, says who wrote it
    (several nodes may write the same file on shared storage) and never existed before
    (O_EXCL); an existing file or link of that name is left alone and another is tried."""
    path = Path(path)
    host = socket.gethostname().replace(os.sep, "_")
    for _ in range(_TEMP_ATTEMPTS):
        tmp = path.with_name(f".{path.name}.{host}.{os.getpid()}.{_temp_token()}.tmp")
        try:
            return open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), tmp
        except FileExistsError:
            continue
        except SymlinkRefused:
            continue  # a link planted at this name: left as it is, another name tried
    raise FileExistsError(
        errno.EEXIST, f"no fresh temporary name beside {path} after {_TEMP_ATTEMPTS} tries"
    )


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike[str], mode: str = "wb", *, fsync: bool = False, **open_kw: Any
) -> Iterator[IO[Any]]:
    """A file object ("wb" or "w", with `open`'s keywords) whose contents replace PATH
    when the block ends without an exception; readers see the old file or the new one,
    never half of it. The data go to a new temporary file beside PATH
    (create_temp_beside), renamed onto PATH (a link at PATH is replaced, not followed);
    on an exception the temporary file is removed and PATH is untouched. `fsync`: the
    data reach the disk before the rename (and the rename before return)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer writes a new file: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    fd, tmp = create_temp_beside(path)
    try:
        with os.fdopen(fd, mode, **open_kw) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent, best_effort=True)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False) -> None:
    """Write DATA so that readers see the old file or the new one (atomic_writer)."""
    with atomic_writer(path, "wb", fsync=fsync) as f:
        f.write(data)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, fsync: bool = False) -> None:
    """Write TEXT (UTF-8) so that readers see the old file or the new one, never half of
    it (atomic_writer)."""
    with atomic_writer(path, "w", fsync=fsync, encoding="utf-8") as f:
        f.write(text)


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
