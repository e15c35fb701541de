"""`meshforge train`'s command line is torchrun's (its parser, its PET_* variables) plus
--iface and --oversubscribe; one config per job, agreed from global rank 0."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from helpers import TINY_JOB, assert_one_line_error, meshforge, stop_processes
from meshforge.errors import ConfigError
from meshforge.launch.torchrun import (
    check_gpu_count,
    launch_config,
    parse_launch_args,
)
from meshforge.runtime import netif


@pytest.fixture
def clean_launch_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("PET_") or key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            monkeypatch.delenv(key)
    monkeypatch.delenv("MESHFORGE_IFACE", raising=False)
    return monkeypatch


def test_every_spelling_of_nproc(clean_launch_env):
    for flags in (["--nproc", "3"], ["--nproc-per-node", "3"], ["--nproc_per_node=3"]):
        assert parse_launch_args(["job.yaml", *flags]).nproc_per_node == 3
    assert parse_launch_args(["job.yaml", "--nproc-per-node", "cpu"]).nproc_per_node == (
        os.cpu_count()
    )
    # no accelerator here: auto means one process per core, as torchrun does
    assert parse_launch_args(["job.yaml", "--nproc-per-node", "auto"]).nproc_per_node >= 1


def test_single_node_defaults_follow_torchrun(clean_launch_env):
    a = parse_launch_args(["job.yaml"]).args
    assert (a.rdzv_backend, a.rdzv_endpoint) == ("c10d", "localhost:0")
    standalone = parse_launch_args(["job.yaml", "--standalone"]).args
    assert standalone.rdzv_backend == "c10d" and standalone.rdzv_id != "none"


def test_elastic_range_and_torchrun_options(clean_launch_env, tmp_path):
    launch = parse_launch_args(
        ["job.yaml", "--nnodes", "1:4", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "abc", "--max-restarts", "3",
         "--log-dir", str(tmp_path / "elastic"), "--monitor-interval", "0.5"]
    )  # fmt: skip
    assert (launch.min_nodes, launch.max_nodes) == (1, 4)
    config, cmd, cmd_args = launch_config(launch, ["worker", "x.yaml"], tmp_path / "default")
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 4, 2)
    assert (config.run_id, config.max_restarts, config.monitor_interval) == ("abc", 3, 0.5)
    assert config.rdzv_endpoint == "127.0.0.1:29400"
    assert config.logs_specs.root_log_dir == str(tmp_path / "elastic")
    assert cmd_args[-4:] == ["-m", "meshforge", "worker", "x.yaml"]
    assert "OMP_NUM_THREADS" not in os.environ  # meshforge shares cores itself


def test_pet_variables_are_read_as_torchrun_reads_them(clean_launch_env, tmp_path):
    for key, value in {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "4",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "10.1.2.3",
        "PET_MASTER_PORT": "23456",
    }.items():
        clean_launch_env.setenv(key, value)
    launch = parse_launch_args(["job.yaml"])
    assert (launch.max_nodes, launch.nproc_per_node) == (2, 4)
    config, _, _ = launch_config(launch, ["worker"], tmp_path)
    assert config.rdzv_backend == "static"
    assert config.rdzv_endpoint == "10.1.2.3:23456"
    assert config.rdzv_configs["rank"] == 1
    # a flag beats its PET_ variable
    assert parse_launch_args(["job.yaml", "--nproc", "1"]).nproc_per_node == 1


def test_iface_sets_socket_variables_and_address(clean_launch_env):
    a = parse_launch_args(["job.yaml", "--iface", "lo"]).args
    assert a.local_addr == "127.0.0.1"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    # an explicit --local-addr wins over the interface's address
    assert (
        parse_launch_args(
            ["job.yaml", "--iface", "lo", "--local-addr", "localhost"]
        ).args.local_addr
        == "localhost"
    )


def test_store_host_found_on_a_secondary_address(clean_launch_env):
    """torchrun compares the endpoint with the host name only; meshforge also checks the
    node's own addresses (the cluster network is often a second interface)."""
    flags = ["job.yaml", "--nnodes", "2", "--rdzv-backend", "c10d"]
    clean_launch_env.setattr(netif, "endpoint_is_local", lambda host, port: True)
    here = parse_launch_args([*flags, "--rdzv-endpoint", "10.9.0.1:29400"])
    assert here.args.rdzv_conf == "is_host=1"
    clean_launch_env.setattr(netif, "endpoint_is_local", lambda host, port: False)
    there = parse_launch_args([*flags, "--rdzv-endpoint", "10.9.0.1:29400", "--rdzv-conf",
                               "read_timeout=30"])  # fmt: skip
    assert there.args.rdzv_conf == "read_timeout=30,is_host=0"
    explicit = parse_launch_args([*flags, "--rdzv-endpoint", "10.9.0.1:1", "--rdzv-conf",
                                  "is_host=1"])  # fmt: skip
    assert explicit.args.rdzv_conf == "is_host=1"


def test_endpoint_is_local_on_loopback():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert netif.endpoint_is_local("127.0.0.1", taken) is False  # someone serves it
    assert netif.endpoint_is_local("192.0.2.123", 29400) is False  # not an address here


def test_more_processes_than_gpus_is_refused_unless_forced():
    with pytest.raises(ConfigError, match="more than the 2 GPU"):
        check_gpu_count(4, "auto", oversubscribe=False, gpus=2)
    check_gpu_count(4, "auto", oversubscribe=True, gpus=2)
    check_gpu_count(4, "cpu", oversubscribe=False, gpus=2)
    check_gpu_count(2, "cuda", oversubscribe=False, gpus=2)
    check_gpu_count(8, "auto", oversubscribe=False, gpus=0)  # a CPU node


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(TINY_JOB))
    return path


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--nnodes", "3:2"], ["--nnodes 3:2", "minimum"]),
        (["--nnodes", "0"], ["--nnodes 0"]),
        (["--nnodes", "two"], ["--nnodes two"]),
        (["--iface", "nosuch0"], ["--iface nosuch0", "no such network interface"]),
        (["--nproc-per-node", "gpu"], ["--nproc-per-node gpu", "cuda"]),
        (["--nproc-per-node", "lots"], ["--nproc-per-node lots"]),
        (["--standalone", "--nnodes", "2"], ["--standalone"]),
        (["--nnodes", "1:2"], ["--nnodes 1:2", "rendezvous"]),
        (  # 8 sequences of 4 per micro-batch fit 1 or 2 data-parallel ranks, not 3
            ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999"],
            ["at 3 ranks", "2..3", "global_batch"],
        ),
        (["--nnodes", "2", "--node-rank", "5", "--master-port", "29999"], ["--node-rank 5"]),
        (["--no-such-flag"], ["unrecognized arguments", "--no-such-flag"]),
        (
            ["--local-addr", "192.0.2.77"],
            ["--local-addr 192.0.2.77", "not an address of this host"],
        ),
        (["--max-restarts", "x"], ["--max-restarts"]),
        (["--monitor-interval", "0"], ["--monitor-interval", "> 0"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_launch_flags_exit_2(job_file, tmp_path, flags, fragments):
    run_dir = tmp_path / "run"
    proc = meshforge(["train", str(job_file), "--run-dir", str(run_dir), *flags])
    assert_one_line_error(proc, *fragments)
    assert not run_dir.exists()  # nothing written


def test_train_help_lists_torchrun_flags():
    proc = meshforge(["train", "--help"])
    assert proc.returncode == 0
    for flag in ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--rdzv-conf",
                 "--standalone", "--max-restarts", "--log-dir", "--local-addr",
                 "--master-addr", "--master-port", "--iface", "--set", "--run-dir"):  # fmt: skip
        assert flag in proc.stdout, flag
    fresh = " ".join(proc.stdout.split("\n  --fresh", 1)[1].split("\n  --trace", 1)[0].split())
    for what in ("nothing left to train", "another model", "not a meshforge run", "resumes"):
        assert what in fresh, fresh  # what happens without --fresh, all of it


# -- one config per job, decided by global rank 0 -------------------------------------------


def _agree(run_dir: str) -> tuple[float, str, bool]:
    from meshforge.config import build_config
    from meshforge.plan.jobs.auto import resolve_open_decisions
    from meshforge.runtime.agree import agree_on_config

    rank = dist.get_rank()
    raw = {**TINY_JOB, "train": {**TINY_JOB["train"], "lr": 0.001 * (rank + 1)}}
    cfg = agree_on_config(
        build_config(raw), rank, dist.get_world_size(), 0, Path(run_dir), resolve_open_decisions
    )
    written = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    return cfg.train.lr, str(written["train"]["lr"]), cfg.parallel == "auto"


def test_every_rank_trains_rank_zeros_config(gloo, tmp_path):
    results = gloo.run(2, _agree, str(tmp_path))
    assert [r[0] for r in results] == [0.001, 0.001]
    assert results[0][1] == "0.001"


def _agree_auto(run_dir: str) -> dict:
    from meshforge.config import build_config
    from meshforge.plan.jobs.auto import resolve_open_decisions
    from meshforge.runtime.agree import agree_on_config

    raw = {**TINY_JOB, "parallel": "auto"}
    cfg = agree_on_config(
        build_config(raw), dist.get_rank(), 2, 0, Path(run_dir), resolve_open_decisions
    )
    return cfg.parallel.model_dump()


def test_parallel_auto_is_resolved_once_by_rank_zero(gloo, tmp_path):
    layouts = gloo.run(2, _agree_auto, str(tmp_path))
    assert layouts[0] == layouts[1]
    assert layouts[0]["tp"] * layouts[0]["pp"] * (layouts[0]["dp"] or 1) in (1, 2)


def test_unknown_scheduler_exits_2(job_file):
    proc = meshforge(["submit", "pbs", str(job_file)])
    assert_one_line_error(proc, "unknown scheduler 'pbs'", "slurm", "mpi", "k8s")


def test_a_host_name_on_loopback_is_warned_about_across_nodes(clean_launch_env):
    flags = ["job.yaml", "--nnodes", "2", "--rdzv-backend", "c10d"]
    clean_launch_env.setattr(netif, "hostname_address", lambda: "127.0.1.1")
    clean_launch_env.setattr(netif, "endpoint_is_local", lambda host, port: False)
    far = parse_launch_args([*flags, "--rdzv-endpoint", "10.9.0.1:29400"])
    assert len(far.warnings) == 1 and "--iface" in far.warnings[0]
    # every node on this host, or an interface named: nothing to warn about
    assert not parse_launch_args([*flags, "--rdzv-endpoint", "127.0.0.1:29400"]).warnings
    assert not parse_launch_args(
        [*flags, "--rdzv-endpoint", "10.9.0.1:29400", "--iface", "lo"]
    ).warnings


def test_nodes_are_counted_by_the_launchers_numbering():
    from meshforge.runtime.agree import count_nodes

    same_machine = [{"host": "a", "addr": "127.0.0.1", "node": n} for n in (0, 0, 1, 1)]
    assert count_nodes(same_machine) == 2  # two agents on one machine: two nodes
    mpi = [{"host": h, "addr": a, "node": None} for h, a in [("a", "10.0.0.1"), ("a", "10.0.0.2")]]
    assert count_nodes(mpi) == 2  # namespace hosts: one name, two addresses
    assert count_nodes([{"host": "a", "addr": "10.0.0.1", "node": None}] * 3) == 1


def test_ctrl_c_stops_the_workers_in_one_line(tmp_path):
    """SIGINT to `meshforge train`: the agent stops its workers; one line, exit 130."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from helpers import REPO

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 100000}}))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshforge", "train", str(job), "--nproc", "2",
         "--run-dir", str(run_dir)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("meshforge: stopped by SIGINT"), err
    assert "death signal" not in err, err  # torch's agent stays quiet: one line is ours
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive


def test_plain_torchrun_leaves_the_same_run_directory(tmp_path, job_file):
    """`torchrun -m meshforge worker` (no meshforge launcher): config.yaml, report.json
    with hosts, and each rank's log are there all the same."""
    from helpers import run_python

    run_dir = tmp_path / "run"
    proc = run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "meshforge", "worker", str(job_file), "--run-dir", str(run_dir)],
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["train"] == {**written["train"], **TINY_JOB["train"]}
    report = yaml.safe_load((run_dir / "report.json").read_text())
    assert report["world_size"] == 2 and report["nodes"] == 1
    assert [h["node"] for h in report["hosts"]] == [0, 0]
    for rank in (0, 1):
        assert "step 20/20" in (run_dir / "logs" / f"rank-{rank}.log").read_text()


def test_workers_of_a_killed_launcher_checkpoint_and_leave(tmp_path):
    """SIGKILL to `meshforge train`: its workers get SIGTERM (parent-death signal),
    checkpoint the same step together and exit, instead of training on orphaned. While
    they do, the run directory stays theirs: another launch there is refused (they are
    held still meanwhile, so that it comes before they leave); once they have exited,
    the same command resumes from their checkpoint."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from helpers import REPO
    from meshforge.runtime.runlock import is_held

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 100000}}))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshforge", "train", str(job), "--nproc", "2",
         "--run-dir", str(run_dir)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    workers = []
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.2)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        stop_processes(workers)  # stopped before the launcher dies: none sees it go
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert is_held(run_dir) is True  # the launcher's lock went with it; theirs stays
        again = meshforge(["train", str(job), "--nproc", "1", "--run-dir", str(run_dir)])
        assert_one_line_error(again, f"run directory {run_dir} is in use by another job",
                              "its workers")  # fmt: skip
        for w in workers:
            w.resume()
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive
    finally:
        for w in workers:
            if w.is_running():
                w.kill()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "stopped"
    step = report["stopped"]["step"]
    assert (run_dir / "checkpoints" / f"step-{step:08d}").is_dir()
    assert is_held(run_dir) is False
    resumed = meshforge(["train", str(job), "--nproc", "1", "--run-dir", str(run_dir),
                         "--set", f"train.steps={step + 2}"])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["resumed_from"] == step
