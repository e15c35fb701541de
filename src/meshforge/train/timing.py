"""Where a run's wall-clock time outside training goes (report.json `timing`):

startup_s      the command (the launcher process's start: MESHFORGE_LAUNCHED_AT, which
               `meshforge train` sets; without it, as under srun or mpirun, rank 0's
               own process start) to the first training step, which begins when every
               rank has built its model and joined the first step's barrier
after_last_s   the end of the last step to the report being written (final checkpoint
               `final_checkpoint_s` included)
shutdown_s     the end of the last step to the last worker's exit; filled in by
               `meshforge train` after its workers exit (None without it)
restarts       each elastic restart's gap: the failure that ended the previous attempt
               (the failed rank's recorded error, or the previous attempt's last flight
               record when it died silently) to the first step of the next one

All times are epoch seconds of global rank 0's clock (the launcher's for exited_at),
so they compare with metrics.jsonl's `time` fields.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.rundir.report import read_report_or_none, write_report

LAUNCHED_AT_ENV = "MESHFORGE_LAUNCHED_AT"


def launched_at() -> float:
    """When the command started: the launcher's process start, or this process's."""
    value = os.environ.get(LAUNCHED_AT_ENV)
    if value:
        try:
            return float(value)
        except ValueError:
            pass
    return process_start()


def process_start() -> float:
    """This process's start in epoch seconds, to a clock tick (10 ms): its start time
    since boot (/proc/self/stat) against CLOCK_BOOTTIME. psutil's create_time adds
    the boot time, which /proc/stat gives in whole seconds only."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return psutil.Process().create_time()


PRELOADED_ENV = "MESHFORGE_PRELOADED"  # set in a worker forked from the zygote


def mark_launch() -> None:
    """In the launcher: record its own process start for the workers it starts, and its
    pid (a worker started after the launcher died must notice: train/worker.py)."""
    os.environ.setdefault(LAUNCHED_AT_ENV, repr(process_start()))
    os.environ["MESHFORGE_LAUNCHER_PID"] = str(os.getpid())


@dataclass
class RunTiming:
    launched_at: float
    worker_started_at: float | None = None  # rank 0's process start
    group_up_at: float | None = None  # its process group initialised (peers joined)
    ready_at: float | None = None  # the trainer built: config agreed, data, model, sinks
    first_step_at: float | None = None
    last_step_at: float | None = None
    final_checkpoint_s: float | None = None

    def phases(self) -> dict[str, float | None]:
        """Where start-up went: launcher (the command to rank 0's process start:
        parsing, the run directory, the agent, spawning; with the zygote, also its
        import of torch, since a forked worker starts after it), imports (rank 0's start to
        its process group, which waits for the slowest peer's imports), build (the
        trainer: data, model, sharding, sinks), ready (resume, the machine profile,
        the loader and the first step's barrier)."""
        marks = [self.launched_at, self.worker_started_at, self.group_up_at, self.ready_at,
                 self.first_step_at]  # fmt: skip
        names = ("launcher", "imports", "build", "ready")
        return {
            n: (b - a if a is not None and b is not None else None)
            for n, a, b in zip(names, marks, marks[1:], strict=False)
        }

    def as_dict(
        self,
        report_at: float,
        restarts: list[dict[str, Any]],
        launch_first_step_at: float | None = None,
    ) -> dict[str, Any]:
        """`launch_first_step_at`: after an elastic restart, the launch's first step (its
        first attempt's): start-up is the command's to it, and the phases, which this
        attempt's workers did not see, are left out (the restart's gap is in
        restart_gaps_s)."""

        def since(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else end - start

        gaps = [r["gap_s"] for r in restarts if r.get("gap_s") is not None]
        first = self.first_step_at
        phases: dict[str, float | None] | None = self.phases()
        if launch_first_step_at is not None:
            first, phases = launch_first_step_at, None
        return {
            "launched_at": self.launched_at,
            "first_step_at": first,
            "startup_s": since(self.launched_at, first),
            "startup_phases_s": phases,
            "last_step_at": self.last_step_at,
            "final_checkpoint_s": self.final_checkpoint_s,
            "report_at": report_at,
            "after_last_s": since(self.last_step_at, report_at),
            "exited_at": None,
            "shutdown_s": None,
            "restart_gaps_s": gaps,
            # rank 0 was forked from the launcher's zygote, torch already imported
            # (launch/zygote.py), rather than started as a fresh interpreter
            "preloaded_workers": os.environ.get(PRELOADED_ENV) == "1",
        }


def record_exit(run_dir: Path, exited_at: float | None = None) -> None:
    """In the launcher, after its workers exited (completed, or stopped by a signal):
    complete report.json's `timing` with the exit (only a report this launch's workers
    wrote, and only when it has one)."""
    report = read_report_or_none(run_dir)
    if report is None:
        return
    timing = report.get("timing")
    if not isinstance(timing, dict) or timing.get("exited_at") is not None:
        return
    if timing.get("launched_at") != launched_at():
        return  # written by another launch (a finished run re-run)
    exited_at = time.time() if exited_at is None else exited_at
    timing["exited_at"] = exited_at
    last = timing.get("last_step_at")
    timing["shutdown_s"] = exited_at - last if last is not None else None
    write_report(run_dir, report)
