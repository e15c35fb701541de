"""`meshforge submit slurm`: the sbatch script it writes (quoting hostile values, run
for real against stand-ins for Slurm's commands), its refusals of bad input, and a
two-node job on a real Slurm cluster whose nodes are network-namespace hosts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster import netns_hosts, slurm_cluster
from helpers import REPO, TINY_JOB, assert_one_line_error, merge, meshforge

# Would create a file named PWNED in the working directory if it ever ran as code.
HOSTILE = "run dir 'q' \"d\" $(touch PWNED) `touch PWNED` ;touch PWNED #h"


@pytest.fixture
def job_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(merge(TINY_JOB, {"train": {"steps": 6}})))
    return path


def submit(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return meshforge(["submit", "slurm", *args], env=env, timeout=120)


# Stand-ins for Slurm's commands: a two-node allocation n1, n2 at 10.9.0.1/.2, and an
# srun that runs its command once per node, as Slurm would, in this process's network.
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$*" in
  "show hostnames n[1-2]") printf 'n1\\nn2\\n' ;;
  "-o show node n1") echo "NodeName=n1 Arch=x86_64 NodeAddr=10.9.0.1 NodeHostName=vm" ;;
  "-o show node n2") echo "NodeName=n2 Arch=x86_64 NodeAddr=10.9.0.2 NodeHostName=vm" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
for node in n1 n2; do SLURMD_NODENAME=$node "$@" || exit; done
"""
# The "python" on the nodes: records what it was asked to run.
FAKE_PYTHON = """#!{python}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    env = {{k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}
    f.write(json.dumps({{"argv": sys.argv[1:], "env": env}}) + "\\n")
"""


def _fake_slurm(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """PATH with the stand-ins, a hostile --python path, and the record file."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    python = tmp_path / "py $(touch PWNED) 'x'" / "python"
    python.parent.mkdir()
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    record = tmp_path / "record.jsonl"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "RECORD": str(record),
    }
    return env, python, record


def test_dry_run_quotes_hostile_values_so_they_stay_data(tmp_path, job_yaml):
    env, python, record = _fake_slurm(tmp_path)
    run_dir = tmp_path / HOSTILE
    proc = submit(
        [str(job_yaml), "--nodes", "2", "--run-dir", str(run_dir), "--python", str(python)]
        + ["--iface", "ci0", "--port", "29777", "--partition", "gpu-a100,debug"]
        + ["--time", "1-02:03:04", "--account", "proj.x_1", "--cpus-per-task", "3", "--dry-run"]
    )
    assert proc.returncode == 0, proc.stderr
    slurm_dir = run_dir / "slurm"
    sbatch, node = slurm_dir / "job.sbatch", slurm_dir / "node.sh"
    # What was printed is what was written, and it is valid bash.
    assert proc.stdout.startswith(sbatch.read_text())
    assert proc.stdout.rstrip().endswith(node.read_text().rstrip())
    for script in (sbatch, node):
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    subprocess.run(["bash", "-n"], input=proc.stdout, text=True, check=True, timeout=30)

    text = sbatch.read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives[:4] == [
        "#SBATCH --job-name=tiny",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        '#SBATCH --output="{}"'.format(str(slurm_dir / "slurm-%j.out").replace('"', '\\"')),
    ]
    assert set(directives[4:]) == {
        "#SBATCH --cpus-per-task=3",
        "#SBATCH --partition=gpu-a100,debug",
        "#SBATCH --time=1-02:03:04",
        "#SBATCH --account=proj.x_1",
    }
    assert "--gres" not in text  # no GPUs asked for

    # Run both scripts for real, against the stand-ins: nothing injected runs, and
    # every value reaches `meshforge train` exactly as given.
    ran = subprocess.run(
        ["bash", str(sbatch)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert not list(tmp_path.rglob("PWNED")), "an injected command ran"
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) == 2
    for call, addr, is_host in zip(calls, ["10.9.0.1", "10.9.0.2"], [1, 0], strict=True):
        assert call["argv"] == [
            "-m", "meshforge", "train", str(slurm_dir / "job.yaml"),
            "--run-dir", str(run_dir),
            "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.9.0.1:29777",
            "--rdzv-id", "4242", "--rdzv-conf", f"is_host={is_host}",
            "--local-addr", addr, "--iface", "ci0",
        ]  # fmt: skip
        assert call["env"] == {"GLOO_SOCKET_IFNAME": "ci0", "NCCL_SOCKET_IFNAME": "ci0"}
    # The job config the agents read is the validated job.
    assert yaml.safe_load((slurm_dir / "job.yaml").read_text())["train"]["steps"] == 6


def test_dry_run_requests_gpus_and_one_worker_per_gpu(tmp_path, job_yaml):
    proc = submit(
        [str(job_yaml), "--nodes", "4", "--gpus-per-node", "2", "--run-dir", str(tmp_path / "r")]
        + ["--set", "train.global_batch=32", "--dry-run"]
    )
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --gres=gpu:2" in proc.stdout
    assert "--nnodes 4 \\\n  --nproc-per-node 2" in proc.stdout
    assert "GLOO_SOCKET_IFNAME" not in proc.stdout  # no --iface, no interface pinned
    assert "--iface" not in proc.stdout
    # no --port: derived from the job id, so two jobs sharing a first node differ
    assert "port=$((29500 + SLURM_JOB_ID % 10000))" in proc.stdout


def test_a_hostile_config_name_is_refused_before_any_script(tmp_path):
    # issue 26: a job name is a plain name (config.py), so a hostile one never reaches
    # an sbatch script (which made it `x---touch-PWNED--y` before)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(merge(TINY_JOB, {"name": "x $(touch PWNED);y"})))
    proc = submit([str(path), "--nodes", "1", "--run-dir", str(tmp_path / "r"), "--dry-run"])
    assert_one_line_error(proc, "x $(touch PWNED);y", "not a plain name")
    assert not (tmp_path / "r").exists() and "#SBATCH" not in proc.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--partition", "x; rm -rf /"], ["--partition"]),
        (["--partition", "a\nb"], ["--partition"]),
        (["--time", "$(reboot)"], ["--time"]),
        (["--time", "10\n#SBATCH --uid=0"], ["--time"]),
        (["--account", "`reboot`"], ["--account"]),
        (["--iface", "ci0; reboot"], ["--iface"]),
        (["--run-dir", "/tmp/a\ntouch PWNED"], ["--run-dir", "line break"]),
        (["--run-dir", "/tmp/run-%j"], ["--run-dir", "%"]),
        (["--nodes", "0"], ["--nodes"]),
        (["--nodes", "2", "--nproc-per-node", "0"], ["--nproc-per-node"]),
    ],
    ids=[
        "partition-injection",
        "partition-newline",
        "time-substitution",
        "time-newline-directive",
        "account-backticks",
        "iface-injection",
        "run-dir-newline",
        "run-dir-percent",
        "zero-nodes",
        "zero-workers",
    ],
)
def test_bad_values_are_refused_in_one_line(tmp_path, job_yaml, args, fragments):
    nodes = [] if "--nodes" in args else ["--nodes", "2"]
    proc = submit([str(job_yaml), *nodes, "--run-dir", str(tmp_path / "r"), *args, "--dry-run"])
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "r" / "slurm" / "job.sbatch").exists()


def test_missing_sbatch_says_what_to_install(tmp_path, job_yaml):
    proc = submit(
        [str(job_yaml), "--nodes", "2", "--run-dir", str(tmp_path / "r")],
        env={"PATH": str(tmp_path)},
    )
    assert_one_line_error(proc, "sbatch not found", "apt-get install slurm-client")
    assert not (tmp_path / "r").exists()  # refused before anything was written


# --- a real Slurm cluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm():
    with netns_hosts(2) as hosts, slurm_cluster(hosts) as cluster:
        yield cluster


def submit_in_cluster(slurm, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`meshforge submit slurm ARGS` run as a user on the controller's host would."""
    env = {k: v for k, v in slurm.env.items() if k != "MESHFORGE_FAULT"}
    argv = [sys.executable, "-m", "meshforge", "submit", "slurm", *args]
    return slurm.run(argv, env=env, cwd=REPO, timeout=timeout, check=False)


@pytest.mark.cluster
def test_slurm_own_error_comes_back_in_one_line(slurm, tmp_path, job_yaml):
    run_dir = tmp_path / "r"
    proc = submit_in_cluster(
        slurm,
        [str(job_yaml), "--nodes", "2", "--run-dir", str(run_dir), "--partition", "nosuch"],
        60,
    )
    assert_one_line_error(proc, "sbatch", "invalid partition", "nosuch")


@pytest.mark.cluster
@pytest.mark.slow
def test_two_node_job_runs_to_completion_on_slurm(slurm, tmp_path, job_yaml):
    # A run dir with spaces, quotes and `$`: Slurm's and bash's quoting both hold.
    run_dir = tmp_path / "run 'a' $(touch PWNED)"
    job_yaml.write_text(
        yaml.safe_dump(merge(TINY_JOB, {"train": {"steps": 6}, "parallel": {"zero": 2}}))
    )
    proc = submit_in_cluster(
        slurm,
        [str(job_yaml), "--nodes", "2", "--wait", "--iface", "ci0", "--run-dir", str(run_dir)],
        timeout=240,
    )
    log = next((run_dir / "slurm").glob("slurm-*.out"), None)
    seen = (
        f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n"
        f"--- job log\n{log.read_text()[-4000:] if log else '(none)'}\n{slurm.logs()}"
    )
    assert proc.returncode == 0, seen
    assert "COMPLETED" in proc.stdout, seen
    assert not list(tmp_path.rglob("PWNED")) and not list(REPO.glob("PWNED"))
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed"
    assert report["world_size"] == 2
    assert report["steps"] == 6
    if "hosts" in report:  # each rank's host, where the report records them
        addrs = {h["addr"] for h in report["hosts"]}
        assert addrs == {h.addr for h in slurm.hosts}, report["hosts"]


@pytest.mark.cluster
def test_wait_reports_a_failed_job_with_its_log(slurm, tmp_path, job_yaml):
    run_dir = tmp_path / "r"
    args = [str(job_yaml), "--nodes", "2", "--run-dir", str(run_dir), "--python", "/bin/false"]
    proc = submit_in_cluster(slurm, [*args, "--wait"], timeout=90)
    assert proc.returncode == 1, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    job_id = proc.stdout.split("Slurm job ")[1].split()[0]
    assert "FAILED" in lines[0] and str(run_dir / "slurm" / f"slurm-{job_id}.out") in lines[0]
