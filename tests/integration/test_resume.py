"""Resume is exact, survives SIGKILL and layout changes, and never loses a committed checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import Job

# keep=2 of the checkpoints of steps 10, 20 and 30: the uninterrupted run also shows pruning
JOB = {"parallel": {"zero": 2}, "train": {"steps": 30}, "checkpoint": {"every": 10, "keep": 2}}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    job = Job(tmp_path_factory.mktemp("straight"), JOB, name="straight")
    job.train(2)
    return job


@pytest.mark.slow
def test_sigkilled_run_resumes_to_identical_parameters(job_factory, uninterrupted):
    job = job_factory(JOB, name="killed")
    killed = job.train(2, env={"MESHFORGE_FAULT": "kill_after_checkpoint:20"}, check=False)
    assert killed.returncode == 1
    assert "SIGKILL" in killed.stderr
    assert (job.run_dir / "checkpoints" / "step-00000020").is_dir()
    job.train(2)
    report = job.report
    assert report["resumed_from"] == 20
    assert report["final_param_digest"] == uninterrupted.report["final_param_digest"]


@pytest.mark.slow
def test_resume_under_another_layout_keeps_the_loss_continuous(job_factory, uninterrupted):
    job = job_factory({**JOB, "parallel": {"zero": 3}}, name="relayout")
    first = job.train(2, env={"MESHFORGE_FAULT": "kill_after_checkpoint:20"}, check=False)
    assert first.returncode == 1
    # Same run directory, now plain DDP on one process: DCP reshards the ZeRO-3 shards.
    job.train(1, "--set", "parallel.zero=0")
    report = job.report
    assert report["resumed_from"] == 20
    assert report["layout"]["zero"] == 0 and report["world_size"] == 1
    expected = uninterrupted.losses()
    got = job.losses()
    assert got[21] == pytest.approx(expected[21], rel=1e-3)
    assert got[30] == pytest.approx(expected[30], rel=1e-3)


@pytest.mark.slow
def test_crash_before_commit_leaves_previous_checkpoint(job_factory):
    job = job_factory({**JOB, "train": {"steps": 20}}, name="crash")
    failed = job.train(2, env={"MESHFORGE_FAULT": "before_commit:20"}, check=False)
    assert failed.returncode == 1
    assert "injected fault before committing checkpoint of step 20" in failed.stderr
    ckpts = job.run_dir / "checkpoints"
    assert (ckpts / "step-00000010").is_dir()
    assert not (ckpts / "step-00000020").exists()
    assert (ckpts / ".tmp-step-00000020").is_dir()  # written but never committed
    assert job.report["status"] == "failed"
    job.train(2)
    assert job.report["resumed_from"] == 10
    assert job.report["status"] == "completed"


def _copy_of(done: Job, tmp_path: Path, name: str) -> Job:
    """A Job whose run directory starts as a copy of DONE's finished one."""
    job = Job(tmp_path, done.cfg, name=name)
    shutil.copytree(done.run_dir, job.run_dir)
    return job


@pytest.mark.slow
def test_checkpoint_with_bad_checksum_is_skipped_with_warning(tmp_path, uninterrupted):
    # a copy of the finished 30-step run, whose checkpoints are those of steps 20 and 30
    job = _copy_of(uninterrupted, tmp_path, "corrupt")
    newest = job.run_dir / "checkpoints" / "step-00000030"
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    second = job.train(2, "--set", "train.steps=35")
    assert "skipping checkpoint step-00000030: checksum mismatch" in second.stderr
    assert job.report["resumed_from"] == 20


@pytest.mark.slow
def test_only_the_newest_checkpoints_are_kept(uninterrupted):
    # checkpoints of steps 10, 20 and 30 were written with keep=2: step 10's is gone
    names = sorted(p.name for p in (uninterrupted.run_dir / "checkpoints").iterdir())
    assert names == ["step-00000020", "step-00000030"]
