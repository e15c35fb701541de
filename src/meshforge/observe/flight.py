"""A flight record per rank: what it is doing, cheaply, for diagnosing a run afterwards.

Each rank keeps, in plain attributes that cost an assignment to update:

- its phase (data, forward_backward, optimizer, checkpoint, eval, report, ...) and
  since when, its step and when it last finished one;
- the torch.distributed call it is inside, if any, and how many it has made (every
  collective and point-to-point call through `torch.distributed` is counted by a thin
  wrapper), plus the process group's own collective sequence number, which also counts
  what DDP and FSDP issue from C++;
- its memory (resident set; on a GPU allocated and reserved), read when the record is
  written.

A background thread writes the record to RUN_DIR/health/flight-rank-K.json every few
seconds (atomically), and the worker writes it at once on an exception (an
out-of-memory error recorded as such) and at the end. A rank that stops writing while
its peers go on is the one that hangs; the rank with the lowest sequence number is
the one the others wait for (health/diagnose.py reads them)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge.fileio import write_text_atomic
from meshforge.rundir.flights import newest_world

# The torch.distributed calls counted: collectives, object collectives, point-to-point.
_WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",  # FSDP2's gathers
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",  # FSDP2's gradient reduction
    "broadcast",
    "broadcast_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "batch_isend_irecv",
)
# isend and irecv are not wrapped: torch.distributed.P2POp checks that its op *is*
# torch.distributed.isend or irecv, and the pipeline schedules captured the originals.

_current: FlightRecorder | None = None
_installed = False


def flight_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "health" / f"flight-rank-{rank}.json"


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "cannot allocate memory" in text


def _install_wrappers() -> None:
    """Count torch.distributed calls into the current recorder (installed once)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name in _WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*args, __fn=fn, __name=name, **kwargs):
            rec = _current
            if rec is None:
                return __fn(*args, **kwargs)
            rec.calls += 1
            rec.call, rec.call_since = __name, time.time()
            try:
                return __fn(*args, **kwargs)
            finally:
                rec.call = None

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapped.__name__ = name
        setattr(dist, name, wrapped)


def _group_sequence() -> int | None:
    try:
        group = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - not initialised, or a backend without it
        return None


def _memory(device: torch.device | None) -> dict[str, int | None]:
    out: dict[str, int | None] = {"rss_bytes": None}
    try:
        import psutil

        out["rss_bytes"] = psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001
        pass
    if device is not None and device.type == "cuda":
        try:
            out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
            out["cuda_reserved_bytes"] = torch.cuda.memory_reserved(device)
            out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        except Exception:  # noqa: BLE001
            pass
    return out


class FlightRecorder:
    """This rank's flight record. Updating it is attribute assignment; writing it is
    the background thread's job (every `every_s` seconds) and `write()`'s."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        every_s: float = 5.0,
        device: torch.device | None = None,
        enabled: bool = True,
    ) -> None:
        self.path = flight_path(run_dir, rank)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.every_s, self.enabled = every_s, enabled
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.started = time.time()
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.phase, self.phase_since = "start", self.started
        self.step: int | None = None
        self.step_time_s: float | None = None  # wall time of the last step
        self.last_progress = self.started
        self.call: str | None = None
        self.call_since: float | None = None
        self.calls = 0
        self.status = "running"
        self.error: str | None = None
        self.oom = False
        self.extra: dict[str, Any] = {}
        # what this rank's previous attempt reached (an elastic restart), read before
        # this attempt's first write replaces it
        self.previous = _read(self.path) if enabled else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- cheap updates, called from the training loop ------------------------------------
    def set_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.time()

    def progress(self, step: int, step_time_s: float | None = None) -> None:
        """`step` steps are done, the last in `step_time_s` seconds."""
        self.step, self.last_progress = step, time.time()
        if step_time_s is not None:
            self.step_time_s = step_time_s

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> FlightRecorder:
        global _current
        if not self.enabled:
            return self
        _install_wrappers()
        _current = self
        from meshforge.runtime.agree import host_of_rank

        where = host_of_rank()  # the address and node tell apart hosts sharing a name
        self.extra.update({"addr": where["addr"], "node": where["node"]})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread = threading.Thread(target=self._loop, name="meshforge-flight", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()

    def fail(self, exc: BaseException) -> None:
        """Record an exception (out-of-memory recognised) and write at once."""
        if self.status == "failed":
            return
        self.status = "failed"
        self.oom = is_oom(exc)
        self.error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
        self.write()

    def close(self, status: str | None = None) -> None:
        global _current
        if status is not None and self.status == "running":
            self.status = status
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, self.every_s))
        self.write()
        if _current is self:
            _current = None

    # -- the record ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": self.host,
            "pid": self.pid,
            "attempt": self.attempt,
            "status": self.status,
            "time": now,
            "started": self.started,
            "phase": self.phase,
            "phase_since": self.phase_since,
            "step": self.step,
            "step_time_s": self.step_time_s,
            "last_progress": self.last_progress,
            "call": self.call,
            "call_since": self.call_since if self.call else None,
            "calls": self.calls,
            "collective_seq": _group_sequence(),
            "memory": _memory(self.device),
            "error": self.error,
            "oom": self.oom,
            **self.extra,
        }

    def write(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            try:
                write_text_atomic(self.path, json.dumps(self.snapshot()))
            except OSError:
                pass  # a full or vanished disk must not take the rank down


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_flight_records(health: Path) -> list[dict[str, Any]]:
    """The newest launch's flight records (rundir/flights.py), in rank order."""
    records: dict[int, Any] = {}
    for path in sorted(Path(health).glob("flight-rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict):
            records[record.get("rank", 0)] = record
    return [records[k] for k in sorted(newest_world(records, Path(health).parent))]
