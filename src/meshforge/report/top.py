"""`meshforge top`: a live view of a run, read only from its run directory.

Nothing here connects to the job; each frame is what the run directory says now:

- a header: the run's name and status, the step out of the job's steps, and the
  newest metrics.jsonl row's loss, tokens/s and MFU, with an ETA from the pace of the
  last rows (only the file's tail is read: it grows with the run);
- for a mixture-of-experts run, a line from the newest row's `moe` section: the worst
  layer's max/mean expert load, the dropped fraction and the auxiliary loss;
- one line per rank from health/flight-rank-K.json (observe/flight.py): host, step,
  phase and how long it had been in it when it wrote the record, step time, memory,
  status and the age of the record. While the run is running, a running rank whose
  record is older than 3 x observe.flight_every_s is flagged stale: it may hang
  (`meshforge diagnose` says more);
- one line per host from the newest sample of system/*.jsonl (observe/sampler.py): CPU,
  memory, network summed over the non-loopback interfaces, link utilisation, GPUs.

The status: report.json's final status when the report is newer than the run's start
(the lock holder's start while RUN_DIR/.lock is held, else the ranks' first record);
else "running" while a process holds the lock (or, where no lock can tell, while a
rank's record is running and fresh: a free lock means that the launcher and its
workers are gone, however fresh their last records); else "not started" while nothing
has been written, "ended without a report" otherwise.
The run has ended (`watch` stops) with a final report once no rank's record is running
and fresh or nobody holds the lock, and with no report once both hold; not before it
started.

Any file may be missing or half-written (a truncated line, a record mid-replace): what
cannot be read shows as n/a. `read_run` reads, `format_frame` draws plain text,
`render_frame` does both; `watch` is the loop. No torch import: it answers at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from meshforge.errors import DataError
from meshforge.observe.console import moe_summary_text
from meshforge.observe.metrics import is_tail
from meshforge.rundir.flights import newest_world
from meshforge.rundir.records import tail_rows
from meshforge.rundir.report import read_report_or_none, report_path
from meshforge.runtime import runlock
from meshforge.units import format_bytes, format_duration, format_percent

FINAL_STATUSES = ("completed", "failed", "stopped", "interrupted")
# What a run directory holds from the moment its launcher takes it.
_RUN_MARKERS = (runlock.LOCK_FILE, "config.yaml", "report.json", "metrics.jsonl", "health")
_FLIGHT_FILE = re.compile(r"flight-rank-(\d+)\.json")
_LOOPBACK = re.compile(r"lo\d*")
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen
# A record written this long before the lock holder's start is an earlier run's (clocks
# of the hosts sharing a run directory differ a little).
_CLOCK_SLACK_S = 2.0


def check_run_dir(run_dir: Path) -> Path:
    """RUN_DIR if it is a run directory (or one its launcher has just taken); DataError
    (exit 2, one line) otherwise."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise DataError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise DataError(f"{run_dir} is not a directory")
    if not any((run_dir / marker).exists() for marker in _RUN_MARKERS):
        raise DataError(
            f"{run_dir} is not a meshforge run directory "
            "(no config.yaml, report.json, metrics.jsonl, health/ or .lock)"
        )
    return run_dir


# -- reading, every file optional ---------------------------------------------------------
def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, or cut short (UnicodeDecodeError included)
        return None
    return value if isinstance(value, dict) else None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        value = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def _flight_records(health: Path) -> dict[int, dict[str, Any] | None]:
    """Rank -> its flight record, None where the file cannot be read as one."""
    records: dict[int, dict[str, Any] | None] = {}
    try:
        paths = list(health.iterdir())
    except OSError:
        return records
    for path in paths:
        match = _FLIGHT_FILE.fullmatch(path.name)
        if match:
            records[int(match.group(1))] = _read_json(path)
    return newest_world(records, health.parent)


def _trailing_run(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest segment's rows, whose steps rise (a resumed run logs its steps again:
    its rows carry the segment's number, rundir/segments.py)."""
    run: list[dict[str, Any]] = []
    for row in reversed(rows):
        step = _num(row.get("step"))
        if step is None:
            continue
        if run and (step >= run[0]["step"] or row.get("segment") != run[0].get("segment")):
            break
        run.insert(0, row)
    return run


def _seconds_per_step(rows: list[dict[str, Any]]) -> float | None:
    """The pace of the last rows (their wall-clock times), else the newest step's time."""
    timed = [(r["step"], t) for r in rows if (t := _num(r.get("time"))) is not None]
    if len(timed) >= 2:
        (s0, t0), (s1, t1) = timed[0], timed[-1]
        if s1 > s0 and t1 > t0:
            return (t1 - t0) / (s1 - s0)
    return _num(rows[-1].get("step_time_s")) if rows else None


# -- the view -----------------------------------------------------------------------------
@dataclass
class RankLine:
    rank: int
    record: dict[str, Any] | None  # None: no record, or one that cannot be read
    problem: str | None = None  # why the record is not shown
    age_s: float | None = None
    stale: bool = False


@dataclass
class HostLine:
    name: str
    sample: dict[str, Any] | None
    age_s: float | None = None


@dataclass
class RunView:
    run_dir: Path
    now: float
    name: str
    status: str  # running, completed, failed, stopped, not started, ended without a report
    ended: bool  # nothing more will happen: `watch` stops
    total_steps: int | None
    step: int | None
    row: dict[str, Any]  # the newest metrics row ({} without one)
    row_age_s: float | None
    eta_s: float | None
    stale_after_s: float
    note: str | None = None  # why a run failed or stopped
    moe: dict[str, Any] | None = None  # the newest row's moe section (and its step)
    ranks: list[RankLine] = field(default_factory=list)
    hosts: list[HostLine] = field(default_factory=list)


def _config_value(config: dict[str, Any], section: str, key: str) -> Any:
    part = config.get(section)
    return part.get(key) if isinstance(part, dict) else None


def _report_note(report: dict[str, Any]) -> str | None:
    failure = report.get("failure")
    if report.get("status") == "failed" and isinstance(failure, dict):
        summary = failure.get("summary") or failure.get("error")
        return f"failure: {summary}" if summary else None
    stopped = report.get("stopped")
    if report.get("status") == "stopped" and stopped is not None:
        if isinstance(stopped, dict):
            signal = f" ({stopped['signal']})" if stopped.get("signal") else ""
            return f"stopped after step {stopped.get('step')}{signal}, checkpoint written"
        return f"stopped: {stopped}"
    if report.get("status") == "interrupted" and isinstance(stopped, dict):
        at = report.get("last_checkpoint")
        last = f"last checkpoint at step {at}" if at is not None else "no checkpoint"
        return f"interrupted by {stopped.get('signal') or 'a signal'} before a checkpoint; {last}"
    return None


def _host_lines(system: Path, now: float) -> list[HostLine]:
    def order(path: Path) -> tuple:
        match = re.fullmatch(r"node-(\d+)", path.stem)
        return (0, int(match.group(1)), "") if match else (1, 0, path.stem)

    try:
        paths = sorted(system.glob("*.jsonl"), key=order)
    except OSError:
        return []
    hosts = []
    for path in paths:
        rows = tail_rows(path, 16 * 1024)
        sample = rows[-1] if rows else None
        name = str((sample or {}).get("host") or path.stem)
        t = _num((sample or {}).get("time"))
        hosts.append(HostLine(name, sample, None if t is None else max(0.0, now - t)))
    return hosts


def read_run(run_dir: Path, now: float | None = None) -> RunView:
    """What RUN_DIR says about its run at `now` (default: now)."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    config = _read_yaml(run_dir / "config.yaml")
    every_s = _num(_config_value(config, "observe", "flight_every_s")) or 5.0
    stale_after_s = max(3 * every_s, every_s + 2.0)

    held = runlock.is_held(run_dir)
    holder = runlock.read_holder(run_dir) if held else None
    records = _flight_records(run_dir / "health")
    if holder is not None:
        start: float | None = holder.since
    else:
        starts = [_num(r.get("started")) for r in records.values() if r]
        start = min((s for s in starts if s is not None), default=None)

    ranks: list[RankLine] = []
    current: list[dict[str, Any]] = []  # this run's readable records
    for rank in sorted(records):
        record = records[rank]
        if record is None:
            ranks.append(RankLine(rank, None, "record unreadable"))
            continue
        t = _num(record.get("time"))
        age = None if t is None else max(0.0, now - t)
        if holder is not None and t is not None and t < holder.since - _CLOCK_SLACK_S:
            ranks.append(RankLine(rank, record, "earlier run", age))
            continue
        current.append(record)
        ranks.append(RankLine(rank, record, None, age))
    world = max((int(w) for r in current if (w := _num(r.get("world_size")))), default=0)
    ranks += [RankLine(k, None, "no record yet") for k in range(world) if k not in records]
    ranks.sort(key=lambda line: line.rank)
    fresh_running = any(
        line.record.get("status") == "running"
        and line.problem is None
        and line.age_s is not None
        and line.age_s <= stale_after_s
        for line in ranks
        if line.record is not None
    )

    report = read_report_or_none(run_dir)
    if report is not None and start is not None:
        with contextlib.suppress(OSError):
            if report_path(run_dir).stat().st_mtime < start - _CLOCK_SLACK_S:
                report = None  # an earlier run's
    # a segment's moe_tail record holds expert counts only, no figures to show
    rows = [r for r in tail_rows(run_dir / "metrics.jsonl") if not is_tail(r)]
    if report is not None and report.get("status") in FINAL_STATUSES:
        # ended once the ranks have written their last records too (the report comes
        # first), or their launcher has let go of the run directory
        status, ended = str(report["status"]), not (held and fresh_running)
    elif held or (held is None and fresh_running):  # a free lock: nothing runs there
        status, ended = "running", False
    elif not current and not rows and report is None:
        status, ended = "not started", False  # keep watching: it may start yet
    else:
        status, ended = "ended without a report", True
    if status == "running":
        for line in ranks:
            running = line.record is not None and line.record.get("status") == "running"
            line.stale = bool(running and line.age_s is not None and line.age_s > stale_after_s)

    trailing = _trailing_run(rows)
    row = trailing[-1] if trailing else (rows[-1] if rows else {})
    row_time = _num(row.get("time"))
    steps = [_num(r.get("step")) for r in current] + [_num(row.get("step"))]
    step = max((int(s) for s in steps if s is not None), default=None)
    totals = [_num(r.get("steps")) for r in current]
    total = max((int(t) for t in totals if t is not None), default=None)
    if total is None:
        total_value = _num(_config_value(config, "train", "steps"))
        if total_value is None and report is not None:
            total_value = _num(report.get("steps"))
        total = None if total_value is None else int(total_value)
    eta_s = None
    if status == "running" and total is not None and step is not None:
        per_step = _seconds_per_step(trailing)
        eta_s = None if per_step is None else max(0, total - step) * per_step

    moe = next(
        ({**r["moe"], "step": r.get("step")} for r in reversed(trailing or rows)
         if isinstance(r.get("moe"), dict)),
        None,
    )  # fmt: skip
    name = config.get("name") or (report or {}).get("name") or run_dir.resolve().name
    if report is not None and status in FINAL_STATUSES and _num(report.get("tokens_per_s")):
        # a finished run: its medians (report.json), not the last interval's figures
        row = {**row, "tokens_per_s": report["tokens_per_s"], "mfu": report.get("mfu")}
    return RunView(
        run_dir=run_dir,
        now=now,
        name=str(name),
        status=status,
        ended=ended,
        total_steps=total,
        step=step,
        row=row,
        row_age_s=None if row_time is None else max(0.0, now - row_time),
        eta_s=eta_s,
        stale_after_s=stale_after_s,
        note=_report_note(report) if report is not None else None,
        moe=moe,
        ranks=ranks,
        hosts=_host_lines(run_dir / "system", now),
    )


# -- drawing ------------------------------------------------------------------------------
def _age(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 60 else format_duration(seconds)


def _seconds(value: Any) -> str:
    s = _num(value)
    return "n/a" if s is None else f"{s:.3f} s" if s < 10 else f"{s:.1f} s"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{format_bytes(value)}/s"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "~"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]  # fmt: skip


def _per_rank(row: dict[str, Any], key: str, rank: int) -> Any:
    values = row.get(key)
    return values[rank] if isinstance(values, list) and rank < len(values) else None


def _memory(record: dict[str, Any], fallback: Any) -> str:
    memory = record.get("memory") if isinstance(record.get("memory"), dict) else {}
    allocated = _num(memory.get("cuda_allocated_bytes"))
    if allocated is not None:
        return f"{format_bytes(allocated)} / {format_bytes(memory.get('cuda_reserved_bytes'))}"
    rss = _num(memory.get("rss_bytes"))
    if rss is not None:
        return f"{format_bytes(rss)} rss"
    return format_bytes(fallback)


def _rank_rows(view: RunView) -> list[list[str]]:
    rows = []
    live = view.status == "running"
    for line in view.ranks:
        r = line.record or {}
        if line.record is None or line.problem == "earlier run":
            age = _age(line.age_s) if line.record is not None else "n/a"
            host = str(r.get("host") or "n/a")[:14]
            rows.append([str(line.rank), host, "n/a", "n/a", "n/a", "n/a", line.problem or "", age])
            continue
        phase = str(r.get("phase") or "n/a")[:18]
        # how long the rank had been in its phase when it wrote the record (the record's
        # own age is the last column): a phase that lasts is a rank stuck in it
        since, written = _num(r.get("phase_since")), _num(r.get("time"))
        if live and r.get("status") == "running" and since is not None and written is not None:
            phase += f" {_age(max(0.0, written - since))}"
        step_time = r.get("step_time_s")
        if _num(step_time) is None:
            step_time = _per_rank(view.row, "step_time_s_per_rank", line.rank)
        step = _num(r.get("step"))
        rows.append([
            str(line.rank),
            str(r.get("host") or "n/a")[:14],
            "n/a" if step is None else str(int(step)),
            phase,
            _seconds(step_time),
            _memory(r, _per_rank(view.row, "memory_bytes_per_rank", line.rank)),
            str(r.get("status") or "n/a"),
            _age(line.age_s) + (" STALE" if line.stale else ""),
        ])  # fmt: skip
    return rows


def _net(net: Any) -> tuple[str, str, str]:
    """(rx, tx, busiest link's utilisation), summed over the non-loopback interfaces; or
    loopback's, marked "lo", when it is all there is (or all that moves: one host's ranks
    talk over loopback)."""
    if not isinstance(net, dict):
        return "n/a", "n/a", "n/a"
    ifaces = {str(k): v for k, v in net.items() if isinstance(v, dict)}
    loop = {k: v for k, v in ifaces.items() if _LOOPBACK.fullmatch(k)}
    wire = {k: v for k, v in ifaces.items() if k not in loop}

    def total(group: dict[str, Any], key: str) -> float | None:
        values = [v for i in group.values() if (v := _num(i.get(key))) is not None]
        return sum(values) if values else None

    keys = ("rx_bytes_per_s", "tx_bytes_per_s")
    moves = any(total(wire, k) for k in keys) or not any(total(loop, k) for k in keys)
    shown, mark = (wire, "") if wire and moves else (loop, "lo ")
    if not shown:
        return "n/a", "n/a", "n/a"
    rx, tx = (total(shown, k) for k in keys)
    utils = [(u, k) for k, i in shown.items() if (u := _num(i.get("utilization"))) is not None]
    link = f"{format_percent(max(utils)[0])} {max(utils)[1]}" if utils else "n/a"
    return (
        "n/a" if rx is None else mark + _rate(rx),
        "n/a" if tx is None else mark + _rate(tx),
        link,
    )


def _host_rows(view: RunView) -> tuple[list[list[str]], list[str]]:
    rows, gpu_lines = [], []
    for host in view.hosts:
        s = host.sample
        if s is None:
            rows.append([host.name[:16], "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"])
            continue
        cpu = _num(s.get("cpu_percent"))
        used, total = s.get("mem_used_bytes"), s.get("mem_total_bytes")
        rx, tx, link = _net(s.get("net"))
        memory = "n/a" if _num(used) is None else f"{format_bytes(used)} / {format_bytes(total)}"
        cells = [host.name[:16], "n/a" if cpu is None else f"{cpu:.0f}%", memory, rx, tx, link]
        rows.append([*cells, _age(host.age_s)])
        for gpu in s.get("gpus") or []:
            if isinstance(gpu, dict):
                gpu_lines.append(_gpu_line(host.name, gpu))
    return rows, gpu_lines


def _gpu_line(host: str, gpu: dict[str, Any]) -> str:
    util, temp, power = (_num(gpu.get(k)) for k in ("utilization_percent", "temperature_c",
                                                     "power_w"))  # fmt: skip
    parts = [
        f"  {host[:16]} gpu {gpu.get('index', '?')} {str(gpu.get('name') or '')[:28]}".rstrip(),
        "util n/a" if util is None else f"util {util:.0f}%",
        f"mem {format_bytes(gpu.get('memory_used_bytes'))} / "
        f"{format_bytes(gpu.get('memory_total_bytes'))}",
        "n/a C" if temp is None else f"{temp:.0f} C",
        "n/a W" if power is None else f"{power:.0f} W",
    ]
    return "  ".join(parts)


def _progress(view: RunView) -> str:
    step = "n/a" if view.step is None else str(view.step)
    total = "n/a" if view.total_steps is None else str(view.total_steps)
    text = f"step {step}/{total}"
    if view.step is not None and view.total_steps:
        fraction = min(1.0, view.step / view.total_steps)
        filled = round(20 * fraction)
        text += f" [{'#' * filled}{'.' * (20 - filled)}] {format_percent(fraction)}"
    return text


def moe_line(moe: dict[str, Any]) -> str:
    """`experts: max/mean load 1.31 (layer 1), dropped 0.0%, aux loss 1.0207 (step 10)`:
    a row's moe section, its worst layer's balance first."""
    step = _num(moe.get("step"))
    return "experts: " + moe_summary_text(moe) + ("" if step is None else f" (step {int(step)})")


def format_frame(view: RunView, width: int = 100) -> str:
    """One frame of `meshforge top` as plain text, each line at most `width` columns."""
    clock = time.strftime("%H:%M:%S", time.localtime(view.now))
    title = f"meshforge top: {view.name}  ({view.run_dir})"
    title = _cut(title, width - len(clock) - 2).ljust(width - len(clock) - 2) + "  " + clock
    row = view.row
    loss, tokens = _num(row.get("loss")), _num(row.get("tokens_per_s"))
    metrics = [
        "loss n/a" if loss is None else f"loss {loss:.4f}",
        f"tokens/s {'n/a' if tokens is None else f'{tokens:,.0f}'}",
        f"MFU {format_percent(_num(row.get('mfu')))}",
    ]
    if row:
        metrics.append(f"(metrics at step {row.get('step')}, {_age(view.row_age_s)} old)")
    else:
        metrics.append("(no metrics yet)")
    eta = "-" if view.status != "running" else format_duration(view.eta_s)
    lines = [
        title,
        f"status {view.status}   {_progress(view)}   ETA {eta}",
        "   ".join(metrics),
    ]
    if view.moe is not None:
        lines.append(moe_line(view.moe))
    if view.note:
        lines.append(view.note)
    lines.append("")
    if view.ranks:
        header = ["rank", "host", "step", "phase", "step time", "memory", "status", "record age"]
        lines += _table(header, _rank_rows(view))
        if any(line.stale for line in view.ranks):
            lines.append(
                f"STALE: a running rank's record is older than {view.stale_after_s:.1f} s "
                f"(3 x observe.flight_every_s): it may hang; see meshforge diagnose"
            )
    else:
        lines.append("ranks: n/a (no flight records in health/ yet)")
    lines.append("")
    host_rows, gpu_lines = _host_rows(view)
    if host_rows:
        header = ["host", "cpu", "memory", "net rx", "net tx", "link", "sample age"]
        lines += _table(header, host_rows) + gpu_lines
    else:
        lines.append("hosts: n/a (no system samples in system/)")
    return "\n".join(_cut(line, width) for line in lines)


def render_frame(run_dir: Path, now: float | None = None, width: int = 100) -> str:
    """The frame `meshforge top RUN_DIR` draws at `now`: plain text, no escape codes."""
    return format_frame(read_run(run_dir, now), width)


# -- the loop -----------------------------------------------------------------------------
def watch(
    run_dir: Path, interval_s: float = 2.0, once: bool = False, out: TextIO | None = None
) -> int:
    """Draw RUN_DIR every `interval_s` until its run ends (then the last frame stays), or
    once. On a terminal each frame replaces the last; elsewhere frames follow one another,
    without escape codes. Ctrl-C ends it quietly. Returns the exit code (0)."""
    out = sys.stdout if out is None else out
    terminal = out.isatty()
    try:
        while True:
            width = shutil.get_terminal_size((100, 24)).columns if terminal else 100
            view = read_run(run_dir)
            frame = format_frame(view, max(40, width))
            out.write((_CLEAR + frame + "\n") if terminal else frame + "\n\n")
            out.flush()
            if once or view.ended:
                return 0
            time.sleep(interval_s)
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):
            out.write("\n")
            out.flush()
        return 0
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
