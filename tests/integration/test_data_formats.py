"""Input formats of `data prepare`: the same documents as text files, JSON Lines, Parquet or a
Hugging Face dataset (saved, or built from local files) give byte-identical shards."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_one_line_error, meshforge
from meshforge.data import formats
from meshforge.data import shards as shards_module
from meshforge.data.formats import Chunker, document_pieces, find_sources
from meshforge.data.shards import INDEX_NAME, load_shards, prepare
from meshforge.data.tokenizer import DOCUMENT_SEPARATOR, END_OF_TEXT, decode
from meshforge.errors import DataError

DOCS = [
    "def f(x):\n    return x * 2  # ünïcødé ✓\n" * 5,
    "a second document\n\nwith a blank line and trailing spaces   \n",
    "no newline at the end, 😀 and ∑",
    "tab\tseparated\tvalues\n" * 30,
]


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_pyarrow = pytest.mark.skipif(not _have("pyarrow"), reason="pip install pyarrow failed")
needs_datasets = pytest.mark.skipif(not _have("datasets"), reason="pip install datasets failed")


def _text_dir(root: Path, docs: list[str] = DOCS) -> Path:
    src = root / "text"
    src.mkdir()
    for i, doc in enumerate(docs):
        (src / f"doc-{i:03d}.txt").write_bytes(doc.encode("utf-8"))
    return src


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    lines = [json.dumps({"id": i, field: doc, "meta": {"n": i}}) for i, doc in enumerate(docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs))), field: docs})
    pq.write_table(table, path, row_group_size=2)  # several row groups
    return path


def _shard_bytes(out: Path) -> list[bytes]:
    index = json.loads((out / INDEX_NAME).read_text())
    return [(out / s["file"]).read_bytes() for s in index["shards"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[bytes]:
    """Shards of DOCS given as plain text files (byte tokenizer, 64-token shards)."""
    root = tmp_path_factory.mktemp("reference")
    prepare(_text_dir(root), root / "out", shard_tokens=64)
    return _shard_bytes(root / "out")


def test_plain_text_shards_are_the_documents_joined_by_the_separator(tmp_path: Path) -> None:
    prepare(_text_dir(tmp_path), tmp_path / "out", shard_tokens=64)
    assert decode(load_shards(tmp_path / "out")[:]) == DOCUMENT_SEPARATOR.decode().join(DOCS)


def test_json_lines_give_the_same_shards_as_text(tmp_path: Path, reference) -> None:
    src = tmp_path / "jsonl"
    src.mkdir()
    _jsonl(src / "a.jsonl", DOCS[:1])
    _jsonl(src / "b.jsonl", DOCS[1:], field="body")
    with pytest.raises(DataError, match=r"b\.jsonl:1: no field 'text' .*--field"):
        prepare(src, tmp_path / "out", shard_tokens=64)
    _jsonl(src / "b.jsonl", DOCS[1:])
    index = prepare(src, tmp_path / "out", shard_tokens=64)
    assert _shard_bytes(tmp_path / "out") == reference
    assert index["documents"] == len(DOCS)
    assert [(s["path"], s["format"], s["documents"]) for s in index["sources"]] == [
        ("a.jsonl", "jsonl", 1),
        ("b.jsonl", "jsonl", 3),
    ]


@needs_pyarrow
def test_parquet_gives_the_same_shards_as_text(tmp_path: Path, reference) -> None:
    _parquet(tmp_path / "docs.parquet", DOCS, field="content")
    prepare(tmp_path / "docs.parquet", tmp_path / "out", shard_tokens=64, field="content")
    assert _shard_bytes(tmp_path / "out") == reference


@needs_datasets
def test_a_saved_hugging_face_dataset_gives_the_same_shards_as_text(
    tmp_path: Path, reference
) -> None:
    import datasets

    datasets.disable_progress_bars()
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(saved)
    assert [s.format for s in find_sources(saved)] == ["hf"]
    prepare(saved, tmp_path / "out", shard_tokens=64)
    assert _shard_bytes(tmp_path / "out") == reference

    as_dict = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(
        as_dict
    )
    prepare(as_dict, tmp_path / "out-dict", shard_tokens=64, fmt="hf")
    assert _shard_bytes(tmp_path / "out-dict") == reference


@needs_datasets
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "text"])
def test_a_hugging_face_dataset_built_from_local_files_gives_the_same_shards(
    tmp_path: Path, reference, kind: str
) -> None:
    if kind == "jsonl":
        src = _jsonl(tmp_path / "docs.jsonl", DOCS)
    elif kind == "parquet":
        pytest.importorskip("pyarrow")
        src = _parquet(tmp_path / "docs.parquet", DOCS)
    else:
        src = _text_dir(tmp_path)
    index = prepare(src, tmp_path / "out", shard_tokens=64, fmt="hf")
    assert _shard_bytes(tmp_path / "out") == reference
    assert {s["format"] for s in index["sources"]} == {"hf"}
    assert not list((tmp_path / "out").glob(".prepare-*"))  # datasets' cache went with staging


def test_bpe_shards_are_the_same_from_text_and_from_json_lines(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    docs = DOCS * 3
    prepare(_text_dir(tmp_path, docs), tmp_path / "plain", tokenizer="bpe", vocab_size=300)
    trained = tmp_path / "plain" / "tokenizer.json"
    index = prepare(
        _jsonl(tmp_path / "docs.jsonl", docs),
        tmp_path / "jsonl",
        tokenizer_file=trained,
        workers=2,
    )
    assert _shard_bytes(tmp_path / "jsonl") == _shard_bytes(tmp_path / "plain")
    assert (
        index["tokenizer"] == json.loads((tmp_path / "plain" / INDEX_NAME).read_text())["tokenizer"]
    )
    tokens = load_shards(tmp_path / "jsonl")
    assert tokens.vocab_size == index["vocab_size"] <= 300
    text = tokens.tokenizer.decode(tokens[:])
    assert text == "".join(doc + END_OF_TEXT for doc in docs)  # end-of-document after each


def test_a_process_pool_writes_the_same_shards_as_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference
) -> None:
    monkeypatch.setattr(shards_module, "_BATCH_CHARS", 50)  # many small batches, in order
    prepare(_text_dir(tmp_path), tmp_path / "out", shard_tokens=64, workers=2)
    assert _shard_bytes(tmp_path / "out") == reference


@settings(max_examples=80, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab \n\t.é"), max_size=120),
    limit=st.integers(min_value=1, max_value=12),
    feeds=st.lists(st.integers(min_value=0, max_value=40), max_size=6),
)
def test_pieces_depend_on_the_text_only(text: str, limit: int, feeds: list[int]) -> None:
    whole = [piece for piece, _ in document_pieces(text, limit)]
    assert "".join(whole) == text
    assert all(len(piece) <= limit for piece in whole)
    chunker, streamed, at = Chunker(limit), [], 0
    for size in [*feeds, len(text)]:
        streamed += chunker.feed(text[at : at + size])
        at = min(len(text), at + size)
    assert [*streamed, chunker.finish()] == whole


def test_long_text_files_are_read_in_pieces_with_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(formats, "PIECE_CHARS", 10)
    monkeypatch.setattr(formats, "_READ_CHUNK_BYTES", 7)
    (tmp_path / "a.txt").write_text(DOCS[0])
    pieces = list(formats.read_pieces(find_sources(tmp_path / "a.txt")[0]))
    assert len(pieces) > 5 and [ends for _, ends in pieces].count(True) == 1
    assert "".join(text for text, _ in pieces) == DOCS[0]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"docs\.jsonl:2: not valid JSON"),
        ('["a list"]', r"docs\.jsonl:2: expected a JSON object, got list"),
        ('{"text": 3}', r"docs\.jsonl:2: field 'text' holds int, not a string"),
        ('{"body": "x"}', r"docs\.jsonl:2: no field 'text' \(fields: body\)"),
    ],
)
def test_a_bad_json_line_is_named_by_file_and_line(tmp_path: Path, line: str, message) -> None:
    (tmp_path / "docs.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        prepare(tmp_path / "docs.jsonl", tmp_path / "out")
    assert not (tmp_path / "out" / INDEX_NAME).exists()


def test_a_text_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match=r"a\.txt: not UTF-8 text \(bad byte at offset 3\)"):
        prepare(tmp_path / "a.txt", tmp_path / "out")


@needs_pyarrow
def test_parquet_without_the_column_or_with_nulls_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _parquet(tmp_path / "d.parquet", DOCS)
    with pytest.raises(DataError, match=r"d\.parquet: no column 'body' \(columns: id, text\)"):
        prepare(tmp_path / "d.parquet", tmp_path / "out", field="body")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet: row 1: 'text' is null"):
        prepare(tmp_path / "n.parquet", tmp_path / "out")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a Parquet file"):
        prepare(tmp_path / "bad.parquet", tmp_path / "out")


@pytest.mark.parametrize(("module", "suffix"), [("pyarrow", "parquet"), ("datasets", "hf")])
def test_a_missing_optional_package_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, suffix: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    fmt = "hf" if suffix == "hf" else "auto"
    with pytest.raises(DataError, match=f"needs the '{module}' package: pip install {module}"):
        prepare(tmp_path / "d.parquet", tmp_path / "out", fmt=fmt)


def test_cli_reads_json_lines_with_a_field_and_refuses_a_bad_line(tmp_path: Path) -> None:
    _jsonl(tmp_path / "docs.jsonl", DOCS, field="body")
    ok = meshforge(["data", "prepare", str(tmp_path / "docs.jsonl"), str(tmp_path / "out"),
                    "--field", "body", "--shard-tokens", "64"], timeout=60)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "from 1 file(s) (4 documents, byte tokenizer" in ok.stdout
    assert decode(load_shards(tmp_path / "out")[:]) == DOCUMENT_SEPARATOR.decode().join(DOCS)

    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n\n{"text": "y"}\n')
    bad = meshforge(["data", "prepare", str(tmp_path / "bad.jsonl"), str(tmp_path / "out2"),
                     "--field", "body"], timeout=60)  # fmt: skip
    assert_one_line_error(bad, "bad.jsonl:3", "no field 'body'")
    for args, needle in [
        (["--format", "xml"], "--format"),
        (["--tokenizer", "bpe"], "--vocab-size"),
        (["--vocab-size", "300"], "--tokenizer bpe"),
        (["--workers", "0"], "--workers"),
    ]:
        proc = meshforge(["data", "prepare", str(tmp_path / "docs.jsonl"), str(tmp_path / "o3"),
                          "--field", "body", *args], timeout=60)  # fmt: skip
        assert_one_line_error(proc, needle)
