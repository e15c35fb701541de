"""Issue 26: a run whose `data.source` URL carries credentials trains, and leaves none of
them in its run directory (config.yaml, report.json, report.html, logs/, metrics,
TensorBoard and W&B files) nor on its console; it resumes from its own redacted
config.yaml.

The URL is a `file://` one whose directory name holds the credential-like parameters
(`shards?token=...&sig=...`): fsspec reads it as a plain path, so the run has a
credential-carrying URL to hide without any network."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import meshforge
from meshforge.data.corpus import remote_cache_path
from meshforge.data.shards import prepare

TOKEN, SIG = "tok-Zq81xv", "sig-Hp44wd"
WANDB = importlib.util.find_spec("wandb") is not None


def leaks(folder: Path, secrets: tuple[str, ...]) -> list[str]:
    """Every file under `folder` (any format, read as bytes) that holds one of `secrets`."""
    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path.relative_to(folder)}: {s}" for s in secrets if s.encode() in data]
    return found


@pytest.mark.slow
def test_a_credentialed_url_source_trains_and_leaves_no_credential(tmp_path, job_factory):
    text = "".join(chr(c) for c in np.random.default_rng(0).integers(32, 127, size=40_000))
    (tmp_path / "corpus.txt").write_text(text)
    shards = tmp_path / "data" / f"shards?token={TOKEN}&sig={SIG}"
    prepare(tmp_path / "corpus.txt", shards, shard_tokens=10_000)
    url = f"file://{shards}"
    observe = {"log_every": 1, "tensorboard": True}
    if WANDB:
        observe["wandb"] = {"project": "meshforge-test", "mode": "offline"}
    job = job_factory(
        {
            "data": {"source": url, "cache_dir": str(tmp_path / "cache")},
            "train": {"steps": 4},
            "checkpoint": {"every": 2},
            "observe": observe,
        }
    )
    env = {"WANDB_SILENT": "true", "MESHFORGE_CACHE": str(tmp_path / "user-cache")}
    first = job.train(2, env=env)
    assert job.report["status"] == "completed" and job.report["steps"] == 4
    html = meshforge(["report", str(job.run_dir)])
    assert html.returncode == 0, html.stderr
    assert (job.run_dir / "report.html").is_file() and (job.run_dir / "logs").is_dir()

    secrets = (TOKEN, SIG)
    assert leaks(job.run_dir, secrets) == []
    assert not any(s in first.stdout + first.stderr + html.stdout for s in secrets)
    # config.yaml still names the data, its credentials masked
    saved = yaml.safe_load((job.run_dir / "config.yaml").read_text())
    redacted = f"file://{shards.parent}/shards?token=***&sig=***"
    assert saved["data"]["source"] == redacted
    # the workers read that config.yaml: they trained on the launcher's cached copy
    assert (remote_cache_path(url, tmp_path / "cache") / "index.json").is_file()

    # a resume from the run's own (redacted) config.yaml is not refused and trains on
    argv = ["train", str(job.run_dir / "config.yaml"), "--nproc", "2"]
    again = meshforge([*argv, "--run-dir", str(job.run_dir), "--set", "train.steps=6"], env=env)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert job.report["resumed_from"] == 4 and job.report["steps"] == 6
    assert leaks(job.run_dir, secrets) == []
