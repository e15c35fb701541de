"""Two hosts made of network namespaces, one worker each: torchrun's multi-node flags
pass through `meshforge train` to the elastic agent (c10d rendezvous)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _run_nodes(commands: list[tuple[list[str], dict[str, str]]]) -> list[tuple[str, str]]:
    """Start one command per host at once; wait (bounded) for all; each must succeed."""
    procs = [
        subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd, env in commands
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    return outputs


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "MESHFORGE_FAULT" and not k.startswith(("PET_", "GLOO_", "NCCL_"))
    }
    env.update(extra)
    return env


def _assert_same_curve(job, reference) -> None:
    mine, ref = job.losses(), reference.losses()
    assert mine.keys() == ref.keys()
    for step, loss in ref.items():
        assert abs(mine[step] - loss) <= 1e-4 * abs(loss), (step, mine[step], loss)


def _assert_two_hosts(job, addrs) -> None:
    report = job.report
    assert report["world_size"] == 2
    assert report["status"] == "completed"
    assert report["nodes"] == 2
    assert sorted(h["addr"] for h in report["hosts"]) == sorted(addrs)
    assert {p.name for p in (job.run_dir / "logs").glob("rank-*.log")} == {
        "rank-0.log",
        "rank-1.log",
    }
    # each rank's own step lines are in its own log
    for rank in (0, 1):
        text = (job.run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert "step 6/6" in text, text[-2000:]
    # the run directory holds the job config whichever launcher started it
    assert (job.run_dir / "config.yaml").is_file()
    # each node's first rank sampled its own host, interfaces included
    samples = {}
    for path in sorted((job.run_dir / "system").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[path.name] = rows[-1]
    assert sorted(samples) == ["node-0.jsonl", "node-1.jsonl"], sorted(samples)
    assert sorted(row["addr"] for row in samples.values()) == sorted(addrs)
    for row in samples.values():
        assert "lo" in row["net"] and len(row["net"]) >= 2, row["net"]


@pytest.mark.parametrize("zero", [0, 3], ids=["ddp", "zero3"])
def test_two_hosts_train_like_one(job_factory, two_hosts, zero):
    """--nnodes 2 on two namespace hosts, found by --iface alone: the loss curve equals
    the same job on one host within 1e-4 relative."""
    overrides = {"train": {"steps": 6}, "parallel": {"zero": zero}}
    reference = job_factory(overrides, name="one-host")
    reference.train(2)
    job = job_factory(overrides, name="two-hosts")
    addr0 = two_hosts[0].addr
    port = 29500 + os.getpid() % 400
    commands = [
        h.exec_argv([sys.executable, "-m", "meshforge", "train",
         str(job.config_path), "--run-dir", str(job.run_dir), "--nnodes", "2",
         "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"{addr0}:{port}", "--rdzv-id", "mf-test", "--iface", h.iface])
        for h in two_hosts
    ]  # fmt: skip
    outputs = _run_nodes([(cmd, _clean_env()) for cmd in commands])
    assert "serves the rendezvous store" in outputs[0][0]
    _assert_two_hosts(job, [h.addr for h in two_hosts])
    _assert_same_curve(job, reference)


def test_pet_variables_alone_start_a_run(job_factory, two_hosts):
    """What the Kubeflow operator sets (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
    PET_MASTER_ADDR, PET_MASTER_PORT) starts a correct two-node run with no launch flags."""
    overrides = {"train": {"steps": 6}, "parallel": {"zero": 2}}
    job = job_factory(overrides, name="pet")
    addr0 = two_hosts[0].addr
    port = str(29100 + os.getpid() % 300)
    procs = []
    for node_rank, host in enumerate(two_hosts):
        env = _clean_env(
            PET_NNODES="2",
            PET_NPROC_PER_NODE="1",
            PET_NODE_RANK=str(node_rank),
            PET_MASTER_ADDR=addr0,
            PET_MASTER_PORT=port,
            GLOO_SOCKET_IFNAME=host.iface,
        )
        cmd = host.exec_argv([sys.executable, "-m", "meshforge", "train",
               str(job.config_path), "--run-dir", str(job.run_dir)])  # fmt: skip
        procs.append((cmd, env))
    _run_nodes(procs)
    _assert_two_hosts(job, [h.addr for h in two_hosts])
