"""Appending to shards, and proof before the run: `data prepare` run again adds shards for
new files only (old ones byte-identical), `data inspect` verifies every checksum and names a
damaged shard, and the loader (and so `meshforge train`) refuses one."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from helpers import Job, assert_one_line_error, meshforge
from meshforge.data.inspect import inspect_shards
from meshforge.data.shards import END_CHECK_BYTES, INDEX_NAME, load_shards, prepare
from meshforge.data.tokenizer import DOCUMENT_SEPARATOR, END_OF_TEXT, decode
from meshforge.errors import DataError

SEP = DOCUMENT_SEPARATOR.decode()


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir()}


def _index(out: Path) -> dict:
    return json.loads((out / INDEX_NAME).read_text())


def _assert_index_matches_the_files(out: Path) -> None:
    index = _index(out)
    itemsize = np.dtype(index["dtype"]).itemsize
    for shard in index["shards"]:
        raw = (out / shard["file"]).read_bytes()
        assert len(raw) == shard["tokens"] * itemsize
        assert hashlib.sha256(raw).hexdigest() == shard["sha256"]
        ends = raw[:END_CHECK_BYTES], raw[-END_CHECK_BYTES:] if raw else b""
        assert [hashlib.sha256(e).hexdigest() for e in ends] == [
            shard["head_sha256"],
            shard["tail_sha256"],
        ]
    assert index["total_tokens"] == sum(s["tokens"] for s in index["shards"])
    assert index["total_tokens"] == sum(s["tokens"] for s in index["sources"])
    assert index["documents"] == sum(s["documents"] for s in index["sources"])


def test_running_prepare_again_appends_new_files_and_keeps_old_shards(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.txt").write_text("alpha " * 20)
    (src / "b.txt").write_text("beta " * 7)
    first = prepare(src, out, shard_tokens=50)
    old = {name: raw for name, raw in _files(out).items() if name != INDEX_NAME}

    (src / "c.txt").write_text("gamma " * 12)
    (src / "sub").mkdir()
    (src / "sub" / "d.txt").write_text("delta")
    index = prepare(src, out, shard_tokens=50)

    assert {name: (out / name).read_bytes() for name in old} == old  # byte-identical
    assert [s["file"] for s in index["shards"][: len(first["shards"])]] == sorted(old)
    assert len(index["shards"]) > len(first["shards"])
    assert [s["path"] for s in index["sources"]] == ["a.txt", "b.txt", "c.txt", "sub/d.txt"]
    _assert_index_matches_the_files(out)
    text = SEP.join(["alpha " * 20, "beta " * 7, "gamma " * 12, "delta"])
    assert decode(load_shards(out, verify_checksums=True)[:]) == text

    before = (out / INDEX_NAME).read_bytes()
    assert prepare(src, out, shard_tokens=50) == index  # nothing new: nothing written
    assert (out / INDEX_NAME).read_bytes() == before
    assert not list(out.glob(".prepare-*"))


@pytest.mark.parametrize("change", ["edited", "removed", "tokenizer", "old-index"])
def test_appending_refuses_what_it_cannot_append_to(tmp_path: Path, change: str) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.txt").write_text("alpha")
    (src / "b.txt").write_text("beta")
    prepare(src, out, shard_tokens=4)
    (src / "c.txt").write_text("new file")
    options = {}
    if change == "edited":
        (src / "a.txt").write_text("alpha, edited")
        message = r"source a\.txt changed since it was prepared .*--force"
    elif change == "removed":
        (src / "b.txt").unlink()
        message = r"lists source b\.txt, which is not in .*--force"
    elif change == "tokenizer":
        options = {"tokenizer": "bpe", "vocab_size": 300}
        message = r"made with the byte tokenizer, not bpe; use --force"
    else:
        index = _index(out)
        del index["sources"]
        (out / INDEX_NAME).write_text(json.dumps(index))
        message = r"does not list its sources .*--force"
    before = _files(out)
    with pytest.raises(DataError, match=message):
        prepare(src, out, shard_tokens=4, **options)
    assert _files(out) == before
    prepare(src, out, shard_tokens=4, force=True, **options)
    assert [s["path"] for s in _index(out)["sources"]] == sorted(p.name for p in src.iterdir())


def test_bpe_shards_append_with_the_tokenizer_they_were_made_with(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    words = "the quick brown fox jumps over the lazy dog. " * 30
    (src / "a.txt").write_text(words)
    first = prepare(src, out, tokenizer="bpe", vocab_size=300, shard_tokens=64)
    tokenizer_json = (out / "tokenizer.json").read_bytes()
    old = {s["file"]: (out / s["file"]).read_bytes() for s in first["shards"]}
    (src / "b.txt").write_text("a lazy dog and a quick fox")

    with pytest.raises(DataError, match="trained for --vocab-size 300, not 400"):
        prepare(src, out, tokenizer="bpe", vocab_size=400, shard_tokens=64)
    index = prepare(src, out, tokenizer="bpe", vocab_size=300, shard_tokens=64)

    assert (out / "tokenizer.json").read_bytes() == tokenizer_json
    assert {name: (out / name).read_bytes() for name in old} == old
    assert index["tokenizer"] == first["tokenizer"] and index["dtype"] == "uint16"
    _assert_index_matches_the_files(out)
    tokens = load_shards(out)
    docs = tokens.tokenizer.decode(tokens[:]).split(END_OF_TEXT)
    assert docs == [words, "a lazy dog and a quick fox", ""]


# --------------------------------------------------------------------------- inspect


@pytest.fixture
def big_shards(tmp_path: Path) -> Path:
    """Two shards: one of 1.5 M tokens (3 MiB, more than its head and tail MiB), one short."""
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefgh \n"), size=1_600_000))
    (tmp_path / "a.txt").write_text(text)
    prepare(tmp_path / "a.txt", tmp_path / "out", shard_tokens=1_500_000)
    return tmp_path / "out"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_inspect_reports_an_intact_directory(big_shards: Path) -> None:
    report = inspect_shards(big_shards)
    assert report["ok"] and report["damaged"] == []
    assert report["total_tokens"] == 1_600_000 and report["verified"] == 2
    assert report["bytes"] == 3_200_000 and report["dtype"] == "uint16"
    assert report["tokenizer"]["kind"] == "byte" and report["sources"][0]["path"] == "a.txt"

    proc = meshforge(["data", "inspect", str(big_shards)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "2 of 2 shards verified" in proc.stdout and "1,600,000" in proc.stdout


def test_a_byte_changed_in_the_middle_is_found_by_inspect_not_at_load(big_shards: Path) -> None:
    _flip(big_shards / "shard-00000.bin", 1_500_000)  # beyond the first and last MiB
    load_shards(big_shards)  # the cheap load-time check cannot see it
    with pytest.raises(DataError, match=r"shard-00000\.bin does not match its sha256"):
        load_shards(big_shards, verify_checksums=True)

    proc = meshforge(["data", "inspect", str(big_shards), "--json"], timeout=60)
    line = assert_one_line_error(proc, "1 damaged file", "shard-00000.bin", "sha256")
    assert line.startswith("meshforge: error: ")
    report = json.loads(proc.stdout)
    assert report["damaged"] == [
        {"file": "shard-00000.bin", "problem": "sha256 does not match index.json"}
    ]
    assert [s["ok"] for s in report["shards"]] == [False, True]


@pytest.mark.parametrize(
    ("damage", "load_error", "problem"),
    [
        ("head", r"shard-00000\.bin is damaged: its first 1048576 bytes", "sha256"),
        ("tail", r"shard-00000\.bin is damaged: its last 1048576 bytes", "sha256"),
        ("size", r"shard-00001\.bin has 200002 bytes", "has 200002 bytes"),
        ("missing", r"shard-00001\.bin is listed in index.json but missing", "missing"),
    ],
)
def test_a_damaged_shard_is_named_by_inspect_and_refused_by_the_loader(
    big_shards: Path, damage: str, load_error: str, problem: str
) -> None:
    if damage == "head":
        _flip(big_shards / "shard-00000.bin", 10)
    elif damage == "tail":
        _flip(big_shards / "shard-00000.bin", 2_999_999)
    elif damage == "size":
        with open(big_shards / "shard-00001.bin", "ab") as f:
            f.write(b"\0\0")
    else:
        (big_shards / "shard-00001.bin").unlink()
    with pytest.raises(DataError, match=load_error):
        load_shards(big_shards)
    report = inspect_shards(big_shards)
    assert not report["ok"] and len(report["damaged"]) == 1
    assert problem in report["damaged"][0]["problem"]


def test_inspect_checks_the_tokenizer_file_and_refuses_a_directory_without_index(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tokenizers")
    (tmp_path / "a.txt").write_text("some words and more words " * 20)
    out = tmp_path / "out"
    prepare(tmp_path / "a.txt", out, tokenizer="bpe", vocab_size=280)
    report = inspect_shards(out)
    assert report["ok"] and report["tokenizer"]["file"] == "tokenizer.json"
    with open(out / "tokenizer.json", "a") as f:
        f.write(" ")
    report = inspect_shards(out)
    assert [d["file"] for d in report["damaged"]] == ["tokenizer.json"]

    proc = meshforge(["data", "inspect", str(tmp_path)], timeout=60)
    assert_one_line_error(proc, "no index.json")


def test_a_two_rank_run_refuses_a_damaged_shard(tmp_path: Path) -> None:
    text = (Path(os.__file__)).read_text()[:40_000]
    (tmp_path / "a.txt").write_text(text)
    shards = tmp_path / "shards"
    prepare(tmp_path / "a.txt", shards, shard_tokens=8192)
    _flip(shards / "shard-00002.bin", 100)
    job = Job(tmp_path, {"data": {"source": str(shards)}, "train": {"steps": 2}})
    proc = job.train(2, check=False)
    assert_one_line_error(proc, "shard-00002.bin is damaged", "head_sha256")
    assert not (job.run_dir / "report.json").exists()


def test_cli_appends_new_files_then_has_nothing_to_do(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.txt").write_text("alpha " * 50)

    def run():  # type: ignore[no-untyped-def]
        proc = meshforge(["data", "prepare", str(src), str(out), "--shard-tokens", "128"])
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "wrote 300 tokens from 1 file(s)" in run()
    (src / "b.txt").write_text("beta " * 40)
    assert "appended 201 tokens from 1 new file(s) in 2 new shards" in run()
    assert "nothing new" in run()

    _flip(out / "shard-00003.bin", 0)
    proc = meshforge(["data", "inspect", str(out)], timeout=60)
    assert_one_line_error(proc, "shard-00003.bin sha256 does not match")
    assert "4 of 5 shards verified" in proc.stdout
    assert "DAMAGED    shard-00003.bin: sha256 does not match index.json" in proc.stdout
