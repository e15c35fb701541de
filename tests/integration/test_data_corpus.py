"""The built-in corpus, its cache, the train/val split and `load_tokens` errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshforge.data import corpus
from meshforge.data.corpus import (
    STDLIB_CORPUS,
    STDLIB_CORPUS_MAX_TOKENS,
    check_source,
    load_tokens,
    split_tokens,
    stdlib_files,
)
from meshforge.data.shards import ShardedTokens, prepare
from meshforge.data.tokenizer import decode
from meshforge.errors import DataError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_stdlib_files_leave_out_tests_tools_and_site_packages() -> None:
    files = stdlib_files()
    rels = [rel for rel, _, _ in files]
    assert rels == sorted(rels) and len(rels) > 100
    assert all(rel.endswith(".py") for rel in rels)
    for rel in rels:
        parts = set(rel.split("/")[:-1])
        assert not parts & {"test", "tests", "idlelib", "turtledemo", "lib2to3", "site-packages"}
    assert "os.py" in rels and "json/__init__.py" in rels


def test_builtin_corpus_is_deterministic_sizeable_python(cache: Path) -> None:
    first = load_tokens(STDLIB_CORPUS, val_fraction=0.1)
    assert list(cache.glob("python-stdlib-*.npy")), "the token array is cached"
    again = load_tokens(STDLIB_CORPUS, val_fraction=0.1)  # from the cache

    n = len(first.train) + len(first.val)
    assert 2**20 < n <= STDLIB_CORPUS_MAX_TOKENS
    assert len(first.val) == int(n * 0.1)
    assert first.vocab_size == 256
    np.testing.assert_array_equal(first.train, again.train)
    np.testing.assert_array_equal(first.val, again.val)
    text = decode(first.train[:200_000])
    assert "def " in text and "import " in text and "return" in text


def test_builtin_corpus_is_rebuilt_identically_from_an_empty_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    built = np.asarray(corpus.stdlib_tokens(max_tokens=300_000))
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path / "other-cache"))
    rebuilt = np.asarray(corpus.stdlib_tokens(max_tokens=300_000))
    np.testing.assert_array_equal(built, rebuilt)
    assert len(built) == 300_000


def test_a_corrupt_cache_file_is_rebuilt(cache: Path) -> None:
    good = np.array(corpus.stdlib_tokens(max_tokens=100_000))  # a copy, not the mmap
    (path,) = cache.glob("python-stdlib-*.npy")
    path.write_bytes(path.read_bytes()[:1000])  # truncated, e.g. by a full disk
    np.testing.assert_array_equal(corpus.stdlib_tokens(max_tokens=100_000), good)


def test_concurrent_workers_build_the_cache_safely(cache: Path) -> None:
    code = (
        "import numpy as np, sys; from meshforge.data.corpus import stdlib_tokens; "
        "t = stdlib_tokens(max_tokens=500_000); "
        "sys.stdout.write(str(len(t)) + ' ' + str(int(np.asarray(t, dtype=np.int64).sum())))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = {p.communicate(timeout=60)[0] for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outputs) == 1
    assert [p.name for p in cache.iterdir()] == [next(cache.glob("*.npy")).name], "no temp left"


def test_split_takes_validation_from_the_end() -> None:
    tokens = np.arange(100, dtype=np.uint16)
    train, val = split_tokens(tokens, 0.05)
    np.testing.assert_array_equal(train, np.arange(95))
    np.testing.assert_array_equal(val, np.arange(95, 100))
    sharded_train, sharded_val = split_tokens(ShardedTokens(np.split(tokens, [30, 96])), 0.05)
    np.testing.assert_array_equal(sharded_train[:], np.arange(95))
    np.testing.assert_array_equal(sharded_val[:], np.arange(95, 100))


def test_load_tokens_reads_a_shard_directory(tmp_path: Path) -> None:
    text = "".join(f"line {i}\n" for i in range(500))
    (tmp_path / "t.txt").write_text(text)
    prepare(tmp_path / "t.txt", tmp_path / "shards", shard_tokens=333)
    splits = load_tokens(str(tmp_path / "shards"), val_fraction=0.25)
    assert decode(splits.train[:]) + decode(splits.val[:]) == text
    assert len(splits.val) == int(len(text) * 0.25)
    check_source(str(tmp_path / "shards"))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("builtin:nope", r"data.source 'builtin:nope': unknown built-in corpus"),
        ("/no/such/dir", r"data.source /no/such/dir: no such directory"),
    ],
)
def test_unknown_sources_are_named(source: str, message: str) -> None:
    with pytest.raises(DataError, match=message):
        load_tokens(source, 0.05)
    with pytest.raises(DataError, match=message):
        check_source(source)


def test_a_file_is_not_a_shard_directory(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match="not a directory of token shards"):
        load_tokens(str(tmp_path / "a.txt"), 0.05)


def test_a_shard_directory_problem_names_data_source_and_the_file(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("abcdefgh" * 10)
    prepare(tmp_path / "t.txt", tmp_path / "shards", shard_tokens=16)
    (tmp_path / "shards" / "shard-00001.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match=r"^data.source .*shards: .*shard-00001\.bin has 1 bytes"):
        load_tokens(str(tmp_path / "shards"), 0.05)


def test_a_sequence_longer_than_the_training_split_names_source_and_seq_len(
    tmp_path: Path,
) -> None:
    (tmp_path / "t.txt").write_text("x" * 100)
    prepare(tmp_path / "t.txt", tmp_path / "shards")
    source = str(tmp_path / "shards")
    assert len(load_tokens(source, 0.1, seq_len=9).train) == 90
    with pytest.raises(DataError, match=r"data.source .*training split .*model.seq_len \+ 1 = 101"):
        load_tokens(source, 0.0, seq_len=100)
    with pytest.raises(DataError, match=r"data.source .*data.val_fraction=0.1.* = 11"):
        load_tokens(source, 0.1, seq_len=10)
