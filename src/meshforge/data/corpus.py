"""Token sources for training: the built-in corpus and token-shard directories.

``load_tokens(source, val_fraction)`` is what the trainer calls. ``source`` is

- ``builtin:python-stdlib``: the running Python's standard-library ``.py``
  files (no download). Test suites, IDLE, turtledemo, lib2to3, site-packages,
  ``pydoc_data`` and build-configuration files are left out. Files are read in
  sorted relative-path order, joined by ``DOCUMENT_SEPARATOR`` and cut at
  ``STDLIB_CORPUS_MAX_TOKENS`` tokens (byte-level), so the corpus is the same on
  every machine with the same Python build. The token array is cached as
  ``.npy`` under ``$MESHFORGE_CACHE`` (default ``~/.cache/meshforge``), keyed by
  the Python version and a hash of the file list and sizes, and written
  atomically so that concurrent worker processes can build it at once.
- a path to a directory made by ``meshforge data prepare`` (token shards).

Train/validation split (deterministic, no shuffling): of N tokens the last
``floor(N * val_fraction)`` are validation and the ones before them training.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.data.shards import ShardedTokens, load_shards
from meshforge.data.tokenizer import DOCUMENT_SEPARATOR, TOKEN_DTYPE, VOCAB_SIZE, encode_bytes
from meshforge.errors import DataError

BUILTIN_PREFIX = "builtin:"
STDLIB_CORPUS = "builtin:python-stdlib"
BUILTIN_SOURCES = (STDLIB_CORPUS,)
STDLIB_CORPUS_MAX_TOKENS = 8 * 2**20
_CORPUS_VERSION = 1  # bump when the selection or layout of the corpus changes

# Directories of the stdlib that are not library source worth learning from, or
# that are not the standard library at all.
_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "turtledemo",
        "lib2to3",
        "pydoc_data",
        "ensurepip",
        "lib-dynload",
        "__pycache__",
    }
)

Tokens = Any  # np.ndarray or ShardedTokens: len() and tokens[a:b] -> np.ndarray


@dataclass(frozen=True)
class TokenSplits:
    """A token source split into training and validation tokens.

    ``train`` and ``val`` are 1-D token sequences (an ``np.ndarray``/memmap, or
    a :class:`ShardedTokens` view): ``len()`` and ``tokens[a:b] -> np.ndarray``.
    """

    train: Tokens
    val: Tokens
    vocab_size: int
    source: str


def cache_dir() -> Path:
    """Where meshforge caches derived data: ``$MESHFORGE_CACHE`` or ``~/.cache/meshforge``."""
    env = os.environ.get("MESHFORGE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshforge"


def _is_excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or name.startswith((".", "config-"))


def stdlib_files(stdlib: str | os.PathLike[str] | None = None) -> list[tuple[str, Path, int]]:
    """The files of the built-in corpus: (relative posix path, path, size), sorted by path."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _is_excluded_dir(d))
        for name in filenames:
            if not name.endswith(".py") or name.startswith(("_sysconfigdata", ".")):
                continue
            path = Path(dirpath) / name
            try:
                size = path.stat().st_size
            except OSError:
                continue  # e.g. a dangling symlink: not part of this Python's library
            found.append((path.relative_to(root).as_posix(), path, size))
    found.sort(key=lambda item: item[0])
    return found


def _stdlib_cache_path(files: list[tuple[str, Path, int]], max_tokens: int) -> Path:
    h = hashlib.sha256(f"{_CORPUS_VERSION}\0{sys.version}\0{max_tokens}\0".encode())
    for rel, _, size in files:
        h.update(f"{rel}\0{size}\n".encode())
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir() / f"python-stdlib-{tag}-{h.hexdigest()[:16]}.npy"


def _build_stdlib_tokens(files: list[tuple[str, Path, int]], max_tokens: int) -> np.ndarray:
    buf = bytearray()
    for i, (_, path, _) in enumerate(files):
        if len(buf) >= max_tokens:
            break
        if i:
            buf += DOCUMENT_SEPARATOR
        try:
            buf += path.read_bytes()
        except OSError as exc:
            raise DataError(
                f"data.source {STDLIB_CORPUS}: cannot read {path} ({exc.strerror})"
            ) from None
    return encode_bytes(memoryview(buf)[:max_tokens])


def _load_cached(path: Path) -> np.ndarray | None:
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError):
        return None
    if arr.ndim != 1 or arr.dtype != TOKEN_DTYPE or len(arr) == 0:
        return None
    return arr


def _save_atomic(path: Path, tokens: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, tokens)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # concurrent builders write identical bytes; last one wins
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stdlib_tokens(max_tokens: int = STDLIB_CORPUS_MAX_TOKENS) -> np.ndarray:
    """The tokens of ``builtin:python-stdlib`` (read-only memmap of the cache when possible)."""
    files = stdlib_files()
    if not files:
        stdlib = sysconfig.get_paths()["stdlib"]
        raise DataError(f"data.source {STDLIB_CORPUS}: no standard-library .py files in {stdlib}")
    path = _stdlib_cache_path(files, max_tokens)
    cached = _load_cached(path)
    if cached is not None:
        return cached
    tokens = _build_stdlib_tokens(files, max_tokens)
    try:
        _save_atomic(path, tokens)
    except OSError:
        return tokens  # read-only home or full disk: work uncached rather than fail
    mapped = _load_cached(path)
    return mapped if mapped is not None else tokens


def split_tokens(tokens: Tokens, val_fraction: float) -> tuple[Tokens, Tokens]:
    """(train, val): the last ``floor(len * val_fraction)`` tokens are validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    n = len(tokens)
    n_train = n - int(n * val_fraction)
    if isinstance(tokens, ShardedTokens):
        return tokens.window(0, n_train), tokens.window(n_train, n)
    return tokens[:n_train], tokens[n_train:]


def _resolve(source: str) -> Path | None:
    """None for the built-in corpus, else the shard directory; DataError if neither."""
    if source.startswith(BUILTIN_PREFIX):
        if source != STDLIB_CORPUS:
            known = ", ".join(BUILTIN_SOURCES)
            raise DataError(f"data.source {source!r}: unknown built-in corpus (known: {known})")
        return None
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data.source {source}: no such directory")
    if not path.is_dir():
        raise DataError(
            f"data.source {source}: not a directory of token shards "
            "(make one with `meshforge data prepare SRC OUT`)"
        )
    return path


def check_source(source: str) -> None:
    """Cheap up-front check of ``data.source`` (for the launcher): the name of a
    built-in corpus, or a shard directory whose index and file sizes agree."""
    path = _resolve(source)
    if path is not None:
        load_shards(path, context=f"data.source {source}")


def load_tokens(source: str, val_fraction: float = 0.05, seq_len: int | None = None) -> TokenSplits:
    """Load ``source`` (``builtin:python-stdlib`` or a shard directory) and split it.

    With ``seq_len``, also checks that the training split (and a non-empty
    validation split) holds at least one sequence of ``seq_len + 1`` tokens, so
    that a too-short source fails before training rather than at the first eval.
    Every problem is a DataError naming ``data.source`` (and ``model.seq_len``
    where it is the cause).
    """
    path = _resolve(source)
    if path is None:
        tokens: Tokens = stdlib_tokens()
    else:
        tokens = load_shards(path, context=f"data.source {source}")
    train, val = split_tokens(tokens, val_fraction)
    if seq_len is not None and len(train) < seq_len + 1:
        raise DataError(
            f"data.source {source}: the training split has {len(train)} tokens, fewer than "
            f"model.seq_len + 1 = {seq_len + 1}"
        )
    if seq_len is not None and val_fraction > 0 and len(val) < seq_len + 1:
        raise DataError(
            f"data.source {source}: the validation split (data.val_fraction={val_fraction}) "
            f"has {len(val)} tokens, fewer than model.seq_len + 1 = {seq_len + 1}"
        )
    return TokenSplits(train=train, val=val, vocab_size=VOCAB_SIZE, source=source)
