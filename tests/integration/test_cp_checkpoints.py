"""Checkpoints do not depend on context parallelism: a run saved under parallel.cp
resumes under any other cp (and at world 1) on the uninterrupted loss curve, and back;
in-process on the shared gloo pool (tests/layouts.py), and end to end through
`meshforge train` killed under cp2 and resumed on one rank."""

from __future__ import annotations

import json

import pytest
from test_context_parallel import cp_job

from helpers import Job
from layouts import train_layout

STEPS = 20

# (name, world saving, parallel saving, world resuming, parallel resuming)
RESHARDS = [
    ("cp2->world1", 2, {"cp": 2}, 1, {}),
    ("world1->cp2", 1, {}, 2, {"cp": 2}),
    ("dp2xcp2-zero3->cp4", 4, {"cp": 2, "zero": 3}, 4, {"cp": 4}),
    ("tp2xcp2->dp2", 4, {"cp": 2, "tp": 2}, 2, {}),
]


@pytest.fixture(scope="module")
def reference(gloo) -> dict[int, float]:
    (out,) = gloo.run(1, train_layout, cp_job("llama", {}), STEPS)
    return out["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("name,wa,la,wb,lb", RESHARDS, ids=[r[0] for r in RESHARDS])
def test_a_cp_checkpoint_resumes_under_another_layout(
    gloo, reference, tmp_path, name, wa, la, wb, lb
):
    root = str(tmp_path / "checkpoints")
    saved = gloo.run(wa, train_layout, cp_job("llama", la), 10, root, 10)[0]
    resumed = gloo.run(wb, train_layout, cp_job("llama", lb), STEPS, root, None, True)[0]
    # the full parameters after the load are bitwise those that were saved
    assert resumed["digest_loaded"] == saved["digest_saved"], name
    assert sorted(resumed["losses"]) == list(range(11, STEPS + 1))
    for step in range(1, 11):  # the saving layout trained world 1's steps
        assert saved["losses"][step] == pytest.approx(reference[step], rel=1e-4), (name, step)
    for step in range(11, STEPS + 1):  # the loss continues as if never interrupted
        assert resumed["losses"][step] == pytest.approx(reference[step], rel=1e-3), (
            f"{name} step {step}: {resumed['losses'][step]} vs {reference[step]}"
        )


# -- end to end: `meshforge train` killed under cp2, resumed at world 1 ---------------------
CLI_JOB = {
    "model": {"seq_len": 64, "n_heads": 4},
    "parallel": {"cp": 2},
    "train": {"steps": 8, "global_batch": 4, "micro_batch": 2, "warmup": 2},
    "checkpoint": {"every": 4, "keep": 2},
}


@pytest.mark.slow
def test_a_run_killed_under_cp2_resumes_at_world_1_on_the_uninterrupted_curve(tmp_path):
    (tmp_path / "straight").mkdir()
    straight = Job(tmp_path / "straight", {**CLI_JOB, "parallel": {}}, name="straight")
    straight.train(1)
    job = Job(tmp_path, CLI_JOB, name="killed")
    first = job.train(2, env={"MESHFORGE_FAULT": "kill_after_checkpoint:4"}, check=False)
    assert first.returncode == 1, first.stderr[-2000:]
    assert (job.run_dir / "checkpoints" / "step-00000004").is_dir()
    assert not (job.run_dir / "checkpoints" / "step-00000008").exists()
    job.train(1, "--set", "parallel.cp=1")  # the same run directory, one process
    report = job.report
    assert report["resumed_from"] == 4
    assert report["world_size"] == 1 and "cp" not in report["layout"]  # cp 1: not listed
    segments = [json.loads(line) for line in (job.run_dir / "segments.jsonl").open()]
    layouts = [(r["world_size"], r["layout"].get("cp")) for r in segments if "layout" in r]
    assert layouts == [(2, 2), (1, None)], layouts
    expected, got = straight.losses(), job.losses()
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-3), (step, got, expected)
    for step in range(1, 5):  # the cp2 steps before the kill: world 1's too
        assert got[step] == pytest.approx(expected[step], rel=1e-4), (step, got, expected)
