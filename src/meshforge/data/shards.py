"""Token shards: text files -> ``shard-NNNNN.bin`` files + ``index.json``, and back.

A shard directory made by :func:`prepare` holds raw little-endian ``uint16``
token files, read back with ``np.memmap`` (no copy, shared page cache between
worker processes), and an ``index.json``::

    {"format": "meshforge-tokens-v1", "dtype": "uint16", "tokenizer": "byte",
     "vocab_size": 256, "total_tokens": N, "documents": D,
     "shards": [{"file": "shard-00000.bin", "tokens": n0, "sha256": "..."}, ...]}

Source files are read in sorted relative-path order and concatenated, with
``DOCUMENT_SEPARATOR`` between two files, into one token sequence that is cut
into shards of ``shard_tokens`` tokens (the last one shorter). The index is
written last, atomically, so a crash never leaves an index that lists missing
or half-written shards. :func:`load_shards` checks the index against the files
and exposes all shards as one logical sequence (:class:`ShardedTokens`).
"""

from __future__ import annotations

import bisect
import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.data.tokenizer import DOCUMENT_SEPARATOR, TOKEN_DTYPE, VOCAB_SIZE, encode_bytes
from meshforge.errors import DataError

INDEX_FORMAT = "meshforge-tokens-v1"
INDEX_NAME = "index.json"
DEFAULT_SHARD_TOKENS = 16 * 2**20
_SHARD_NAME = re.compile(r"^shard-\d{5,}\.bin$")
_READ_CHUNK_BYTES = 4 * 2**20

ProgressFn = Callable[[int, int], None]  # (bytes read so far, total bytes)


class ShardedTokens:
    """Several 1-D token arrays (shard memmaps) seen as one read-only sequence.

    ``len(t)`` is the total token count; ``t[i]`` a token; ``t[a:b]`` an ndarray
    (a view when the range lies inside one shard, a copy of just that range when
    it crosses shard boundaries). ``t.window(a, b)`` is a lazy sub-sequence.
    """

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self._parts = [p for p in parts if len(p)]
        if any(p.ndim != 1 for p in self._parts):
            raise ValueError("ShardedTokens parts must be 1-D arrays")
        self._starts = [0]
        for p in self._parts:
            self._starts.append(self._starts[-1] + len(p))
        self.dtype = self._parts[0].dtype if self._parts else TOKEN_DTYPE

    @property
    def n_parts(self) -> int:
        return len(self._parts)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __len__(self) -> int:
        return self._starts[-1]

    def __repr__(self) -> str:
        return f"ShardedTokens(tokens={len(self)}, parts={self.n_parts})"

    def __getitem__(self, key: int | slice) -> Any:
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._range(start, max(start, stop))
            picks = range(start, stop, step)
            if not picks:
                return np.empty(0, dtype=self.dtype)
            lo = min(picks[0], picks[-1])
            covering = self._range(lo, max(picks[0], picks[-1]) + 1)
            return covering[picks[0] - lo :: step]
        i = int(key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"token index {key} out of range for {n} tokens")
        part = bisect.bisect_right(self._starts, i) - 1
        return self._parts[part][i - self._starts[part]]

    def _range(self, start: int, stop: int) -> np.ndarray:
        if start == stop:
            return np.empty(0, dtype=self.dtype)
        pieces = []
        part = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            base = self._starts[part]
            end = min(stop, self._starts[part + 1])
            pieces.append(self._parts[part][start - base : end - base])
            start = end
            part += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def window(self, start: int, stop: int) -> ShardedTokens:
        """The tokens [start, stop) as a new ShardedTokens, without copying."""
        start, stop, _ = slice(start, stop).indices(len(self))
        parts = []
        for p, base in zip(self._parts, self._starts, strict=False):
            lo, hi = max(start, base), min(stop, base + len(p))
            if lo < hi:
                parts.append(p[lo - base : hi - base])
        return ShardedTokens(parts)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self._range(0, len(self))
        return arr.astype(dtype) if dtype is not None else np.array(arr, copy=True)


# --------------------------------------------------------------------------- reading sources


def source_files(
    src: str | os.PathLike[str], pattern: str | None = None, exclude: Path | None = None
) -> list[tuple[str, Path]]:
    """The files ``prepare`` reads from ``src``: (relative posix path, path), sorted.

    A file is itself; a directory is walked recursively (symlinked directories
    are not followed; names starting with "." are skipped, so ``.git`` stays out)
    for regular files whose relative path or name matches ``pattern`` (fnmatch,
    case-sensitive; ``None`` takes all). Files under ``exclude`` are skipped so
    that an output directory inside ``src`` is never read back.
    """
    root = Path(src)
    if not root.exists():
        raise DataError(f"{root}: no such file or directory")
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise DataError(f"{root}: not a regular file or directory")

    def _walk_error(exc: OSError) -> None:
        raise DataError(f"{exc.filename}: cannot list directory ({exc.strerror})")

    excluded = exclude.resolve() if exclude is not None else None
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_walk_error):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".") and (excluded is None or (here / d).resolve() != excluded)
        )
        for name in filenames:
            path = here / name
            if name.startswith(".") or not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            if pattern is None or fnmatch.fnmatchcase(rel, pattern):
                found.append((rel, path))
            elif fnmatch.fnmatchcase(name, pattern):
                found.append((rel, path))
    found.sort(key=lambda item: item[0])
    return found


class _ShardWriter:
    """Cuts a stream of bytes into shard files of ``shard_tokens`` tokens each."""

    def __init__(self, directory: Path, shard_tokens: int) -> None:
        self.directory = directory
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._hash: Any = None
        self._count = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            if self._file is None:
                name = f"shard-{len(self.shards):05d}.bin"
                self._file = open(self.directory / name, "wb")  # closed by _finish/abort
                self._hash = hashlib.sha256()
                self._count = 0
                self.shards.append({"file": name, "tokens": 0, "sha256": ""})
            take = min(len(view), self.shard_tokens - self._count)
            raw = encode_bytes(view[:take]).tobytes()  # TOKEN_DTYPE is little-endian
            self._file.write(raw)
            self._hash.update(raw)
            self._count += take
            view = view[take:]
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())
        self._file = None

    def close(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _write_json_atomic(path: Path, obj: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    *,
    pattern: str | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Tokenize ``src`` (a text file or a directory of them) into shards in ``out``.

    Returns the index that was written to ``out/index.json``. An existing index
    is kept (DataError) unless ``force``; bad input (missing or empty ``src``, an
    unreadable file) raises DataError before any existing index is touched.
    """
    src_path, out_dir = Path(src), Path(out)
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be >= 1, got {shard_tokens}")
    index_path = out_dir / INDEX_NAME
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a directory")
    if index_path.exists() and not force:
        raise DataError(f"{index_path} already exists; use --force to replace it")

    files = source_files(src_path, pattern, exclude=out_dir)
    if not files:
        matching = f" matching {pattern!r}" if pattern else ""
        raise DataError(f"{src_path}: no files{matching} to read")
    try:
        sizes = [path.stat().st_size for _, path in files]
    except OSError as exc:
        raise DataError(f"{exc.filename}: cannot read ({exc.strerror})") from None
    total_bytes = sum(sizes) + len(DOCUMENT_SEPARATOR) * (len(files) - 1)
    if sum(sizes) == 0:
        raise DataError(f"{src_path}: empty (no bytes to tokenize)")

    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    writer = _ShardWriter(staging, shard_tokens)
    try:
        done = 0
        for i, (_, path) in enumerate(files):
            if i:
                writer.write(DOCUMENT_SEPARATOR)
                done += len(DOCUMENT_SEPARATOR)
            try:
                with open(path, "rb") as f:
                    while chunk := f.read(_READ_CHUNK_BYTES):
                        writer.write(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress(done, total_bytes)
            except OSError as exc:
                raise DataError(f"{path}: cannot read ({exc.strerror})") from None
        shards = writer.close()
        total = sum(s["tokens"] for s in shards)
        if total == 0:
            raise DataError(f"{src_path}: empty (no bytes to tokenize)")
        index = {
            "format": INDEX_FORMAT,
            "dtype": "uint16",
            "tokenizer": "byte",
            "vocab_size": VOCAB_SIZE,
            "total_tokens": total,
            "documents": len(files),
            "shards": shards,
        }
        _commit(staging, out_dir, index)
    except BaseException:
        writer.abort()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return index


def _commit(staging: Path, out_dir: Path, index: dict[str, Any]) -> None:
    """Move staged shards into ``out_dir``; the index goes last, atomically.

    An old index is removed first, so between here and the final rename the
    directory has no index at all (never one that lists the wrong files).
    """
    index_path = out_dir / INDEX_NAME
    index_path.unlink(missing_ok=True)
    _fsync_dir(out_dir)
    names = {s["file"] for s in index["shards"]}
    for name in sorted(names):
        os.replace(staging / name, out_dir / name)
    for stale in out_dir.iterdir():  # shards of a previous, larger dataset
        if _SHARD_NAME.match(stale.name) and stale.name not in names:
            stale.unlink()
    _fsync_dir(out_dir)
    _write_json_atomic(index_path, index)
    _fsync_dir(out_dir)


# --------------------------------------------------------------------------- loading


def _read_index(directory: Path, context: str) -> dict[str, Any]:
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise DataError(
            f"{context}: no {INDEX_NAME} in {directory} "
            f"(make one with `meshforge data prepare SRC {directory}`)"
        )
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{context}: {index_path} is not valid JSON ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{context}: cannot read {index_path} ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise DataError(f"{context}: {index_path} has format {found!r}, expected {INDEX_FORMAT!r}")
    expected = {"dtype": "uint16", "tokenizer": "byte", "vocab_size": VOCAB_SIZE}
    for key, value in expected.items():
        if index.get(key) != value:
            raise DataError(
                f"{context}: {index_path} has {key}={index.get(key)!r}, expected {value!r}"
            )
    shards = index.get("shards")
    if not isinstance(shards, list) or not shards:
        raise DataError(f"{context}: {index_path} lists no shards")
    for entry in shards:
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("file"), str)
            and _SHARD_NAME.match(entry["file"])
            and isinstance(entry.get("tokens"), int)
            and entry["tokens"] >= 0
            and isinstance(entry.get("sha256"), str)
        )
        if not ok:
            raise DataError(f"{context}: {index_path} has a malformed shard entry {entry!r}")
    total = sum(entry["tokens"] for entry in shards)
    if index.get("total_tokens") != total:
        raise DataError(
            f"{context}: {index_path} says total_tokens={index.get('total_tokens')!r} "
            f"but its shards hold {total}"
        )
    return index


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def load_shards(
    directory: str | os.PathLike[str],
    *,
    verify_checksums: bool = False,
    context: str | None = None,
) -> ShardedTokens:
    """Memory-map the shards of a directory made by :func:`prepare` as one sequence.

    Checks the index and that every shard file exists with exactly
    ``tokens * 2`` bytes; with ``verify_checksums`` also each file's sha256
    (reads every byte, so off by default). Problems raise DataError prefixed by
    ``context`` (default: the directory) and naming the offending file.
    """
    root = Path(directory)
    context = context or str(root)
    index = _read_index(root, context)
    parts = []
    for entry in index["shards"]:
        path = root / entry["file"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DataError(f"{context}: {path} is listed in {INDEX_NAME} but missing") from None
        expected = entry["tokens"] * TOKEN_DTYPE.itemsize
        if size != expected:
            raise DataError(
                f"{context}: {path} has {size} bytes but {INDEX_NAME} says "
                f"{entry['tokens']} tokens ({expected} bytes)"
            )
        if verify_checksums and _sha256_file(path) != entry["sha256"]:
            raise DataError(f"{context}: {path} does not match its sha256 in {INDEX_NAME}")
        if entry["tokens"]:  # np.memmap cannot map an empty file
            parts.append(np.memmap(path, dtype=TOKEN_DTYPE, mode="r", shape=(entry["tokens"],)))
    return ShardedTokens(parts)
