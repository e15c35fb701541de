"""`meshforge data prepare` as a user runs it: a subprocess, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import assert_one_line_error, meshforge
from meshforge.data.shards import load_shards
from meshforge.data.tokenizer import DOCUMENT_SEPARATOR, decode

ERROR = "meshforge: error: "


def _prepare(*args: str | Path):
    return meshforge(["data", "prepare", *map(str, args)], timeout=60)


def test_prepare_writes_shards_that_decode_to_the_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha " * 30)
    (src / "sub" / "b.txt").write_text("beta " * 30)
    (src / "c.log").write_text("not text we want")

    result = _prepare(src, tmp_path / "out", "--shard-tokens", "64", "--glob", "*.txt")

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "2 file(s)" in result.stdout
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["format"] == "meshforge-tokens-v1" and len(index["shards"]) == 6
    expected = "alpha " * 30 + DOCUMENT_SEPARATOR.decode() + "beta " * 30
    assert decode(load_shards(tmp_path / "out")[:]) == expected


def test_an_existing_index_is_kept_unless_force(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first version")
    assert _prepare(tmp_path / "a.txt", tmp_path / "out").returncode == 0
    index_before = (tmp_path / "out" / "index.json").read_bytes()

    (tmp_path / "a.txt").write_text("second version")
    refusal = assert_one_line_error(_prepare(tmp_path / "a.txt", tmp_path / "out"), "--force")
    assert refusal.startswith(ERROR)
    assert (tmp_path / "out" / "index.json").read_bytes() == index_before

    assert _prepare(tmp_path / "a.txt", tmp_path / "out", "--force").returncode == 0
    assert decode(load_shards(tmp_path / "out")[:]) == "second version"


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("missing-src", "no such file or directory"),
        ("empty-dir", "no files to read"),
        ("empty-file", "empty"),
        ("no-glob-match", "no files matching '*.md'"),
        ("bad-shard-tokens", "--shard-tokens"),
        ("zero-shard-tokens", "--shard-tokens"),
        ("out-is-a-file", "is not a directory"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, case: str, needle: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("some text")
    out = tmp_path / "out"
    extra: list[str] = []
    if case == "missing-src":
        src = tmp_path / "missing"
    elif case == "empty-dir":
        src = tmp_path / "empty"
        src.mkdir()
    elif case == "empty-file":
        src = tmp_path / "empty.txt"
        src.write_text("")
    elif case == "no-glob-match":
        extra = ["--glob", "*.md"]
    elif case == "bad-shard-tokens":
        extra = ["--shard-tokens", "lots"]
    elif case == "zero-shard-tokens":
        extra = ["--shard-tokens", "0"]
    elif case == "out-is-a-file":
        out.write_text("")
    assert assert_one_line_error(_prepare(src, out, *extra), needle).startswith(ERROR)
    assert not (out / "index.json").exists()


def test_a_missing_argument_is_a_usage_error() -> None:
    refusal = assert_one_line_error(_prepare("only-src"), "Missing argument 'out'")
    assert refusal.startswith(ERROR)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read a mode-000 file"
)
def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    secret = tmp_path / "src" / "secret.txt"
    secret.write_text("hidden")
    secret.chmod(0)
    try:
        refusal = assert_one_line_error(_prepare(tmp_path / "src", tmp_path / "out"), "secret.txt")
        assert refusal.startswith(ERROR)
    finally:
        secret.chmod(0o600)
