"""Fault injection: real 2-rank runs with a fault (MESHFORGE_FAULT, a signal from outside,
a cut link), each judged by `meshforge diagnose RUN_DIR --json`.

Every run has short collective timeouts so a fault surfaces in seconds, and every wait
is bounded: a run that does not end by its deadline fails the test (and is killed).
The deadlines are generous on purpose; they are bounds, not measurements."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from cluster import netns_hosts
from helpers import REPO, Job, meshforge

pytestmark = pytest.mark.slow

STEP_TIMEOUT_S = 10  # runtime.step_timeout_s: a peer that died or hangs is noticed after it
GRACE_S = 5  # runtime.grace_s
START_S = 60  # start-up allowance (two interpreters and a process group on 2 busy cores)
AGENT_CLOSE_S = 30  # torch's agent waits this long before it SIGKILLs a worker that is stopped
FAST = {
    "runtime": {"timeout_s": 20, "step_timeout_s": STEP_TIMEOUT_S, "grace_s": GRACE_S},
    "observe": {"flight_every_s": 0.5},
}
EIGHT_STEPS = {"train": {"steps": 8}, **FAST}


def _env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    if fault:
        env["MESHFORGE_FAULT"] = fault
    return env


@dataclass
class Launched:
    """A `meshforge train` started in the background, waited for with a bound."""

    job: Job
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    output: tuple[str, str] | None = None

    def wait(self, deadline_s: float) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); fails the test if the run has not ended
        `deadline_s` after it started."""
        if self.output is None:
            left = self.started + deadline_s - time.monotonic()
            try:
                self.output = self.proc.communicate(timeout=max(1.0, left))
            except subprocess.TimeoutExpired:
                _stop_tree([self.proc])
                pytest.fail(f"`meshforge train` still running {deadline_s:.0f} s after its start")
        return self.proc.returncode, *self.output


def _start(job: Job, fault: str | None, *extra: str, env: dict | None = None) -> Launched:
    argv = [sys.executable, "-m", "meshforge", "train", str(job.config_path), "--nproc", "2",
            "--run-dir", str(job.run_dir), *extra]  # fmt: skip
    env = {**_env(fault), **(env or {})}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    return Launched(job, proc)


def _stop_tree(procs: list[subprocess.Popen], workers: list[psutil.Process] = ()) -> None:
    """Kill what this test started and is still running, and its workers. psutil checks
    that a Process is still the one it was (pid and start time) before it signals it."""
    workers = list(workers)
    for p in procs:
        if p.poll() is None:
            try:
                workers += psutil.Process(p.pid).children(recursive=True)
            except psutil.Error:
                pass
            p.kill()
            p.wait(timeout=30)
    for w in workers:
        try:
            w.kill()
        except psutil.Error:
            pass


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _diagnose(run_dir: Path) -> dict:
    proc = meshforge(["diagnose", str(run_dir), "--json"], timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _flight_steps(run_dir: Path, world: int = 2) -> list[int] | None:
    """Each rank's steps done, from its flight record (None until all have one)."""
    steps = []
    for rank in range(world):
        try:
            record = json.loads((run_dir / "health" / f"flight-rank-{rank}.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        steps.append(record.get("step") or 0)
    return steps


def _wait_for_steps(run_dir: Path, steps: int, procs: list[subprocess.Popen]) -> list[int]:
    deadline = time.monotonic() + START_S + 60
    while time.monotonic() < deadline:
        done = _flight_steps(run_dir)
        if done and min(done) >= steps:
            return done
        for p in procs:
            assert p.poll() is None, f"the run ended early ({p.returncode})"
        time.sleep(0.2)
    pytest.fail(f"no rank reached step {steps} within {START_S + 60} s")


# --- a rank killed, out of memory, stopped ---------------------------------------------

# From its start, a failed run must end within: start-up, the collective timeout, and
# the agent's stop of the other workers (SIGTERM, then SIGKILL after its close timeout,
# which a stopped process needs), plus the grace.
FAILED_DEADLINE_S = START_S + STEP_TIMEOUT_S + AGENT_CLOSE_S + GRACE_S + 30


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory):
    """The three runs that fail, started together (the stopped rank's run spends most of
    its time waiting out timeouts): rank 1 SIGKILLed after step 3, out of memory in
    step 3, stopped (SIGSTOP) after step 3."""
    runs: dict[str, Launched] = {}
    try:
        for name, fault in (("kill", "kill:3:1"), ("oom", "oom:3:1"), ("hang", "hang:3:1")):
            runs[name] = _start(Job(tmp_path_factory.mktemp(name), EIGHT_STEPS, name), fault)
        yield runs
    finally:
        _stop_tree([r.proc for r in runs.values()])


def _failed(run: Launched) -> Job:
    returncode, out, err = run.wait(FAILED_DEADLINE_S)
    assert returncode == 1, f"{out[-2000:]}\n{err[-3000:]}"
    return run.job


def test_sigkilled_rank_is_named_with_its_step(failed_runs):
    job = _failed(failed_runs["kill"])  # ended by its deadline: the survivor did not wait
    d = _diagnose(job.run_dir)
    assert d["verdict"] == "rank_crashed", d["summary"]
    assert d["ranks"] == [1] and d["step"] == 3, d["summary"]
    assert "SIGKILL" in d["summary"] and "after step 3" in d["summary"]
    rows = {r["rank"]: r for r in d["evidence"]["ranks"]}
    assert rows[1]["signal"] == "SIGKILL"
    assert rows[0]["error_kind"] == "connection"  # the survivor's error is a consequence
    assert any("rank-1.log" in a for a in d["advice"])


def test_out_of_memory_is_named(failed_runs):
    job = _failed(failed_runs["oom"])
    d = _diagnose(job.run_dir)
    assert d["verdict"] == "oom", d["summary"]
    assert d["ranks"] == [1] and d["step"] == 3, d["summary"]
    assert d["summary"].startswith("rank 1 (host ") and "ran out of memory" in d["summary"]
    advice = " ".join(d["advice"])
    assert "train.micro_batch" in advice and "activation_checkpointing: full" in advice


def test_stopped_rank_is_named_as_hung(failed_runs):
    """SIGSTOP: the rank is alive and silent. Its peer times out after step_timeout_s;
    the agent cannot SIGTERM a stopped process and SIGKILLs it after its close timeout."""
    job = _failed(failed_runs["hang"])
    d = _diagnose(job.run_dir)
    assert d["verdict"] == "hang", d["summary"]
    assert d["ranks"] == [1] and d["step"] == 3, d["summary"]
    rows = {r["rank"]: r for r in d["evidence"]["ranks"]}
    assert rows[1]["stale"] and rows[0]["error_kind"] == "timeout"
    assert [(w["rank"], w["waited_for"]) for w in d["evidence"]["waits"]] == [(0, [1])]
    assert any(f"py-spy dump --pid {rows[1]['pid']}" in a for a in d["advice"])
    assert any("NCCL_DEBUG=INFO" in a for a in d["advice"])


# --- a slow rank; a restart ------------------------------------------------------------

# Ten steps, logged every second one: five intervals in which the ranks compare their
# own work (the first, with start-up, is not judged).
TEN_STEPS = {**FAST, "train": {"steps": 10}, "observe": {"flight_every_s": 0.5, "log_every": 2}}


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    """Rank 1 does 6x its work each step; otherwise an uninterrupted run (the reference
    for the restart test: the busy loop touches no tensor). Its workers start as fresh
    interpreters (no zygote: launch/zygote.py), the restart test's are forked."""
    job = Job(tmp_path_factory.mktemp("slow"), TEN_STEPS, "slow")
    launched = _start(job, "slow:1:6", env={"MESHFORGE_ZYGOTE": "0"})
    returncode, _, err = launched.wait(START_S + 120)
    assert returncode == 0, err[-3000:]
    return job


def test_slow_rank_is_named_a_straggler(slow_run):
    d = _diagnose(slow_run.run_dir)
    assert d["verdict"] == "straggler", d["summary"]
    assert d["ranks"] == [1]
    assert [s["rank"] for s in slow_run.report["stragglers"]] == [1]


def test_a_restarted_run_ends_where_an_uninterrupted_one_does(tmp_path_factory, slow_run):
    """max_restarts: 1 and rank 1 killed after step 5: the workers restart from the
    checkpoint of step 4 and finish with the same parameters."""
    overrides = {**TEN_STEPS, "checkpoint": {"every": 2}, "train": {"steps": 10,
                 "max_restarts": 1}}  # fmt: skip
    job = Job(tmp_path_factory.mktemp("restart"), overrides, "restart")
    returncode, _, err = _start(job, "kill:5:1").wait(2 * START_S + AGENT_CLOSE_S + 60)
    assert returncode == 0, err[-3000:]
    report = job.report
    assert report["status"] == "completed"
    assert report["final_param_digest"] == slow_run.report["final_param_digest"]
    # forked from the zygote (both attempts) or started fresh: the same parameters
    assert report["timing"]["preloaded_workers"] is True
    assert slow_run.report["timing"]["preloaded_workers"] is False
    [restart] = report["restarts"]
    assert (restart["attempt"], restart["resumed_from"]) == (1, 4)
    # the restart's gap: the failure to the first step of the next attempt
    assert restart["failed_at"] < restart["resumed_at"] <= report["timing"]["last_step_at"]
    assert restart["gap_s"] == pytest.approx(restart["resumed_at"] - restart["failed_at"])
    assert report["timing"]["restart_gaps_s"] == [restart["gap_s"]]
    # start-up is the command's to the launch's first step (the first attempt's), and
    # the failed attempt's segment ends where its restart says it had reached
    assert report["timing"]["first_step_at"] < restart["failed_at"]
    assert report["timing"]["startup_phases_s"] is None
    first = report["segments"][0]
    assert (first["ended"], first["end_step"]) == ("restarted", restart["reached_before"])
    d = _diagnose(job.run_dir)
    assert d["verdict"] == "ok" and "after 1 restart" in d["summary"], d["summary"]


# --- SIGTERM ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory):
    """A long run stopped by SIGTERM to `meshforge train` once both ranks have done 2 steps."""
    overrides = {**FAST, "train": {"steps": 5000}, "observe": {"flight_every_s": 0.5,
                 "log_every": 50}}  # fmt: skip
    job = Job(tmp_path_factory.mktemp("sigterm"), overrides, "sigterm")
    run = _start(job, None)
    try:
        _wait_for_steps(job.run_dir, 2, [run.proc])
        run.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        returncode, _, err = run.wait(sent - run.started + GRACE_S + 10 + 45)
    finally:
        _stop_tree([run.proc])
    return job, returncode, err


def test_sigterm_checkpoints_the_current_step_and_exits_143(sigterm_run):
    job, returncode, err = sigterm_run
    assert returncode == 143, err[-3000:]
    report = job.report
    assert report["status"] == "stopped", report.get("status")
    step = report["stopped"]["step"]
    assert (job.run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    assert f"checkpoint at step {step}" in err
    d = _diagnose(job.run_dir)
    assert d["verdict"] == "stopped" and d["step"] == step, d["summary"]


def test_a_stopped_run_resumes_from_its_checkpoint(sigterm_run):
    job, _, _ = sigterm_run
    step = job.report["stopped"]["step"]
    # the same job, shortened so the rerun ends two steps after the checkpoint
    returncode, out, err = _start(job, None, "--set", f"train.steps={step + 2}").wait(START_S + 60)
    assert returncode == 0, err[-3000:]
    assert f"resumed from checkpoint at step {step}" in out + err


# --- the diagnosis the launcher leaves behind -----------------------------------------


def test_a_failed_or_stopped_run_leaves_its_diagnosis(failed_runs, sigterm_run):
    """health/diagnosis.json holds the same verdict `meshforge diagnose` gives."""
    runs = [(_failed(failed_runs[name]), v) for name, v in (("kill", "rank_crashed"),
            ("oom", "oom"), ("hang", "hang"))]  # fmt: skip
    for job, verdict in [*runs, (sigterm_run[0], "stopped")]:
        written = json.loads((job.run_dir / "health" / "diagnosis.json").read_text())
        assert written.get("verdict") == verdict, written
        assert written["summary"]


# --- a cut link between two hosts ------------------------------------------------------


@pytest.mark.cluster
def test_cut_link_is_named_a_network_partition(tmp_path):
    """Two namespace hosts (each with its own host name), one rank each; the link goes
    down mid-run. Both sides time out on each other; the host cut off from rank 0's side
    is named, and every process on both sides has exited within the timeout + 60 s."""
    overrides = {**FAST, "train": {"steps": 5000}, "observe": {"flight_every_s": 0.5,
                 "log_every": 50}}  # fmt: skip
    job = Job(tmp_path, overrides, "partition")
    with netns_hosts(2) as hosts:
        port = 29500 + os.getpid() % 400
        procs: list[subprocess.Popen] = []
        workers: dict[psutil.Process, tuple[str, int]] = {}
        try:
            for h in hosts:
                argv = [sys.executable, "-m", "meshforge", "train", str(job.config_path),
                        "--run-dir", str(job.run_dir), "--nnodes", "2", "--nproc-per-node",
                        "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"{hosts[0].addr}:{port}", "--rdzv-id", "mf-cut",
                        "--iface", h.iface]  # fmt: skip
                # a UTS namespace of its own: the host has its own name, as real ones do
                shell = f"hostname {h.name} && exec {shlex.join(argv)}"
                env = {k: v for k, v in _env().items() if not k.startswith(("PET_", "GLOO_"))}
                with open(tmp_path / f"{h.name}.log", "w") as log:
                    procs.append(h.popen(["unshare", "--uts", "sh", "-c", shell], cwd=REPO,
                                         env=env, stdout=log, stderr=log))  # fmt: skip
            _wait_for_steps(job.run_dir, 3, procs)
            for h, p in zip(hosts, procs, strict=True):
                for child in psutil.Process(p.pid).children(recursive=True):
                    rank = child.environ().get("RANK")
                    if rank is not None:
                        workers[child] = (h.name, int(rank))
            far_ranks = sorted(r for host, r in workers.values() if host == hosts[1].name)
            subprocess.run(["ip", "-n", hosts[1].name, "link", "set", hosts[1].iface, "down"],
                           check=True, timeout=30)  # fmt: skip
            deadline = time.monotonic() + STEP_TIMEOUT_S + 60
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logs = "".join(f.read_text()[-2000:] for f in tmp_path.glob("*.log"))
                    pytest.fail(f"a launcher still ran 60 s after the collective timeout:\n{logs}")
            alive = [w.pid for w in workers if _alive(w)]
            assert not alive, f"workers still running: {alive}"
        finally:
            _stop_tree(procs, list(workers))
    assert [p.returncode for p in procs] == [1, 1]
    d = _diagnose(job.run_dir)
    assert d["verdict"] == "network_partition", d["summary"]
    assert far_ranks and d["ranks"] == far_ranks
    assert [h["host"] for h in d["hosts"]] == [hosts[1].name]
    assert hosts[1].name in d["summary"]
    advice = " ".join(d["advice"])
    assert "--iface" in advice and "GLOO_SOCKET_IFNAME" in advice and "firewall" in advice
