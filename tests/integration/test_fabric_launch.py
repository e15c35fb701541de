"""Fabric.launch where it runs: in the shell of `salloc` or of an `sbatch` batch script
(no srun step: it starts its own workers and finishes, instead of waiting as rank 0 of
SLURM_NTASKS for ranks that never come), as the tasks of an srun step (each task one
rank), on a real Slurm cluster, and a failing worker reported by its root-cause rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import netns_hosts, slurm_cluster
from helpers import REPO
from meshforge.launch.local import free_port
from meshforge.launch.slurm import FINAL_STATES
from meshforge.runtime.env import detect_env

SCRIPT = """
import json, os, sys
import torch.distributed as dist
from meshforge.fabric import Fabric

def train(fabric):
    seen = [None] * fabric.world_size
    dist.all_gather_object(seen, [fabric.rank, os.getpid()])
    if sys.argv[1] == "fail":
        if fabric.rank == 1:
            raise ValueError("boom on rank 1")
        fabric.barrier()  # waits for rank 1, which has failed
    return seen

if __name__ == "__main__":
    print("RESULT " + json.dumps(Fabric().launch(train, nproc=int(sys.argv[2]))), flush=True)
"""

# What launchers and schedulers set; a test's process starts without any of it.
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
_LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "MESHFORGE_IN_POOL", "MESHFORGE_FAULT")  # fmt: skip

# The variables a real Slurm 22.05 sets (tests/cluster.py's cluster, `env` in each).
SALLOC_SHELL = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_JOB_NODELIST": "n1",
    "SLURM_NODELIST": "n1",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_JOB_CPUS_PER_NODE": "2",
}
BATCH_SHELL = {
    **SALLOC_SHELL,
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_GTIDS": "0",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_TASK_PID": "1",
}


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_KEYS
    }
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "fabric_script.py"
    path.write_text(SCRIPT)
    return path


def _start(script: Path, mode: str, nproc: int, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(nproc)],
        env=_clean_env(env),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout:.0f} s (a hang):\n{out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err


def _result(out: str) -> list:
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_an_allocation_shell_is_no_rank_and_an_srun_task_is():
    assert detect_env(SALLOC_SHELL).launcher == "single"
    batch = detect_env(BATCH_SHELL)  # SLURM_PROCID=0 of SLURM_NTASKS=2, but no step
    assert (batch.launcher, batch.rank, batch.world_size) == ("single", 0, 1)
    for step_id in ("SLURM_STEP_ID", "SLURM_STEPID"):
        task = detect_env({**BATCH_SHELL, step_id: "0", "SLURM_PROCID": "1"})
        assert (task.launcher, task.rank, task.world_size) == ("slurm", 1, 2)


@pytest.mark.parametrize("shell", ["salloc", "sbatch"])
def test_launch_in_an_allocation_shell_starts_its_own_workers(tmp_path, shell):
    env = SALLOC_SHELL if shell == "salloc" else BATCH_SHELL
    rc, out, err = _finish(_start(_script(tmp_path), "ok", 2, env))
    assert rc == 0, f"{out[-2000:]}\n{err[-3000:]}"
    seen = _result(out)
    # two ranks, in two workers that are not this process
    assert [rank for rank, _ in seen] == [0, 1]
    assert len({pid for _, pid in seen}) == 2


def test_tasks_of_an_srun_step_are_the_ranks(tmp_path):
    script = _script(tmp_path)
    step = {**BATCH_SHELL, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "n1"}
    step.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    tasks = [
        _start(script, "ok", 1, {**step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
        for r in range(2)
    ]
    results = [_finish(t) for t in tasks]
    for rc, out, err in results:
        assert rc == 0, f"{out[-2000:]}\n{err[-3000:]}"
    seen = [_result(out) for _, out, _ in results]
    # each task ran train itself: both report the same two ranks, their own pids
    assert seen[0] == seen[1]
    assert {pid for _, pid in seen[0]} == {t.pid for t in tasks}


def test_a_failing_worker_is_reported_by_its_root_cause_rank(tmp_path):
    rc, out, err = _finish(_start(_script(tmp_path), "fail", 2, {}))
    assert rc != 0
    last = err.strip().splitlines()[-1]
    assert "FabricWorkerError: rank 1 failed" in last, err[-3000:]
    assert "ValueError: boom on rank 1 (the root cause)" in last
    # rank 0, waiting for rank 1, is stopped by the agent; whether the agent counts it
    # among the failures depends on which it sees first: when it does, it comes second
    if "rank 0" in last:
        assert last.index("rank 1 failed") < last.index("as its consequence: rank 0")


# --- a real Slurm cluster ------------------------------------------------------------

BATCH_SCRIPT = """#!/bin/bash
#SBATCH --nodes=1 --ntasks=2
#SBATCH --output={log}
set -e
cd {repo}
echo "=== batch shell"
timeout 90 {python} {script} ok 2
echo "=== srun step"
export MASTER_ADDR=127.0.0.1 MASTER_PORT={port}
timeout 90 srun --ntasks=2 {python} {script} ok 1
"""


def _wait_for_job(slurm, job: str, timeout_s: float) -> str:
    """The job's final state (sbatch --wait polls at growing intervals: seconds late)."""
    deadline = time.monotonic() + timeout_s
    state = "?"
    while time.monotonic() < deadline:
        shown = slurm.run(["scontrol", "-o", "show", "job", job], check=False).stdout
        match = re.search(r"JobState=(\S+)", shown)
        state = match.group(1) if match else "?"
        if state in FINAL_STATES:
            return state
        time.sleep(0.3)
    return f"{state} after {timeout_s:.0f} s"


@pytest.mark.cluster
def test_launch_in_a_real_sbatch_job_and_its_srun_step(tmp_path):
    script = _script(tmp_path)
    log = tmp_path / "job.out"
    batch = tmp_path / "job.sbatch"
    batch.write_text(
        BATCH_SCRIPT.format(
            log=log, repo=REPO, python=sys.executable, script=script, port=free_port()
        )
    )
    with netns_hosts(2) as hosts, slurm_cluster(hosts) as slurm:
        env = {**slurm.env, "OMP_NUM_THREADS": "1"}
        job = slurm.run(["sbatch", "--parsable", str(batch)], env=env).stdout.split(";")[0]
        state = _wait_for_job(slurm, job.strip(), timeout_s=220)  # its commands: 90 s each
        text = log.read_text() if log.exists() else "(no log)"
        seen = f"job {job}: {state}\n--- job log\n{text[-4000:]}"
        if state != "COMPLETED":
            shown = slurm.run(["scontrol", "show", "job", job.strip()], check=False).stdout
            pytest.fail(f"{seen}\n--- scontrol\n{shown}\n{slurm.logs()}", pytrace=False)
    batch_part, step_part = text.split("=== srun step")
    results = [json.loads(ln[len("RESULT ") :]) for ln in batch_part.splitlines() if "RESULT" in ln]
    assert len(results) == 1 and [r for r, _ in results[0]] == [0, 1], seen
    results = [json.loads(ln[len("RESULT ") :]) for ln in step_part.splitlines() if "RESULT" in ln]
    assert len(results) == 2 and results[0] == results[1], seen  # each task one of 2 ranks
    assert [r for r, _ in results[0]] == [0, 1], seen
