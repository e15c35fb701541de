"""Issue 26 across hosts: a two-host job (namespace hosts h0, h1) listens only on its
interface's address, and a pickled callable that a third host (h2) writes into the
rendezvous state's key does not run: the job refuses it and ends with one clear line.

Traffic goes only between the namespace hosts that the test makes; every wait has a
time bound."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cluster import netns_hosts
from helpers import REPO, Job
from listening import listeners

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RUN_ID = "mf-listeners"

# Run inside the third host: a plain TCPStore client writes, into the rendezvous state's
# key, a pickle whose loading runs `touch MARKER` (what issue 26 found possible).
ATTACK = """
import base64, datetime, os, pickle, sys
import torch.distributed as dist
host, port, key, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=20))
store.set(key, base64.b64encode(pickle.dumps(Payload())).decode())
print("written", flush=True)
"""


def _env(secret: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MESHFORGE_FAULT", "MESHFORGE_JOB_SECRET")
        and not k.startswith(("PET_", "GLOO_", "NCCL_"))
    }
    if secret:
        env["MESHFORGE_JOB_SECRET"] = secret
    return env


def _wait_for_training(job: Job, procs: list[subprocess.Popen], logs: list, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    metrics = job.run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a launcher exited ({p.returncode}) before training:\n{_tails(logs)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no training within {timeout_s:.0f} s:\n{_tails(logs)}")
        time.sleep(0.2)


def _tails(logs: list) -> str:
    return "\n".join(f"--- {path.name}\n{path.read_text()[-2500:]}" for path in logs)


@pytest.mark.parametrize("secret", ["a-job-secret", None], ids=["secret", "no-secret"])
def test_listeners_and_a_forged_rendezvous_state(tmp_path, secret):
    job = Job(
        tmp_path,
        {"train": {"steps": 100000}, "observe": {"log_every": 1}, "checkpoint": {"every": 0}},
        "listeners",
    )
    marker = tmp_path / "payload-ran"
    with netns_hosts(3) as hosts:
        job_hosts, attacker = hosts[:2], hosts[2]
        port = 29500 + os.getpid() % 400
        endpoint = f"{job_hosts[0].addr}:{port}"
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for h in job_hosts:
                argv = [sys.executable, "-m", "meshforge", "train", str(job.config_path),
                        "--run-dir", str(job.run_dir), "--nnodes", "2", "--nproc-per-node",
                        "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                        "--rdzv-id", RUN_ID, "--iface", h.iface]  # fmt: skip
                log_path = tmp_path / f"{h.name}.log"
                logs.append(log_path)
                with log_path.open("w") as log:
                    procs.append(h.popen(argv, cwd=REPO, env=_env(secret), stdout=log,
                                         stderr=log))  # fmt: skip
            _wait_for_training(job, procs, logs, 240)

            # 1. every listener of each host's launcher, agent and workers is on that
            # host's interface address: none on every interface, none elsewhere
            for h, p in zip(job_hosts, procs, strict=True):
                seen = listeners(p.pid)
                workers = {pid for pid, _, _ in seen} - {p.pid}
                assert workers, seen  # the check saw the worker's listeners (gloo, ...)
                assert {addr for _, addr, _ in seen} == {h.addr}, (h.name, seen)
            served = listeners(procs[0].pid)
            assert (procs[0].pid, job_hosts[0].addr, port) in served, served  # the store

            # 2. a third host writes a pickled callable into the rendezvous state's key
            attack = attacker.run(
                [sys.executable, "-c", ATTACK, job_hosts[0].addr, str(port),
                 f"torch.rendezvous.{RUN_ID}", str(marker)],
                timeout=60, check=False, cwd=REPO, env=_env(None),
            )  # fmt: skip
            assert attack.returncode == 0 and "written" in attack.stdout, attack.stderr[-2000:]

            # 3. the job refuses it and ends; nothing ran it
            deadline = time.monotonic() + 150
            for p in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pytest.fail(f"a launcher still ran 150 s after the attack:\n{_tails(logs)}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
    time.sleep(1.0)
    assert not marker.exists(), "the forged rendezvous state was unpickled"
    outputs = [path.read_text() for path in logs]
    assert all(p.returncode == 1 for p in procs), ([p.returncode for p in procs], _tails(logs))
    refusals = [
        line
        for out in outputs
        for line in out.splitlines()
        if line.startswith("meshforge: the rendezvous state") and "refused before" in line
    ]
    assert refusals, _tails(logs)
    cause = "not signed" if secret else "posix.system"
    assert all(cause in line and endpoint in line for line in refusals), refusals
    assert not any("Traceback" in out for out in outputs), _tails(logs)
    unsigned = [out for out in outputs if "no MESHFORGE_JOB_SECRET is set" in out]
    assert len(unsigned) == (0 if secret else 2), _tails(logs)
