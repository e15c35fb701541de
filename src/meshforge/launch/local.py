"""Start worker processes on this node through the torch elastic agent.

The agent (the machinery behind torchrun) spawns `meshforge worker`, watches it,
and reports which rank failed and why; multi-node rendezvous uses torchrun's
own c10d or static backends."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# the failure records and the root-cause choice live with the run directory's files;
# the launcher's callers (Fabric, benchmarks) also use them by these names
from meshforge.rundir.failures import (  # noqa: F401
    choose_first_failure,
    clear_recorded_failures,
    describe_exit,
    is_peer_failure,
    recorded_failures,
    root_cause,
)

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig


@dataclass
class NodeSpec:
    """torchrun's multi-node flags."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    local_addr: str | None = None
    max_restarts: int = 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_config(nproc: int, node: NodeSpec, log_dir: Path) -> LaunchConfig:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    rdzv_configs: dict[str, Any] = {}
    if node.rdzv_endpoint or node.rdzv_backend == "c10d":
        backend, endpoint = node.rdzv_backend or "c10d", node.rdzv_endpoint or ""
        rdzv_configs["is_host"] = node.node_rank == 0
    elif node.nnodes > 1 or node.master_addr:
        # torchrun's default for --master-addr/--node-rank: a static rendezvous.
        backend = "static"
        endpoint = f"{node.master_addr or '127.0.0.1'}:{node.master_port or 29500}"
        rdzv_configs["rank"] = node.node_rank
    else:
        backend, endpoint = "c10d", f"127.0.0.1:{node.master_port or free_port()}"
    from meshforge.launch.rendezvous import secure

    config = LaunchConfig(
        min_nodes=node.nnodes,
        max_nodes=node.nnodes,
        nproc_per_node=nproc,
        run_id=node.rdzv_id or f"meshforge-{uuid.uuid4().hex[:8]}",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=node.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr=node.local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.NONE, tee=Std.NONE),
    )
    return secure(config)  # meshforge's rendezvous backends (launch/rendezvous.py)


def failure_message(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", json.dumps(msg))
    msg = str(msg or "").strip()
    if not msg or msg.startswith("To enable traceback"):
        return "no error recorded (see its log)"
    return msg.splitlines()[-1] if "Traceback" in msg else msg.splitlines()[0]


def run_workers(worker_args: list[str], nproc: int, node: NodeSpec, run_dir: Path) -> dict | None:
    """Run `python -m meshforge WORKER_ARGS` on nproc local processes (NodeSpec form)."""
    config = launch_config(nproc, node, run_dir / "logs" / "elastic")
    return run_elastic(config, sys.executable, ["-u", "-m", "meshforge", *worker_args], run_dir)


class AgentWatchdog:
    """Ends this launcher when its workers are gone and the elastic agent does not
    return: an agent whose rendezvous store is on the far side of a cut link waits on
    it for as long as the link stays down. Waiting for workers to start (rendezvous,
    restarts) is not watched; only the time after every local worker has exited."""

    def __init__(
        self, grace_s: float, restarts: int, poll_s: float = 0.5, helper_pid: int | None = None
    ) -> None:
        self.helper_pid = helper_pid  # the zygote (launch/zygote.py) is not a worker
        # a restart may wait for the other nodes to rendezvous again (torch's default
        # join timeout is 600 s); a job without restarts has only its exit to finish
        self.limit_s = grace_s + (600.0 if restarts else 0.0)
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshforge-agent-watch",
                                        daemon=True)  # fmt: skip

    def __enter__(self) -> AgentWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _watch(self) -> None:
        import psutil

        me = psutil.Process()
        had_workers, gone_since = False, None
        while not self._stop.wait(self.poll_s):
            try:
                alive = [
                    c
                    for c in me.children()
                    if c.status() != psutil.STATUS_ZOMBIE and c.pid != self.helper_pid
                ]
            except psutil.Error:
                continue
            if alive:
                had_workers, gone_since = True, None
                continue
            if not had_workers:
                continue
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > self.limit_s:
                print(
                    f"meshforge: this node's workers exited {self.limit_s:.0f} s ago and the "
                    "elastic agent is still waiting on its rendezvous (store or peers "
                    "unreachable?); giving up",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)


def run_elastic(
    config: LaunchConfig,
    cmd: str,
    cmd_args: list[str],
    run_dir: Path,
    grace_s: float = 60.0,
    helper_pid: int | None = None,
) -> dict | None:
    """Run CMD CMD_ARGS under the elastic agent with CONFIG.

    Returns None on success, or a failure description (also written to
    RUN_DIR/health/diagnosis.json). The agent runs meshforge's rendezvous backends
    (launch/rendezvous.py): its stores listen on one address, and a rendezvous state
    that this job did not write is refused (RendezvousRefused) before it is read."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from meshforge.launch.rendezvous import secure

    secure(config)

    # torch's elastic loggers carry their own levels (LOGLEVEL): quiet each, so a stop
    # prints meshforge's one line, not the agent's "Received 2 death signal" too
    for name in ["torch.distributed.elastic", *logging.Logger.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    clear_recorded_failures(run_dir / "health")
    launch = elastic_launch(config, cmd)
    watchdog = AgentWatchdog(max(grace_s, 30.0), config.max_restarts, helper_pid=helper_pid)
    try:
        with watchdog:
            launch(*cmd_args)
        return None
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        failures = [
            {
                "rank": r,
                "local_rank": f.local_rank,
                "pid": f.pid,
                "exitcode": f.exitcode,
                "exit": describe_exit(f.exitcode),
                "error": failure_message(f),
                "log": str(run_dir / "logs" / f"rank-{r}.log"),
            }
            for r, f in sorted(exc.failures.items())
        ]
        recorded = recorded_failures(run_dir / "health")
        first_failure = choose_first_failure(recorded, failures, rank)
        first_failure.setdefault("log", str(run_dir / "logs" / f"rank-{first_failure['rank']}.log"))
        from meshforge.health.diagnose import write_diagnosis

        agent = {"time": time.time(), "first_failure": first_failure, "failures": failures}
        return write_diagnosis(run_dir, agent)


def launch_training(argv: list[str], worker_entry: str) -> int:
    """`meshforge train ARGV`: parse torchrun's flags, prepare the job, run the agent.

    `worker_entry` (`module:function`) is what each worker runs with its arguments, the
    CLI's main: the zygote preloads and calls it, so that launch/ imports nothing above
    it."""
    from meshforge.launch import zygote
    from meshforge.train.timing import mark_launch

    mark_launch()  # the workers' start-up is timed from this process's start
    # A Ctrl-C before the agent runs is noted, not raised: raised inside a torch call
    # it would abort the process; the job is given up before the workers start.
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    # first: it imports torch and the trainer while this process prepares the job
    preloaded = zygote.start(worker_entry)
    try:
        return _launch_training(argv, preloaded, pressed)
    finally:
        if preloaded is not None:
            preloaded.stop()
        signal.signal(signal.SIGINT, previous)  # called in-process (tests): as it found it


def _launch_training(argv: list[str], preloaded: Any, pressed: list[int]) -> int:
    from meshforge.config import load_config
    from meshforge.errors import ConfigError
    from meshforge.launch.torchrun import check_gpu_count, launch_config, parse_launch_args
    from meshforge.launch.train import layout_line, prepare_job, report_failure
    from meshforge.train.timing import record_exit

    launch = parse_launch_args(argv)
    a = launch.args
    _listeners(launch)
    if a.recalibrate:  # the workers inherit it (train/calibration_cache.py)
        os.environ["MESHFORGE_RECALIBRATE"] = "1"
    cfg = load_config(a.config, a.overrides)
    check_gpu_count(launch.nproc_per_node, cfg.runtime.device, a.oversubscribe)
    multi = launch.max_nodes > 1
    if a.fresh and multi:  # every node's agent would remove files its peers write
        raise ConfigError(
            "--fresh starts over on one node; for a multi-node job, remove the run "
            "directory (or use another --run-dir) before launching it"
        )
    from meshforge.runtime import runlock

    if multi:  # global rank 0's worker holds the run directory; the agents only check
        job_id = runlock.torchrun_job_id(a.rdzv_id, a.master_addr, a.master_port)
        runlock.export_job_id(job_id)
        lock = functools.partial(runlock.check_run_dir_free, job_id=job_id)
    else:
        lock = runlock.hold_run_dir  # held by this launcher until it exits
    # Across nodes the workers agree on one config (global rank 0's) and write
    # config.yaml themselves; each node's agent keeps its own copy under .launch/.
    config_name = (
        f".launch/job-{socket.gethostname()}-{os.getpid()}.yaml" if multi else "config.yaml"
    )
    job = prepare_job(
        a.config,
        a.overrides,
        nproc_per_node=launch.nproc_per_node,
        min_nodes=launch.min_nodes,
        max_nodes=launch.max_nodes,
        run_dir=a.run_dir,
        config_name=config_name,
        lock=lock,
        fresh=a.fresh,
        workers_here=True,
    )
    if job.finished is not None:  # nothing to train, nothing written
        print(job.finished, flush=True)
        return 0
    if not multi:
        runlock.mark_held_for_workers(job.run_dir)
    for line in [job.auto_line, job.history_line, *(f"meshforge: {n}" for n in launch.notes)]:
        if line:
            print(line, flush=True)
    for warning in launch.warnings:
        print(f"meshforge: warning: {warning}", file=sys.stderr, flush=True)
    if job.schedule_warning:
        print(job.schedule_warning, file=sys.stderr, flush=True)
    if job.world is not None and job.cfg.parallel != "auto":
        print(layout_line(job.cfg, job.world, job.run_dir), flush=True)
    else:
        nodes = (
            f"{launch.min_nodes}..{launch.max_nodes}"
            if launch.min_nodes != launch.max_nodes
            else launch.max_nodes
        )
        what = "layout (parallel: auto)" if job.cfg.parallel == "auto" else "layout"
        print(
            f"meshforge: training {job.cfg.name!r} on {nodes} node(s) x "
            f"{launch.nproc_per_node} worker(s); global rank 0 fixes the {what} "
            f"once every node has joined -> {job.run_dir}",
            flush=True,
        )
    worker_args = ["worker", str(job.config_file), "--run-dir", str(job.run_dir)]
    config, cmd, cmd_args = launch_config(launch, worker_args, job.run_dir / "logs" / "elastic")
    if preloaded is not None:  # the workers fork from the zygote (launch/zygote.py)
        cmd_args = preloaded.worker_command(cmd_args)
    runtime = job.cfg.runtime
    if not _given(argv, "--max-restarts", "PET_MAX_RESTARTS"):
        config.max_restarts = job.cfg.train.max_restarts
    if not _given(argv, "--monitor-interval", "PET_MONITOR_INTERVAL"):
        # how soon the agent sees its workers exit (torchrun's default is 0.1 s): a
        # run's exit waits on it; the check is a waitpid per worker
        config.monitor_interval = 0.05
    if not _given(argv, "--shutdown-timeout", "PET_SHUTDOWN_TIMEOUT"):
        # after SIGTERM the workers checkpoint within runtime.grace_s; the agent waits
        # that long (and a little) before it kills them
        config.shutdown_timeout = int(runtime.grace_s) + 10
    # Workers get a store of their own per attempt: sharing the rendezvous store breaks
    # elastic restarts (the new attempt's gloo/NCCL setup reads the old attempt's
    # addresses: pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from meshforge.launch.ctrl_c import CtrlC
    from meshforge.launch.rendezvous import RendezvousRefused

    launched = time.time()
    if pressed:
        print("meshforge: interrupted (Ctrl-C) before the workers started; nothing was "
              "trained", file=sys.stderr, flush=True)  # fmt: skip
        return 130
    ctrl_c = CtrlC().install(config)  # a second Ctrl-C kills the workers (launch/ctrl_c.py)
    try:
        diagnosis = run_elastic(
            config, cmd, cmd_args, job.run_dir, runtime.grace_s,
            helper_pid=preloaded.proc.pid if preloaded is not None else None,
        )  # fmt: skip
    except RendezvousRefused as exc:  # the agent has stopped its workers
        print(f"meshforge: {exc}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        # Ctrl-C or a scheduler's SIGTERM: the agent has already stopped its workers
        # (or, after a second Ctrl-C, they were killed).
        name = signal.Signals(exc.sigval).name
        from meshforge.health.diagnose import write_diagnosis

        where = _where_to_resume(job.run_dir, launched)
        if not multi:  # this launcher holds the run directory; its workers are gone
            _report_interrupted(job, name, launched)
            record_exit(job.run_dir)
        write_diagnosis(job.run_dir, stopped_by=name)
        how = name
        if ctrl_c.killed:
            how, where = f"{name} twice: the workers were killed", _where_after_kill(job.run_dir)
        print(f"meshforge: stopped by {how}; {where}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    if diagnosis is None:
        if not multi:  # the workers have exited: the report's shutdown time is known
            record_exit(job.run_dir)
        return 0
    return report_failure(job.run_dir, diagnosis)


def _listeners(launch: Any) -> None:
    """What the job listens on, said at launch (docs/cluster.md, "Trust model"). A
    single-node run keeps every listener on loopback: its agent's store and its workers'
    (launch/rendezvous.py), and gloo's and NCCL's, pinned here for the workers. Across
    nodes, a c10d rendezvous without a job secret is said to be unsigned."""
    from meshforge.launch.rendezvous import job_secret, unsigned_warning
    from meshforge.runtime import listen

    if launch.max_nodes == 1:
        chosen = os.environ.get("GLOO_SOCKET_IFNAME")
        lo = listen.pin_collectives_to_loopback()
        if chosen and chosen != lo:
            launch.notes.append(
                f"a single-node run listens on loopback only: collectives use {lo}, not {chosen}"
            )
    elif launch.args.rdzv_backend == "c10d" and job_secret() is None:
        launch.warnings.append(unsigned_warning(launch.args.rdzv_endpoint))


def _report_interrupted(job: Any, signal_name: str, launched: float) -> None:
    """report.json after a stop whose workers wrote none (stopped before they could
    checkpoint): status interrupted, never at the cost of the stop itself."""
    from meshforge.train.report import write_interrupted_report

    try:
        write_interrupted_report(
            job.run_dir, signal_name, launched, job.cfg.name, job.cfg.train.steps
        )
    except Exception as exc:  # noqa: BLE001 - the stop must end in its one line
        logging.getLogger(__name__).warning("no report after the stop: %s", exc)


def _given(argv: list[str], flag: str, env: str) -> bool:
    """Whether the user set a torchrun option (either spelling, or its PET_ variable)."""
    spellings = (flag, flag.replace("-", "_").replace("__", "--", 1))
    return env in os.environ or any(a.split("=")[0] in spellings for a in argv)


def _where_after_kill(run_dir: Path) -> str:
    from meshforge.rundir.checkpoints import committed_checkpoints

    steps = committed_checkpoints(run_dir)
    if not steps:
        return "no checkpoint was written; the same command starts over"
    return f"the same command resumes from the last checkpoint, at step {steps[-1]}"


def _where_to_resume(run_dir: Path, since: float) -> str:
    """What the user needs after a stop: the step the workers checkpointed, if they did
    (a report written since the launch says so)."""
    from meshforge.rundir.report import read_report_or_none, report_path

    try:
        fresh = report_path(run_dir).stat().st_mtime >= since
    except OSError:
        fresh = False
    report = (read_report_or_none(run_dir) or {}) if fresh else {}
    stopped = report.get("stopped") if report.get("status") == "stopped" else None
    if stopped:
        return (
            f"the workers wrote a checkpoint at step {stopped['step']}; the same command "
            "resumes from it"
        )
    if not any((run_dir / "checkpoints").glob("step-*")):
        return "the workers were stopped before any checkpoint; the same command starts over"
    return "the workers were stopped; the same command resumes from the last checkpoint"
