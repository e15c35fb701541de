"""The evidence a run leaves in its run directory, read into one view per rank.

- health/flight-rank-K.json: each rank's flight record (observe/flight.py): status,
  phase, steps done, the torch.distributed call it is in, the process group's
  collective sequence number, its memory, when it was last written;
- health/failure-rank-K.json: the error a rank recorded itself (train/worker.py);
- the elastic agent's record of how each local process ended, exit code or signal
  (health/diagnosis.json, or `failure` in report.json; launch/local.py);
- report.json (status, hosts, stragglers, a stop, restarts) and config.yaml (the
  timeouts and the flight record's period);
- when report.json names stragglers: why, where the metrics rows say
  (`straggler_causes`, e.g. a rank whose experts got most of the routed tokens);
- for a run that looks live: whether anything holds its run directory (RUN_DIR/.lock,
  runtime/runlock.py; nothing does once its launcher and workers are gone) and the
  step of the newest metrics.jsonl row.

Records of an earlier attempt or launch in the same run directory are left out: a
failure record older than its rank's flight record, an agent record older than the
flight records' start. Nothing here imports torch: `meshforge diagnose` answers at once.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshforge.errors import MeshforgeError
from meshforge.rundir.failures import recorded_failures
from meshforge.rundir.flights import newest_world
from meshforge.rundir.records import tail_rows
from meshforge.rundir.report import read_report_or_none

_OOM_TEXT = ("outofmemoryerror", "out of memory", "cannot allocate memory", "memoryerror")
_TIMEOUT_TEXT = ("timed out", "timeout", "deadline exceeded")
_CONNECTION_TEXT = (
    "connection reset",
    "reset by peer",
    "closed by peer",
    "connection closed",
    "connection was likely closed",
    "broken pipe",
    "connection refused",
    "connectfullmesh",
    "no route to host",
    "network is unreachable",
    "host is unreachable",
)


class NotARunDirectory(MeshforgeError):
    """The path holds no run: no config.yaml, report.json or health/ records."""


def error_kind(text: str | None) -> str | None:
    """oom, timeout, connection (a peer's broken connection) or own (anything else)."""
    if not text:
        return None
    low = text.lower()
    if any(m in low for m in _OOM_TEXT):
        return "oom"
    if any(m in low for m in _TIMEOUT_TEXT):
        return "timeout"
    if any(m in low for m in _CONNECTION_TEXT):
        return "connection"
    return "own"


def signal_of(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass
class Rank:
    """One rank as the evidence shows it (flight record, own failure, agent's record)."""

    rank: int
    flight: dict[str, Any] = field(default_factory=dict)
    failure: dict[str, Any] | None = None  # health/failure-rank-K.json
    agent: dict[str, Any] | None = None  # the agent's entry: exit code, signal, error
    host: dict[str, Any] = field(default_factory=dict)  # host, addr, node when known

    @property
    def status(self) -> str:
        return self.flight.get("status") or ("failed" if self.failure else "unknown")

    @property
    def error(self) -> str | None:
        if self.failure and self.failure.get("error"):
            return self.failure["error"]
        if self.flight.get("error"):
            return self.flight["error"]
        if self.agent and self.agent.get("exitcode", 0) >= 0:
            err = self.agent.get("error") or ""
            return None if err.startswith("no error recorded") else err or None
        return None

    @property
    def kind(self) -> str | None:
        if self.flight.get("oom"):
            return "oom"
        return error_kind(self.error)

    @property
    def signal(self) -> str | None:
        return signal_of((self.agent or {}).get("exitcode"))

    @property
    def failed_at(self) -> float | None:
        if self.failure and self.failure.get("time"):
            return float(self.failure["time"])
        return self.flight.get("time") if self.status == "failed" else None

    @property
    def steps_done(self) -> int:
        return int(self.flight.get("step") or 0)

    @property
    def seq(self) -> int | None:
        return self.flight.get("collective_seq")

    @property
    def pid(self) -> int | None:
        return self.flight.get("pid") or (self.agent or {}).get("pid")

    def group(self) -> tuple:
        """What tells this rank's host apart: the launcher's node number, else name and
        address (namespace hosts share a name but not an address)."""
        h = self.host
        if h.get("node") is not None:
            return ("node", h["node"])
        return (h.get("host"), h.get("addr"))


@dataclass
class Evidence:
    run_dir: Path
    ranks: dict[int, Rank]
    config: dict[str, Any]
    report: dict[str, Any] | None
    agent: dict[str, Any] | None  # {first_failure, failures, time}
    stopped_by: str | None
    now: float  # the moment the evidence describes: the last record, or now for a live run
    live: bool  # no failure, stop or completion recorded: the run may still be going
    missing: list[int] = field(default_factory=list)  # ranks of the world with no record
    # while live: whether a process holds the run directory (None: cannot be told), and
    # the step of the newest metrics row (it may be ahead of the flight records)
    held: bool | None = None
    logged_step: int | None = None
    # rank -> why the metrics rows say it straggled (read when report.json names one)
    straggler_causes: dict[int, dict[str, Any]] = field(default_factory=dict)

    def setting(self, section: str, key: str, default: Any) -> Any:
        value = (self.config.get(section) or {}).get(key)
        return default if value is None else value

    @property
    def timeout_s(self) -> float:
        """The collective timeout in force: start-up's until the first step is done."""
        started = any(r.steps_done > 0 for r in self.ranks.values())
        step_timeout = self.setting("runtime", "step_timeout_s", 120.0)
        return float(step_timeout if started and step_timeout else self.setting(
            "runtime", "timeout_s", 300.0))  # fmt: skip

    @property
    def stale_s(self) -> float:
        """A flight record this much older than the newest one has stopped being written."""
        every = float(self.setting("observe", "flight_every_s", 5.0))
        return max(3 * every, 0.5 * self.timeout_s)

    def age(self, r: Rank) -> float | None:
        t = r.flight.get("time")
        return None if t is None else max(0.0, self.now - t)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def straggler_causes(metrics: Path) -> dict[int, dict[str, Any]]:
    """Rank -> why the metrics rows say it straggled: {"cause": the newest row's text,
    "intervals": logged intervals that gave a cause, "named": intervals that named it a
    straggler, "steps": [first, last] step with a cause}. Read line by line (a long run's
    file is large); a line that is not a JSON object is skipped."""
    causes: dict[int, dict[str, Any]] = {}
    named: dict[int, int] = {}
    try:
        with open(metrics, "rb") as f:
            for line in f:
                if b"straggler" not in line:
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(row, dict):
                    continue
                for rank in row.get("stragglers") or []:
                    if isinstance(rank, int):
                        named[rank] = named.get(rank, 0) + 1
                found = row.get("straggler_causes")
                for key, cause in found.items() if isinstance(found, dict) else ():
                    if not str(key).isdigit() or not isinstance(cause, str):
                        continue
                    entry = causes.setdefault(int(key), {"intervals": 0, "steps": [None, None]})
                    entry["cause"] = cause
                    entry["intervals"] += 1
                    step = row.get("step")
                    if isinstance(step, int):
                        entry["steps"] = [entry["steps"][0] or step, step]
    except OSError:
        return {}
    for rank, entry in causes.items():
        entry["named"] = max(named.get(rank, 0), entry["intervals"])
    return causes


def collect(
    run_dir: Path, agent_failures: dict | None = None, stopped_by: str | None = None
) -> Evidence:
    run_dir = Path(run_dir).absolute()
    health = run_dir / "health"
    if not run_dir.is_dir():
        raise NotARunDirectory(f"{run_dir}: no such directory")
    if not any((run_dir / p).exists() for p in ("config.yaml", "report.json", "health")):
        raise NotARunDirectory(
            f"{run_dir} is not a meshforge run directory (no config.yaml, report.json or health/)"
        )
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    report = read_report_or_none(run_dir)
    agent = agent_failures or _read_json(health / "diagnosis.json")
    if agent is None and report and isinstance(report.get("failure"), dict):
        agent = report["failure"]
    ranks: dict[int, Rank] = {}

    def rank(k: int) -> Rank:
        return ranks.setdefault(k, Rank(k))

    flights: dict[int, Any] = {}
    for path in sorted(health.glob("flight-rank-*.json")):
        record = _read_json(path)
        if record is not None and isinstance(record.get("rank"), int):
            flights[record["rank"]] = record
    for k, record in newest_world(flights, run_dir).items():  # not a rank an earlier launch had
        rank(k).flight = record
    flight_times = [r.flight["time"] for r in ranks.values() if r.flight.get("time")]
    started = min((r.flight.get("started") or 0 for r in ranks.values()), default=0)
    if agent is not agent_failures and (agent or {}).get("time", started) < started:
        agent = None  # a record of an earlier launch in the same run directory
    for record in recorded_failures(health) if health.is_dir() else []:
        # a failure record older than this attempt's flight record is an earlier attempt's
        r = rank(int(record["rank"]))
        if record.get("time", 0) >= r.flight.get("started", 0):
            r.failure = record
    for entry in (agent or {}).get("failures") or []:
        if isinstance(entry.get("rank"), int):
            rank(entry["rank"]).agent = entry
    hosts = (report or {}).get("hosts") or []
    for r in ranks.values():
        known = hosts[r.rank] if r.rank < len(hosts) and isinstance(hosts[r.rank], dict) else {}
        r.host = {
            "host": r.flight.get("host") or known.get("host"),
            "addr": r.flight.get("addr") or known.get("addr"),
            "node": r.flight.get("node", known.get("node")),
        }
    failed = agent is not None or any(r.status == "failed" for r in ranks.values())
    finished = report is not None and report.get("status") in (
        "completed",
        "stopped",
        "interrupted",  # the launcher's report of a stop its workers could not confirm
    )
    live = not failed and not finished and stopped_by is None
    stamps = flight_times + [r.failure["time"] for r in ranks.values() if r.failure]
    now = time.time() if live or not stamps else max(stamps)
    world = max((r.flight.get("world_size") or 0 for r in ranks.values()), default=0)
    missing = [k for k in range(world) if k not in ranks]
    ev = Evidence(run_dir, ranks, config, report, agent, stopped_by, now, live, missing)
    if (report or {}).get("stragglers"):
        ev.straggler_causes = straggler_causes(run_dir / "metrics.jsonl")
    if live and agent_failures is None:  # not the launcher (which holds the directory)
        from meshforge.runtime.runlock import is_held

        ev.held = is_held(run_dir)
        steps = [row.get("step") for row in tail_rows(run_dir / "metrics.jsonl")[-1:]]
        ev.logged_step = next((int(s) for s in steps if isinstance(s, int | float)), None)
    return ev
