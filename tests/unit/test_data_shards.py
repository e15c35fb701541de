"""Byte tokenizer and token shards: prepare -> load round trips, and bad shard directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshforge.data import formats as formats_module
from meshforge.data.shards import INDEX_NAME, ShardedTokens, load_shards, prepare, source_files
from meshforge.data.tokenizer import DOCUMENT_SEPARATOR, VOCAB_SIZE, decode, encode
from meshforge.errors import DataError

TEXT = "def f(x):\n    return x * 2  # ünïcødé ✓\n" * 40


def test_byte_tokenizer_round_trips_utf8_text() -> None:
    tokens = encode(TEXT)
    assert tokens.dtype == np.uint16
    assert len(tokens) == len(TEXT.encode("utf-8"))
    assert int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens) == TEXT
    assert decode(tokens.tolist()) == TEXT


def test_decode_replaces_a_cut_multibyte_character() -> None:
    tokens = encode("é")  # two bytes
    assert decode(tokens[:1]) == "\ufffd"


def test_prepare_round_trips_a_file_across_many_shards(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text(TEXT, encoding="utf-8")
    index = prepare(src, tmp_path / "out", shard_tokens=100)

    n = len(TEXT.encode("utf-8"))
    assert index["total_tokens"] == n
    assert len(index["shards"]) == -(-n // 100)
    assert [s["file"] for s in index["shards"]][:2] == ["shard-00000.bin", "shard-00001.bin"]
    on_disk = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    assert on_disk == index

    tokens = load_shards(tmp_path / "out", verify_checksums=True)
    assert len(tokens) == n
    assert decode(tokens[:]) == TEXT
    assert decode(tokens[95:305]) == TEXT.encode()[95:305].decode("utf-8", errors="replace")
    assert tokens[150] == TEXT.encode()[150]
    assert tokens[-1] == TEXT.encode()[-1]


def test_prepare_joins_directory_files_in_sorted_order_with_a_separator(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "b" / "z.txt").write_text("third")
    (src / "a.txt").write_text("first")
    (src / "b" / "c.txt").write_text("second")
    (src / "skip.md").write_text("not matched")
    (src / ".hidden.txt").write_text("hidden files are skipped")

    index = prepare(src, tmp_path / "out", shard_tokens=7, pattern="*.txt")

    sep = DOCUMENT_SEPARATOR.decode()
    assert decode(load_shards(tmp_path / "out")[:]) == sep.join(["first", "second", "third"])
    assert index["documents"] == 3


def test_source_files_skips_an_output_directory_inside_the_source(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "shard-00000.bin").write_bytes(b"\0\0")
    assert [rel for rel, _ in source_files(tmp_path, exclude=tmp_path / "out")] == ["a.txt"]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=6),
    start=st.integers(min_value=-40, max_value=40),
    stop=st.integers(min_value=-40, max_value=40),
    step=st.sampled_from([1, 1, 2, 3, -1, -2]),
)
def test_sharded_tokens_slice_like_one_concatenated_array(
    sizes: list[int], start: int, stop: int, step: int
) -> None:
    parts, first = [], 0
    for size in sizes:
        parts.append(np.arange(first, first + size, dtype=np.uint16))
        first += size
    whole = np.arange(first, dtype=np.uint16)
    view = ShardedTokens(parts)

    assert len(view) == len(whole)
    np.testing.assert_array_equal(view[start:stop:step], whole[start:stop:step])
    window = view.window(max(start, 0), max(stop, 0))
    np.testing.assert_array_equal(window[:], whole[max(start, 0) : max(stop, 0)])
    if whole.size:
        assert view[start % len(whole)] == whole[start % len(whole)]


def test_prepare_refuses_to_rebuild_over_a_changed_source_without_force(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("old text")
    out = tmp_path / "out"
    prepare(src, out, shard_tokens=4)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    src.write_text("new text, longer than before")
    with pytest.raises(DataError, match=r"already exists and source a\.txt changed.*--force"):
        prepare(src, out, shard_tokens=4)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    prepare(src, out, shard_tokens=100, force=True)
    assert decode(load_shards(out)[:]) == "new text, longer than before"
    assert sorted(p.name for p in out.iterdir()) == [INDEX_NAME, "shard-00000.bin"]


def test_a_failed_prepare_leaves_the_previous_index_and_no_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("alpha")
    (src / "b.txt").write_text("beta")
    out = tmp_path / "out"
    prepare(src, out, shard_tokens=3)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    real_open = open

    def failing_open(path, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith("b.txt"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(formats_module, "open", failing_open, raising=False)
    with pytest.raises(DataError, match=r"b\.txt: cannot read \(Permission denied\)"):
        prepare(src, out, shard_tokens=3, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _bad_source(kind: str, root: Path) -> Path:
    if kind == "empty-dir":
        (root / "empty").mkdir()
        return root / "empty"
    if kind == "empty-file":
        (root / "e.txt").write_text("")
        return root / "e.txt"
    return root / "missing"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "no such file or directory"),
        ("empty-dir", "no files to read"),
        ("empty-file", "empty"),
    ],
)
def test_prepare_rejects_bad_sources(tmp_path: Path, kind: str, message: str) -> None:
    with pytest.raises(DataError, match=message):
        prepare(_bad_source(kind, tmp_path), tmp_path / "out")
    assert not (tmp_path / "out" / INDEX_NAME).exists()


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    src = tmp_path / "a.txt"
    src.write_text(TEXT)
    prepare(src, tmp_path / "out", shard_tokens=128)
    return tmp_path / "out"


def _edit_index(directory: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = directory / INDEX_NAME
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def test_loading_a_directory_without_index_names_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no index.json"):
        load_shards(tmp_path)


def test_loading_an_index_that_is_not_json_fails(shard_dir: Path) -> None:
    (shard_dir / INDEX_NAME).write_text("{not json")
    with pytest.raises(DataError, match="index.json is not valid JSON"):
        load_shards(shard_dir)


def test_loading_an_index_of_another_format_fails(shard_dir: Path) -> None:
    _edit_index(shard_dir, lambda index: index.update(format="something-else"))
    with pytest.raises(DataError, match="format 'something-else'"):
        load_shards(shard_dir)


def test_a_shard_whose_size_does_not_match_the_index_is_named(shard_dir: Path) -> None:
    with open(shard_dir / "shard-00001.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match=r"shard-00001\.bin has 258 bytes .* 128 tokens"):
        load_shards(shard_dir)


def test_a_missing_shard_is_named(shard_dir: Path) -> None:
    (shard_dir / "shard-00002.bin").unlink()
    with pytest.raises(DataError, match=r"shard-00002\.bin is listed in index.json but missing"):
        load_shards(shard_dir)


def test_total_tokens_must_match_the_shards(shard_dir: Path) -> None:
    _edit_index(shard_dir, lambda index: index.update(total_tokens=index["total_tokens"] + 1))
    with pytest.raises(DataError, match="total_tokens"):
        load_shards(shard_dir)


def test_a_shard_path_outside_the_directory_is_rejected(shard_dir: Path) -> None:
    _edit_index(shard_dir, lambda index: index["shards"][0].update(file="../a.txt"))
    with pytest.raises(DataError, match="malformed shard entry"):
        load_shards(shard_dir)


def test_a_changed_byte_of_a_small_shard_is_caught_at_load(shard_dir: Path) -> None:
    path = shard_dir / "shard-00000.bin"
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    # a shard under 1 MiB is all head: the load-time check reads every byte of it
    with pytest.raises(DataError, match=r"shard-00000\.bin is damaged: its first 256 bytes"):
        load_shards(shard_dir)


def test_an_index_without_end_digests_is_checked_by_size_and_full_checksum(
    shard_dir: Path,
) -> None:
    def drop_digests(index: dict) -> None:
        for shard in index["shards"]:
            del shard["head_sha256"], shard["tail_sha256"]

    _edit_index(shard_dir, drop_digests)  # as written before they existed
    path = shard_dir / "shard-00000.bin"
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    load_shards(shard_dir)  # sizes still match: only the checksum tells
    with pytest.raises(DataError, match=r"shard-00000\.bin does not match its sha256"):
        load_shards(shard_dir, verify_checksums=True)
