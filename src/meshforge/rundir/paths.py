"""Paths that a run directory's files name, confined to the directory they belong to.

A run directory is data, possibly someone else's (sent, downloaded, unpacked): every
path a checkpoint manifest, a DCP metadata record or any other record names is taken
relative to its directory and must stay inside it, with no `..`, no absolute path and
no symlink leading out. A violation is a one-line DataError (exit 2): the directory
was made by hand or tampered with, never by a crash."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from meshforge.errors import DataError


def confined(directory: Path, name: object, what: str) -> Path:
    """DIRECTORY/NAME, for a relative path NAME that WHAT (e.g. "manifest.json of
    checkpoints/step-00000010") names; DataError unless it stays inside DIRECTORY."""
    directory = Path(directory)
    problem = _problem(name)
    if problem is None:
        path = directory / str(name)
        try:
            inside = path.resolve().is_relative_to(directory.resolve())
        except (OSError, RuntimeError):  # a symlink loop
            inside = False
        if not inside:
            problem = "a symlink out of it"
        else:
            return path
    raise DataError(
        f"{what} names {name!r}, {problem}: refused (a path a run directory names stays "
        f"inside {directory})"
    )


def _problem(name: object) -> str | None:
    if not isinstance(name, str) or not name.strip():
        return "not a relative path"
    pure = PurePosixPath(name)
    if pure.is_absolute() or "\\" in name or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    if ".." in pure.parts:
        return "a path out of its directory"
    if "\0" in name:
        return "not a path"
    return None
