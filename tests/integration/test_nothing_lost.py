"""Nothing is lost, whatever fails.

A run directory belongs to one job at a time; a checkpoint that cannot be written (a
full disk, no permission, its directory gone) stops the run with a one-line reason and
leaves the previous checkpoint loadable; a checkpoint is read as data, never run as code.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from helpers import REPO, Job, assert_one_line_error, meshforge, stop_processes
from meshforge.errors import CheckpointError, ConfigError, MeshforgeError
from meshforge.runtime.runlock import (
    LOCK_FILE,
    WORKERS_LOCK_FILE,
    RunDirInUse,
    check_run_dir_free,
    export_job_id,
    hold_run_dir,
    is_held,
    job_id_from_env,
    mark_held_for_workers,
    read_holder,
    torchrun_job_id,
    worker_run_lock,
)
from meshforge.train.checkpoint import (
    find_latest_valid,
    read_dcp,
    read_rng_state,
    step_dir_name,
    verify,
    write_manifest,
)

LONG_WAIT_S = 300  # an upper bound for a stuck test, never a performance threshold


# -- helpers ----------------------------------------------------------------------------------
class _RunsCode:
    """Unpickling this runs `touch PWNED` in the given directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.directory / 'PWNED'))}",))


def _env() -> dict[str, str]:
    inherited = ("MESHFORGE_FAULT", "MESHFORGE_RUN_LOCK_HELD", "MESHFORGE_JOB_ID")
    return {k: v for k, v in os.environ.items() if k not in inherited}


class _Background:
    """`meshforge train` running in the background, its output into files."""

    def __init__(self, job: Job, nproc: int) -> None:
        cmd = [sys.executable, "-m", "meshforge", "train", str(job.config_path)]
        cmd += ["--nproc", str(nproc), "--run-dir", str(job.run_dir)]
        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=self.out, stderr=self.err, text=True
        )

    def wait_for(self, predicate) -> None:
        deadline = time.monotonic() + LONG_WAIT_S
        while not predicate():
            assert self.proc.poll() is None, f"the job ended first:\n{self.finish().stderr}"
            assert time.monotonic() < deadline, "gave up waiting"
            time.sleep(0.05)

    def finish(self) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=LONG_WAIT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.out.seek(0)
        self.err.seek(0)
        return subprocess.CompletedProcess(
            self.proc.args, self.proc.returncode, self.out.read(), self.err.read()
        )


def _signal_tree(
    pid: int, signum: int, processes: list[psutil.Process] | None = None
) -> list[psutil.Process]:
    """Send SIGNUM to PID and its descendants (the elastic agent's workers lead sessions
    of their own, so a process group would miss them); returns the processes."""
    if processes is None:
        root = psutil.Process(pid)
        processes = [*root.children(recursive=True), root]
    if signum == signal.SIGSTOP:  # stopped, every thread, when this returns
        stop_processes([p for p in processes if p.is_running()])
        return processes
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signum)
    return processes


def _logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line)["step"])
    return rows


def _tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ROOT: its sha256 and modification time."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(root))] = (digest, p.stat().st_mtime_ns)
    return out


def _failure_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """A failed run: exit 1, no traceback, and the launcher's one line naming the
    fragments."""
    seen = f"exit code {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 1, seen
    assert "Traceback" not in proc.stderr, seen
    line = next((x for x in proc.stderr.splitlines() if x.startswith("meshforge: rank ")), None)
    assert line is not None, seen
    for fragment in fragments:
        assert fragment.lower() in line.lower(), f"{fragment!r} not in {line!r}"
    return line


@contextlib.contextmanager
def _tmpfs(directory: Path, size: str) -> Iterator[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


class _Holder:
    """Another process holding a run directory (its lock file NAME) until told to let go."""

    def __init__(self, run_dir: Path, job_id: str, name: str = LOCK_FILE) -> None:
        code = (
            "import sys; from meshforge.runtime.runlock import RunDirLock\n"
            f"lock = RunDirLock({str(run_dir)!r}, {job_id!r}, name={name!r}).acquire()\n"
            "print('held', flush=True); sys.stdin.read(); lock.release()\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        assert self.proc.stdout.readline().strip() == "held"

    def let_go(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=LONG_WAIT_S)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=LONG_WAIT_S)


# -- a run directory belongs to one job at a time ----------------------------------------------
def test_a_second_holder_is_refused_in_one_line_naming_the_first(tmp_path):
    holder = _Holder(tmp_path, "job-a")
    try:
        before = (tmp_path / LOCK_FILE).read_bytes()
        with pytest.raises(RunDirInUse) as refused:
            hold_run_dir(tmp_path, "job-b")
        message = str(refused.value)
        assert isinstance(refused.value, MeshforgeError)  # the CLI's one line, exit 2
        assert "\n" not in message
        assert f"run directory {tmp_path} is in use by another job" in message
        assert f"pid {holder.proc.pid} on host {socket.gethostname()} since " in message
        assert (tmp_path / LOCK_FILE).read_bytes() == before  # the refused one wrote nothing
    finally:
        holder.let_go()
    with hold_run_dir(tmp_path, "job-b") as lock:  # free once the first has let go
        assert lock.held and read_holder(tmp_path).job_id == "job-b"


def test_a_holder_that_dies_leaves_no_stale_lock(tmp_path):
    holder = _Holder(tmp_path, "job-a")
    holder.kill()
    assert read_holder(tmp_path).pid == holder.proc.pid  # its text is only history
    with hold_run_dir(tmp_path, "job-b"):
        assert read_holder(tmp_path).pid == os.getpid()


def test_a_new_rank0_waits_for_its_dead_predecessor_of_the_same_job(tmp_path):
    # an elastic restart: the old rank 0's lock may outlive it briefly (NFS leases)
    holder = _Holder(tmp_path, "rdzv=job-a")
    with pytest.raises(RunDirInUse):
        hold_run_dir(tmp_path, "rdzv=job-b", wait_same_job_s=LONG_WAIT_S)  # not waited for
    releaser = threading.Timer(0.2, holder.let_go)
    releaser.start()
    try:
        with hold_run_dir(tmp_path, "rdzv=job-a", wait_same_job_s=LONG_WAIT_S) as lock:
            assert lock.held
    finally:
        releaser.join()


def test_workers_take_the_lock_only_on_rank0_and_only_without_the_launcher(tmp_path):
    holder = _Holder(tmp_path, "job-a")
    try:
        launcher_env: dict[str, str] = {"TORCHELASTIC_RUN_ID": "a"}
        mark_held_for_workers(tmp_path, launcher_env)
        with worker_run_lock(tmp_path, 0, launcher_env) as held:
            # the launcher holds .lock; its rank 0 holds .lock-workers, so that the run
            # directory stays held while it outlives a killed launcher
            assert held.path.name == WORKERS_LOCK_FILE
            assert read_holder(tmp_path, WORKERS_LOCK_FILE).job_id == "rdzv=a"
        with worker_run_lock(tmp_path, 1, {}) as held:
            assert held is None  # only global rank 0 takes it
        with pytest.raises(RunDirInUse):
            worker_run_lock(tmp_path, 0, {"TORCHELASTIC_RUN_ID": "other"}, wait_same_job_s=0)
    finally:
        holder.let_go()
    with worker_run_lock(tmp_path, 0, {"TORCHELASTIC_RUN_ID": "x"}) as lock:
        assert lock.held and read_holder(tmp_path).job_id == "rdzv=x"


def test_the_workers_of_a_killed_launcher_keep_the_run_directory_held(tmp_path):
    worker = _Holder(tmp_path, "rdzv=orphans", WORKERS_LOCK_FILE)  # its launcher is gone
    try:
        assert is_held(tmp_path) is True
        for take in (lambda: hold_run_dir(tmp_path, "job-b"), lambda: check_run_dir_free(tmp_path)):
            with pytest.raises(RunDirInUse) as refused:
                take()
            message = str(refused.value)
            assert f"run directory {tmp_path} is in use by another job (its workers: " in message
            assert f"pid {worker.proc.pid} on host" in message and "\n" not in message
        check_run_dir_free(tmp_path, "rdzv=orphans")  # their own job's agents
    finally:
        worker.kill()
    assert is_held(tmp_path) is False
    with hold_run_dir(tmp_path, "job-b") as lock:  # free once they have exited
        assert lock.held


def test_the_agents_of_one_multinode_job_do_not_refuse_each_other(tmp_path):
    fresh = tmp_path / "fresh"
    check_run_dir_free(fresh, "rdzv=a")  # nobody ever held it: free, and nothing written
    assert not fresh.exists()
    job = torchrun_job_id("abc", "10.0.0.1", 29400)
    holder = _Holder(tmp_path, job)  # the job's global rank 0
    try:
        check_run_dir_free(tmp_path, job)  # a late agent of the same job
        with pytest.raises(RunDirInUse):
            check_run_dir_free(tmp_path)  # a submitter, whose job has not started yet
        with pytest.raises(RunDirInUse):
            check_run_dir_free(tmp_path, torchrun_job_id("other", "10.0.0.1", 29400))
    finally:
        holder.let_go()
    static = torchrun_job_id("none", "10.0.0.1", 29400)
    assert static == torchrun_job_id(None, "10.0.0.1", 29400) != job
    # what the workers of each kind of job call their job: the same on every rank
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "abc"}) == job  # c10d rendezvous
    exported: dict[str, str] = {"TORCHELASTIC_RUN_ID": "none"}
    export_job_id(static, exported)  # a static rendezvous: its launchers say which job
    assert job_id_from_env(exported) == static
    assert job_id_from_env({"SLURM_JOB_ID": "42"}) == "SLURM_JOB_ID=42"


def test_an_unusable_run_directory_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot use run directory"):
        hold_run_dir(tmp_path / "file" / "run")


def test_a_second_job_on_a_busy_run_directory_is_refused_and_changes_nothing(job_factory):
    first = job_factory({"train": {"steps": 60}}, name="first")
    second = job_factory({"train": {"steps": 5, "lr": 1e-3}}, name="second")
    run = _Background(first, 1)
    stopped: list[psutil.Process] = []
    try:
        run.wait_for(lambda: len(_logged_steps(first.run_dir)) > 0)
        stopped = _signal_tree(run.proc.pid, signal.SIGSTOP)  # the first job stays put
        before = _tree(first.run_dir)
        refused = meshforge(
            ["train", str(second.config_path), "--nproc", "1", "--run-dir", str(first.run_dir)]
        )
        assert_one_line_error(refused, f"run directory {first.run_dir}", "in use by another job")
        assert _tree(first.run_dir) == before  # not one byte, not one timestamp
    finally:
        _signal_tree(run.proc.pid, signal.SIGCONT, stopped)
        finished = run.finish()
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert first.report["status"] == "completed"
    assert sorted(set(_logged_steps(first.run_dir))) == list(range(1, 61))
    assert "lr: 0.001" not in (first.run_dir / "config.yaml").read_text()
    with hold_run_dir(first.run_dir):  # the finished job let go of it
        pass


# -- a checkpoint that cannot be written ------------------------------------------------------
def _assert_previous_checkpoint_is_latest(ckpts: Path, step: int) -> None:
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp-")]
    latest = find_latest_valid(ckpts)
    assert latest is not None and latest[0] == step
    assert verify(latest[1]) is None


@pytest.mark.cluster
def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(job_factory):
    job = job_factory({"train": {"steps": 200}, "checkpoint": {"every": 2, "keep": 100}})
    ckpts = job.run_dir / "checkpoints"
    with _tmpfs(ckpts, "3m"):  # room for two checkpoints of this model, not three
        failed = job.train(2, check=False)
        _failure_line(failed, "cannot write checkpoint", str(ckpts), "No space left on device")
        latest = find_latest_valid(ckpts)
        assert latest is not None and latest[0] < 200
        _assert_previous_checkpoint_is_latest(ckpts, latest[0])
        sample = meshforge(["sample", str(job.run_dir), "--prompt", "def ", "--tokens", "4"])
        assert sample.returncode == 0, sample.stderr


def test_a_vanished_checkpoints_directory_stops_the_run_in_one_line(job_factory):
    job = job_factory({"train": {"steps": 400}, "checkpoint": {"every": 50, "keep": 3}})
    ckpts = job.run_dir / "checkpoints"
    run = _Background(job, 1)
    try:
        # after the checkpoint of step 50, well before the one of step 100
        run.wait_for(lambda: any(s > 50 for s in _logged_steps(job.run_dir)))
        while ckpts.exists():
            shutil.rmtree(ckpts, ignore_errors=True)
    finally:
        failed = run.finish()
    _failure_line(failed, "cannot write checkpoint", str(ckpts), "vanished")
    assert not ckpts.exists()  # never silently made anew


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory) -> Job:
    """A finished one-rank run of 2 steps with its checkpoint of step 2."""
    job = Job(
        tmp_path_factory.mktemp("checkpointed"),
        {"train": {"steps": 2}, "checkpoint": {"every": 2, "keep": 3}},
    )
    job.train(1)
    return job


def _copy_of(job: Job, tmp_path: Path) -> Job:
    copy = Job(tmp_path, job.cfg)
    shutil.copytree(job.run_dir, copy.run_dir)
    return copy


def _without_dac_override() -> list[str]:
    """A command prefix under which root obeys file permissions ([] for another user)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root ignores file permissions and setpriv is not installed")
    return ["setpriv", "--inh-caps=-dac_override,-dac_read_search"] + [
        "--bounding-set=-dac_override,-dac_read_search"
    ]


def test_a_checkpoint_directory_without_write_permission_stops_the_run(checkpointed_run, tmp_path):
    job = _copy_of(checkpointed_run, tmp_path)
    ckpts = job.run_dir / "checkpoints"
    prefix = _without_dac_override()
    ckpts.chmod(0o555)
    try:
        cmd = ["-m", "meshforge", "train", str(job.config_path), "--nproc", "1"]
        cmd += ["--run-dir", str(job.run_dir), "--set", "train.steps=4"]
        failed = subprocess.run(
            [*prefix, sys.executable, *cmd],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=_env(),
            timeout=LONG_WAIT_S,
        )
    finally:
        ckpts.chmod(0o755)
    _failure_line(failed, f"cannot write checkpoint {step_dir_name(4)}", str(ckpts))
    assert "permission denied" in failed.stderr.lower()
    _assert_previous_checkpoint_is_latest(ckpts, 2)


# -- a checkpoint is data, never code ----------------------------------------------------------
def _tamper(step_dir: Path, name: str, payload: bytes) -> None:
    """Replace a file and record it in the manifest, as a forger would."""
    (step_dir / name).write_bytes(payload)
    write_manifest(step_dir, json.loads((step_dir / "manifest.json").read_text())["step"])
    assert verify(step_dir) is None


def test_an_rng_state_that_carries_code_is_refused_and_never_run(checkpointed_run, tmp_path):
    job = _copy_of(checkpointed_run, tmp_path)
    step_dir = job.run_dir / "checkpoints" / step_dir_name(2)
    forged = _pickled_by_torch(_RunsCode(tmp_path))
    _tamper(step_dir, "rng-rank-0.pt", forged)
    failed = job.train(1, "--set", "train.steps=4", check=False)
    _failure_line(failed, "rng-rank-0.pt refers to posix.system", "refused")
    assert not (tmp_path / "PWNED").exists()


def test_dcp_metadata_that_carries_code_is_refused_and_never_run(checkpointed_run, tmp_path):
    job = _copy_of(checkpointed_run, tmp_path)
    step_dir = job.run_dir / "checkpoints" / step_dir_name(2)
    _tamper(step_dir, ".metadata", pickle.dumps(_RunsCode(tmp_path)))
    refused = meshforge(["sample", str(job.run_dir), "--prompt", "def ", "--tokens", "4"])
    assert_one_line_error(refused, str(step_dir), ".metadata refers to posix.system", "refused")
    assert not (tmp_path / "PWNED").exists()


def _pickled_by_torch(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_rng_state_and_plain_values_load_as_data_only(checkpointed_run, tmp_path):
    step_dir = checkpointed_run.run_dir / "checkpoints" / step_dir_name(2)
    state = read_rng_state(step_dir / "rng-rank-0.pt")  # weights_only, as written today
    assert state["cpu"].dtype == torch.uint8
    # non-tensor values (an optimizer's hyper-parameters) read back as plain data ...
    plain = {"w": torch.arange(4.0), "group": {"lr": 0.1, "betas": (0.9, 0.99), "name": "x"}}
    with pytest.warns(UserWarning):  # DCP says it runs without a process group
        dcp.save(plain, checkpoint_id=str(tmp_path / "plain"))
    loaded = {"w": torch.zeros(4), "group": {"lr": 0.0, "betas": (0.0, 0.0), "name": ""}}
    with pytest.warns(UserWarning):
        read_dcp(loaded, tmp_path / "plain")
    assert loaded["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert loaded["group"] == {"lr": 0.1, "betas": (0.9, 0.99), "name": "x"}
    # ... and a stored value that is code is refused
    with pytest.warns(UserWarning):
        dcp.save(
            {"w": torch.ones(1), "evil": _RunsCode(tmp_path)}, checkpoint_id=str(tmp_path / "e")
        )
    with pytest.raises(CheckpointError, match=r"a stored value refers to posix\.system.*refused"):
        with pytest.warns(UserWarning):
            read_dcp({"w": torch.zeros(1), "evil": None}, tmp_path / "e")
    assert not (tmp_path / "PWNED").exists()


# -- the ranks agree on a failed checkpoint (in-process gloo ranks) ----------------------------
def _no_space_on_rank1(write):
    def patched(path: Path, data: bytes) -> None:
        if dist.get_rank() == 1 and path.name.startswith("rng-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write(path, data)

    return patched


def _io_error(_write):
    def patched(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    return patched


def _save_with_failures(root: str) -> dict:
    """On every rank: a checkpoint of step 1; then step 2 with rank 1's disk full, step 3
    with rank 0's manifest unwritable, step 4 after the directory was removed."""
    from meshforge.train import checkpoint as ck

    root_path = Path(root)
    snap = ck.Snapshot({"w": torch.ones(8)}, {}, {"step": 1, "world_size": 2})
    ck.save(root_path, 1, snap, keep=5)
    messages = []
    for step, name, fault in (
        (2, "_write_durably", _no_space_on_rank1),
        (3, "write_manifest", _io_error),
    ):
        original = getattr(ck, name)
        setattr(ck, name, fault(original))
        try:
            ck.save(root_path, step, snap, keep=5)
        except CheckpointError as exc:
            messages.append(str(exc))
        finally:
            setattr(ck, name, original)
    dist.barrier()
    left = sorted(p.name for p in root_path.iterdir())
    latest = ck.find_latest_valid(root_path)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root_path)
    try:
        ck.save(root_path, 4, snap, keep=5, create_root=False)
    except CheckpointError as exc:
        messages.append(str(exc))
    return {"messages": messages, "left": left, "latest": latest[0] if latest else None}


def test_every_rank_fails_alike_when_one_cannot_write(gloo, tmp_path):
    root = tmp_path / "checkpoints"
    per_rank = gloo.run(2, _save_with_failures, str(root))
    assert per_rank[0] == per_rank[1]  # nobody waits for a peer that gave up
    no_space, commit, vanished = per_rank[0]["messages"]
    where = f"in {root}: "
    assert no_space == f"cannot write checkpoint {step_dir_name(2)} {where}No space left on device"
    assert commit == f"cannot write checkpoint {step_dir_name(3)} {where}Input/output error"
    assert per_rank[0]["left"] == [step_dir_name(1)]  # no partial directory
    assert per_rank[0]["latest"] == 1
    assert "has vanished" in vanished and not root.exists()  # never silently made anew
