"""`meshforge submit mpi`: the mpirun command it builds, the input it refuses, and real
`mpirun -np 2` runs that train exactly like `meshforge train --nproc 2`."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, Job, assert_one_line_error, meshforge
from meshforge.launch.mpi import MpiLaunch, mpirun_command, parse_hostfile
from meshforge.runtime.env import detect_env

MPIRUN = shutil.which("mpirun")
needs_mpirun = pytest.mark.skipif(
    MPIRUN is None, reason="mpirun not installed (Debian: apt-get install openmpi-bin)"
)
RTOL = 1e-4
SHORT = {"train": {"steps": 6}}


def _submit(job: Job, *extra: str, env: dict[str, str] | None = None, timeout: float = 240):
    args = ["submit", "mpi", str(job.config_path), "--run-dir", str(job.run_dir), *extra]
    return meshforge(args, env=env, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _spare_cores() -> list[str]:
    return [] if (os.cpu_count() or 1) >= 2 else ["--oversubscribe"]


# ---- the command line (no mpirun needed) ---------------------------------------------


def test_hostfile_syntax_hosts_slots_and_comments():
    text = """
    # the rack
    node0 slots=4 max_slots=8   # rank 0 lives here
    admin@node1 slots=2
    node2
    """
    hosts = parse_hostfile(text)
    assert [(h.host, h.slots) for h in hosts] == [("node0", 4), ("node1", 2), ("node2", None)]


def _command(launch: MpiLaunch, environ: dict[str, str], **kwargs) -> list[str]:
    return mpirun_command(
        "/usr/bin/mpirun",
        launch,
        master_addr="10.0.0.1",
        master_port=29511,
        config_file=Path("/shared/run/config.yaml"),
        run_dir=Path("/shared/run"),
        environ=environ,
        python="/opt/py/bin/python",
        **kwargs,
    )


def _exported(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, word in enumerate(cmd) if word == "-x"]


def test_command_passes_rendezvous_and_environment_with_x():
    environ = {
        "PATH": "/opt/py/bin:/usr/bin",
        "PYTHONPATH": "/src",
        "OMP_NUM_THREADS": "4",
        "NCCL_DEBUG": "INFO",
        "MESHFORGE_CACHE": "/cache",
        "HOME": "/root",
    }
    launch = MpiLaunch(np=4, hostfile=Path("hosts"), iface="eth1", oversubscribe=True)
    cmd = _command(launch, environ, as_root=True, on_terminal=True)
    assert cmd[:3] == ["/usr/bin/mpirun", "-np", "4"]
    assert cmd[cmd.index("--hostfile") + 1] == "hosts"
    assert "--oversubscribe" in cmd and "--allow-run-as-root" in cmd
    assert _exported(cmd) == [
        "MASTER_ADDR=10.0.0.1",
        "MASTER_PORT=29511",
        "PYTHONUNBUFFERED=1",
        "GLOO_SOCKET_IFNAME=eth1",
        "NCCL_SOCKET_IFNAME=eth1",
        "PATH",
        "PYTHONPATH",
        "OMP_NUM_THREADS",
        "MESHFORGE_CACHE",
        "NCCL_DEBUG",
    ]
    assert cmd[-8:] == [
        "/opt/py/bin/python",
        "-u",
        "-m",
        "meshforge",
        "worker",
        "/shared/run/config.yaml",
        "--run-dir",
        "/shared/run",
    ]


def test_command_without_root_terminal_or_options():
    cmd = _command(MpiLaunch(np=2), {"PATH": "/usr/bin"}, as_root=False, on_terminal=False)
    for flag in ("--allow-run-as-root", "--oversubscribe", "--hostfile"):
        assert flag not in cmd
    # Rank 0's progress bar is not drawn into a log through mpirun's pseudo-terminal.
    assert "TTY_COMPATIBLE=0" in _exported(cmd)
    assert not any("IFNAME" in x for x in _exported(cmd))


def test_workers_take_local_world_size_from_openmpi():
    env = detect_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (
        detect_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2
    )
    assert detect_env({}).local_world_size == 1


def _fake_mpirun(tmp_path: Path) -> Path:
    fake = tmp_path / "bin" / "mpirun"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    return fake


def test_dry_run_prints_the_mpirun_command(tmp_path):
    job = Job(tmp_path, {"train": {"steps": 6, "micro_batch": 2}})
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode0 slots=2\nnode1 slots=2\n")
    fake = _fake_mpirun(tmp_path)
    proc = _ok(
        _submit(
            job,
            "-np",
            "4",
            "--hostfile",
            str(hostfile),
            "--master-port",
            "29533",
            "--dry-run",
            "--mpirun",
            str(fake),
        )
    )
    lines = proc.stdout.strip().splitlines()
    assert "on 4 worker(s): dp=4" in lines[0]
    cmd = shlex.split(lines[-1])
    assert cmd[:3] == [str(fake), "-np", "4"]
    assert "MASTER_ADDR=node0" in cmd and "MASTER_PORT=29533" in cmd
    assert cmd[-2:] == ["--run-dir", str(job.run_dir)]
    assert (job.run_dir / "config.yaml").exists()  # the file the printed command reads
    assert not (job.run_dir / "report.json").exists()


# ---- bad input: exit 2, one line ------------------------------------------------------


def test_missing_mpirun_says_what_to_install(tmp_path):
    job = Job(tmp_path, SHORT)
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _submit(job, "-np", "2", env={"PATH": str(empty)})
    assert_one_line_error(proc, "mpirun not found", "apt-get install openmpi-bin")


def test_mpirun_path_that_does_not_exist(tmp_path):
    job = Job(tmp_path, SHORT)
    proc = _submit(job, "-np", "2", "--mpirun", str(tmp_path / "no-mpirun"))
    assert_one_line_error(proc, "mpirun not found", "no-mpirun", "openmpi")


def test_zero_ranks_is_refused(tmp_path):
    assert_one_line_error(_submit(Job(tmp_path, SHORT), "-np", "0"), "-np", "at least 1")


def test_more_ranks_than_cores_without_a_hostfile_is_refused(tmp_path):
    """mpirun would refuse it later, in a page of output; nothing is written before."""
    job = Job(tmp_path, SHORT)
    proc = _submit(job, "-np", "4096")
    assert_one_line_error(proc, "-np 4096", "core(s)", "--oversubscribe")
    assert not job.run_dir.exists()


@pytest.mark.parametrize(
    "make, fragments",
    [
        (lambda d: d / "nowhere", ["hostfile", "does not exist"]),
        (lambda d: d, ["hostfile", "cannot be read"]),  # a directory
        (lambda d: _write(d / "h", "# nobody\n\n"), ["hostfile", "no hosts"]),
        (lambda d: _write(d / "h", "n0 slots=two\n"), ["line 1", "slots"]),
        (lambda d: _write(d / "h", "n0 slots=1\n"), ["more than the 1 slot", "--oversubscribe"]),
    ],
    ids=["missing", "unreadable", "empty", "bad-slots", "too-few-slots"],
)
def test_bad_hostfile_is_refused(tmp_path, make, fragments):
    job = Job(tmp_path, SHORT)
    proc = _submit(job, "-np", "2", "--hostfile", str(make(tmp_path)))
    assert_one_line_error(proc, *fragments)
    assert not job.run_dir.exists()  # refused before anything is written


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_unknown_interface_is_refused(tmp_path):
    proc = _submit(Job(tmp_path, SHORT), "-np", "2", "--iface", "nosuch0")
    assert_one_line_error(proc, "--iface nosuch0", "no such network interface")


def test_layout_that_does_not_fit_the_ranks(tmp_path):
    job = Job(tmp_path, {**SHORT, "parallel": {"zero": 0, "tp": 2}})
    proc = _submit(
        job, "-np", "3", "--oversubscribe", "--dry-run", "--mpirun", str(_fake_mpirun(tmp_path))
    )
    assert_one_line_error(proc, "tp")


# ---- real mpirun ------------------------------------------------------------------------


def _assert_same_losses(got: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(got) == sorted(ref) and got, (got, ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=RTOL), f"step {step}: {got} vs {ref}"


@pytest.mark.cluster
@pytest.mark.slow
@needs_mpirun
@pytest.mark.parametrize(
    "zero, use_hostfile", [(2, False), (0, True)], ids=["zero2", "zero0-hostfile"]
)
def test_mpirun_trains_like_meshforge_train(tmp_path, zero, use_hostfile):
    overrides = {**SHORT, "parallel": {"zero": zero}}
    under_mpi = Job(tmp_path, overrides, name="mpi")
    extra = _spare_cores()
    if use_hostfile:
        hostfile = _write(tmp_path / "hosts", "# this host\nlocalhost slots=2\n")
        extra = ["--hostfile", str(hostfile)]
    proc = _ok(_submit(under_mpi, "-np", "2", *extra))
    assert f"zero={zero}" in proc.stdout
    report = under_mpi.report
    assert (report["status"], report["world_size"]) == ("completed", 2)

    reference = Job(tmp_path, overrides, name="torchrun")
    reference.train(2)
    _assert_same_losses(under_mpi.losses(), reference.losses())


@pytest.mark.cluster
@pytest.mark.slow
@needs_mpirun
def test_failed_rank_is_named_in_one_line(tmp_path):
    job = Job(tmp_path, SHORT)
    proc = _submit(job, "-np", "2", *_spare_cores(), env={"MESHFORGE_FAULT": "crash:3:1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("meshforge: rank 1 failed"), last
    assert "injected crash at step 3 on rank 1" in last
    assert job.report["failure"]["first_failure"]["rank"] == 1


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.mark.cluster
@pytest.mark.slow
@needs_mpirun
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the workers")
def test_ctrl_c_stops_mpirun_and_its_workers(tmp_path):
    job = Job(tmp_path, {"train": {"steps": 100_000}})
    args = ["submit", "mpi", str(job.config_path), "-np", "2", "--run-dir", str(job.run_dir)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshforge", *args, *_spare_cores()],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        metrics = job.run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        assert metrics.exists(), "training never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "stopped by SIGINT" in err.strip().splitlines()[-1]
    assert _processes_mentioning(str(job.run_dir)) == []
