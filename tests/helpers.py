"""What the tests share: tiny jobs, the planner's small GPT and CPU profile, the CLI runner,
and the one assertion every refusal of bad input must pass.

Test modules import from here (`from helpers import meshforge`); tests/conftest.py holds
only fixtures. tests/ is on sys.path (pyproject: pythonpath = ["tests"]; pytest also imports
tests/conftest.py in its "prepend" mode), so tests/unit, integration and cluster all see it.
"""

from __future__ import annotations

import copy
import json
import os
import random
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]

TINY_JOB: dict[str, Any] = {
    "name": "tiny",
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
    "data": {"source": "builtin:python-stdlib"},
    "parallel": {"zero": 0},
    "precision": {"dtype": "fp32"},
    "train": {
        "steps": 20,
        "global_batch": 8,
        "micro_batch": 4,
        "lr": 3.0e-3,
        "warmup": 5,
        "seed": 7,
        "eval_every": 0,
    },
    "checkpoint": {"every": 0, "keep": 3},
    "observe": {"log_every": 1},
}


def unused_port() -> int:
    """A TCP port that nothing holds now, below the kernel's ephemeral range.

    A port from bind(0) is an ephemeral one: between the test's pick and its use the kernel
    can give the same port to any outgoing connection (gloo opens many), which once made a
    healthy preflight report its --port "in use". Ports below the range are handed out only
    to explicit binds."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no unused TCP port found in 10000..{low}")


# A small GPT and a fixed CPU machine profile shared by the planner's tests.
SMALL_GPT = {"vocab_size": 256, "d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64}


def _small_cpu_profile():
    from meshforge.plan.core.profile import MachineProfile

    return MachineProfile(
        name="cpu:gloo:1thr",
        matmul_flops_per_s=6e10,
        allreduce_busbw_bytes_per_s=1e9,
        allreduce_latency_s=3e-4,
        memory_bytes=16e9,
        memory_bandwidth_bytes_per_s=2e9,
        matmul_overhead_s=1e-3,
    )


SMALL_CPU_PROFILE = _small_cpu_profile()


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_python(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh interpreter from the repository root, with a time bound and
    without an injected fault (MESHFORGE_FAULT) leaking in from the caller's environment."""
    full_env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


def meshforge(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in a fresh interpreter, with a time bound."""
    return run_python(["-m", "meshforge", *args], env=env, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Bad input is refused as the CLI promises: exit code 2, stderr exactly one non-empty
    line, no traceback, and the line names each fragment (case-insensitive). Returns the line."""
    out, err = proc.stdout[-500:], proc.stderr[-2000:]
    seen = f"exit code {proc.returncode}; stdout: {out!r}; stderr:\n{err}"
    assert proc.returncode == 2, seen
    assert "Traceback" not in proc.stderr, seen
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, seen
    line = lines[0]
    for fragment in fragments:
        assert fragment.lower() in line.lower(), f"{fragment!r} not in {line!r}"
    return line


class Job:
    """A tiny training job written to disk and run through `meshforge train`."""

    def __init__(self, tmp: Path, overrides: dict | None = None, name: str = "job") -> None:
        self.cfg = merge(TINY_JOB, overrides or {})
        self.dir = tmp
        self.config_path = tmp / f"{name}.yaml"
        self.run_dir = tmp / f"run-{name}"
        self.config_path.write_text(yaml.safe_dump(self.cfg))

    def train(
        self, nproc: int, *extra: str, env: dict[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        proc = meshforge(
            [
                "train",
                str(self.config_path),
                "--nproc",
                str(nproc),
                "--run-dir",
                str(self.run_dir),
                *extra,
            ],
            env=env,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"meshforge train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                f"{proc.stderr[-3000:]}"
            )
        return proc

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "report.json").read_text())

    def losses(self) -> dict[int, float]:
        """Train loss by step; a resumed run's later rows win."""
        rows = [
            json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        return {r["step"]: r["loss"] for r in rows}


@contextmanager
def peak_rss_growth(out: list[int]):
    """The growth of this process's peak resident memory inside the block: the kernel's
    VmHWM after resetting it (writing 5 to /proc/self/clear_refs), or, where that is
    refused, the RSS sampled every millisecond. Freed heap memory is handed back first,
    so that reusing it cannot hide growth."""
    import contextlib
    import ctypes
    import gc
    import threading

    import psutil

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    proc = psutil.Process()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm = True
    except OSError:
        hwm = False
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(0.001)

    sampler = None if hwm else threading.Thread(target=sample, daemon=True)
    if sampler is not None:
        sampler.start()
    try:
        yield
    finally:
        if hwm:
            status = open("/proc/self/status").read()
            peak[0] = int(
                next(ln for ln in status.splitlines() if ln.startswith("VmHWM:")).split()[1]
            )
            peak[0] *= 1024
        else:
            done.set()
            sampler.join()
        out.append(peak[0] - base)


def training_processes(launcher_pid: int) -> list:
    """The processes that run a `meshforge train` launcher's workers: forked from its
    zygote (launch/zygote.py), or its own children when there is none."""
    import psutil

    children = psutil.Process(launcher_pid).children()
    zygotes = [c for c in children if "--serve" in c.cmdline()]
    if zygotes:
        return zygotes[0].children()
    return children


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process PID is in a stop (or gone)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = (task / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread exited meanwhile
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def stop_processes(processes: list, timeout_s: float = 120.0) -> None:
    """SIGSTOP each of PROCESSES (psutil.Process) and return once every thread of each has
    stopped. kill() only queues SIGSTOP: a process the scheduler has not run since takes a
    signal sent to it after that, but of a lower number (SIGINT, SIGTERM), first, and
    handles it before it stops, where a test means that signal to wait, pending, until the
    process is resumed. Raises AssertionError if one does not stop within TIMEOUT_S (a
    bound for a stuck machine, never a performance threshold)."""
    import time

    import psutil

    for process in processes:
        try:
            process.suspend()
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + timeout_s
    for process in processes:
        while True:
            try:
                if _all_threads_stopped(process.pid):
                    break
            except FileNotFoundError:
                break  # it had exited before it was stopped
            except psutil.Error:
                break
            assert time.monotonic() < deadline, f"process {process.pid} never stopped"
            time.sleep(0.01)


def assert_killed_run_resumes_at_world_1(tmp_path: Path, cli_job: dict[str, Any], key: str) -> None:
    """`meshforge train` of `cli_job` (8 steps, a checkpoint every 4, `parallel.KEY: 2` on
    two processes) killed after its step-4 checkpoint, then resumed in the same run
    directory on one process with `parallel.KEY=1`: its steps 1-4 are world 1's (1e-4),
    steps 5-8 on the uninterrupted world-1 curve (1e-3), and the report and segments
    name both layouts (KEY 1: not listed)."""
    import pytest

    (tmp_path / "straight").mkdir()
    straight = Job(tmp_path / "straight", {**cli_job, "parallel": {}}, name="straight")
    straight.train(1)
    job = Job(tmp_path, cli_job, name="killed")
    first = job.train(2, env={"MESHFORGE_FAULT": "kill_after_checkpoint:4"}, check=False)
    assert first.returncode == 1, first.stderr[-2000:]
    assert (job.run_dir / "checkpoints" / "step-00000004").is_dir()
    assert not (job.run_dir / "checkpoints" / "step-00000008").exists()
    job.train(1, "--set", f"parallel.{key}=1")  # the same run directory, one process
    report = job.report
    assert report["resumed_from"] == 4
    assert report["world_size"] == 1 and key not in report["layout"]
    segments = [json.loads(line) for line in (job.run_dir / "segments.jsonl").open()]
    layouts = [(r["world_size"], r["layout"].get(key)) for r in segments if "layout" in r]
    assert layouts == [(2, 2), (1, None)], layouts
    expected, got = straight.losses(), job.losses()
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-3), (step, got, expected)
    for step in range(1, 5):  # the steps before the kill: world 1's too
        assert got[step] == pytest.approx(expected[step], rel=1e-4), (step, got, expected)


def short_documents_jsonl(
    directory: Path, count: int, max_words: int, max_chars: int, seed: int = 0
) -> Path:
    """DIRECTORY/docs.jsonl: `count` documents of 2 to max_words-1 code words, cut at
    `max_chars` characters, so a short training sequence holds several separators."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "import", "class", "value", "x", "=", "(", ")", ":"]
    lines = []
    for _ in range(count):
        text = " ".join(rng.choice(words, size=int(rng.integers(2, max_words))))[:max_chars]
        lines.append(json.dumps({"text": text}))
    path = directory / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
