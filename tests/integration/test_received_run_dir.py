"""A run directory someone sent you is data: the commands that read it never import the
code its config.yaml names unless you say so (--trust-model-code), a job's name cannot
choose a directory outside runs/, `export --force` replaces only an earlier export, and
`train --fresh` removes what meshforge wrote, never through a symlink (the in-process
rules: tests/unit/test_run_directory_is_data.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from helpers import Job, assert_one_line_error, meshforge
from layouts import job, train_layout
from meshforge.config import build_config, save_config

STEPS = 2
TESTS = Path(__file__).resolve().parents[1]
CLUSTER = TESTS.parent / "examples" / "cluster.yaml"
EVIL = "evil_received"  # the module the received config.yaml names
FACTORY = {"name": "user_models:tiny_lm", "kwargs": {"width": 16, "layers": 2}, "seq_len": 32}


@pytest.fixture(scope="module")
def received(gloo, tmp_path_factory):
    """A factory model's run, trained, whose config.yaml then names EVIL: a module that
    writes a marker file when imported (and builds the same model)."""
    root = tmp_path_factory.mktemp("received")
    run_dir = root / "run"
    run_dir.mkdir()
    raw = job({}, train={"steps": STEPS, "warmup": 1})
    raw["model"] = dict(FACTORY)
    save_config(build_config(raw), run_dir / "config.yaml")
    results = gloo.run(1, train_layout, raw, STEPS, str(run_dir / "checkpoints"), STEPS)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["model"]["name"] = f"{EVIL}:tiny_lm"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    report = {"status": "completed", "steps": STEPS, "world_size": 2, "wall_time_s": 3600.0,
              "step_time_s": 1800.0}  # fmt: skip
    (run_dir / "report.json").write_text(json.dumps(report))
    code = root / "code"
    code.mkdir()
    marker = root / "marker"
    (code / f"{EVIL}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from user_models import tiny_lm  # noqa: E402,F401\n"
    )
    path = os.pathsep.join([str(code), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {"dir": run_dir, "marker": marker, "env": {"PYTHONPATH": path},
            "digest": results[0]["digest_final"]}  # fmt: skip


def test_commands_reading_a_received_run_never_import_its_code(received, tmp_path):
    run_dir, env = str(received["dir"]), received["env"]
    for fmt in ("torch", "safetensors"):
        refused = meshforge(["export", run_dir, "--format", fmt, "--out", str(tmp_path / fmt)],
                            env=env)  # fmt: skip
        assert_one_line_error(refused, f"model.name={EVIL}:tiny_lm", "--trust-model-code")
        assert not (tmp_path / fmt).exists()
    sample = meshforge(["sample", run_dir, "--prompt", "def "], env=env)
    assert_one_line_error(sample, f"{EVIL}:tiny_lm", "user's factory")
    for args in (["report", run_dir, "--out", str(tmp_path / "report.html")],
                 ["diagnose", run_dir], ["top", run_dir, "--once"],
                 ["cost", str(CLUSTER), "--run", run_dir]):  # fmt: skip
        proc = meshforge(args, env=env, timeout=120)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])  # they work without it
    assert not received["marker"].exists(), "a command imported the run directory's code"


def test_export_with_trust_model_code_imports_it_and_exports(received, tmp_path):
    out = tmp_path / "trusted"
    proc = meshforge(["export", str(received["dir"]), "--format", "safetensors", "--out",
                      str(out), "--trust-model-code"], env=received["env"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert received["marker"].read_text() == "ran"  # the code ran: the user said so
    assert received["digest"] in proc.stdout and (out / "model.safetensors").is_file()
    received["marker"].unlink()


def test_export_force_replaces_an_earlier_export_only(received, tmp_path):
    run_dir, env = str(received["dir"]), received["env"]

    def export(out: Path, *extra: str):
        return meshforge(["export", run_dir, "--format", "torch", "--out", str(out),
                          "--trust-model-code", *extra], env=env)  # fmt: skip

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (foreign / "model.pt").write_text("not a model")
    assert_one_line_error(export(foreign, "--force"), str(foreign), "not an earlier export",
                          "kept")  # fmt: skip
    assert sorted(p.name for p in foreign.iterdir()) == ["model.pt", "notes.txt"]
    link = tmp_path / "link"
    link.symlink_to(foreign)
    assert_one_line_error(export(link, "--force"), "a symlink")
    assert link.is_symlink() and (foreign / "notes.txt").read_text() == "mine"

    earlier = tmp_path / "earlier"
    assert export(earlier).returncode == 0
    stamp = (earlier / "model.pt").stat().st_mtime_ns
    again = export(earlier, "--force")
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in earlier.iterdir()) == ["config.yaml", "model.pt"]
    assert (earlier / "model.pt").stat().st_mtime_ns != stamp  # written anew
    received["marker"].unlink(missing_ok=True)


@pytest.mark.parametrize("name", ["../..", "/abs/path"])
def test_a_job_name_that_would_leave_runs_is_refused_in_one_line(tmp_path, name):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"name": name, "train": {"steps": 1}}))
    proc = meshforge(["train", str(job_file), "--nproc", "1"], timeout=120)
    assert_one_line_error(proc, "name", repr(name), "plain name")


def test_train_fresh_keeps_what_meshforge_did_not_write_and_never_follows_a_symlink(tmp_path):
    home = tmp_path / "home"  # another project's runs, reached through a symlink
    (home / "run-elsewhere").mkdir(parents=True)
    (home / "run-elsewhere" / "data.txt").write_text("theirs")
    (home / "latest-run").write_text("theirs")
    job = Job(tmp_path, {"train": {"steps": 2}, "checkpoint": {"every": 2}})
    job.run_dir.mkdir()
    (job.run_dir / "wandb").symlink_to(home)
    (job.run_dir / "notes.md").write_text("mine")
    job.train(1)
    (job.run_dir / "logs" / "mine.txt").write_text("mine")
    fresh = job.train(1, "--fresh")
    line = next(x for x in fresh.stdout.splitlines() if "--fresh: removed" in x)
    for kept in ("notes.md", "logs/mine.txt", "wandb (a symlink, not followed)"):
        assert kept in line, (kept, line)
    assert "no record" not in line  # this run directory's record says what meshforge wrote
    assert (home / "run-elsewhere" / "data.txt").read_text() == "theirs"
    assert (home / "latest-run").read_text() == "theirs"
    assert (job.run_dir / "notes.md").read_text() == "mine"
    assert (job.run_dir / "logs" / "mine.txt").read_text() == "mine"
    rows = (job.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["segment"] for r in rows] == [1] * len(rows)  # the old run went
    assert job.report["resumed_from"] is None
