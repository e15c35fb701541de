"""A run directory's checkpoint folders and JSON-lines files, read torch-free
(meshforge.rundir.checkpoints, meshforge.rundir.records)."""

from __future__ import annotations

import json

import pytest

from meshforge.rundir.checkpoints import (
    committed_checkpoints,
    find_latest_valid,
    is_committed,
    list_checkpoints,
    step_dir_name,
    write_manifest,
)
from meshforge.rundir.records import read_jsonl, tail_rows


def _checkpoint(run_dir, step: int, data: bytes = b"shard") -> object:
    directory = run_dir / "checkpoints" / step_dir_name(step)
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(data)
    write_manifest(directory, step)
    return directory


def test_only_whole_checkpoints_count_as_committed(tmp_path):
    _checkpoint(tmp_path, 10)
    cut = _checkpoint(tmp_path, 20)
    (cut / "__0_0.distcp").write_bytes(b"sh")  # a file shorter than its manifest says
    (tmp_path / "checkpoints" / step_dir_name(30)).mkdir()  # never committed
    (tmp_path / "checkpoints" / "step-notanumber").mkdir()
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [10, 20, 30]
    assert not is_committed(cut)
    assert committed_checkpoints(tmp_path) == [10]


def test_the_newest_valid_checkpoint_skips_a_damaged_one_and_says_why(tmp_path):
    _checkpoint(tmp_path, 10)
    damaged = _checkpoint(tmp_path, 20)
    (damaged / "__0_0.distcp").write_bytes(b"SHARD")  # same size, other bytes
    assert is_committed(damaged)  # the cheap check sees sizes only
    warned: list[str] = []
    step, _ = find_latest_valid(tmp_path / "checkpoints", warned.append)
    assert step == 10 and warned == [
        "skipping checkpoint step-00000020: checksum mismatch in __0_0.distcp"
    ]


def test_a_torn_last_line_is_ignored_and_a_broken_middle_one_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + '\n{"st')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert [r["step"] for r in tail_rows(path)] == [1, 2]
    path.write_text('{"st\n' + json.dumps({"step": 2}) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_jsonl(path)
