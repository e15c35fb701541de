"""Bad configs and command lines: exit code 2, one line naming the problem, no traceback,
and nothing already written is lost."""

from __future__ import annotations

import pytest
import yaml

from helpers import TINY_JOB, assert_one_line_error, merge, meshforge

# (id, config overrides or raw YAML text, extra CLI args, words the error must contain)
CASES = [
    ("unknown-key", {"train": {"stepz": 5}}, [], ["unknown key", "train.stepz"]),
    ("unknown-section", {"optimiser": {"lr": 1}}, [], ["unknown key", "optimiser"]),
    ("wrong-type", {"train": {"steps": "many"}}, [], ["train.steps"]),
    ("negative-steps", {"train": {"steps": -5}}, [], ["train.steps", "greater than"]),
    ("zero-lr", {"train": {"lr": 0}}, [], ["train.lr"]),
    ("tp-not-dividing-heads", {"parallel": {"tp": 3}}, [], ["parallel.tp=3", "n_heads=2"]),
    ("heads-not-dividing-width", {"model": {"n_heads": 5}}, [], ["n_heads=5", "d_model=32"]),
    ("bad-zero-stage", {"parallel": {"zero": 4}}, [], ["parallel.zero"]),
    ("bad-dtype", {"precision": {"dtype": "fp8"}}, [], ["precision.dtype"]),
    (
        "indivisible-batch",
        {"train": {"global_batch": 6, "micro_batch": 4}},
        [],
        ["global_batch=6", "micro_batch=4"],
    ),
    (
        "batch-vs-world",
        {"train": {"global_batch": 4, "micro_batch": 4}},
        ["--nproc", "2"],
        ["global_batch=4", "dp=2"],
    ),
    (
        "dp-vs-world",
        {"parallel": {"dp": 3}, "train": {"global_batch": 12}},
        ["--nproc", "2"],
        ["parallel.dp=3", "world size 2"],
    ),
    (
        "missing-data-path",
        {"data": {"source": "/nonexistent/shards"}},
        [],
        ["data.source", "/nonexistent/shards"],
    ),
    ("unknown-builtin", {"data": {"source": "builtin:wikipedia"}}, [], ["builtin:wikipedia"]),
    # bad layouts (parallel/dims.py): each names the fields involved
    ("pp-with-tied-head", {"parallel": {"pp": 2}}, [], ["model.tie_embeddings", "parallel.pp=2"]),
    (
        "tp-not-dividing-vocab",
        {"model": {"vocab_size": 257}, "parallel": {"tp": 2}},
        [],
        ["parallel.tp=2", "vocab_size=257"],
    ),
    (
        "pp-stages-more-than-layers",  # uneven stages are fine, empty ones are not
        {"model": {"n_layers": 1, "tie_embeddings": False}, "parallel": {"pp": 2}},
        [],
        ["parallel.pp=2", "2 stages", "more than", "n_layers=1"],
    ),
    (
        "virtual-stages-more-than-layers",
        {
            "model": {"tie_embeddings": False},
            "parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2},
        },
        [],
        ["parallel.pp=2", "4 stages", "n_layers=2"],
    ),
    (
        "layout-not-the-world",
        {"model": {"tie_embeddings": False}, "parallel": {"tp": 2, "pp": 2}},
        ["--nproc", "2"],
        ["parallel.tp=2", "parallel.pp=2", "world size 2"],
    ),
    (
        "too-few-microbatches",
        {
            "model": {"tie_embeddings": False, "n_layers": 4},
            "parallel": {"pp": 4, "pp_schedule": "1f1b"},
        },
        ["--nproc", "4"],
        ["pp_schedule=1f1b", "parallel.pp=4", "at least 4 micro-batches", "= 2"],
    ),
    (
        "interleaved-microbatches",
        {
            "model": {"tie_embeddings": False, "n_layers": 8},
            "parallel": {"pp": 4, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2},
            "train": {"global_batch": 36, "micro_batch": 4},
        },
        ["--nproc", "4"],
        ["interleaved_1f1b", "9 micro-batches", "parallel.pp=4"],
    ),
    (
        "sequence-parallel-without-tp",
        {"parallel": {"sequence_parallel": True}},
        [],
        ["parallel.sequence_parallel", "parallel.tp > 1"],
    ),
    (
        "zero1-with-pp",
        {"model": {"tie_embeddings": False}, "parallel": {"pp": 2, "zero": 1}},
        [],
        ["parallel.zero=1", "parallel.pp=2"],
    ),
    ("zero1-with-tp", {"parallel": {"tp": 2, "zero": 1}}, [], ["parallel.zero=1", "parallel.tp=2"]),
    (
        "virtual-stages-without-interleaving",
        {"model": {"tie_embeddings": False}, "parallel": {"pp": 2, "virtual_stages": 2}},
        [],
        ["parallel.virtual_stages=2", "interleaved_1f1b"],
    ),
    (
        "fp16-with-tp",
        {"parallel": {"tp": 2}, "precision": {"dtype": "fp16"}},
        [],
        ["precision.dtype=fp16", "parallel.tp=2", "bf16"],
    ),
    ("unknown-schedule", {"parallel": {"pp_schedule": "dualpipe"}}, [], ["parallel.pp_schedule"]),
    (
        "invalid-yaml",
        "model: {d_model: 32\ntrain: [",
        [],
        ["invalid YAML", "flow mapping at line 1"],
    ),
    ("not-a-mapping", "- just\n- a list\n", [], ["mapping"]),
    ("empty-file", "", [], ["empty"]),
    ("only-comments", "# a job file\n# with nothing in it\n", [], ["empty"]),
    ("nproc-zero", {}, ["--nproc", "0"], ["--nproc-per-node 0", "at least one"]),
    ("bad-set-path", {}, ["--set", "train.nope=3"], ["train.nope", "no key 'nope'"]),
    ("bad-set-section", {}, ["--set", "train.steps.x=3"], ["train.steps", "not a section"]),
    ("bad-set-syntax", {}, ["--set", "train.steps"], ["KEY=VALUE"]),
    ("bad-set-value", {}, ["--set", "train.steps=-1"], ["train.steps"]),
    ("unknown-option", {}, ["--nprocs", "2"], ["--nprocs"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_job_input_exits_2_with_one_line(tmp_path, case):
    _, config, args, words = case
    path = tmp_path / "job.yaml"
    if isinstance(config, str):
        path.write_text(config)
    else:
        path.write_text(yaml.safe_dump(merge(TINY_JOB, config)))
    run_dir = tmp_path / "run"
    proc = meshforge(["train", str(path), "--run-dir", str(run_dir), *args], timeout=120)
    assert_one_line_error(proc, *words)
    assert not (run_dir / "checkpoints").exists()


def test_missing_config_file_exits_2(tmp_path):
    proc = meshforge(["train", str(tmp_path / "absent.yaml")], timeout=60)
    assert_one_line_error(proc, "config file not found", "absent.yaml")


def test_bad_input_does_not_touch_an_existing_run(job_factory):
    job = job_factory({"train": {"steps": 2}})
    job.train(1)
    before = {p: p.read_bytes() for p in job.run_dir.rglob("*") if p.is_file()}
    proc = meshforge(
        ["train", str(job.config_path), "--run-dir", str(job.run_dir), "--set", "train.lr=-1"]
    )
    assert_one_line_error(proc, "train.lr")
    after = {p: p.read_bytes() for p in job.run_dir.rglob("*") if p.is_file()}
    assert after == before


# Bounded input (issue 26, part 4): each refused in one line naming the file and the limit.
BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [
        f"{b}: &{b} [{','.join(['*' + a] * 9)}]"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    ]
)


@pytest.mark.parametrize(
    "text, limit",
    [
        (BILLION_LAUGHS, "MAX_CONFIG_NODES"),
        ("model:\n  kwargs: " + "[" * 5000 + "]" * 5000 + "\n", "MAX_CONFIG_DEPTH"),
    ],
    ids=["billion-laughs", "deep-nesting"],
)
def test_hostile_yaml_exits_2_with_one_line_naming_the_file_and_limit(tmp_path, text, limit):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(text)
    run_dir = tmp_path / "run"
    proc = meshforge(["train", str(bomb), "--run-dir", str(run_dir)], timeout=60)
    line = assert_one_line_error(proc, str(bomb), limit)
    assert len(line) < 300
    assert not run_dir.exists()


def test_an_alias_bomb_in_set_exits_2_with_one_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(TINY_JOB))
    flow = "{" + BILLION_LAUGHS.replace("\n", ", ") + "}"
    proc = meshforge(
        ["train", str(path), "--run-dir", str(tmp_path / "run"), "--set", f"model.kwargs={flow}"],
        timeout=60,
    )
    assert_one_line_error(proc, "--set model.kwargs", "MAX_CONFIG_NODES")
