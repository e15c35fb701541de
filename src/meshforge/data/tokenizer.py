"""Tokenizers: byte-level (vocabulary 256) and byte-level BPE (the ``tokenizers`` package).

Every tokenizer has the same small interface (:class:`Tokenizer`): ``kind``,
``vocab_size``, ``eod_id`` (the end-of-document token), ``encode(text)`` -> a
1-D ``np.uint32`` id array, ``encode_batch(texts)``, ``decode(ids)`` and
``save(directory)``, which writes the tokenizer's files beside the shards and
returns the entry that ``index.json`` records under ``"tokenizer"``:

- byte: the string ``"byte"`` (what every index has said so far). One token per
  UTF-8 byte; documents are joined by ``DOCUMENT_SEPARATOR`` (0x1e).
- BPE: ``{"kind": "bpe", "file": "tokenizer.json", "sha256": ..., "vocab_size": V,
  "eod_id": E}``. :func:`tokenizer_from_index` refuses a ``tokenizer.json``
  whose sha256 differs from the entry (the shards' ids would mean other text).

A BPE tokenizer is trained on the user's own text (:func:`train_bpe`, nothing
downloaded) or loaded from a user's ``tokenizer.json`` (:func:`load_tokenizer_file`).
A trained one is GPT-2 style: no normalizer, the ByteLevel pre-tokenizer (GPT-2
regex, no prefix space) and decoder, every byte in the initial alphabet, so
``decode(encode(text)) == text`` for any text, and ``"<|endoftext|>"`` as its
end-of-document special token. ``tokenizers`` is imported lazily: the byte path
never needs it.

Long texts are cut into chunks at points where the GPT-2 pre-tokenizer splits
anyway (a space or newline after a letter, digit or ASCII symbol: no pre-token
spans such a point), so chunking never changes the ids, and the chunks are
encoded with ``encode_batch`` (Rust threads; ``TOKENIZERS_PARALLELISM``).

The module functions ``encode``/``decode``/``encode_bytes``, ``VOCAB_SIZE`` and
``TOKEN_DTYPE`` are the byte tokenizer as before (``uint16`` arrays).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from meshforge.errors import DataError
from meshforge.fileio import write_bytes_atomic

VOCAB_SIZE = 256
TOKEN_DTYPE = np.dtype("<u2")  # little-endian uint16, the on-disk dtype of byte-token shards
ID_DTYPE = np.dtype(np.uint32)  # what Tokenizer.encode returns, whatever the vocabulary

# Written between documents (files) when several are concatenated into one token
# sequence: ASCII "record separator", a byte ordinary text never contains, so a
# model can learn where one document ends and the next begins.
DOCUMENT_SEPARATOR = b"\x1e"

BPE_FILE = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"
# End-of-document tokens recognised in a user's tokenizer.json, in order of preference.
_EOD_CANDIDATES = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
BPE_MIN_VOCAB = 256 + 1  # every byte + "<|endoftext|>"
BPE_MAX_VOCAB = 2**31 - 1
_CHUNK_CHARS = 1 << 16  # target length of one encode_batch input
_BATCH_CHARS = 1 << 23  # characters handed to one encode_batch call (bounds Encoding memory)


def token_dtype(vocab_size: int) -> np.dtype:
    """On-disk dtype of token shards for a vocabulary: ``<u2`` up to 65536 ids, else ``<u4``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


# --------------------------------------------------------------------------- byte tokenizer


def encode_bytes(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Token array (uint16) of raw bytes: token i is the value of byte i."""
    return np.frombuffer(data, dtype=np.uint8).astype(TOKEN_DTYPE)


def encode(text: str) -> np.ndarray:
    """Token array (uint16) of the UTF-8 bytes of ``text``."""
    return encode_bytes(text.encode("utf-8"))


def _as_id_array(tokens: Any) -> np.ndarray:
    if hasattr(tokens, "cpu"):  # a torch tensor, possibly on an accelerator
        tokens = tokens.cpu()
    if not hasattr(tokens, "__array__") and not isinstance(tokens, (list, tuple)):
        tokens = list(tokens)  # a generator or other plain iterable
    return np.asarray(tokens).reshape(-1)


def decode(tokens: np.ndarray | Iterable[int]) -> str:
    """Text of a token sequence; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
    arr = _as_id_array(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"token out of the byte vocabulary [0, {VOCAB_SIZE})")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@runtime_checkable
class Tokenizer(Protocol):
    """What shards, the loader and ``meshforge sample`` need of a tokenizer."""

    kind: str  # "byte" | "bpe"
    vocab_size: int
    eod_id: int  # the end-of-document token

    def encode(self, text: str) -> np.ndarray: ...  # 1-D np.uint32

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Any) -> str: ...

    def save(self, directory: Path) -> dict[str, Any] | str: ...


class ByteTokenizer:
    """The byte tokenizer as an object: one id per UTF-8 byte, ``eod_id`` = 0x1e."""

    kind = "byte"
    name = "byte"  # older spelling of `kind`
    vocab_size = VOCAB_SIZE
    eod_id = DOCUMENT_SEPARATOR[0]

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(ID_DTYPE)

    def encode_bytes(self, data: bytes | bytearray | memoryview) -> np.ndarray:
        """Ids of raw bytes (any file, UTF-8 or not)."""
        return np.frombuffer(data, dtype=np.uint8).astype(ID_DTYPE)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Any) -> str:
        return decode(ids)

    def save(self, directory: Path) -> str:
        """Nothing to write; the index entry is the string ``"byte"``."""
        return "byte"

    def to_json(self) -> str:
        """The ``tokenizer.json`` of an equivalent ``tokenizers`` tokenizer (for tools
        that read only that format, e.g. a Hugging Face export): GPT-2's byte-level
        pre-tokenizer and decoder without its regex, and a BPE model with no merges
        whose 256 tokens are the bytes, token i standing for byte i."""
        tk = _tokenizers()
        vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
        inner = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
        inner.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        inner.decoder = tk.decoders.ByteLevel()
        return inner.to_str(pretty=True)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


def _byte_level_chars() -> list[str]:
    """The printable character GPT-2's byte-level BPE writes for each byte 0..255
    (`bytes_to_unicode` of GPT-2's encoder.py): printable Latin-1 bytes stand for
    themselves, the others for chr(256 + n) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, n = [], 0
    for byte in range(VOCAB_SIZE):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(VOCAB_SIZE + n))
            n += 1
    return chars


# --------------------------------------------------------------------------- BPE


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "the BPE tokenizer needs the `tokenizers` package (pip install tokenizers)"
        ) from None
    return tokenizers


# A space or newline after a letter, digit or ASCII symbol (\w is str.isalnum() or "_").
# GPT-2's pre-tokenizer regex never puts whitespace after a non-whitespace char inside
# one pre-token, so a chunk boundary at such a point leaves the ids unchanged.
_SPLIT_POINT = re.compile(r"(?<=[\w!-~])[ \n]")


def _chunks(text: str, target: int = _CHUNK_CHARS) -> Iterator[str]:
    """``text`` in pieces of about ``target`` chars, cut only at safe split points."""
    start, n = 0, len(text)
    while n - start > target:
        found = _SPLIT_POINT.search(text, start + target)
        if found is None:
            break
        yield text[start : found.start()]
        start = found.start()
    yield text[start:]


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    write_bytes_atomic(path, data, fsync=True)


class BpeTokenizer:
    """A ``tokenizers.Tokenizer`` behind the :class:`Tokenizer` interface."""

    kind = "bpe"

    def __init__(self, inner: Any, eod_id: int) -> None:
        self._inner = inner
        self.eod_id = int(eod_id)
        self.vocab_size = int(inner.get_vocab_size(with_added_tokens=True))
        self._chunkable = _gpt2_byte_level(json.loads(inner.to_str()))

    @property
    def inner(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._inner

    def to_json(self) -> str:
        return self._inner.to_str(pretty=True)

    def encode(self, text: str) -> np.ndarray:
        if len(text) <= _CHUNK_CHARS:
            ids = self._inner.encode(text, add_special_tokens=False).ids
            return np.asarray(ids, dtype=ID_DTYPE)
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text, encoded in parallel (long texts in chunks, same ids)."""
        pieces: list[str] = []
        owner: list[int] = []
        for i, text in enumerate(texts):
            parts = list(_chunks(text)) if self._chunkable else [text]
            pieces.extend(parts)
            owner.extend([i] * len(parts))
        out: list[list[np.ndarray]] = [[] for _ in texts]
        encode_batch = getattr(self._inner, "encode_batch_fast", self._inner.encode_batch)
        lo = 0
        while lo < len(pieces):
            hi, chars = lo, 0
            while hi < len(pieces) and (hi == lo or chars + len(pieces[hi]) <= _BATCH_CHARS):
                chars += len(pieces[hi])
                hi += 1
            encodings = encode_batch(pieces[lo:hi], add_special_tokens=False)
            for j, enc in zip(range(lo, hi), encodings, strict=True):
                out[owner[j]].append(np.asarray(enc.ids, dtype=ID_DTYPE))
            lo = hi
        return [
            np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else _empty_ids())
            for parts in out
        ]

    def decode(self, ids: Any) -> str:
        arr = _as_id_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token out of the tokenizer's vocabulary [0, {self.vocab_size})")
        return self._inner.decode(arr.astype(np.int64).tolist(), skip_special_tokens=False)

    def save(self, directory: Path) -> dict[str, Any]:
        """Write ``tokenizer.json`` into ``directory``; return the index entry."""
        data = self.to_json().encode("utf-8")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _write_bytes_atomic(directory / BPE_FILE, data)
        return {
            "kind": "bpe",
            "file": BPE_FILE,
            "sha256": _sha256_bytes(data),
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
        }

    def __repr__(self) -> str:
        return f"BpeTokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def _empty_ids() -> np.ndarray:
    return np.empty(0, dtype=ID_DTYPE)


def _gpt2_byte_level(spec: dict[str, Any]) -> bool:
    """Whether a tokenizer.json is GPT-2 byte-level (so chunking at spaces keeps the ids)."""
    pre = spec.get("pre_tokenizer") or {}
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and not pre.get("add_prefix_space", False)
        and pre.get("use_regex", True)
    )


def train_bpe(texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
    """Train a GPT-2 style byte-level BPE tokenizer on ``texts`` (nothing downloaded).

    The vocabulary holds at most ``vocab_size`` ids (every byte, ``<|endoftext|>``
    and the merges learnt; fewer when the text runs out of pairs to merge).
    """
    if not BPE_MIN_VOCAB <= vocab_size <= BPE_MAX_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size}: a byte-level BPE vocabulary needs at least "
            f"{BPE_MIN_VOCAB} ids (256 bytes + {END_OF_TEXT}) and at most {BPE_MAX_VOCAB}"
        )
    tk = _tokenizers()
    inner = tk.Tokenizer(tk.models.BPE())
    inner.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    inner.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def pieces() -> Iterator[str]:
        for text in texts:
            yield from _chunks(text)

    inner.train_from_iterator(pieces(), trainer=trainer)
    eod = inner.token_to_id(END_OF_TEXT)
    if eod is None:  # the trainer always adds its special tokens; guard the invariant
        raise DataError(f"BPE training produced no {END_OF_TEXT} token")
    return BpeTokenizer(inner, eod)


def _from_json_text(text: str, origin: str) -> BpeTokenizer:
    tk = _tokenizers()
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise DataError(f"{origin}: not a tokenizer.json (invalid JSON: {exc})") from None
    if not isinstance(spec, dict) or "model" not in spec:
        raise DataError(f"{origin}: not a tokenizer.json of the `tokenizers` package (no model)")
    try:
        inner = tk.Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises plain Exception
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{origin}: not a usable tokenizer.json ({first})") from None
    for name in _EOD_CANDIDATES:
        eod = inner.token_to_id(name)
        if eod is not None:
            return BpeTokenizer(inner, eod)
    inner.add_special_tokens([END_OF_TEXT])  # no end-of-document token: add GPT-2's
    return BpeTokenizer(inner, inner.token_to_id(END_OF_TEXT))


def load_tokenizer_file(path: str | os.PathLike[str]) -> BpeTokenizer:
    """A user's ``tokenizer.json`` (``tokenizers`` format); DataError if unusable.

    Its end-of-document token is the first of ``<|endoftext|>``, ``<|end_of_text|>``,
    ``</s>``, ``<eos>``, ``<|eos|>``, ``[SEP]`` it has; with none, ``<|endoftext|>``
    is added as a special token (one more id).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such tokenizer file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a tokenizer.json") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a tokenizer.json (not UTF-8 text)") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    return _from_json_text(text, str(path))


def tokenizer_from_index(
    entry: dict[str, Any] | str, directory: str | os.PathLike[str]
) -> ByteTokenizer | BpeTokenizer:
    """The tokenizer an index's ``"tokenizer"`` entry names, its file checked by sha256."""
    directory = Path(directory)
    if isinstance(entry, dict):
        kind = entry.get("kind")
    else:
        kind = entry
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe" or not isinstance(entry, dict):
        raise DataError(f"{directory}: unknown tokenizer {entry!r} in index.json (byte or bpe)")
    missing = [k for k in ("file", "sha256") if not isinstance(entry.get(k), str)]
    if missing:
        raise DataError(
            f"{directory}: the tokenizer entry of index.json lacks {', '.join(missing)}"
        )
    name = entry["file"]
    path = directory / name
    if Path(name).is_absolute() or Path(name).name != name:
        raise DataError(f"{directory}: tokenizer file {name!r} must be a plain file name")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: listed in index.json but missing") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    if _sha256_bytes(data) != entry["sha256"]:
        raise DataError(
            f"{path} does not match its sha256 in index.json (changed since the shards were made)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a tokenizer.json (not UTF-8 text)") from None
    tok = _from_json_text(text, str(path))
    if "eod_id" in entry:
        tok.eod_id = int(entry["eod_id"])
    if "vocab_size" in entry and int(entry["vocab_size"]) != tok.vocab_size:
        raise DataError(
            f"{path} has {tok.vocab_size} ids but index.json says vocab_size={entry['vocab_size']}"
        )
    return tok
