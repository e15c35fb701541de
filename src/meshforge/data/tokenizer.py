"""The byte-level tokenizer: one token per UTF-8 byte, vocabulary 256.

Tokens are stored as ``np.uint16`` (on disk and in memory) so that a larger
vocabulary can share the shard format later; every byte value maps to itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

VOCAB_SIZE = 256
TOKEN_DTYPE = np.dtype("<u2")  # little-endian uint16, the on-disk dtype of token shards

# Written between documents (files) when several are concatenated into one token
# sequence: ASCII "record separator", a byte ordinary text never contains, so a
# model can learn where one document ends and the next begins.
DOCUMENT_SEPARATOR = b"\x1e"


def encode_bytes(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Token array (uint16) of raw bytes: token i is the value of byte i."""
    return np.frombuffer(data, dtype=np.uint8).astype(TOKEN_DTYPE)


def encode(text: str) -> np.ndarray:
    """Token array (uint16) of the UTF-8 bytes of ``text``."""
    return encode_bytes(text.encode("utf-8"))


def decode(tokens: np.ndarray | Iterable[int]) -> str:
    """Text of a token sequence; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
    if hasattr(tokens, "cpu"):  # a torch tensor, possibly on an accelerator
        tokens = tokens.cpu()
    if not hasattr(tokens, "__array__") and not isinstance(tokens, (list, tuple)):
        tokens = list(tokens)  # a generator or other plain iterable
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"token out of the byte vocabulary [0, {VOCAB_SIZE})")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class ByteTokenizer:
    """Object form of the byte tokenizer, for code that takes a tokenizer argument."""

    name = "byte"
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> np.ndarray:
        return encode(text)

    def decode(self, tokens: np.ndarray | Iterable[int]) -> str:
        return decode(tokens)
