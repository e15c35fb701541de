"""What `meshforge train` checks of data.source before any worker starts (one line, exit 2,
no run directory), and that a shard directory is readable by others on shared storage."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

from helpers import Job, assert_one_line_error, meshforge


def test_a_bin_file_with_ids_beyond_the_vocabulary_is_refused_up_front(tmp_path: Path):
    source = tmp_path / "ids.bin"
    np.arange(0, 1000, dtype="<u2").repeat(20).tofile(source)
    job = Job(tmp_path, {"data": {"source": str(source)}})
    proc = job.train(2, check=False)
    assert_one_line_error(proc, "999", "model.vocab_size=256")
    assert not job.run_dir.exists()


def test_a_missing_url_source_is_refused_up_front(tmp_path: Path):
    job = Job(tmp_path, {"data": {"source": f"file://{tmp_path}/nothing-here"}})
    proc = job.train(2, check=False)
    assert_one_line_error(proc, "data.source", "no such file")
    assert not job.run_dir.exists()


def test_index_and_shards_get_a_plain_files_mode(tmp_path: Path):
    src = tmp_path / "a.txt"
    src.write_text("hello shared storage\n" * 100)
    out = tmp_path / "shards"
    assert meshforge(["data", "prepare", str(src), str(out)]).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
