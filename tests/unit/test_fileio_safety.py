"""Lock and temporary files (issue 26, part 6): opened without following a symbolic link,
temporary files always new (O_EXCL), created with the user's umask. A link planted at a
lock or temporary path never makes meshforge write the file it points to."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshforge import fileio
from meshforge.errors import ConfigError
from meshforge.fileio import (
    SymlinkRefused,
    atomic_writer,
    create_temp_beside,
    open_lock_file,
    write_bytes_atomic,
    write_text_atomic,
)
from meshforge.rundir.files import LOCK_FILE
from meshforge.runtime.runlock import RunDirLock, check_run_dir_free, hold_run_dir, read_holder


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file someone else owns, which a planted link points at."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text("precious contents\n")
    return path


def _untouched(victim: Path) -> None:
    assert victim.read_text() == "precious contents\n"


@pytest.fixture
def umask() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _tokens(monkeypatch: pytest.MonkeyPatch, *tokens: str) -> None:
    """Make the temporary names' random parts TOKENS, in order (to plant a link there)."""
    it = iter(tokens)
    monkeypatch.setattr(fileio, "_temp_token", lambda: next(it))


def _temp_path(final: Path, token: str) -> Path:
    host = socket.gethostname().replace(os.sep, "_")
    return final.with_name(f".{final.name}.{host}.{os.getpid()}.{token}.tmp")


def test_a_link_planted_at_the_run_lock_is_refused_in_one_line(
    tmp_path: Path, victim: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).symlink_to(victim)
    with pytest.raises(ConfigError) as excinfo:
        hold_run_dir(run_dir, "job-a")
    line = str(excinfo.value)
    assert "\n" not in line
    assert str(run_dir / LOCK_FILE) in line and "symbolic link" in line
    _untouched(victim)  # not truncated, no holder written into it
    assert read_holder(run_dir) is None  # never read through the link either
    check_run_dir_free(run_dir, "job-b")  # a link holds nothing; the taker refuses it


def test_a_link_planted_at_the_workers_lock_is_refused(tmp_path: Path, victim: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock-workers").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        RunDirLock(run_dir, "job-a", name=".lock-workers").acquire()
    _untouched(victim)


def test_the_run_lock_is_created_with_the_umask(tmp_path: Path, umask: None) -> None:
    os.umask(0o077)
    with hold_run_dir(tmp_path / "run", "job-a"):
        mode = stat.S_IMODE((tmp_path / "run" / LOCK_FILE).stat().st_mode)
    assert mode == 0o600


def test_a_lock_file_link_is_refused_by_open_lock_file(tmp_path: Path, victim: Path) -> None:
    link = tmp_path / "x.lock"
    link.symlink_to(victim)
    for kwargs in ({}, {"readonly": True, "create": False}):
        with pytest.raises(SymlinkRefused) as excinfo:
            open_lock_file(link, **kwargs)
        assert str(excinfo.value) == (
            f"{link} is a symbolic link; meshforge does not follow links for lock and "
            "temporary files (remove it)"
        )
    _untouched(victim)


def test_a_link_planted_at_the_temporary_name_sends_the_write_to_a_fresh_name(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "report.json"
    planted = _temp_path(final, "planted")
    planted.symlink_to(victim)
    _tokens(monkeypatch, "planted", "fresh")
    write_text_atomic(final, '{"ok": true}')
    assert final.read_text() == '{"ok": true}'
    _untouched(victim)
    assert planted.is_symlink() and planted.readlink() == victim  # left as it was
    assert not _temp_path(final, "fresh").exists()  # renamed into place


def test_an_existing_file_at_the_temporary_name_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "data.bin"
    other = _temp_path(final, "taken")
    other.write_bytes(b"another writer's half-written bytes")
    _tokens(monkeypatch, "taken", "mine")
    write_bytes_atomic(final, b"mine")
    assert final.read_bytes() == b"mine"
    assert other.read_bytes() == b"another writer's half-written bytes"


def test_no_fresh_name_at_all_is_an_error_not_a_write_through(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "f"
    _temp_path(final, "same").symlink_to(victim)
    monkeypatch.setattr(fileio, "_temp_token", lambda: "same")
    with pytest.raises(FileExistsError):
        create_temp_beside(final)
    _untouched(victim)
    assert not final.exists()


def test_a_link_at_the_final_path_is_replaced_not_written_through(
    tmp_path: Path, victim: Path
) -> None:
    final = tmp_path / "config.yaml"
    final.symlink_to(victim)
    write_text_atomic(final, "name: new\n")
    assert not final.is_symlink() and final.read_text() == "name: new\n"
    _untouched(victim)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_get_the_umask_mode(
    tmp_path: Path, umask: None, mask: int, mode: int
) -> None:
    os.umask(mask)
    final = tmp_path / "out.json"
    write_text_atomic(final, "{}")
    assert stat.S_IMODE(final.stat().st_mode) == mode


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    final = tmp_path / "index.json"
    final.write_text("old")
    with pytest.raises(RuntimeError), atomic_writer(final, "w") as f:
        f.write("half of the new")
        raise RuntimeError("crash in the middle")
    assert final.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]


def test_atomic_writer_only_writes_new_files() -> None:
    with pytest.raises(ValueError, match="mode"), atomic_writer("x", "a"):
        pass


def test_a_link_at_the_old_report_temporary_name_is_not_written_through(
    tmp_path: Path, victim: Path
) -> None:
    from meshforge.rundir.report import REPORT_TMP, read_report, write_report

    (tmp_path / REPORT_TMP).symlink_to(victim)  # the fixed name the report once used
    write_report(tmp_path, {"status": "completed"})
    assert read_report(tmp_path) == {"status": "completed"}
    _untouched(victim)


def test_a_link_at_the_old_manifest_temporary_name_is_not_written_through(
    tmp_path: Path, victim: Path
) -> None:
    import json

    from meshforge.rundir.checkpoints import MANIFEST, write_manifest

    step = tmp_path / "step-00000010"
    step.mkdir()
    (step / "weights.distcp").write_bytes(b"tensor bytes")
    (step / (MANIFEST + ".tmp")).symlink_to(victim)  # the fixed name manifests once used
    write_manifest(step, 10)
    _untouched(victim)
    written = step / MANIFEST
    assert not written.is_symlink() and json.loads(written.read_text())["step"] == 10
