"""A timeline of chosen steps, every rank on one clock (Horovod's timeline, from
torch's profiler): `meshforge train ... --trace 5-7`, or observe.trace_steps.

Each rank profiles its traced steps (`StepTracer`: one profiler session per run of
consecutive steps, CPU activity plus CUDA on a GPU, and a "step N" span around each
step) and writes RUN_DIR/.trace/rank-K.json. After training, rank 0 merges the rank
files into RUN_DIR/trace.json (`merge_traces`), a Chrome trace-event file that
Perfetto (ui.perfetto.dev) and chrome://tracing open:

- one process per rank, named "rank K (host)"; its CPU threads, and its GPU streams
  as threads "GPU d stream s";
- timestamps on the wall clock: the profiler exports microseconds since its own base
  time (`baseTimeNanoseconds`, Unix time); each rank's events are moved onto the
  earliest base among the ranks, so ranks line up as far as their hosts' clocks agree;
- every event carries `args.kind`: "communication" (c10d, gloo, NCCL, functional
  collectives, FSDP gathers and reductions, point-to-point sends of a pipeline) or
  "compute" (everything else), and each "step N" span "step" (on a GPU the step
  also has a span on the device's row, covering the kernels it launched);
- CPU ops under a microsecond are left out: they are a third or more of the events and
  too short to see at any zoom that shows a step.

Step numbers are 1-based, as the progress line prints them. The spec and the merge
are plain Python; torch is imported only by the tracer.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from meshforge.fileio import write_text_atomic

TRACE_DIR = ".trace"
TRACE_FILE = "trace.json"


# -- the steps spec ----------------------------------------------------------------------


def steps_text(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5, 9"."""
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs(steps))


def runs(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive steps: [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if out and out[-1][1] == s - 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


# -- one rank ----------------------------------------------------------------------------


class StepTracer:
    """Profiles the traced steps of this rank. The trainer calls `begin(n)` before step
    n and `end(n)` after it (both no-ops for untraced steps), and `close()` after its
    loop. A profiler session spans each run of consecutive traced steps; the rank file
    is written when the last traced step ends (or at `close`, when the run stopped
    early)."""

    def __init__(self, run_dir: Path, rank: int, steps: list[int], device: Any) -> None:
        self.path = Path(run_dir) / TRACE_DIR / f"rank-{rank}.json"
        self.rank, self.steps, self.device = rank, set(steps), device
        self._last = max(steps, default=0)
        self._prof: Any = None
        self._span: Any = None
        self._base_ns: int | None = None  # the first session's base: this rank file's
        self._events: list[dict[str, Any]] = []
        self._traced: list[int] = []  # a resumed run traces only the steps it trains
        if self.steps:
            self.path.unlink(missing_ok=True)  # an earlier attempt's, never merged with ours

    def traces(self, step: int) -> bool:
        return step in self.steps

    def begin(self, step: int) -> None:
        if step not in self.steps:
            return
        if self._prof is None:
            self._start()
        import torch

        self._span = torch.profiler.record_function(f"step {step}")
        self._span.__enter__()
        self._traced.append(step)

    def end(self, step: int) -> None:
        if step not in self.steps or self._prof is None:
            return
        self._close_span()
        if step + 1 not in self.steps:  # the end of a run of consecutive steps
            self._stop()
        if step == self._last:
            self._write()

    def merge(self, world_size: int) -> Path | None:
        """On rank 0, once every rank has written its file: RUN_DIR/trace.json."""
        if not self.steps:
            return None
        path = merge_traces(self.path.parent.parent, world_size)
        if path is not None:
            what = "step" if len(self._traced) == 1 else "steps"
            print(f"meshforge: timeline of {what} {steps_text(self._traced)}: {path}", flush=True)
        return path

    def close(self) -> None:
        """After the loop: a session still open (the run stopped inside a traced run of
        steps) is stopped, and what was recorded is written."""
        if self._prof is not None:
            self._close_span()
            self._stop()
        if self._events:
            self._write()

    # -- the profiler ---------------------------------------------------------------------
    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        from meshforge.observe.comm_time import quiet_native_stderr

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities)
        with quiet_native_stderr():
            self._prof.start()

    def _close_span(self) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None

    def _stop(self) -> None:
        import torch

        from meshforge.observe.comm_time import quiet_native_stderr

        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels of the last step, complete
        with quiet_native_stderr():
            prof.stop()
        part = self.path.with_suffix(".part.json")
        part.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(part))
        try:
            doc = json.loads(part.read_text())
        finally:
            part.unlink(missing_ok=True)
        base_ns = int(doc.get("baseTimeNanoseconds", 0))
        if self._base_ns is None:
            self._base_ns = base_ns
        shift_us = (base_ns - self._base_ns) / 1e3
        for ev in doc.get("traceEvents", []):
            if shift_us and "ts" in ev:
                ev["ts"] = float(ev["ts"]) + shift_us
            self._events.append(ev)

    def _write(self) -> None:
        doc = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),  # the CPU events' pid; other integer pids are devices
            "steps": self._traced,
            "baseTimeNanoseconds": self._base_ns or 0,
            "traceEvents": self._events,
        }
        write_text_atomic(self.path, json.dumps(doc, separators=(",", ":")))
        self._events = []


# -- the merge (rank 0, after training) --------------------------------------------------

_COMM = re.compile(
    r"^(c10d::|c10d_functional::|_c10d_functional|gloo:|nccl|record_param_comms|"
    r"ProcessGroup)|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
    r"post_backward_reduce|rs_wait|backward_prefetch|isend|irecv|\bsend\b|\brecv",
    re.IGNORECASE,
)
_STEP = re.compile(r"^step (\d+)$")
# profiler bookkeeping that only inflates the file
_DROP_ARGS = ("Ev Idx", "Record function id", "Fwd thread id")
# CPU ops shorter than this (views, strides, empty tensors: over a third of all events,
# invisible at any zoom that shows a step) are left out of the merged file
MIN_CPU_OP_US = 1.0
_GPU_TID = 1_000_000_000  # device streams, as threads of the rank's process


def event_kind(name: str) -> str:
    """ "communication" for collectives and point-to-point transfers, else "compute"."""
    return "communication" if _COMM.search(name) else "compute"


def merge_traces(run_dir: Path, world_size: int) -> Path | None:
    """Merge RUN_DIR/.trace/rank-K.json of every rank into RUN_DIR/trace.json and remove
    the rank files. Returns the path, or None when no rank traced a step (every traced
    step came before a resumed run's start). A rank whose file is missing (on another
    node, without a shared run directory) is named in the file's
    otherData.missing_ranks, and the rank files are kept for a later merge."""
    run_dir = Path(run_dir)
    docs, missing = [], []
    for rank in range(world_size):
        path = run_dir / TRACE_DIR / f"rank-{rank}.json"
        try:
            docs.append(json.loads(path.read_text()))
        except FileNotFoundError:
            missing.append(rank)
    docs = [d for d in docs if d["traceEvents"]]
    if not docs:
        return None
    base_ns = min(d["baseTimeNanoseconds"] for d in docs)
    events: list[dict[str, Any]] = []
    for doc in docs:
        events += _rank_events(doc, (doc["baseTimeNanoseconds"] - base_ns) / 1e3)
    timed = [e["ts"] for e in events if "ts" in e and e.get("ph") != "M"]
    start_us = min(timed, default=0.0)
    for e in events:  # the timeline starts at 0; the base says when that was
        if "ts" in e:
            e["ts"] = round(max(0.0, e["ts"] - start_us), 3)
    merged = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base_ns + int(start_us * 1e3),
        "otherData": {
            "producer": "meshforge",
            "steps": sorted({s for d in docs for s in d["steps"]}),
            "world_size": world_size,
            "ranks": sorted(d["rank"] for d in docs),
            "missing_ranks": missing,
        },
    }
    out = run_dir / TRACE_FILE
    write_text_atomic(out, json.dumps(merged, separators=(",", ":")))
    if not missing:  # else kept, to merge again once the others' files are copied in
        for doc in docs:
            (run_dir / TRACE_DIR / f"rank-{doc['rank']}.json").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (run_dir / TRACE_DIR).rmdir()
    return out


def _rank_events(doc: dict[str, Any], shift_us: float) -> list[dict[str, Any]]:
    """One rank's events as one process (pid = rank) on the merged clock, tagged."""
    rank, cpu_pid = doc["rank"], doc["pid"]
    out: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": rank,
            "tid": 0,
            "args": {"name": f"rank {rank} ({doc['host']})"},
        },
        {
            "ph": "M",
            "name": "process_sort_index",
            "pid": rank,
            "tid": 0,
            "args": {"sort_index": rank},
        },
    ]
    streams: set[tuple[int, int]] = set()
    for ev in doc["traceEvents"]:
        pid, ph = ev.get("pid"), ev.get("ph")
        # kineto's own spans and markers ("Spans", "Traces", a global "Record Window
        # End") are not the program's; neither are its per-process labels
        if not isinstance(pid, int) or isinstance(pid, bool) or ph == "i":
            continue
        if ph == "M" and ev.get("name") not in ("thread_name", "thread_sort_index"):
            continue
        if ev.get("cat") == "Trace":
            continue
        ev = dict(ev)
        if pid != cpu_pid:  # a device: its streams become threads of this rank
            tid = ev.get("tid", 0)
            tid = tid if isinstance(tid, int) else 0
            streams.add((pid, tid))
            if ph == "M":
                continue  # named below
            ev["tid"] = _GPU_TID + pid * 1_000_000 + tid
        ev["pid"] = rank
        if "ts" in ev:
            ev["ts"] = float(ev["ts"]) + shift_us
        if ph in ("s", "f", "t") and "id" in ev:  # flow ids are per profile
            ev["id"] = _flow_id(rank, ev["id"])
        if "bind_id" in ev:
            ev["bind_id"] = _flow_id(rank, ev["bind_id"])
        if ph == "X":
            args = {k: v for k, v in (ev.get("args") or {}).items() if k not in _DROP_ARGS}
            step = _STEP.match(ev.get("name", ""))
            if step and ev.get("cat") in ("user_annotation", "gpu_user_annotation"):
                args.update(kind="step", step=int(step.group(1)))
            else:
                args["kind"] = event_kind(ev.get("name", ""))
            short = ev.get("cat") == "cpu_op" and float(ev.get("dur", 0)) < MIN_CPU_OP_US
            if short and args["kind"] == "compute":
                continue
            ev["args"] = args
        out.append(ev)
    for device, stream in sorted(streams):
        out.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": rank,
                "tid": _GPU_TID + device * 1_000_000 + stream,
                "args": {"name": f"GPU {device} stream {stream}"},
            }
        )
    return out


def _flow_id(rank: int, flow: Any) -> Any:
    return rank * (1 << 40) + flow if isinstance(flow, int) else f"{rank}:{flow}"
