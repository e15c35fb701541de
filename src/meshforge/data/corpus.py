"""Token sources for training: the built-in corpus, token shards, ``.bin`` token files, URLs.

``load_tokens(source, val_fraction, ...)`` is what the trainer calls. ``source`` is

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
- a nanoGPT-style ``.bin`` file: raw little-endian ``uint16`` token ids, mapped
  as they are (``np.memmap``, no copy, no index). Its vocabulary is the model's
  (``vocab_size``); files up to ``BIN_SCAN_TOKENS`` tokens are checked for ids
  beyond it. A directory holding ``train.bin`` (and ``val.bin``) without an
  ``index.json`` uses them as the training and validation splits
  (``val_fraction`` then applies only when there is no ``val.bin``).
- an fsspec URL (``s3://bucket/shards``, ``gs://...``, ``file://...``, any
  protocol fsspec knows) of a shard directory, a ``.bin`` file or a
  ``train.bin``/``val.bin`` directory: its files are copied once into
  ``cache_dir`` (default ``$MESHFORGE_CACHE/remote``) and then read like local
  ones. ``fsspec`` and the protocol's backend (``s3fs``, ``gcsfs``, ...) are the
  user's to install; without them the error names the pip package. Nothing is
  imported or contacted for any other kind of source.

Shared storage. Reading takes no lock and writes nothing beside the data: shard
and ``.bin`` files are opened read-only and memory-mapped, so any number of ranks
on any number of nodes can read one directory on NFS, Lustre, GPFS or a FUSE
mount at once, with no coordination. The only writes are to caches (the built-in
corpus and the URL copies), and every one goes to a unique temporary name that is
then renamed over the final one (atomic on POSIX): ranks of a node filling the
same cache at once may copy a file twice, but never leave or read a torn one. A
cached copy is reused while its size and the remote's version tag (ETag, mtime)
match; shards are checked against their sha256 in the index as they arrive.

Train/validation split (deterministic, no shuffling): of N tokens the last
``floor(N * val_fraction)`` are validation and the ones before them training.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.data.shards import (
    DTYPES,
    INDEX_NAME,
    ShardedTokens,
    check_shard,
    load_shards,
    read_index,
)
from meshforge.data.tokenizer import (
    DOCUMENT_SEPARATOR,
    TOKEN_DTYPE,
    VOCAB_SIZE,
    encode_bytes,
    tokenizer_from_index,
)
from meshforge.errors import DataError
from meshforge.fileio import atomic_writer, write_bytes_atomic
from meshforge.redact import is_redacted, redact_url

BUILTIN_PREFIX = "builtin:"
STDLIB_CORPUS = "builtin:python-stdlib"
BUILTIN_SOURCES = (STDLIB_CORPUS,)
STDLIB_CORPUS_MAX_TOKENS = 8 * 2**20
_CORPUS_VERSION = 1  # bump when the selection or layout of the corpus changes

BIN_DTYPE = np.dtype("<u2")  # nanoGPT's train.bin / val.bin: raw little-endian uint16 ids
BIN_SPLITS = ("train.bin", "val.bin")
BIN_SCAN_TOKENS = 2**27  # .bin files up to this many tokens are checked for ids >= vocab_size
SEPARATOR_SCAN_TOKENS = 2**22  # tokens searched for an end-of-text token (document masking)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.:-]*://")
_COPY_CHUNK_BYTES = 8 * 2**20
# fsspec protocols and the pip package that brings each one's backend
_BACKENDS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "http": "aiohttp",
    "https": "aiohttp",
    "hf": "huggingface_hub",
    "sftp": "paramiko",
    "ssh": "paramiko",
    "oci": "ocifs",
}

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
    # concurrent builders write identical bytes; last one wins
    with atomic_writer(path, "wb", fsync=True) as f:
        np.save(f, tokens)


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


def is_url(source: str) -> bool:
    """Whether ``data.source`` is an fsspec URL (``s3://...``, ``file://...``)."""
    return bool(_URL.match(source))


@dataclass(frozen=True)
class _Local:
    """What a source is on this machine: ``kind`` builtin | shards | bin | bin_dir."""

    kind: str
    path: Path | None = None


def _classify(path: Path, source: str) -> _Local:
    if not path.exists():
        what = "file" if path.suffix == ".bin" else "directory"
        raise DataError(f"data.source {source}: no such {what}")
    if path.is_dir():
        if not (path / INDEX_NAME).exists() and (path / BIN_SPLITS[0]).is_file():
            return _Local("bin_dir", path)
        return _Local("shards", path)
    if path.suffix == ".bin":
        return _Local("bin", path)
    raise DataError(
        f"data.source {source}: not a directory of token shards nor a .bin token file "
        "(make shards with `meshforge data prepare SRC OUT`)"
    )


def _resolve(source: str, cache_dir: str | os.PathLike[str] | None = None) -> _Local:
    """The local form of ``source`` (a URL is fetched into the cache); DataError if none."""
    if source.startswith(BUILTIN_PREFIX):
        if source != STDLIB_CORPUS:
            known = ", ".join(BUILTIN_SOURCES)
            raise DataError(f"data.source {source!r}: unknown built-in corpus (known: {known})")
        return _Local("builtin")
    if is_url(source):
        return _classify(fetch_remote(source, cache_dir), source)
    return _classify(Path(source).expanduser(), source)


# --------------------------------------------------------------------------- .bin token files


def _open_bin(path: Path, source: str) -> np.ndarray:
    """A ``.bin`` file as a read-only ``uint16`` memmap."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DataError(f"data.source {source}: cannot read {path} ({exc.strerror})") from None
    if size == 0:
        raise DataError(f"data.source {source}: {path} is empty")
    if size % BIN_DTYPE.itemsize:
        raise DataError(
            f"data.source {source}: {path} has {size} bytes, not a whole number of "
            "uint16 tokens (a .bin file holds raw little-endian uint16 token ids)"
        )
    return np.memmap(path, dtype=BIN_DTYPE, mode="r", shape=(size // BIN_DTYPE.itemsize,))


def _bin_vocab(files: list[tuple[Path, np.ndarray]], vocab_size: int | None, source: str) -> int:
    """The vocabulary of ``.bin`` tokens: the model's ``vocab_size`` (checked against the
    largest id when the files are small enough to scan), else the largest id + 1."""
    if sum(len(a) for _, a in files) > BIN_SCAN_TOKENS:
        return vocab_size or 2**16  # too large to scan at every start: trust the model
    highest = [(int(a.max()), path) for path, a in files]
    top, where = max(highest)
    if vocab_size is not None and top >= vocab_size:
        raise DataError(
            f"data.source {source}: {where} holds token id {top}, beyond "
            f"model.vocab_size={vocab_size}"
        )
    return vocab_size or top + 1


# --------------------------------------------------------------------------- URLs (fsspec)


def _filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) of ``url``; a missing fsspec or backend names its package."""
    protocol = url.split("://", 1)[0].rsplit("::", 1)[-1].lower()
    package = _BACKENDS.get(protocol)
    try:
        import fsspec
    except ImportError:
        extra = f" {package}" if package else ""
        raise DataError(
            f"data.source {url}: a URL source needs fsspec (pip install fsspec{extra})"
        ) from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        hint = f"pip install {package}" if package else str(exc).splitlines()[0]
        raise DataError(
            f"data.source {url}: fsspec's {protocol}:// backend is not installed ({hint})"
        ) from None
    except ValueError as exc:
        raise DataError(f"data.source {url}: {str(exc).splitlines()[0]}") from None


def remote_cache_path(url: str, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Where the files of ``url`` are copied: ``cache_root`` (``data.cache_dir``; default
    ``$MESHFORGE_CACHE/remote``) / its last path component + a hash of the URL. The URL
    is taken redacted (meshforge.redact): a credential in it names no data, and the run's
    config.yaml, which records it redacted, finds the same copy."""
    root = Path(cache_root).expanduser() if cache_root else cache_dir() / "remote"
    url = redact_url(url)
    tail = url.rstrip("/").rsplit("/", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:40] or "root"
    return root / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def _version_tag(info: dict[str, Any]) -> str | None:
    """What tells two versions of a remote file apart, as far as its backend says."""
    for key in ("ETag", "etag", "md5Hash", "LastModified", "updated", "mtime", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return None


def _sidecar(local: Path) -> Path:
    return local.with_name(f".{local.name}.remote.json")


def _is_cached(local: Path, stamp: dict[str, Any]) -> bool:
    try:
        if stamp["size"] is not None and local.stat().st_size != stamp["size"]:
            return False
        return json.loads(_sidecar(local).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _fetch_file(fs: Any, info: dict[str, Any], local: Path, sha256: str | None, url: str) -> None:
    """Copy one remote file to ``local`` unless the cached copy is that version. The
    bytes go to a name unique to this host, process and thread and are renamed into
    place (atomic), so concurrent ranks never see a half-written file."""
    stamp = {"size": info.get("size"), "tag": _version_tag(info), "sha256": sha256}
    if _is_cached(local, stamp):
        return
    digest = hashlib.sha256()
    with fs.open(info["name"], "rb") as src, atomic_writer(local, "wb", fsync=True) as dst:
        while chunk := src.read(_COPY_CHUNK_BYTES):
            digest.update(chunk)
            dst.write(chunk)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise DataError(
                f"data.source {url}: {local.name} does not match its sha256 in {INDEX_NAME}"
            )
    write_bytes_atomic(_sidecar(local), json.dumps(stamp).encode())


def _index_files(index: Any, url: str) -> dict[str, str | None]:
    """{file name: sha256 or None} of the files a shard index needs beside it."""
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list) or not shards:
        raise DataError(f"data.source {url}: its {INDEX_NAME} lists no shards")
    files: dict[str, str | None] = {}
    entries = list(shards)
    tokenizer = index.get("tokenizer")
    if isinstance(tokenizer, dict) and "file" in tokenizer:
        entries.append(tokenizer)
    for entry in entries:
        name = entry.get("file") if isinstance(entry, dict) else None
        # a plain file name: an index must not write outside the cache directory
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise DataError(f"data.source {url}: {INDEX_NAME} has a malformed entry {entry!r}")
        sha = entry.get("sha256")
        files[name] = sha if isinstance(sha, str) and sha else None
    return files


def fetch_remote(url: str, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Copy the shard directory, ``.bin`` file or ``train.bin``/``val.bin`` directory at
    ``url`` into the cache (only the files missing or changed there) and return its local
    path. A shard index is written last, so a cached index never lists a missing file.

    A redacted URL (its credential replaced by ``***``, as a run's config.yaml records it)
    cannot reach its data: it names the copy that the launcher, which read the job with
    the credential, made in the cache before the workers started."""
    if is_redacted(url):
        return _cached_copy(url, cache_root)
    fs, root = _filesystem(url)
    dest = remote_cache_path(url, cache_root)
    try:
        info = fs.info(root)
        dest.mkdir(parents=True, exist_ok=True)
        if info.get("type") != "directory":
            if not root.endswith(".bin"):
                raise DataError(
                    f"data.source {url}: not a directory of token shards nor a .bin token file"
                )
            local = dest / posixpath.basename(root)
            _fetch_file(fs, info, local, None, url)
            return local
        listing = {posixpath.basename(e["name"].rstrip("/")): e for e in fs.ls(root, detail=True)}
        index_bytes = None
        if INDEX_NAME in listing:
            index_bytes = fs.cat_file(listing[INDEX_NAME]["name"])
            try:
                wanted = _index_files(json.loads(index_bytes), url)
            except (ValueError, UnicodeDecodeError):
                raise DataError(f"data.source {url}: its {INDEX_NAME} is not valid JSON") from None
        elif BIN_SPLITS[0] in listing:
            wanted = {name: None for name in BIN_SPLITS if name in listing}
        else:
            raise DataError(f"data.source {url}: neither {INDEX_NAME} nor {BIN_SPLITS[0]} in it")
        names = sorted(wanted)
        turn = int(os.environ.get("LOCAL_RANK", "0") or 0) % len(names)
        for name in names[turn:] + names[:turn]:  # ranks of a node start on different files
            if name not in listing:
                raise DataError(f"data.source {url}: {name} is listed in {INDEX_NAME} but missing")
            _fetch_file(fs, listing[name], dest / name, wanted[name], url)
        if index_bytes is not None:
            index_path = dest / INDEX_NAME
            if not index_path.is_file() or index_path.read_bytes() != index_bytes:
                write_bytes_atomic(index_path, index_bytes)
    except FileNotFoundError:
        raise DataError(f"data.source {url}: no such file or directory") from None
    except OSError as exc:
        detail = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise DataError(f"data.source {url}: {detail}") from None
    return dest


def _cached_copy(url: str, cache_root: str | os.PathLike[str] | None) -> Path:
    """The complete cached copy of a redacted URL's data (no remote is contacted)."""
    dest = remote_cache_path(url, cache_root)
    path = url.split("://", 1)[1].split("?", 1)[0].split("#", 1)[0].rstrip("/")
    if path.endswith(".bin"):
        candidates = [dest / posixpath.basename(path)]
    else:  # a shard index is written last; train.bin comes first of a .bin directory
        candidates = [dest / INDEX_NAME, dest / BIN_SPLITS[0]]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise DataError(
            f"data.source {url}: its credential is redacted (a run never records one) and "
            f"no launcher fetched it into {dest} on this host; pass the credential through "
            "the environment (e.g. AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "FSSPEC_<PROTOCOL>_<OPTION>) with a URL that carries none"
        )
    return found if path.endswith(".bin") else dest


# --------------------------------------------------------------------------- loading


def check_source(source: str) -> None:
    """Cheap up-front check of ``data.source`` (for the launcher): the name of a
    built-in corpus, a shard directory whose index and file sizes agree, a ``.bin``
    file (or ``train.bin``/``val.bin`` directory) of whole uint16 tokens, or a URL
    whose fsspec backend is installed (nothing is read from it here)."""
    if is_url(source):
        _filesystem(source)
        return
    local = _resolve(source)
    if local.kind == "shards":
        load_shards(local.path, context=f"data.source {source}")  # type: ignore[arg-type]
    elif local.kind == "bin":
        _open_bin(local.path, source)  # type: ignore[arg-type]
    elif local.kind == "bin_dir":
        for name in BIN_SPLITS:
            if (local.path / name).exists():  # type: ignore[operator]
                _open_bin(local.path / name, source)  # type: ignore[operator]


def end_of_text_id(source: str, cache_dir: str | os.PathLike[str] | None = None) -> int:
    """The token that ends a document in ``source``, where ``data.document_masking`` cuts
    its sequences: the byte tokenizer's ``DOCUMENT_SEPARATOR`` for the built-in corpus
    (written between its files), the ``eod_id`` of the tokenizer a shard directory's
    index records. DataError, naming the source, when none is known (a ``.bin`` file
    records no tokenizer) or when the first ``SEPARATOR_SCAN_TOKENS`` tokens hold none:
    the data is then not documents packed by ``meshforge data prepare``, and masking
    would silently do nothing."""
    local = _resolve(source, cache_dir)
    if local.kind == "builtin":
        return DOCUMENT_SEPARATOR[0]
    if local.kind != "shards":
        raise DataError(
            f"data.source {source}: a .bin token file records no tokenizer, so no end-of-text "
            "token is known for data.document_masking (make shards with `meshforge data "
            "prepare`, which writes one after each document)"
        )
    root, context = local.path, f"data.source {source}"
    index = read_index(root, context)  # type: ignore[arg-type]
    eod = int(tokenizer_from_index(index["tokenizer"], root).eod_id)  # type: ignore[arg-type]
    dtype, seen = DTYPES[index["dtype"]], 0
    for entry in index["shards"]:  # the first shards only: each is checked as the loader does
        if seen >= SEPARATOR_SCAN_TOKENS:
            break
        if not entry["tokens"]:
            continue
        path = check_shard(root, entry, dtype, context)  # type: ignore[arg-type]
        n = min(entry["tokens"], SEPARATOR_SCAN_TOKENS - seen)
        if (np.memmap(path, dtype=dtype, mode="r", shape=(n,)) == eod).any():
            return eod
        seen += n
    raise DataError(
        f"data.source {source}: no end-of-text token (id {eod}) in its first {seen} tokens; "
        "data.document_masking needs documents ended by it"
    )


def load_tokens(
    source: str,
    val_fraction: float = 0.05,
    seq_len: int | None = None,
    *,
    vocab_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TokenSplits:
    """Load ``source`` (see the module docstring) and split it.

    ``vocab_size`` is the model's (``model.vocab_size``): the vocabulary of ``.bin``
    tokens, which carry none of their own. ``cache_dir`` is where a URL source is
    copied (``data.cache_dir``). With ``seq_len``, also checks that the training
    split (and a non-empty validation split) holds at least one sequence of
    ``seq_len + 1`` tokens, so that a too-short source fails before training rather
    than at the first eval. Every problem is a DataError naming ``data.source`` (and
    ``model.seq_len`` where it is the cause).
    """
    local = _resolve(source, cache_dir)
    val_name = f"data.val_fraction={val_fraction}"
    if local.kind == "builtin":
        train, val = split_tokens(stdlib_tokens(), val_fraction)
        vocab = VOCAB_SIZE
    elif local.kind == "shards":
        tokens = load_shards(local.path, context=f"data.source {source}")  # type: ignore[arg-type]
        train, val = split_tokens(tokens, val_fraction)
        vocab = getattr(tokens, "vocab_size", VOCAB_SIZE)
    else:
        directory = local.path if local.kind == "bin_dir" else None
        files = [local.path if directory is None else directory / BIN_SPLITS[0]]
        if directory is not None and (directory / BIN_SPLITS[1]).exists():
            files.append(directory / BIN_SPLITS[1])
        arrays = [(path, _open_bin(path, source)) for path in files]  # type: ignore[arg-type]
        vocab = _bin_vocab(arrays, vocab_size, source)  # type: ignore[arg-type]
        if len(arrays) == 2:
            train, val = arrays[0][1], arrays[1][1]
            val_name = BIN_SPLITS[1]
        else:
            train, val = split_tokens(arrays[0][1], val_fraction)
    if seq_len is not None and len(train) < seq_len + 1:
        raise DataError(
            f"data.source {source}: the training split has {len(train)} tokens, fewer than "
            f"model.seq_len + 1 = {seq_len + 1}"
        )
    if seq_len is not None and (val_fraction > 0 or len(val)) and len(val) < seq_len + 1:
        raise DataError(
            f"data.source {source}: the validation split ({val_name}) "
            f"has {len(val)} tokens, fewer than model.seq_len + 1 = {seq_len + 1}"
        )
    return TokenSplits(train=train, val=val, vocab_size=vocab, source=source)
