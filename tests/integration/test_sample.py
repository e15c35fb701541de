"""`meshforge sample` reads any layout's checkpoint in one process and prints text."""

from __future__ import annotations

import shutil

import pytest

from helpers import Job, assert_one_line_error, meshforge
from meshforge.cli.sample import load_model
from meshforge.parallel.parallelize import digest_of

JOB = {"parallel": {"zero": 3}, "train": {"steps": 10, "warmup": 2}}


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """A ZeRO-3 world-2 run: its checkpoint holds DTensor shards of every parameter."""
    job = Job(tmp_path_factory.mktemp("sample"), JOB, name="zero3")
    job.train(2)
    return job


def _sample(run_dir, *extra: str):
    return meshforge(["sample", str(run_dir), "--prompt", "def ", "--tokens", "20", *extra])


@pytest.mark.slow
def test_sample_prints_text_continuing_the_prompt(zero3_run):
    proc = _sample(zero3_run.run_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def ")
    assert len(proc.stdout.rstrip("\n")) > len("def ")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_greedy_sampling_is_deterministic(zero3_run):
    first = _sample(zero3_run.run_dir, "--temperature", "0")
    second = _sample(zero3_run.run_dir, "--temperature", "0", "--step", "10")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout


@pytest.mark.slow
def test_zero3_shards_load_into_the_full_trained_parameters(zero3_run):
    model, step = load_model(zero3_run.run_dir)
    assert step == 10
    assert digest_of(model.named_parameters()) == zero3_run.report["final_param_digest"]


def test_missing_run_dir_exits_2(tmp_path):
    assert_one_line_error(_sample(tmp_path / "nowhere"), "not found")


@pytest.mark.slow
def test_run_dir_without_checkpoints_exits_2(zero3_run, tmp_path):
    run = tmp_path / "fresh"
    run.mkdir()
    shutil.copy(zero3_run.run_dir / "config.yaml", run / "config.yaml")
    assert_one_line_error(_sample(run), "no valid checkpoint")


def test_run_dir_without_config_exits_2(tmp_path):
    assert_one_line_error(_sample(tmp_path), "config.yaml")


@pytest.mark.slow
def test_unknown_step_exits_2_naming_the_steps_there(zero3_run):
    assert_one_line_error(_sample(zero3_run.run_dir, "--step", "3"), "steps: 10")
