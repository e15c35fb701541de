"""meshforge's data layer: byte tokenizer, built-in corpus, token shards, batch loader.

The names below are imported lazily, so that ``meshforge.data.shards`` (used by
``meshforge data prepare``) and the corpus do not pull in torch; only the loader
needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the eager names, for type checkers and IDEs
    from meshforge.data.corpus import (
        BUILTIN_SOURCES,
        STDLIB_CORPUS,
        TokenSplits,
        cache_dir,
        check_source,
        end_of_text_id,
        load_tokens,
        split_tokens,
    )
    from meshforge.data.loader import (
        DistributedBatchLoader,
        StepBatch,
        global_batch_offsets,
        rank_micro_batches,
        val_batches,
        val_offsets,
    )
    from meshforge.data.shards import (
        DEFAULT_SHARD_TOKENS,
        INDEX_FORMAT,
        ShardedTokens,
        load_shards,
        prepare,
    )
    from meshforge.data.tokenizer import (
        DOCUMENT_SEPARATOR,
        VOCAB_SIZE,
        ByteTokenizer,
        decode,
        encode,
    )

_EXPORTS = {
    "VOCAB_SIZE": "tokenizer",
    "DOCUMENT_SEPARATOR": "tokenizer",
    "ByteTokenizer": "tokenizer",
    "encode": "tokenizer",
    "decode": "tokenizer",
    "STDLIB_CORPUS": "corpus",
    "BUILTIN_SOURCES": "corpus",
    "TokenSplits": "corpus",
    "load_tokens": "corpus",
    "split_tokens": "corpus",
    "cache_dir": "corpus",
    "check_source": "corpus",
    "end_of_text_id": "corpus",
    "INDEX_FORMAT": "shards",
    "DEFAULT_SHARD_TOKENS": "shards",
    "ShardedTokens": "shards",
    "prepare": "shards",
    "load_shards": "shards",
    "StepBatch": "loader",
    "DistributedBatchLoader": "loader",
    "global_batch_offsets": "loader",
    "rank_micro_batches": "loader",
    "val_batches": "loader",
    "val_offsets": "loader",
}

__all__ = [
    "BUILTIN_SOURCES",
    "ByteTokenizer",
    "DEFAULT_SHARD_TOKENS",
    "DOCUMENT_SEPARATOR",
    "DistributedBatchLoader",
    "INDEX_FORMAT",
    "STDLIB_CORPUS",
    "ShardedTokens",
    "StepBatch",
    "TokenSplits",
    "VOCAB_SIZE",
    "cache_dir",
    "check_source",
    "decode",
    "encode",
    "end_of_text_id",
    "global_batch_offsets",
    "load_shards",
    "load_tokens",
    "prepare",
    "rank_micro_batches",
    "split_tokens",
    "val_batches",
    "val_offsets",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'meshforge.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"meshforge.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
