"""Sinks beside metrics.jsonl: TensorBoard, Prometheus, Weights & Biases, and a sink that
fails. One 2-rank run with every sink on (scraped while it trains), one with the port
taken and metrics.jsonl on a full disk."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import REPO, Job, assert_one_line_error, meshforge, unused_port

pytestmark = pytest.mark.slow

WANDB = importlib.util.find_spec("wandb") is not None


def _scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def _listening_addrs(port: int) -> set[str]:
    """Local IPv4 addresses with a socket listening on `port` (/proc/net/tcp)."""
    addrs = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        hex_addr, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            addrs.add(socket.inet_ntoa(bytes.fromhex(hex_addr)[::-1]))
    return addrs


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    """A 2-rank run with TensorBoard, W&B (offline, when installed) and Prometheus on,
    scraped over loopback until both ranks have finished a step."""
    tmp = tmp_path_factory.mktemp("sinks")
    port = unused_port()
    observe = {
        "log_every": 5,
        "tensorboard": True,
        "prometheus_port": port,
        "flight_every_s": 0.3,
        "sample_every_s": 0.3,
    }
    if WANDB:
        observe["wandb"] = {"project": "meshforge-test", "mode": "offline"}
    job = Job(tmp, {"train": {"steps": 60}, "observe": observe})
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    env["MESHFORGE_FAULT"] = "slow:1:4"  # a few seconds of training to scrape
    env["WANDB_SILENT"] = "true"
    argv = [sys.executable, "-m", "meshforge", "train", str(job.config_path), "--nproc", "2",
            "--run-dir", str(job.run_dir)]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    scraped, listening, deadline = None, set(), time.monotonic() + 240
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                metrics = _scrape(url)
            except OSError:
                time.sleep(0.3)
                continue
            steps = {s[0]["rank"]: s[1] for s in metrics.get("meshforge_step", [])}
            # both ranks stepped, rank 0 logged, and the host sampler has sampled (its
            # first sample follows the first interval, which can be after step 1)
            sampled = "meshforge_network_receive_bytes_per_second" in metrics
            ready = "meshforge_loss" in metrics and "meshforge_cpu_percent" in metrics
            if steps.get("0", 0) >= 1 and steps.get("1", 0) >= 1 and ready and sampled:
                scraped, listening = metrics, _listening_addrs(port)
                break
            time.sleep(0.3)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    return {"job": job, "metrics": scraped, "listening": listening, "port": port, "err": err}


def test_prometheus_serves_every_rank_with_rank_and_host_labels(watched_run):
    metrics = watched_run["metrics"]
    assert metrics is not None, "the endpoint never served both ranks' steps"
    host = socket.gethostname()
    for name in (
        "meshforge_step",
        "meshforge_step_time_seconds",
        "meshforge_memory_rss_bytes",
        "meshforge_record_age_seconds",
        "meshforge_phase",
    ):
        ranks = {labels["rank"] for labels, _ in metrics.get(name, [])}
        assert ranks == {"0", "1"}, (name, metrics.get(name))
        assert {labels["host"] for labels, _ in metrics[name]} == {host}
    for name in ("meshforge_loss", "meshforge_tokens_per_second", "meshforge_learning_rate"):
        (labels, value), *_ = metrics[name]
        assert labels == {"rank": "0", "host": host} and value > 0, (name, metrics[name])
    assert metrics["meshforge_cpu_percent"][0][0] == {"host": host}
    interfaces = {labels["interface"] for labels, _ in metrics.get(
        "meshforge_network_receive_bytes_per_second", [])}  # fmt: skip
    assert "lo" in interfaces
    # the endpoint listens on loopback only: nothing configured another address
    assert watched_run["listening"] == {"127.0.0.1"}


def test_tensorboard_events_read_back(watched_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = watched_run["job"]
    acc = EventAccumulator(str(job.run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "perf/tokens_per_s", "time/step_s", "ranks/step_s/rank1"):
        assert tag in tags, sorted(tags)
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(losses) == list(range(5, 61, 5))
    rows = {r: loss for r, loss in job.losses().items()}
    for step, value in losses.items():
        assert value == pytest.approx(rows[step], rel=1e-6)
    assert any(t.startswith("system/net_rx_bytes_per_s/") for t in tags)


@pytest.mark.skipif(not WANDB, reason="the wandb package is not installed here")
def test_wandb_offline_writes_its_run(watched_run):
    runs = list((watched_run["job"].run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert list(runs[0].glob("run-*.wandb")), list(runs[0].iterdir())


def test_every_metrics_row_has_a_timestamp(watched_run):
    job = watched_run["job"]
    import json

    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows]
    assert all(isinstance(t, float) for t in times)
    assert times == sorted(times) and time.time() - 600 < times[0] <= times[-1] <= time.time()
    for row in rows:
        assert len(row["step_time_s_per_rank"]) == 2 and len(row["memory_bytes_per_rank"]) == 2
        assert all(m > 0 for m in row["memory_bytes_per_rank"])


@pytest.fixture
def full_disk(tmp_path):
    """A tiny tmpfs filled up: writing there fails with ENOSPC, reading works."""
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True, text=True,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        (mount / "metrics.jsonl").touch()
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"x" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_failing_sinks_warn_once_and_training_goes_on(tmp_path, full_disk):
    """The Prometheus port is taken and metrics.jsonl sits on a full disk: one warning
    each, the run completes, its report is written."""
    port = unused_port()
    job = Job(tmp_path, {"observe": {"prometheus_port": port, "log_every": 2}})
    job.run_dir.mkdir()
    # the full disk's file mounted over the run's metrics.jsonl (a bind mount, not a
    # symlink: meshforge refuses to write a run's outputs through a link)
    metrics = job.run_dir / "metrics.jsonl"
    metrics.touch()
    subprocess.run(["mount", "--bind", str(full_disk / "metrics.jsonl"), str(metrics)],
                   check=True, capture_output=True)  # fmt: skip
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", port))
            taken.listen()
            proc = job.train(2)
    finally:
        subprocess.run(["umount", "-l", str(metrics)], capture_output=True)
    text = proc.stdout + proc.stderr
    assert text.count(f"Prometheus endpoint on 127.0.0.1:{port} not started") == 1, text
    assert text.count("metrics.jsonl stopped") == 1, text
    assert "No space left on device" in text
    assert job.report["status"] == "completed" and job.report["final_loss"] is not None


def test_prometheus_address_is_refused_in_the_port(tmp_path):
    job = Job(tmp_path)
    proc = meshforge(
        ["train", str(job.config_path), "--set", "observe.prometheus_port=0.0.0.0:9100"]
    )
    assert_one_line_error(proc, "prometheus_port", "prometheus_addr")
    proc = meshforge(
        ["train", str(job.config_path), "--set", "observe.prometheus_addr=example.org"]
    )
    assert_one_line_error(proc, "prometheus_addr")
    assert not job.run_dir.exists()


def test_a_resumed_run_logs_each_step_once_to_tensorboard(tmp_path):
    """A run that crashed after step 15 resumes from its step-10 checkpoint and logs
    steps 11-15 again: TensorBoard keeps the new attempt's, once each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = Job(tmp_path, {"observe": {"tensorboard": True}, "checkpoint": {"every": 10}})
    crashed = job.train(2, env={"MESHFORGE_FAULT": "crash:15"}, check=False)
    assert crashed.returncode != 0
    job.train(2)
    acc = EventAccumulator(str(job.run_dir / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    steps = [e.step for e in events]
    assert sorted(steps) == list(range(1, 21)), steps
    losses = job.losses()  # the latest row of each step
    for e in events:
        assert e.value == pytest.approx(losses[e.step], rel=1e-6)
