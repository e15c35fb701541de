"""A run directory's files, read and removed torch-free: its checkpoint folders and
JSON-lines files (meshforge.rundir.checkpoints, meshforge.rundir.records), what
`--fresh` removes (meshforge.rundir.files) and report.json (meshforge.rundir.report)."""

from __future__ import annotations

import json

import pytest

from meshforge.errors import DataError
from meshforge.fileio import fsync_dir
from meshforge.rundir.checkpoints import (
    committed_checkpoints,
    find_latest_valid,
    is_committed,
    list_checkpoints,
    step_dir_name,
    write_manifest,
)
from meshforge.rundir.files import LOCK_FILES, earlier_run, remove_earlier_run
from meshforge.rundir.records import read_jsonl, tail_rows
from meshforge.rundir.report import (
    REPORT_TMP,
    read_report,
    read_report_or_none,
    report_path,
    write_report,
)


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


def _a_run_with_files_of_yours(run_dir):
    """A run directory holding what a run writes, its locks and files of the user's."""
    _checkpoint(run_dir, 10)
    ours = ["config.yaml", "metrics.jsonl", "segments.jsonl", "report.json", "report.html",
            ".report.html.host.1.tmp", "logs/rank-0.log", "health/flight-rank-0.json",
            "system/node-0.jsonl", ".launch/job-0.yaml"]  # fmt: skip
    yours = ["notes.txt", "logs/mine.log", "data/train.bin"]
    for name in [*ours, *yours, *LOCK_FILES]:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text("x")
    (run_dir / "logs" / "elastic" / "attempt_0").mkdir(parents=True)
    return ours, yours


def test_fresh_removes_what_meshforge_wrote_and_keeps_the_rest(tmp_path):
    ours, yours = _a_run_with_files_of_yours(tmp_path)
    line = remove_earlier_run(tmp_path)
    assert line is not None and line.startswith(
        f"meshforge: --fresh: removed the earlier run in {tmp_path} (checkpoints up to step 10, "
    )
    assert "; kept 3 entries meshforge did not write (data, logs/mine.log, notes.txt)" in line
    assert not any((tmp_path / name).exists() for name in ours)
    assert all((tmp_path / name).read_text() == "x" for name in [*yours, *LOCK_FILES])
    assert not (tmp_path / "logs" / "elastic").exists()  # the agent's logs are a run's
    # folders meshforge writes go once empty; one with a file of yours stays
    assert not any((tmp_path / f).exists() for f in ("checkpoints", "health", "system"))
    assert (tmp_path / "logs").is_dir()
    assert earlier_run(tmp_path) is None  # nothing of a run left
    assert remove_earlier_run(tmp_path) is None  # and nothing more to remove


def test_fresh_in_a_directory_without_a_run_removes_nothing(tmp_path):
    assert remove_earlier_run(tmp_path / "absent") is None
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / LOCK_FILES[0]).write_text("")
    assert earlier_run(tmp_path) is None
    assert remove_earlier_run(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LOCK_FILES[0], "notes.txt"])


def test_an_earlier_run_reads_past_a_report_that_is_not_json(tmp_path):
    (tmp_path / "report.json").write_text('{"status": "compl')
    earlier = earlier_run(tmp_path)
    assert earlier is not None and earlier.report == {} and earlier.reached is None
    (tmp_path / "report.json").write_text(json.dumps({"status": "completed", "steps": 10}))
    _checkpoint(tmp_path, 10)
    earlier = earlier_run(tmp_path)
    assert earlier.reached == 10 and earlier.completed


def test_read_report_absent_garbage_not_an_object_and_valid(tmp_path):
    path = report_path(tmp_path)
    assert path == tmp_path / "report.json"
    assert read_report(tmp_path) is None and read_report(tmp_path / "absent") is None
    for data, message in (
        (b'{"status": "compl', "not readable JSON"),  # cut short
        (b"\xff\xfe", "not readable JSON"),  # not text
        (b"[1, 2]", "expected a JSON object"),
    ):
        path.write_bytes(data)
        with pytest.raises(DataError, match=message) as caught:
            read_report(tmp_path)
        assert str(caught.value).startswith(f"{path}: ")  # it names the file
        assert read_report_or_none(tmp_path) is None
    report = {"status": "completed", "steps": 3}
    path.write_text(json.dumps(report))
    assert read_report(tmp_path) == read_report_or_none(tmp_path) == report


def test_the_report_is_replaced_whole_and_leaves_no_tmp(tmp_path):
    write_report(tmp_path, {"status": "failed"})
    write_report(tmp_path, {"status": "completed", "steps": 5})
    assert read_report(tmp_path) == {"status": "completed", "steps": 5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert not (tmp_path / REPORT_TMP).exists()


def test_fsync_dir_raises_unless_best_effort(tmp_path):
    fsync_dir(tmp_path)
    fsync_dir(tmp_path / "absent", best_effort=True)
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "absent")
