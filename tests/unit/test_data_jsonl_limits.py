"""A JSON Lines line longer than MAX_JSONL_LINE_BYTES is refused (issue 26, part 4): a
DataError naming the file and the line number, raised after reading at most the limit
and one byte of that line, never the whole of it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from meshforge.data import formats
from meshforge.data.formats import MAX_JSONL_LINE_BYTES, Source, count_documents, read_pieces
from meshforge.errors import DataError

LIMIT = 1024  # a small stand-in for MAX_JSONL_LINE_BYTES, so the files stay tiny


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formats, "MAX_JSONL_LINE_BYTES", LIMIT)


def _line(text: str) -> bytes:
    return (json.dumps({"text": text}) + "\n").encode()


def _documents(path: Path) -> int:
    return count_documents(read_pieces(Source(path.name, path, "jsonl")))


def test_an_over_long_line_is_named_by_file_and_line_number(
    tmp_path: Path, small_limit: None
) -> None:
    path = tmp_path / "dump.jsonl"
    path.write_bytes(_line("short") + b"\n" + _line("x" * 5000) + _line("after"))
    with pytest.raises(DataError) as excinfo:
        _documents(path)
    line = str(excinfo.value)
    assert line.startswith(f"{path}:3: line longer than 1,024 bytes")
    assert "MAX_JSONL_LINE_BYTES" in line and "\n" not in line and len(line) < 300


def test_a_line_of_exactly_the_limit_is_read(tmp_path: Path, small_limit: None) -> None:
    overhead = len(_line(""))  # {"text": ""} and the newline
    exact = _line("y" * (LIMIT - overhead + 1))  # LIMIT bytes before its newline
    assert len(exact) == LIMIT + 1
    path = tmp_path / "edge.jsonl"
    path.write_bytes(exact + exact.rstrip(b"\n"))  # the last one without a newline
    assert _documents(path) == 2


def test_a_last_line_without_newline_over_the_limit_is_refused(
    tmp_path: Path, small_limit: None
) -> None:
    path = tmp_path / "tail.jsonl"
    path.write_bytes(_line("ok") + _line("z" * LIMIT).rstrip(b"\n"))
    with pytest.raises(DataError, match=r"tail\.jsonl:2: line longer than"):
        _documents(path)


class _CountingReader(io.BytesIO):
    """A file that counts the bytes handed out and the sizes asked for."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.handed_out = 0
        self.asked: list[int] = []

    def readline(self, size: int | None = -1) -> bytes:
        self.asked.append(-1 if size is None else size)
        line = super().readline(size)
        self.handed_out += len(line)
        return line


def test_the_over_long_line_is_never_read_whole(tmp_path: Path) -> None:
    first = _line("first")
    f = _CountingReader(first + b"[" + b"0," * 50_000 + b"0]\n")  # a 100 KB line
    lines = formats._bounded_lines(f, tmp_path / "big.jsonl", LIMIT)
    assert next(lines) == (1, first)
    with pytest.raises(DataError, match=r"big\.jsonl:2:"):
        next(lines)
    assert all(0 < size <= LIMIT + 1 for size in f.asked)  # never "the whole line"
    assert f.handed_out <= len(first) + LIMIT + 1


def test_the_stated_limit_is_documented() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    assert MAX_JSONL_LINE_BYTES == 64 * 2**20
    assert "MAX_JSONL_LINE_BYTES" in docs and f"{MAX_JSONL_LINE_BYTES:,} bytes" in docs
