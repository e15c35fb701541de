"""Input formats of ``meshforge data prepare``: sources, and the documents they hold.

``find_sources(src, fmt)`` lists the *sources* under ``src`` in sorted relative-path
order; ``read_pieces(source, field)`` yields the text of each source's documents,
in order, as pieces of at most ``PIECE_CHARS`` characters. A source is one of

- ``text``: a UTF-8 file; the whole file is one document (bytes kept as they are:
  no newline translation, a BOM stays).
- ``jsonl``: JSON Lines; each non-blank line is an object and the string in its
  ``field`` (default ``"text"``) is one document. A line that is not an object,
  lacks the field or holds a non-string is a DataError naming ``file:line``.
- ``parquet``: a Parquet file (``pyarrow``); each row's ``field`` column is a document.
- ``hf``: a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (a
  directory holding ``state.json`` and ``dataset_info.json``, or
  ``dataset_dict.json``: its ``train`` split, or its only split), or a local
  file loaded with ``datasets.load_dataset(builder, data_files=...)``: ``.jsonl``,
  ``.ndjson`` and ``.json`` with the ``json`` builder, ``.parquet`` with the
  ``parquet`` builder, anything else with the ``text`` builder (one document per
  file; that builder reads in universal-newline mode, so ``\\r\\n`` becomes ``\\n``).
  Nothing is downloaded: ``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set
  before ``datasets`` is imported, and its cache goes to a directory the caller
  gives (``prepare`` uses its staging directory, removed afterwards).

``fmt="auto"`` picks per source: a saved dataset directory is ``hf``, ``.jsonl``
and ``.ndjson`` files are ``jsonl``, ``.parquet`` files are ``parquet``, all
other files ``text``. ``pyarrow`` and ``datasets`` are imported only when a
source needs them; a missing one is a one-line DataError saying what to install.

Pieces are a pure function of a document's text (see :class:`Chunker`), so the
same documents give the same pieces, and hence the same tokens, whichever format
they come in.
"""

from __future__ import annotations

import codecs
import fnmatch
import importlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from meshforge.errors import DataError, shorten

FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
DEFAULT_FIELD = "text"
PIECE_CHARS = 2**20  # a document longer than this is tokenized in pieces (see Chunker)
_READ_CHUNK_BYTES = 4 * 2**20
# The longest JSON Lines line read. One line is one document, parsed whole by
# json.loads (a few times its size in memory); the longest single documents of common
# corpora (whole books) are a few megabytes, so 64 MiB refuses only input that is not
# line-delimited at all (a JSON array on one line, a binary file), before it is held
# in memory. Lines are read at most this many bytes at a time.
MAX_JSONL_LINE_BYTES = 64 * 2**20
_BATCH_ROWS = 1024
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_HF_JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
_HF_SAVED_MARKERS = (("state.json", "dataset_info.json"), ("dataset_dict.json",))

Piece = tuple[str, bool]  # (text, this piece ends its document)
ReadFn = Callable[[int], None]  # bytes of the source consumed so far (for a progress bar)


@dataclass(frozen=True)
class Source:
    """One input of ``prepare``: a file, or a saved ``datasets`` directory.

    ``rel`` is its path relative to SRC (SRC's own name when SRC is the source);
    ``format`` one of ``text``, ``jsonl``, ``parquet``, ``hf``.
    """

    rel: str
    path: Path
    format: str

    def stat(self) -> tuple[int, float]:
        """(bytes, mtime): the file's, or a directory's total bytes and newest mtime."""
        try:
            if self.path.is_file():
                st = self.path.stat()
                return st.st_size, st.st_mtime
            size, mtime = 0, self.path.stat().st_mtime
            for dirpath, _, filenames in os.walk(self.path):
                for name in filenames:
                    st = (Path(dirpath) / name).stat()
                    size, mtime = size + st.st_size, max(mtime, st.st_mtime)
            return size, mtime
        except OSError as exc:
            raise DataError(f"{exc.filename}: cannot read ({exc.strerror})") from None


# --------------------------------------------------------------------------- finding sources


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any(
        all((path / name).is_file() for name in names) for names in _HF_SAVED_MARKERS
    )


def _file_format(name: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    lower = name.lower()
    if lower.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    return "text"


def _matches(rel: str, name: str, pattern: str | None) -> bool:
    return (
        pattern is None or fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(name, pattern)
    )


def find_sources(
    src: str | os.PathLike[str],
    fmt: str = "auto",
    pattern: str | None = None,
    exclude: Path | None = None,
) -> list[Source]:
    """The sources ``prepare`` reads from ``src``, sorted by relative path.

    A file is itself; a directory is walked recursively (symlinked directories
    are not followed; names starting with "." are skipped, so ``.git`` stays out)
    for regular files whose relative path or name matches ``pattern`` (fnmatch,
    case-sensitive; ``None`` takes all). With ``fmt`` ``auto`` or ``hf`` a saved
    ``datasets`` directory is one source (not walked into). Files under
    ``exclude`` are skipped so that an output directory inside ``src`` is never
    read back.
    """
    if fmt not in FORMATS:
        raise DataError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    root = Path(src)
    if not root.exists():
        raise DataError(f"{root}: no such file or directory")
    datasets_too = fmt in ("auto", "hf")
    if root.is_file():
        return [Source(root.name, root, _file_format(root.name, fmt))]
    if not root.is_dir():
        raise DataError(f"{root}: not a regular file or directory")
    if datasets_too and is_saved_dataset(root):
        return [Source(root.resolve().name, root, "hf")]

    def _walk_error(exc: OSError) -> None:
        raise DataError(f"{exc.filename}: cannot list directory ({exc.strerror})")

    excluded = exclude.resolve() if exclude is not None else None
    found: list[Source] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_walk_error):
        here = Path(dirpath)
        kept = []
        for d in sorted(dirnames):
            path = here / d
            if d.startswith(".") or (excluded is not None and path.resolve() == excluded):
                continue
            if datasets_too and is_saved_dataset(path):
                rel = path.relative_to(root).as_posix()
                if _matches(rel, d, pattern):
                    found.append(Source(rel, path, "hf"))
                continue
            kept.append(d)
        dirnames[:] = kept
        for name in filenames:
            path = here / name
            if name.startswith(".") or not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            if _matches(rel, name, pattern):
                found.append(Source(rel, path, _file_format(name, fmt)))
    found.sort(key=lambda source: source.rel)
    return found


def source_files(
    src: str | os.PathLike[str], pattern: str | None = None, exclude: Path | None = None
) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every file ``prepare`` would read as text."""
    return [(s.rel, s.path) for s in find_sources(src, "text", pattern, exclude)]


# --------------------------------------------------------------------------- documents -> pieces


def _is_split_point(prev: str, cur: str) -> bool:
    # A space or newline right after a letter, digit or ASCII symbol: GPT-2's
    # pre-tokenizer splits there anyway (the whitespace starts the next pre-token),
    # so a cut here leaves byte-level BPE ids unchanged (see meshforge.data.tokenizer).
    return cur in " \n" and (prev.isalnum() or "!" <= prev <= "~")


def _cut(text: str, limit: int) -> int:
    """Where the next piece of ``text`` (longer than ``limit``) ends: the last split
    point among its first ``limit`` characters, else ``limit``."""
    end = limit
    while True:
        at = max(text.rfind(" ", 1, end), text.rfind("\n", 1, end))
        if at <= 0:
            return limit
        if _is_split_point(text[at - 1], text[at]):
            return at
        end = at


class Chunker:
    """Cuts one document's text into pieces of at most ``limit`` characters.

    While more than ``limit`` characters remain, the next piece ends before the
    last space or newline (that follows a non-space character) among the next
    ``limit`` characters, or at ``limit`` when there is none. The cut depends
    only on the text, never on how it was fed in, so a file streamed in chunks
    and the same text given whole give the same pieces; and byte-level BPE
    splits there anyway, so the pieces' ids are the whole document's ids.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit or PIECE_CHARS
        self._buf = ""

    def feed(self, text: str) -> Iterator[str]:
        self._buf += text
        while len(self._buf) > self.limit:
            cut = _cut(self._buf, self.limit)
            piece, self._buf = self._buf[:cut], self._buf[cut:]
            yield piece

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        return rest


def document_pieces(text: str, limit: int | None = None) -> Iterator[Piece]:
    """The pieces of one document; the last (possibly empty) one ends it."""
    chunker = Chunker(limit)
    yield from ((piece, False) for piece in chunker.feed(text))
    yield chunker.finish(), True


def read_pieces(
    source: Source,
    field: str = DEFAULT_FIELD,
    *,
    cache_dir: Path | None = None,
    on_read: ReadFn | None = None,
) -> Iterator[Piece]:
    """The documents of ``source`` as pieces, in order; the last piece of each ends it.

    ``on_read(n)`` is told how many of the source's bytes are consumed so far
    (estimated by rows for Parquet and ``datasets``). ``cache_dir`` is where
    ``datasets.load_dataset`` may write its Arrow cache (required for ``hf`` files).
    """
    report = on_read or (lambda n: None)
    if source.format == "text":
        return _text_pieces(source.path, report)
    if source.format == "jsonl":
        return _pieces_of(_jsonl_documents(source.path, field, report))
    if source.format == "parquet":
        return _pieces_of(_parquet_documents(source, field, report))
    if source.format == "hf":
        return _pieces_of(_hf_documents(source, field, cache_dir, report))
    raise DataError(f"{source.path}: unknown format {source.format!r}")


def count_documents(pieces: Iterator[Piece]) -> int:
    return sum(1 for _, ends in pieces if ends)


def _pieces_of(documents: Iterator[str]) -> Iterator[Piece]:
    for text in documents:
        yield from document_pieces(text)


def _text_pieces(path: Path, report: ReadFn) -> Iterator[Piece]:
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    chunker = Chunker()
    pending: str | None = None  # one piece held back: only the last one ends the document
    done = 0
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_READ_CHUNK_BYTES)
                held = len(decoder.getstate()[0])  # bytes of a character cut by the last read
                try:
                    text = decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"{path}: not UTF-8 text (bad byte at offset {done - held + exc.start}); "
                        "choose the files to read with --glob"
                    ) from None
                for piece in chunker.feed(text):
                    if pending is not None:
                        yield pending, False
                    pending = piece
                done += len(chunk)
                report(done)
                if not chunk:
                    break
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    if pending is not None:
        yield pending, False
    yield chunker.finish(), True


def _bounded_lines(f: Any, path: Path, limit: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a binary file, each line read at most LIMIT + 1 bytes at
    a time: a longer line is a DataError naming it, raised before it is held whole."""
    lineno = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        lineno += 1
        if len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
            raise DataError(
                f"{path}:{lineno}: line longer than {limit:,} bytes (the limit, "
                "MAX_JSONL_LINE_BYTES); is the file JSON Lines, one document per line?"
            )
        yield lineno, line


def _jsonl_documents(path: Path, field: str, report: ReadFn) -> Iterator[str]:
    done = 0
    try:
        with open(path, "rb") as f:
            for lineno, line in _bounded_lines(f, path, MAX_JSONL_LINE_BYTES):
                done += len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                    raise DataError(f"{path}:{lineno}: not valid JSON ({reason})") from None
                if not isinstance(record, dict):
                    raise DataError(
                        f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
                    )
                if field not in record:
                    keys = ", ".join(shorten(str(k), 40) for k in list(record)[:8]) or "none"
                    raise DataError(
                        f"{path}:{lineno}: no field {field!r} (fields: {keys}); "
                        "choose one with --field"
                    )
                text = record[field]
                if not isinstance(text, str):
                    raise DataError(
                        f"{path}:{lineno}: field {field!r} holds {type(text).__name__}, "
                        "not a string"
                    )
                yield text
                report(done)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None


def _require(module: str, package: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the {package!r} package: pip install {package}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _string_rows(
    path: Path, field: str, columns: Iterator[Any], total_rows: int, size: int, report: ReadFn
) -> Iterator[str]:
    """Yield the strings of Arrow arrays of ``field`` (chunks of one column), refusing nulls."""
    row = 0
    for column in columns:
        values = column.to_pylist()
        if column.null_count:
            first = next(i for i, v in enumerate(values) if v is None)
            raise DataError(f"{path}: row {row + first}: {field!r} is null, not a string")
        yield from values
        row += len(values)
        report(size * row // max(total_rows, 1))


def _check_string_column(path: Path, field: str, names: list[str], arrow_type: Any) -> None:
    pa = importlib.import_module("pyarrow")
    if field not in names:
        raise DataError(
            f"{path}: no column {field!r} (columns: {', '.join(names) or 'none'}); "
            "choose one with --field"
        )
    string_types = (pa.types.is_string, pa.types.is_large_string)
    if not any(check(arrow_type) for check in string_types):
        raise DataError(f"{path}: column {field!r} holds {arrow_type}, not strings")


def _parquet_documents(source: Source, field: str, report: ReadFn) -> Iterator[str]:
    _require("pyarrow", "pyarrow", f"{source.path}: reading Parquet")
    pq = importlib.import_module("pyarrow.parquet")
    path = source.path
    try:
        pf = pq.ParquetFile(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or _first_line(exc)})") from None
    except Exception as exc:  # pyarrow.ArrowInvalid: not a Parquet file
        raise DataError(f"{path}: not a Parquet file ({_first_line(exc)})") from None
    schema = pf.schema_arrow
    names = list(schema.names)
    _check_string_column(path, field, names, schema.field(field).type if field in names else None)
    columns = (b.column(0) for b in pf.iter_batches(batch_size=_BATCH_ROWS, columns=[field]))
    yield from _string_rows(path, field, columns, pf.metadata.num_rows, source.stat()[0], report)


def _import_datasets(what: str) -> ModuleType:
    # Set before the first import: `datasets` reads them once, at import time.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    datasets = _require("datasets", "datasets", what)
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _hf_builder(name: str) -> tuple[str, dict[str, Any]]:
    lower = name.lower()
    if lower.endswith(_HF_JSON_SUFFIXES):
        return "json", {}
    if lower.endswith(".parquet"):
        return "parquet", {}
    return "text", {"sample_by": "document", "keep_linebreaks": True}


def _hf_dataset(source: Source, cache_dir: Path | None) -> Any:
    path = source.path
    datasets = _import_datasets(f"{path}: reading a Hugging Face dataset")
    if cache_dir is None and not is_saved_dataset(path):
        raise ValueError("cache_dir is required to load a file with `datasets`")
    try:
        if is_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                splits = list(loaded)
                if len(splits) != 1 and "train" not in splits:
                    raise DataError(
                        f"{path}: a dataset with splits {', '.join(splits)} and no 'train'; "
                        "save the split to use with save_to_disk"
                    )
                loaded = loaded["train" if "train" in splits else splits[0]]
            return loaded
        builder, options = _hf_builder(path.name)
        return datasets.load_dataset(
            builder,
            data_files=[str(path)],
            split="train",
            cache_dir=str(cache_dir),
            **options,
        )
    except DataError:
        raise
    except Exception as exc:  # datasets raises many kinds; all mean "cannot use this input"
        raise DataError(f"{path}: cannot load with datasets ({_first_line(exc)})") from None


def _hf_documents(
    source: Source, field: str, cache_dir: Path | None, report: ReadFn
) -> Iterator[str]:
    dataset = _hf_dataset(source, cache_dir)
    path = source.path
    table_schema = dataset.data.schema
    names = list(dataset.column_names)
    arrow_type = table_schema.field(field).type if field in table_schema.names else None
    _check_string_column(path, field, names, arrow_type)
    subset = dataset.select_columns([field]).with_format("arrow")
    columns = (
        subset[i : i + _BATCH_ROWS].column(field) for i in range(0, len(subset), _BATCH_ROWS)
    )
    yield from _string_rows(path, field, columns, len(subset), source.stat()[0], report)
