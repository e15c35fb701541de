"""The per-process entry point used under torchrun, the elastic agent, srun or mpirun."""

from __future__ import annotations

import logging
import os
import shlex
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from meshforge.config import load_config
from meshforge.rundir.failures import record_failure
from meshforge.runtime.env import detect_env
from meshforge.runtime.runlock import worker_run_lock


def _setup_logging(run_dir: Path, rank: int) -> Path:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank-{rank}.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    warnings.filterwarnings("ignore", category=FutureWarning)
    # The rank's own output (step lines, warnings, tracebacks) also goes to its log, so
    # a multi-node run can be read afterwards from the run directory alone.
    sys.stdout = _Tee(sys.stdout, handler)
    sys.stderr = _Tee(sys.stderr, handler)
    return path


class _Tee:
    """A text stream that writes to the console and to the rank's log file."""

    def __init__(self, stream, handler: logging.FileHandler) -> None:
        self._stream, self._handler = stream, handler

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        log_stream = self._handler.stream
        if log_stream is not None and text:
            self._handler.acquire()
            try:
                log_stream.write(text)
                log_stream.flush()
            except (OSError, ValueError):
                pass
            finally:
                self._handler.release()
        return n

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@record
def run_worker(
    config_path: Path, run_dir: Path, after_report: Callable[[Path], None] | None = None
) -> None:
    """Train this process's rank of the job in `run_dir`. `after_report` is called on
    global rank 0 with the run directory once report.json is written, before the rank
    leaves its process group: the command hands the run's page (report.html) in here,
    since the viewers sit above train/."""
    from meshforge.observe.flight import FlightRecorder
    from meshforge.plan.jobs.auto import resolve_open_decisions
    from meshforge.runtime.agree import agree_on_config
    from meshforge.runtime.dist import distributed
    from meshforge.train.calibration import calibrate
    from meshforge.train.trainer import Trainer

    run_dir = Path(run_dir)
    env = detect_env()
    _stop_with_launcher()
    # Global rank 0 holds the run directory (.lock; .lock-workers when its launcher holds
    # .lock: one node, mpirun), so that it stays held while this worker outlives a killed
    # launcher; the kernel drops the lock when this process ends, however it ends.
    _run_lock = worker_run_lock(run_dir, env.rank)
    _setup_logging(run_dir, env.rank)
    log = logging.getLogger("meshforge.worker")
    cfg = load_config(config_path)
    log.info(
        "starting: launcher=%s rank=%d/%d master=%s:%s attempt=%s",
        env.launcher, env.rank, env.world_size, env.master_addr, env.master_port,
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )  # fmt: skip
    try:
        r = cfg.runtime
        # the worker command ends in os._exit (cli/train.py): no finalisation to prepare
        with distributed(
            r.device, r.backend, r.timeout_s, r.threads_per_worker, exits_at_once=True
        ) as rt:
            log.info("process group up: backend=%s device=%s", rt.backend, rt.device)
            cfg = agree_on_config(
                cfg, rt.rank, rt.world_size, rt.env.local_rank, run_dir, resolve_open_decisions
            )
            o = cfg.observe
            flight = FlightRecorder(
                run_dir, rt.rank, rt.world_size, o.flight_every_s, rt.device, o.flight
            ).start()
            try:
                trainer = Trainer(cfg, run_dir, rt, flight)
                # the machine measured for the planner's prediction (report.json)
                report = trainer.fit(calibrate(cfg, trainer.engine, rt.device))
                if report and after_report is not None:
                    after_report(run_dir)
            except BaseException as exc:
                flight.fail(exc)
                record_failure(run_dir, env.rank, exc)
                raise
            finally:
                flight.close("finished")
        log.info("finished")
        if env.rank == 0 and report:
            _announce(run_dir, report, sample=not cfg.model.is_factory)
    except BaseException as exc:
        # Recorded before the process group is torn down: the peers' errors (connection
        # reset, timeout) follow this one, so the earliest record is the root cause.
        record_failure(run_dir, env.rank, exc)
        log.exception("worker failed")
        _quiet_traceback(env.rank, run_dir)
        raise


def _quiet_traceback(rank: int, run_dir: Path) -> None:
    """The traceback is in the rank's log already: the console gets one line per rank
    (torch's own hook would print every frame, prefixed, from every failing rank)."""
    log_path = Path(run_dir) / "logs" / f"rank-{rank}.log"

    def hook(exc_type, exc, tb) -> None:  # noqa: ARG001 - sys.excepthook's signature
        text = f"{exc_type.__name__}: {exc}".strip().splitlines()[0]
        print(f"[rank{rank}] {text} (traceback: {log_path})", file=sys.stderr, flush=True)

    sys.excepthook = hook


def _stop_with_launcher() -> None:
    """If the launcher (the elastic agent) is killed, this worker gets SIGTERM: it then
    checkpoints with its peers and leaves (runtime/control.py) instead of training on,
    orphaned, in a run directory nobody holds any more. Linux only."""
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    from meshforge.runtime.parent import term_on_parent_death

    # The parent it must outlive: the launcher (its elastic agent), or the zygote that
    # forked it (launch/zygote.py); by pid, since a launcher killed before this line
    # has already left this worker to init.
    term_on_parent_death(
        os.environ.get("MESHFORGE_EXPECTED_PARENT") or os.environ.get("MESHFORGE_LAUNCHER_PID")
    )


def _announce(run_dir: Path, report: dict, sample: bool = True) -> None:
    from meshforge.observe.console import print_summary

    print_summary(report)
    print(f"run directory: {run_dir}")
    if sample:  # meshforge's own models (a factory's generation is its own business)
        print(f"sample from it: meshforge sample {shlex.quote(str(run_dir))} --prompt 'def '")
    sys.stdout.flush()
