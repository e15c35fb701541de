"""Two hosts made of network namespaces, one worker each: torchrun's multi-node flags
pass through `meshforge train` to the elastic agent (c10d rendezvous)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    return None


@pytest.fixture
def two_hosts():
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    tag = f"mf{os.getpid() % 100000}"
    hosts = [f"{tag}a", f"{tag}b"]
    subnet = f"10.77.{os.getpid() % 250}"
    addrs = [f"{subnet}.1", f"{subnet}.2"]

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    try:
        for h in hosts:
            ip("netns", "add", h)
        ip(
            "link",
            "add",
            "ci0",
            "netns",
            hosts[0],
            "type",
            "veth",
            "peer",
            "name",
            "ci0",
            "netns",
            hosts[1],
        )
        for h, a in zip(hosts, addrs, strict=True):
            ip("-n", h, "addr", "add", f"{a}/24", "dev", "ci0")
            ip("-n", h, "link", "set", "lo", "up")
            ip("-n", h, "link", "set", "ci0", "up")
    except subprocess.CalledProcessError as exc:
        for h in hosts:
            subprocess.run(["ip", "netns", "del", h], capture_output=True, timeout=30)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    yield list(zip(hosts, addrs, strict=True))
    for h in hosts:
        subprocess.run(["ip", "netns", "del", h], capture_output=True, timeout=30)


def test_two_node_run_over_c10d_rendezvous(job_factory, two_hosts):
    job = job_factory({"train": {"steps": 6}, "parallel": {"zero": 2}})
    (host0, addr0), _ = two_hosts
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    env["GLOO_SOCKET_IFNAME"] = "ci0"
    procs = []
    for rank, (host, addr) in enumerate(two_hosts):
        cmd = [
            "ip",
            "netns",
            "exec",
            host,
            sys.executable,
            "-m",
            "meshforge",
            "train",
            str(job.config_path),
            "--nproc",
            "1",
            "--run-dir",
            str(job.run_dir),
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{addr0}:29533",
            "--rdzv-id",
            "mf-test",
            "--local-addr",
            addr,
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=240))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    report = job.report
    assert report["world_size"] == 2
    assert report["layout"]["dp"] == 2
    assert report["status"] == "completed"
    assert {p.name for p in (job.run_dir / "logs").glob("rank-*.log")} == {
        "rank-0.log",
        "rank-1.log",
    }
