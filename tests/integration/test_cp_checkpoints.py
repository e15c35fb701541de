"""Checkpoints do not depend on context parallelism: a run saved under parallel.cp
resumes under any other cp (and at world 1) on the uninterrupted loss curve, and back;
in-process on the shared gloo pool (tests/layouts.py), and end to end through
`meshforge train` killed under cp2 and resumed on one rank."""

from __future__ import annotations

import pytest
from test_context_parallel import cp_job

from helpers import Job, assert_killed_run_resumes_at_world_1, assert_one_line_error
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
    assert_killed_run_resumes_at_world_1(tmp_path, CLI_JOB, "cp")


# -- a run trained at a short context goes on at a longer one --------------------------------
LLAMA_JOB = {
    "model": {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "ffn_hidden": 64, "seq_len": 32},
    "train": {"steps": 4, "global_batch": 4, "micro_batch": 2, "warmup": 1},
    "checkpoint": {"every": 4, "keep": 2},
}  # fmt: skip


@pytest.mark.slow
def test_a_llama_run_goes_on_at_a_longer_context_and_a_gpt_run_is_refused(tmp_path):
    """Long-context training in stages: a rotary model resumes at another model.seq_len
    (no weight is sized by it), here under cp2; the GPT, whose learned positions are,
    is refused in one line with nothing written."""
    job = Job(tmp_path, LLAMA_JOB, name="llama")
    job.train(1)
    longer = job.train(
        2, "--set", "model.seq_len=64", "--set", "train.steps=6", "--set", "parallel.cp=2"
    )
    assert "model.seq_len 32 -> 64" in longer.stdout + longer.stderr
    report = job.report
    assert report["resumed_from"] == 4 and report["layout"]["cp"] == 2
    assert sorted(job.losses()) == list(range(1, 7))
    config = (job.run_dir / "config.yaml").read_text()
    assert "seq_len: 64" in config

    gpt = Job(tmp_path, {"train": {"steps": 4}, "checkpoint": {"every": 4}}, name="gpt")
    gpt.train(1)
    before = sorted(p.name for p in gpt.run_dir.rglob("*"))
    refused = gpt.train(1, "--set", "model.seq_len=64", "--set", "train.steps=6", check=False)
    assert_one_line_error(refused, "another model", "model.seq_len 32 -> 64", "learned position")
    assert sorted(p.name for p in gpt.run_dir.rglob("*")) == before
