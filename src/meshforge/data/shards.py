"""Token shards: documents -> ``shard-NNNNN.bin`` files + ``index.json``, and back.

A shard directory made by :func:`prepare` holds raw little-endian token files
(``uint16``, or ``uint32`` for vocabularies over 65536 ids: ``token_dtype``),
read back with ``np.memmap`` (no copy, shared page cache between worker
processes), the tokenizer's files (BPE: ``tokenizer.json``) and an ``index.json``::

    {"format": "meshforge-tokens-v1", "dtype": "uint16", "tokenizer": "byte",
     "vocab_size": 256, "total_tokens": N, "documents": D,
     "sources": [{"path": "a.txt", "format": "text", "bytes": B, "mtime": T,
                  "documents": d, "tokens": n}, ...],
     "shards": [{"file": "shard-00000.bin", "tokens": n0, "sha256": "...",
                 "head_sha256": "...", "tail_sha256": "..."}, ...]}

The token sequence: the sources (see :mod:`meshforge.data.formats`) in sorted
relative-path order, the documents of each in order. The byte tokenizer puts
``DOCUMENT_SEPARATOR`` between two documents (as every index so far); a BPE
tokenizer puts its end-of-document token (``eod_id``) after each. A source's
``tokens`` count its documents' tokens and the separators in front of or after
them, so the sources' tokens add up to ``total_tokens``. The sequence is cut into
shards of ``shard_tokens`` tokens (the last one shorter). Tokenizing runs in a
pool of worker processes over batches of document pieces, in order.

Appending: when ``out`` already has an index that lists its ``sources``,
``prepare`` tokenizes only the sources not listed there and writes them to new
shards after the old ones (the old shard files are not opened for writing, so
they stay byte-identical; the new tokens start in a new shard even when the last
old one is short). A listed source that is gone or changed (size or mtime), or a
tokenizer other than the index's, is a DataError suggesting ``--force``, which
rebuilds everything.

Crash safety: shards are written to a staging directory inside ``out`` and
moved in; the index is written last, atomically. A rebuild removes the old
index before moving shards in, so a crash never leaves an index that lists
missing or half-written shards; an append leaves the old index in place until
the new one replaces it (the new shards have new names), so readers always see
a complete dataset.

Integrity: each shard's sha256 is recorded, and ``head_sha256``/``tail_sha256``,
the sha256 of its first and of its last ``END_CHECK_BYTES`` (1 MiB; the whole file
when smaller). :func:`load_shards` (what training uses) checks every shard's size
and its head and tail digests: 2 MiB read per shard at each start, which catches
a truncated, extended, swapped, replaced or partly copied shard. It does *not*
catch a changed byte in the middle of a big shard; the full sha256 does, in
``meshforge data inspect`` (:mod:`meshforge.data.inspect`) and with
``load_shards(..., verify_checksums=True)``. Indexes written before the head and
tail digests existed are checked by size only.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.data.formats import DEFAULT_FIELD, Source, find_sources, read_pieces, source_files
from meshforge.data.tokenizer import (
    TOKEN_DTYPE,
    VOCAB_SIZE,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer_file,
    token_dtype,
    tokenizer_from_index,
    train_bpe,
)
from meshforge.errors import DataError
from meshforge.fileio import atomic_writer, fsync_dir

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "END_CHECK_BYTES",
    "INDEX_FORMAT",
    "INDEX_NAME",
    "ShardedTokens",
    "end_digests",
    "load_shards",
    "prepare",
    "read_index",
    "sha256_file",
    "source_files",
]

INDEX_FORMAT = "meshforge-tokens-v1"
INDEX_NAME = "index.json"
DEFAULT_SHARD_TOKENS = 16 * 2**20
END_CHECK_BYTES = 2**20  # head_sha256 / tail_sha256 cover this much of each end of a shard
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_SHARD_NAME = re.compile(r"^shard-\d{5,}\.bin$")
_READ_CHUNK_BYTES = 4 * 2**20
_BATCH_CHARS = 2**20  # characters of text sent to a worker at a time
_SMALL_INPUT_BYTES = 8 * 2**20  # below this, workers=None tokenizes in this process
_MAX_AUTO_WORKERS = 16
_HF_CACHE = "hf-cache"  # inside the staging directory: datasets' Arrow cache, thrown away

ProgressFn = Callable[[str, int, int], None]  # (phase, bytes done, bytes in all)


class ShardedTokens:
    """Several 1-D token arrays (shard memmaps) seen as one read-only sequence.

    ``len(t)`` is the total token count; ``t[i]`` a token; ``t[a:b]`` an ndarray
    (a view when the range lies inside one shard, a copy of just that range when
    it crosses shard boundaries). ``t.window(a, b)`` is a lazy sub-sequence.
    From :func:`load_shards`, ``vocab_size`` is the index's and ``tokenizer`` the
    tokenizer the shards were made with (loaded on first use); otherwise None.
    """

    def __init__(
        self,
        parts: Sequence[np.ndarray],
        *,
        dtype: np.dtype | None = None,
        vocab_size: int | None = None,
        tokenizer_entry: dict[str, Any] | str | None = None,
        directory: Path | None = None,
    ) -> None:
        self._parts = [p for p in parts if len(p)]
        if any(p.ndim != 1 for p in self._parts):
            raise ValueError("ShardedTokens parts must be 1-D arrays")
        self._starts = [0]
        for p in self._parts:
            self._starts.append(self._starts[-1] + len(p))
        default = dtype if dtype is not None else TOKEN_DTYPE
        self.dtype = self._parts[0].dtype if self._parts else np.dtype(default)
        self.vocab_size = vocab_size
        self.tokenizer_entry = tokenizer_entry
        self.directory = directory
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer of the index these tokens came from (None without one)."""
        if self._tokenizer is None and self.tokenizer_entry is not None:
            self._tokenizer = tokenizer_from_index(self.tokenizer_entry, self.directory or ".")
        return self._tokenizer

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
        view = ShardedTokens(
            parts,
            dtype=self.dtype,
            vocab_size=self.vocab_size,
            tokenizer_entry=self.tokenizer_entry,
            directory=self.directory,
        )
        view._tokenizer = self._tokenizer
        return view

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self._range(0, len(self))
        return arr.astype(dtype) if dtype is not None else np.array(arr, copy=True)


# --------------------------------------------------------------------------- checksums


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """sha256 of a whole file; ``progress(n)`` after each chunk of ``n`` bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK_BYTES):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def end_digests(path: Path, size: int) -> tuple[str, str]:
    """(head_sha256, tail_sha256): sha256 of the first and of the last
    ``min(size, END_CHECK_BYTES)`` bytes of a file of ``size`` bytes."""
    n = min(size, END_CHECK_BYTES)
    with open(path, "rb") as f:
        head = f.read(n)
        f.seek(size - n)
        tail = f.read(n)
    return hashlib.sha256(head).hexdigest(), hashlib.sha256(tail).hexdigest()


# --------------------------------------------------------------------------- writing


class _ShardWriter:
    """Cuts a stream of token arrays into shard files of ``shard_tokens`` tokens each,
    numbered from ``first``."""

    def __init__(self, directory: Path, shard_tokens: int, dtype: np.dtype, first: int = 0) -> None:
        self.directory = directory
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self.first = first
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._hash: Any = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                name = f"shard-{self.first + len(self.shards):05d}.bin"
                self._file = open(self.directory / name, "wb")  # closed by _finish/abort
                self._hash = hashlib.sha256()
                self._count = 0
                self.shards.append({"file": name, "tokens": 0, "sha256": ""})
            take = min(len(tokens), self.shard_tokens - self._count)
            raw = tokens[:take].astype(self.dtype, copy=False).tobytes()
            self._file.write(raw)
            self._hash.update(raw)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        entry = self.shards[-1]
        head, tail = end_digests(self.directory / entry["file"], self._count * self.dtype.itemsize)
        entry.update(
            tokens=self._count, sha256=self._hash.hexdigest(), head_sha256=head, tail_sha256=tail
        )

    def close(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Encoder:
    """Text pieces -> (their ids concatenated in the shard dtype, each piece's length)."""

    def __init__(self, entry: dict[str, Any] | str, directory: str, dtype: str) -> None:
        self.tokenizer = tokenizer_from_index(entry, Path(directory))
        self.dtype = np.dtype(dtype)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        arrays = self.tokenizer.encode_batch(texts)
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        ids = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.uint32)
        if ids.size and int(ids.max()) >= self.tokenizer.vocab_size:
            raise DataError(
                f"the tokenizer produced id {int(ids.max())}, beyond its vocabulary of "
                f"{self.tokenizer.vocab_size}"
            )
        return ids.astype(self.dtype, copy=False), lengths


_WORKER_ENCODER: _Encoder | None = None


def _init_worker(entry: dict[str, Any] | str, directory: str, dtype: str) -> None:
    # Ctrl-C reaches the whole process group: the parent alone handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel across processes instead
    global _WORKER_ENCODER
    _WORKER_ENCODER = _Encoder(entry, directory, dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER(texts)


Batch = tuple[list[tuple[int, bool]], list[str]]  # ([(source number, ends a document)], texts)


def _batches(pieces: Iterable[tuple[int, str, bool]]) -> Iterator[Batch]:
    meta: list[tuple[int, bool]] = []
    texts: list[str] = []
    chars = 0
    for source, text, ends in pieces:
        meta.append((source, ends))
        texts.append(text)
        chars += len(text)
        if chars >= _BATCH_CHARS:
            yield meta, texts
            meta, texts, chars = [], [], 0
    if meta:
        yield meta, texts


def _encoded(
    batches: Iterable[Batch], encoder_args: tuple[Any, str, str], workers: int
) -> Iterator[tuple[list[tuple[int, bool]], tuple[np.ndarray, np.ndarray]]]:
    """Each batch with its ids, in order; with ``workers > 1`` from a process pool
    (at most ``2 * workers`` batches in flight, so memory stays bounded)."""
    if workers <= 1:
        encode = _Encoder(*encoder_args)
        for meta, texts in batches:
            yield meta, encode(texts)
        return
    # spawn: a fork of this process (progress-bar thread, tokenizers' thread pool) is unsafe
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=encoder_args,
    )
    try:
        pending: deque[Any] = deque()
        for meta, texts in batches:
            pending.append((meta, pool.submit(_encode_in_worker, texts)))
            if len(pending) >= 2 * workers:
                done_meta, future = pending.popleft()
                yield done_meta, future.result()
        while pending:
            done_meta, future = pending.popleft()
            yield done_meta, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _tokenize(
    sources: list[Source],
    sizes: list[int],
    field: str,
    tokenizer: Tokenizer,
    encoder_args: tuple[Any, str, str],
    writer: _ShardWriter,
    *,
    workers: int,
    after_documents: bool,
    cache_dir: Path,
    progress: ProgressFn | None,
) -> list[dict[str, int]]:
    """Write the tokens of ``sources`` through ``writer``; per source its documents
    and tokens. ``after_documents``: the shards already hold documents (appending)."""
    between = tokenizer.kind == "byte"  # separator between documents, else after each
    separator = np.array([tokenizer.eod_id], dtype=writer.dtype)
    counts = [{"documents": 0, "tokens": 0} for _ in sources]
    total = sum(sizes)

    pieces = _pieces(sources, sizes, field, cache_dir, "tokenizing", progress)
    at_start, first = True, not after_documents
    for meta, (ids, lengths) in _encoded(_batches(pieces), encoder_args, workers):
        ends_at = np.cumsum(lengths)
        for (number, ends), end, length in zip(meta, ends_at, lengths, strict=True):
            count = counts[number]
            if at_start and between and not first:
                writer.write(separator)
                count["tokens"] += 1
            writer.write(ids[end - length : end])
            count["tokens"] += int(length)
            at_start = first = False
            if ends:
                if not between:
                    writer.write(separator)
                    count["tokens"] += 1
                count["documents"] += 1
                at_start = True
    if progress is not None:
        progress("tokenizing", total, total)
    return counts


def _pieces(
    sources: list[Source],
    sizes: list[int],
    field: str,
    cache_dir: Path,
    phase: str,
    progress: ProgressFn | None,
) -> Iterator[tuple[int, str, bool]]:
    """(source number, text, ends a document) of every piece of ``sources``, in order,
    telling ``progress`` how many of all their bytes are read."""
    total, before = sum(sizes), 0
    for number, (source, size) in enumerate(zip(sources, sizes, strict=True)):

        def on_read(n: int, before: int = before, size: int = size) -> None:
            if progress is not None:
                progress(phase, before + min(n, size), total)

        for text, ends in read_pieces(source, field, cache_dir=cache_dir, on_read=on_read):
            yield number, text, ends
        before += size


def _write_json_atomic(path: Path, obj: Any) -> None:
    # a plain file's mode (0644 under the usual umask), as the shards have, so other
    # users of shared storage can read the index
    with atomic_writer(path, "w", fsync=True) as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


# --------------------------------------------------------------------------- prepare


def _default_workers(input_bytes: int, kind: str) -> int:
    # The byte tokenizer is a numpy cast, faster than shipping text to another process;
    # for small inputs a pool's start-up costs more than it saves.
    if kind == "byte" or input_bytes < _SMALL_INPUT_BYTES:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, _MAX_AUTO_WORKERS))


def _check_options(
    shard_tokens: int,
    tokenizer: str | None,
    vocab_size: int | None,
    tokenizer_file: Path | None,
    workers: int | None,
) -> None:
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if workers is not None and workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    if tokenizer not in (None, "byte", "bpe"):
        raise DataError(f"--tokenizer: expected byte or bpe, got {tokenizer!r}")
    if tokenizer_file is not None and tokenizer == "byte":
        raise DataError("--tokenizer-file gives a BPE tokenizer; drop --tokenizer byte")
    if tokenizer_file is not None and vocab_size is not None:
        raise DataError("--vocab-size trains a tokenizer; --tokenizer-file brings one: not both")
    if vocab_size is not None and tokenizer != "bpe":
        raise DataError("--vocab-size is for --tokenizer bpe (the byte tokenizer has 256 ids)")


def _kind(entry: dict[str, Any] | str) -> str:
    return entry if isinstance(entry, str) else str(entry.get("kind"))


def _new_sources(
    index: dict[str, Any], sources: list[Source], index_path: Path, src: Path
) -> list[Source]:
    """The sources not in ``index`` yet; DataError if a listed one is gone or changed."""
    listed = index.get("sources")
    if not isinstance(listed, list) or not all(
        isinstance(e, dict) and isinstance(e.get("path"), str) for e in listed
    ):
        raise DataError(
            f"{index_path} already exists and does not list its sources (made by an older "
            "meshforge), so new files cannot be told from old ones; use --force to rebuild it"
        )
    current = {s.rel: s for s in sources}
    for entry in listed:
        source = current.get(entry["path"])
        if source is None:
            raise DataError(
                f"{index_path} already exists and lists source {entry['path']}, which is not "
                f"in {src} now (removed, renamed or not matched); use --force to rebuild it"
            )
        size, mtime = source.stat()
        if size != entry.get("bytes") or mtime != entry.get("mtime"):
            raise DataError(
                f"{index_path} already exists and source {entry['path']} changed since it "
                "was prepared (size or mtime); use --force to rebuild it"
            )
        if source.format != entry.get("format", source.format):
            raise DataError(
                f"{index_path} already exists and read {entry['path']} as {entry['format']}, "
                f"not {source.format}; use --force to rebuild it"
            )
    done = {e["path"] for e in listed}
    return [s for s in sources if s.rel not in done]


def _check_same_tokenizer(
    index: dict[str, Any],
    tokenizer: str | None,
    vocab_size: int | None,
    tokenizer_file: Path | None,
    index_path: Path,
    staging: Path,
) -> None:
    """Appending must use the index's tokenizer; asking for another is a DataError."""
    entry, kind = index["tokenizer"], _kind(index["tokenizer"])
    hint = "use --force to rebuild the shards with another"
    wanted = "bpe" if tokenizer_file is not None else tokenizer
    if wanted is not None and wanted != kind:
        raise DataError(
            f"{index_path}: the shards were made with the {kind} tokenizer, not {wanted}; {hint}"
        )
    made_for = index.get("requested_vocab_size", index["vocab_size"])
    if vocab_size is not None and vocab_size != made_for:
        raise DataError(
            f"{index_path}: the shards' tokenizer was trained for --vocab-size {made_for}, "
            f"not {vocab_size}; {hint}"
        )
    if tokenizer_file is not None:
        given = load_tokenizer_file(tokenizer_file).save(staging / "given")
        if not isinstance(entry, dict) or given.get("sha256") != entry.get("sha256"):
            raise DataError(
                f"{index_path}: the shards were made with another tokenizer than "
                f"{tokenizer_file}; {hint}"
            )


def _check_old_shards(directory: Path) -> None:
    try:
        load_shards(directory, context=str(directory))
    except DataError as exc:
        raise DataError(f"{exc}; appending needs intact shards (use --force to rebuild)") from None


def _make_tokenizer(
    tokenizer: str | None,
    vocab_size: int | None,
    tokenizer_file: Path | None,
    sources: list[Source],
    sizes: list[int],
    field: str,
    cache_dir: Path,
    progress: ProgressFn | None,
) -> Tokenizer:
    if tokenizer_file is not None:
        return load_tokenizer_file(tokenizer_file)
    if tokenizer != "bpe":
        return ByteTokenizer()
    if vocab_size is None:
        raise DataError("--tokenizer bpe needs --vocab-size V (or a --tokenizer-file)")
    pieces = _pieces(sources, sizes, field, cache_dir, "training BPE", progress)
    return train_bpe((text for _, text, _ in pieces), vocab_size)


def prepare(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    *,
    fmt: str = "auto",
    field: str = DEFAULT_FIELD,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    tokenizer_file: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    pattern: str | None = None,
    force: bool = False,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Tokenize the documents of ``src`` into shards in ``out``; return the index written.

    ``fmt``/``field``/``pattern`` choose the sources (:func:`formats.find_sources`).
    The tokenizer: ``"byte"`` (the default for a new directory), ``"bpe"`` trained on
    the sources with ``vocab_size`` ids, or the BPE ``tokenizer_file``; when
    appending, the index's (``None``), and asking for another is a DataError.
    ``workers``: tokenizing processes (``None``: BPE on one per CPU, up to 16; the
    byte tokenizer, and inputs under 8 MiB, in this process). A pool is started
    with ``spawn``, so a script calling this needs the ``if __name__ == "__main__":``
    guard, as for any multiprocessing. With an index in ``out``, only sources
    it does not list are added (see the module docstring); ``force`` rebuilds from
    scratch. If nothing is new the index is returned unchanged. Bad input (missing
    or empty ``src``, an unreadable file, a malformed record) raises DataError
    before any existing index or shard is touched.
    """
    src_path, out_dir = Path(src), Path(out)
    file = Path(tokenizer_file) if tokenizer_file is not None else None
    _check_options(shard_tokens, tokenizer, vocab_size, file, workers)
    index_path = out_dir / INDEX_NAME
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a directory")
    old = None
    if index_path.exists() and not force:
        try:
            old = read_index(out_dir, str(out_dir))
        except DataError as exc:
            raise DataError(f"{exc}; use --force to replace it") from None

    sources = find_sources(src_path, fmt, pattern, exclude=out_dir)
    if not sources:
        matching = f" matching {pattern!r}" if pattern else ""
        raise DataError(f"{src_path}: no files{matching} to read")
    new = _new_sources(old, sources, index_path, src_path) if old is not None else sources
    if old is not None:
        _check_old_shards(out_dir)
    stats = [s.stat() for s in new]  # before reading: a change while reading shows next time
    sizes = [size for size, _ in stats]
    if old is None and sum(sizes) == 0:
        raise DataError(f"{src_path}: empty (no bytes to tokenize)")

    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    cache_dir = staging / _HF_CACHE
    writer: _ShardWriter | None = None
    try:
        if old is not None:
            _check_same_tokenizer(old, tokenizer, vocab_size, file, index_path, staging)
            if not new:
                return old
            entry, tokenizer_dir = old["tokenizer"], out_dir
        else:
            made = _make_tokenizer(
                tokenizer, vocab_size, file, new, sizes, field, cache_dir, progress
            )
            entry, tokenizer_dir = made.save(staging), staging
        tok = tokenizer_from_index(entry, tokenizer_dir)  # what the shards will be read with
        dtype = token_dtype(tok.vocab_size)
        first_shard = len(old["shards"]) if old is not None else 0
        writer = _ShardWriter(staging, shard_tokens, dtype, first_shard)
        n_workers = workers or _default_workers(sum(sizes), tok.kind)
        counts = _tokenize(
            new,
            sizes,
            field,
            tok,
            (entry, str(tokenizer_dir), dtype.str),
            writer,
            workers=n_workers,
            after_documents=old is not None and old.get("documents", 1) > 0,
            cache_dir=cache_dir,
            progress=progress,
        )
        shards = writer.close()
        records = []
        for source, (size, mtime), count in zip(new, stats, counts, strict=True):
            records.append(
                {"path": source.rel, "format": source.format, "bytes": size, "mtime": mtime} | count
            )
        index = _new_index(old, entry, tok.vocab_size, dtype, records, shards)
        if tokenizer == "bpe" and file is None and old is None:
            index["requested_vocab_size"] = vocab_size
        if index["total_tokens"] == 0:
            raise DataError(f"{src_path}: empty (no text to tokenize)")
        _commit(staging, out_dir, index, append=old is not None)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return index


def _new_index(
    old: dict[str, Any] | None,
    entry: dict[str, Any] | str,
    vocab_size: int,
    dtype: np.dtype,
    records: list[dict[str, Any]],
    shards: list[dict[str, Any]],
) -> dict[str, Any]:
    if old is not None:
        records = old["sources"] + records
        shards = old["shards"] + shards
    index = {
        "format": INDEX_FORMAT,
        "dtype": dtype.name,
        "tokenizer": entry,
        "vocab_size": vocab_size,
        "total_tokens": sum(s["tokens"] for s in shards),
        "documents": sum(r["documents"] for r in records),
        "sources": records,
        "shards": shards,
    }
    if old is not None and "requested_vocab_size" in old:
        index["requested_vocab_size"] = old["requested_vocab_size"]
    return index


def _commit(staging: Path, out_dir: Path, index: dict[str, Any], *, append: bool) -> None:
    """Move staged files into ``out_dir``; the index goes last, atomically.

    A rebuild removes the old index first, so between here and the final rename
    the directory has no index at all (never one that lists the wrong files). An
    append keeps the old index: the files moved in have names it does not list.
    """
    index_path = out_dir / INDEX_NAME
    previous = _lenient_index(index_path)
    if not append:
        index_path.unlink(missing_ok=True)
        fsync_dir(out_dir, best_effort=True)
    names = {s["file"] for s in index["shards"]}
    entry = index["tokenizer"]
    tokenizer_file = entry.get("file") if isinstance(entry, dict) else None
    for name in sorted(names | {tokenizer_file} - {None}):
        if (staging / name).exists():
            os.replace(staging / name, out_dir / name)
    for stale in out_dir.iterdir():  # shards of a previous, larger dataset, or a crashed run
        if _SHARD_NAME.match(stale.name) and stale.name not in names:
            stale.unlink()
    old_entry = previous.get("tokenizer") if previous else None
    old_file = old_entry.get("file") if isinstance(old_entry, dict) else None
    if isinstance(old_file, str) and old_file != tokenizer_file and "/" not in old_file:
        (out_dir / old_file).unlink(missing_ok=True)  # the replaced index's tokenizer
    fsync_dir(out_dir, best_effort=True)
    _write_json_atomic(index_path, index)
    fsync_dir(out_dir, best_effort=True)


def _lenient_index(path: Path) -> dict[str, Any] | None:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None


# --------------------------------------------------------------------------- loading


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def read_index(directory: Path, context: str) -> dict[str, Any]:
    """The validated ``index.json`` of a shard directory (no shard file is opened).

    Problems raise DataError prefixed by ``context``.
    """
    index_path = Path(directory) / INDEX_NAME
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
    _check_vocabulary(index, index_path, context)
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
            and all(_is_digest(entry[k]) for k in ("head_sha256", "tail_sha256") if k in entry)
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


def _check_vocabulary(index: dict[str, Any], index_path: Path, context: str) -> None:
    dtype, vocab, entry = index.get("dtype"), index.get("vocab_size"), index.get("tokenizer")
    if dtype not in DTYPES:
        raise DataError(f"{context}: {index_path} has dtype={dtype!r}, expected uint16 or uint32")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise DataError(f"{context}: {index_path} has vocab_size={vocab!r}, expected an id count")
    if DTYPES[dtype].itemsize < token_dtype(vocab).itemsize:
        raise DataError(f"{context}: {index_path}: vocab_size={vocab} does not fit dtype {dtype}")
    if not (entry == "byte" or (isinstance(entry, dict) and isinstance(entry.get("kind"), str))):
        raise DataError(
            f"{context}: {index_path} has tokenizer={entry!r}, expected 'byte' or a BPE entry"
        )
    if _kind(entry) == "byte" and vocab != VOCAB_SIZE:
        raise DataError(
            f"{context}: {index_path} has vocab_size={vocab} for the byte tokenizer "
            f"(expected {VOCAB_SIZE})"
        )


def check_shard(directory: Path, entry: dict[str, Any], dtype: np.dtype, context: str) -> Path:
    """The cheap load-time check of one shard: it exists with exactly ``tokens``
    tokens, and its first and last MiB match ``head_sha256``/``tail_sha256`` when the
    index has them. Returns its path; DataError naming it otherwise."""
    path = directory / entry["file"]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{context}: {path} is listed in {INDEX_NAME} but missing") from None
    expected = entry["tokens"] * dtype.itemsize
    if size != expected:
        raise DataError(
            f"{context}: {path} has {size} bytes but {INDEX_NAME} says "
            f"{entry['tokens']} tokens ({expected} bytes)"
        )
    if "head_sha256" in entry or "tail_sha256" in entry:
        head, tail = end_digests(path, size)
        for end, digest in (("head", head), ("tail", tail)):
            if entry.get(f"{end}_sha256", digest) != digest:
                which = "first" if end == "head" else "last"
                raise DataError(
                    f"{context}: {path} is damaged: its {which} {min(size, END_CHECK_BYTES)} "
                    f"bytes do not match {end}_sha256 in {INDEX_NAME} "
                    f"(`meshforge data inspect {directory}` checks every shard)"
                )
    return path


def load_shards(
    directory: str | os.PathLike[str],
    *,
    verify_checksums: bool = False,
    context: str | None = None,
) -> ShardedTokens:
    """Memory-map the shards of a directory made by :func:`prepare` as one sequence.

    Checks the index and every shard with :func:`check_shard` (size, and the
    sha256 of its first and last MiB: a corrupted byte in the middle of a big
    shard is not caught here, but by ``meshforge data inspect``); with
    ``verify_checksums`` also each file's full sha256 (reads every byte, so off by
    default). Problems raise DataError prefixed by ``context`` (default: the
    directory) and naming the offending file.
    """
    root = Path(directory)
    context = context or str(root)
    index = read_index(root, context)
    dtype = DTYPES[index["dtype"]]
    parts = []
    for entry in index["shards"]:
        path = check_shard(root, entry, dtype, context)
        if verify_checksums and sha256_file(path) != entry["sha256"]:
            raise DataError(f"{context}: {path} does not match its sha256 in {INDEX_NAME}")
        if entry["tokens"]:  # np.memmap cannot map an empty file
            parts.append(np.memmap(path, dtype=dtype, mode="r", shape=(entry["tokens"],)))
    return ShardedTokens(
        parts,
        dtype=dtype,
        vocab_size=index["vocab_size"],
        tokenizer_entry=index["tokenizer"],
        directory=root,
    )
