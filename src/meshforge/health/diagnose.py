"""What happened to a run, in one verdict, from what it left in its run directory
(health/evidence.py reads it: flight records, the ranks' own errors, the agent's exit
codes and signals, report.json, config.yaml).

The verdict, in this order:

- `oom`: a rank recorded an out-of-memory error.
- `rank_crashed`: a rank failed with an error of its own (not a peer's broken
  connection or a timeout), or was killed by a signal nobody in the job sent: SIGSEGV
  and the like, or a SIGKILL while its peers saw their connections to it break.
- `network_partition`: ranks on more than one host, every one of them alive and timing
  out on the others in the same collective (or reporting the other host's address as
  unreachable), or the ranks of one host going silent together with no exit their
  agent saw. The host named is the one cut off from global rank 0's side.
- `hang`: peers timed out while a rank did not fail: it stopped writing its flight
  record (a stopped process) or kept writing it without entering the collective the
  others were in (stuck in its own code). The lowest collective sequence is the rank
  the others waited for.
- `straggler`: the run completed and named a rank consistently slower than the median,
  with the cause where the metrics rows give one (`straggler_causes`: a rank holding
  the experts that got most of a mixture-of-experts model's tokens), and advice for it.
- `ok`: the run completed. `stopped`: a SIGTERM or Ctrl-C stopped it (with the step it
  checkpointed). `ended`: no report, failure or stop was recorded and nothing holds the
  run directory any more: its launcher and workers were killed (SIGKILL, a lost node).
  `running`: no failure yet, the ranks make progress and the run directory is held.
  `unknown`: nothing to go on.

`diagnose_run` returns a dict: verdict, a one-line summary, the ranks and hosts to
blame, the evidence (one row per rank, and who waited for whom) and advice.
`write_diagnosis` is what the launcher calls when a run fails or is stopped (it
writes health/diagnosis.json); `meshforge diagnose RUN_DIR` prints it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from meshforge.health.evidence import Evidence, Rank, collect
from meshforge.rundir.failures import describe_exit

VERDICTS = (
    "rank_crashed",
    "oom",
    "network_partition",
    "hang",
    "straggler",
    "ok",
    "stopped",
    "ended",
    "running",
    "unknown",
)

# Phases inside a training step (a rank in one of them is working on step done + 1).
_STEP_PHASES = {"data", "forward", "backward", "forward_backward", "optimizer", "metrics", "eval"}
_IPV4 = re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3})\b")


# --- judging ---------------------------------------------------------------------------


def diagnose_run(
    run_dir: Path, agent_failures: dict | None = None, stopped_by: str | None = None
) -> dict[str, Any]:
    """The diagnosis of RUN_DIR. `agent_failures`: the elastic agent's failure record
    (first_failure, failures) when the launcher has one in hand; `stopped_by`: the
    signal that stopped the launcher (SIGTERM, SIGINT). Afterwards the launcher's own
    record of a stop (health/diagnosis.json, newer than every flight record) says which
    signal it was, so a later `meshforge diagnose` agrees with it."""
    if stopped_by is None and agent_failures is None:
        stopped_by = _recorded_stop(Path(run_dir) / "health")
    return judge(collect(run_dir, agent_failures, stopped_by))


def _recorded_stop(health: Path) -> str | None:
    path = health / "diagnosis.json"
    try:
        record = json.loads(path.read_text())
        written = path.stat().st_mtime
        flights = [p.stat().st_mtime for p in health.glob("flight-rank-*.json")]
    except (OSError, ValueError):
        return None
    if record.get("verdict") != "stopped" or any(t > written for t in flights):
        return None
    return record.get("stopped_by") or "a signal"


def write_diagnosis(
    run_dir: Path, agent_failures: dict | None = None, stopped_by: str | None = None
) -> dict[str, Any]:
    """The launcher's side: the agent's record (time, first_failure, failures, kept as
    they are) with the diagnosis added, written to RUN_DIR/health/diagnosis.json and
    returned. A diagnosis that cannot be made never hides the failure itself: the
    agent's record is written alone, with the reason."""
    from meshforge.fileio import write_text_atomic

    record = dict(agent_failures or {})
    if stopped_by is not None:
        record["stopped_by"] = stopped_by
    try:
        record.update(diagnose_run(run_dir, agent_failures, stopped_by))
    except Exception as exc:  # noqa: BLE001 - the failure being reported matters more
        logging.getLogger(__name__).warning("no diagnosis: %s", exc)
        record["diagnosis_error"] = f"{type(exc).__name__}: {exc}"
    health = Path(run_dir) / "health"
    try:
        health.mkdir(parents=True, exist_ok=True)
        write_text_atomic(health / "diagnosis.json", json.dumps(record, indent=2))
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot write %s: %s", health, exc)
    return record


def judge(ev: Evidence) -> dict[str, Any]:
    # a report counts when every rank finished after writing it (not an earlier run's)
    current = all(r.status == "finished" for r in ev.ranks.values())
    status = (ev.report or {}).get("status") if current else None
    if status == "completed" and ev.stopped_by is None:
        return _completed(ev)
    if ev.stopped_by or status in ("stopped", "interrupted"):
        return _stopped(ev, status == "stopped")
    if ev.live:
        if ev.held is False:  # nothing holds the run directory: nothing runs there
            return _ended_without_report(ev)
        return _live(ev)
    return _failed(ev)


def _failed(ev: Evidence) -> dict[str, Any]:
    ranks = list(ev.ranks.values())
    oom = [r for r in ranks if r.kind == "oom"]
    if oom:
        r = _earliest(oom)
        where = _where(ev, r)
        return _verdict(ev, "oom", [r], f"{_who(r)} ran out of memory {where}", _oom_advice(ev, r))
    own = [r for r in ranks if r.kind == "own"]
    if own:
        r = _earliest(own)
        return _verdict(ev, "rank_crashed", [r], f"{_who(r)} failed {_where(ev, r)}: {r.error}",
                        _crash_advice(ev, r))  # fmt: skip
    signalled = [r for r in ranks if r.signal and r.signal not in ("SIGTERM", "SIGKILL")]
    if signalled:
        return _crashed_by_signal(ev, signalled)
    kinds = {r.kind for r in ranks}
    # ranks that did not fail by themselves; the agent's own SIGTERMs last
    silent = sorted(
        (r for r in ranks if r.status == "running"), key=lambda r: (r.signal == "SIGTERM", r.rank)
    )
    killed = [r for r in silent if r.signal == "SIGKILL"]
    if killed and "timeout" not in kinds:  # its peers saw it go at once: not a hang
        return _crashed_by_signal(ev, killed)
    partition = _partition(ev)
    if partition is not None:
        return partition
    if "timeout" in kinds:
        return _hang(ev, silent)
    if silent:
        return _crashed_by_signal(ev, silent)
    first = (ev.agent or {}).get("first_failure") or {}
    blamed = [ev.ranks[first["rank"]]] if first.get("rank") in ev.ranks else []
    what = blamed and f"{_who(blamed[0])} failed {_where(ev, blamed[0])}: {blamed[0].error}"
    return _verdict(ev, "rank_crashed", blamed, what or "a rank failed; no record says which",
                    _crash_advice(ev, blamed[0] if blamed else None))  # fmt: skip


def _crashed_by_signal(ev: Evidence, ranks: list[Rank]) -> dict[str, Any]:
    r = ranks[0]
    sig = r.signal
    how = f"was killed by {sig}" if sig else "exited without recording an error"
    note = ""
    if sig == "SIGKILL":
        note = " (not by meshforge: the kernel's OOM killer, an operator or the scheduler)"
    return _verdict(ev, "rank_crashed", ranks, f"{_who(r)} {how} {_where(ev, r)}{note}",
                    _crash_advice(ev, r))  # fmt: skip


def _hang(ev: Evidence, silent: list[Rank]) -> dict[str, Any]:
    """Peers timed out. The ranks that did not fail themselves hung; failing that (every
    rank timed out), the ones with the lowest collective sequence, or the ones that left
    no record here."""
    blamed = silent or _lowest_seq(ev) or [Rank(k) for k in ev.missing]
    waiting = [r for r in ev.ranks.values() if r not in blamed and r.kind == "timeout"]
    if not blamed:
        seqs = {r.seq for r in ev.ranks.values()}
        same = f" in the same collective (seq {seqs.pop()})" if len(seqs) == 1 else ""
        summary = f"every rank timed out waiting{same}; none stands out"
        return _verdict(ev, "hang", [], summary, _hang_advice(ev, []))
    r = blamed[0]
    age = ev.age(r)
    if not r.flight:
        how = "it left no flight record here (written on another node?)"
    elif age is not None and age >= ev.stale_s:
        how = f"its flight record stopped {age:.0f} s before the last one written"
    else:
        how = f"it stayed outside the collective the others were in (its seq {r.seq})"
    if waiting:
        how += f"; rank(s) {', '.join(str(w.rank) for w in waiting)} timed out waiting for it"
    return _verdict(ev, "hang", blamed, f"{_who(r)} hung {_where(ev, r)}: {how}",
                    _hang_advice(ev, blamed))  # fmt: skip


def _partition(ev: Evidence) -> dict[str, Any] | None:
    """Ranks on several hosts, none failing by itself, all alive until they timed out on
    each other (or naming the far host's address, or going silent as one host)."""
    groups = _host_groups(ev)
    if len(groups) < 2:
        return None
    ranks = list(ev.ranks.values())
    if any(r.kind in ("own", "oom") for r in ranks):
        return None
    near = _near_group(ev, groups)
    far = [g for g in groups if g != near]
    near_seqs = {r.seq for r in groups[near]}
    peer_failure = ("timeout", "connection")
    mentioned = _mentioned_addrs(groups[near])
    if any(r.host.get("addr") in mentioned for g in far for r in groups[g]):
        cut = [g for g in far if any(r.host.get("addr") in mentioned for r in groups[g])]
        why = "the ranks on this side report its address unreachable"
    elif all(r.kind in peer_failure for r in ranks) and len({r.seq for r in ranks}) == 1:
        cut = far
        why = (
            "ranks on both sides were alive and timed out waiting for each other in the "
            f"same collective (seq {ranks[0].seq})"
        )
    else:
        # alive (or frozen together) in the collective the near side timed out in, with
        # no exit of theirs seen by the near side's agent
        cut = [
            g for g in far
            if all(r.status == "running" and not r.agent and r.seq in near_seqs
                   for r in groups[g])
        ]  # fmt: skip
        if not cut or not all(r.kind in peer_failure for r in groups[near]):
            return None
        why = (
            "its ranks did not answer in the collective the others timed out in (no failure "
            "of their own, no exit seen by the other side's agent)"
        )
    blamed = [r for g in cut for r in groups[g]]
    names = " and ".join(_host_label(groups[g][0]) for g in cut)
    summary = f"host {names} became unreachable {_where(ev, blamed[0])}: {why}"
    return _verdict(ev, "network_partition", blamed, summary, _partition_advice(ev, blamed))


def _host_groups(ev: Evidence) -> dict[tuple, list[Rank]]:
    """Ranks by host. Where the records cannot tell hosts apart, the agent's own ranks
    (it lists only the workers of its node) against the failed ranks it does not list."""
    groups: dict[tuple, list[Rank]] = {}
    for r in sorted(ev.ranks.values(), key=lambda r: r.rank):
        groups.setdefault(r.group(), []).append(r)
    if len(groups) > 1 or not ev.agent:
        return groups
    local = [r for r in ev.ranks.values() if r.agent]
    elsewhere = [r for r in ev.ranks.values() if not r.agent and r.status != "finished"]
    if local and elsewhere:
        return {("agent", 0): local, ("elsewhere", 1): elsewhere}
    return groups


def _near_group(ev: Evidence, groups: dict[tuple, list[Rank]]) -> tuple:
    """The side the job is run from: global rank 0's host (the store's side)."""
    for key, members in groups.items():
        if any(r.rank == 0 for r in members):
            return key
    return next(iter(groups))


def _mentioned_addrs(ranks: list[Rank]) -> set[str]:
    found: set[str] = set()
    for r in ranks:
        if r.kind in ("connection", "timeout"):
            found.update(_IPV4.findall(r.error or ""))
    return found - {"127.0.0.1"}


def _lowest_seq(ev: Evidence) -> list[Rank]:
    seqs = {r.seq for r in ev.ranks.values() if r.seq is not None}
    if len(seqs) < 2:
        return []
    low = min(seqs)
    return [r for r in ev.ranks.values() if r.seq == low]


def _completed(ev: Evidence) -> dict[str, Any]:
    report = ev.report or {}
    stragglers = report.get("stragglers") or []
    restarts = report.get("restarts") or []
    again = ""
    if restarts:
        redone = sum(r.get("steps_redone") or 0 for r in restarts)
        again = (
            f" after {len(restarts)} restart{'s' if len(restarts) > 1 else ''} (resumed "
            f"from step {restarts[-1].get('resumed_from')}, {redone} step(s) redone)"
        )
    if stragglers:
        worst = max(stragglers, key=lambda s: s.get("slowdown") or 0)
        blamed = [ev.ranks.get(s["rank"]) or Rank(s["rank"]) for s in stragglers]
        for b, s in zip(blamed, stragglers, strict=True):
            b.host = b.host or {"host": s.get("host")}
        summary = (
            f"the run completed{again}; {_who(blamed[stragglers.index(worst)])} was a "
            f"straggler: {worst.get('slowdown', 0):.2f}x the median rank's own work per step"
        )
        causes = {
            s["rank"]: ev.straggler_causes[s["rank"]]
            for s in stragglers
            if s["rank"] in ev.straggler_causes
        }
        cause = causes.get(worst["rank"])
        if cause is not None:
            summary += f"; cause: {cause['cause']}{_how_often(cause)}"
        advice = _straggler_advice(ev, stragglers, causes)
        result = _verdict(ev, "straggler", blamed, summary, advice)
        result["cause"] = cause["cause"] if cause is not None else None
        result["evidence"]["straggler_causes"] = {str(r): c for r, c in causes.items()}
        return result
    summary = f"the run completed {report.get('steps', '?')} steps" + (again or " without a fault")
    return _verdict(ev, "ok", [], summary, [])


def _stopped(ev: Evidence, reported: bool) -> dict[str, Any]:
    stopped = (ev.report or {}).get("stopped") if reported else None
    sig = ev.stopped_by or (stopped or {}).get("signal") or "a signal"
    if stopped:
        summary = (
            f"the run was stopped by {sig} after step {stopped['step']} with a checkpoint; "
            "the same command resumes from it"
        )
    else:
        again = (
            "resumes from the last checkpoint"
            if any((Path(ev.run_dir) / "checkpoints").glob("step-*"))
            else "starts over (no checkpoint was written)"
        )
        summary = (
            f"the run was stopped by {sig} before its workers confirmed a checkpoint; the "
            f"same command {again}"
        )
    result = _verdict(ev, "stopped", [], summary, [])
    result["step"] = (stopped or {}).get("step")
    return result


def _ended_without_report(ev: Evidence) -> dict[str, Any]:
    """No report, failure or stop recorded, and no process holds the run directory: the
    launcher and its workers ended without a word (SIGKILL, a lost node). Its last step
    is the furthest the records got: the flight records lag the metrics rows by up to
    observe.flight_every_s."""
    steps = [r.steps_done for r in ev.ranks.values()] + [ev.logged_step or 0]
    step = max(steps)
    again = (
        "resumes from its newest checkpoint"
        if any((Path(ev.run_dir) / "checkpoints").glob("step-*"))
        else "starts over (no checkpoint was written)"
    )
    at = f"after step {step}" if step else "before its first step"
    summary = (
        f"the run ended {at} without a report, and nothing holds its run directory: its "
        f"launcher and workers were killed (SIGKILL? a lost node?); the same command {again}"
    )
    advice = [
        "the kernel's OOM killer kills with SIGKILL: `dmesg | grep -i -e oom -e killed`",
        f"the ranks' logs: {ev.run_dir / 'logs'}",
    ]
    result = _verdict(ev, "ended", [], summary, advice)
    result["status"] = "ended without a report"
    result["step"] = step or None
    return result


def _live(ev: Evidence) -> dict[str, Any]:
    ranks = list(ev.ranks.values())
    if not ranks:
        return _verdict(ev, "unknown", [], "no flight record, failure or report yet", [])
    if all(r.status == "finished" for r in ranks):
        summary = "every rank finished, but there is no report.json (rank 0's log may say why)"
        return _verdict(ev, "unknown", [], summary, [])
    stale = [r for r in ranks if r.status == "running" and (ev.age(r) or 0) >= ev.stale_s]
    if stale and len(stale) == len(ranks):
        summary = (
            "every rank stopped writing its flight record without recording a failure: the "
            "job was ended from outside (launcher killed, node lost) or the records are not "
            "on this machine"
        )
        return _verdict(ev, "unknown", [], summary, [])
    if stale:
        return _hang(ev, stale)
    progress = max(r.flight.get("last_progress") or 0 for r in ranks)
    if ev.now - progress > ev.timeout_s:
        return _hang(ev, _lowest_seq(ev))
    step = min(r.steps_done for r in ranks)
    return _verdict(ev, "running", [], f"the run is in progress (step {step}); no fault seen", [])


# --- words -----------------------------------------------------------------------------


def _earliest(ranks: list[Rank]) -> Rank:
    return min(ranks, key=lambda r: (r.failed_at or float("inf"), r.rank))


def _host_label(r: Rank) -> str:
    host, addr = r.host.get("host") or "?", r.host.get("addr")
    return f"{host} ({addr})" if addr and addr != "127.0.0.1" else host


def _who(r: Rank) -> str:
    pid = f", pid {r.pid}" if r.pid else ""
    return f"rank {r.rank} (host {_host_label(r)}{pid})"


def _step_of(ev: Evidence, r: Rank) -> tuple[int, bool]:
    """(step, inside it): the step a rank was in when it failed (1-based), or the last
    one it finished. Ranks move in lockstep through the collectives: a peer that finished
    step N means this rank got that far, even if its own record was written earlier."""
    done = r.steps_done
    peers = [p.steps_done for p in ev.ranks.values() if p is not r and p.flight]
    if peers and min(peers) > done:
        return min(peers), False
    f = r.flight
    inside = f.get("phase") in _STEP_PHASES and (f.get("phase_since") or 0) >= (
        f.get("last_progress") or 0
    )
    return (done + 1, True) if inside else (done, False)


def _where(ev: Evidence, r: Rank) -> str:
    if not any(p.flight for p in ev.ranks.values()):
        return "at a step nothing recorded (observe.flight is off)"
    step, inside = _step_of(ev, r)
    if inside:
        return f"in {r.flight.get('phase')} at step {step}"
    if r.flight.get("phase") == "checkpoint" and step == r.steps_done:
        return f"checkpointing after step {step}"
    return f"after step {step}" if step else "before the first step"


def _log(ev: Evidence, r: Rank) -> str:
    return str((r.agent or {}).get("log") or ev.run_dir / "logs" / f"rank-{r.rank}.log")


def _oom_advice(ev: Evidence, r: Rank) -> list[str]:
    train = ev.config.get("train") or {}
    micro = train.get("micro_batch")
    mem = (r.flight.get("memory") or {}).get("cuda_max_allocated_bytes") or (
        r.flight.get("memory") or {}
    ).get("rss_bytes")
    peak = f" (it held {mem / 2**30:.2f} GiB)" if mem else ""
    return [
        f"rank {r.rank} ran out of memory{peak}: lower train.micro_batch"
        + (f" (now {micro}; the global batch stays, by gradient accumulation)" if micro else ""),
        "or recompute activations: train.activation_checkpointing: full",
        "or shard the model states across ranks: parallel.zero: 3 (or more ranks); "
        "`meshforge plan` estimates memory per rank before a run",
    ]


def _crash_advice(ev: Evidence, r: Rank | None) -> list[str]:
    if r is None:
        return [f"read the ranks' logs in {ev.run_dir / 'logs'}"]
    advice = [f"read rank {r.rank}'s log: {_log(ev, r)}"]
    if r.signal == "SIGKILL":
        advice.append(
            f"a SIGKILL nobody in the job sent: on host {_host_label(r)} look for the kernel's "
            "OOM killer (`dmesg | grep -i -e oom -e killed`) or the scheduler's limits"
        )
    elif r.signal:
        advice.append(f"{r.signal} is a crash in native code: the log's last lines, a core dump")
    advice.append("train.max_restarts: N restarts the workers from the newest checkpoint")
    return advice


def _hang_advice(ev: Evidence, blamed: list[Rank]) -> list[str]:
    advice = []
    for r in blamed[:4]:
        advice.append(
            f"while it hangs, `py-spy dump --pid {r.pid or 'PID'}` on host {_host_label(r)} "
            f"shows where rank {r.rank} is stuck"
        )
    advice += [
        "rerun with NCCL_DEBUG=INFO (and TORCH_DISTRIBUTED_DEBUG=DETAIL) to log the "
        "collective each rank enters",
        f"runtime.step_timeout_s (now {ev.timeout_s:.0f} s) bounds how long the others wait",
    ]
    return advice


def _partition_advice(ev: Evidence, blamed: list[Rank]) -> list[str]:
    far = ", ".join(sorted({_host_label(r) for r in blamed}))
    return [
        f"check the link to {far}: `ping`, `ip link` (is the interface up?)",
        "check firewalls: the rendezvous port and the ports gloo/NCCL open between nodes "
        "must accept TCP from every node",
        "pin the cluster network: --iface NAME (sets GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME); `meshforge preflight` checks reachability before a run",
    ]


def _how_often(cause: dict[str, Any]) -> str:
    n, named = cause.get("intervals") or 0, cause.get("named") or 0
    return f" (on {n} of the {named} logged intervals that named it)" if named > 1 else ""


def _straggler_advice(
    ev: Evidence, stragglers: list[dict[str, Any]], causes: dict[int, dict[str, Any]]
) -> list[str]:
    advice = []
    if any(str(c.get("cause", "")).startswith("hot experts") for c in causes.values()):
        advice += _hot_expert_advice(ev)
    hosts = ", ".join(sorted({str(s.get("host") or "?") for s in stragglers}))
    return advice + [
        f"look at {hosts}: other processes (top, nvidia-smi), clocks and thermal throttling, "
        "a slower device or link",
        "the metrics rows name stragglers per interval (metrics.jsonl: stragglers, own_s_per_rank)",
    ]


def _hot_expert_advice(ev: Evidence) -> list[str]:
    """What spreads a mixture-of-experts model's tokens over its experts (and ranks)."""
    model = ev.config.get("model") if isinstance(ev.config.get("model"), dict) else {}
    moe = model.get("moe") if isinstance(model.get("moe"), dict) else {}
    balance = moe.get("load_balance") or "aux_loss"
    experts, ep = moe.get("experts"), ev.setting("parallel", "ep", 1)
    advice = []
    if balance == "aux_loss":
        coeff = moe.get("aux_loss_coeff")
        coeff = coeff if isinstance(coeff, int | float) else 0.01
        advice.append(
            f"balance the router harder: a larger model.moe.aux_loss_coeff (now {coeff:g}; "
            f"try {10 * coeff:g}), or model.moe.load_balance: bias (DeepSeek-V3's per-expert "
            "routing bias, no loss term)"
        )
    elif balance == "bias":
        rate = moe.get("bias_update_rate")
        now = f" (now {rate:g})" if isinstance(rate, int | float) else ""
        advice.append(
            f"let the routing bias correct hot experts faster: a larger "
            f"model.moe.bias_update_rate{now}, or load_balance: aux_loss with a larger "
            "aux_loss_coeff"
        )
    else:
        advice.append(
            "balance the router: model.moe.load_balance: aux_loss (with aux_loss_coeff, "
            "e.g. 0.01) or bias (DeepSeek-V3's per-expert routing bias)"
        )
    cf = moe.get("capacity_factor")
    if cf is None:
        advice.append(
            "cap each expert's tokens: model.moe.capacity_factor (e.g. 1.25) drops what a "
            "hot expert gets beyond its capacity instead of making its rank wait (watch "
            "dropped_fraction in metrics.jsonl's moe section)"
        )
    else:
        advice.append(
            f"a lower model.moe.capacity_factor (now {cf:g}) caps the hot expert harder, at "
            "the cost of more dropped tokens"
        )
    if isinstance(experts, int) and isinstance(ep, int) and ep < experts:
        advice.append(
            f"more expert parallelism (parallel.ep, now {ep}; up to model.moe.experts="
            f"{experts}): fewer experts per rank, so the rank of a hot expert has less "
            "other expert work"
        )
    advice.append(
        "which experts are hot: report.html's Mixture of experts section, metrics.jsonl's "
        "moe.tokens_per_expert"
    )
    return advice


# --- the result ------------------------------------------------------------------------


def _waits(ev: Evidence, blamed: list[Rank]) -> list[dict[str, Any]]:
    """Who waited for whom: ranks further along the collective sequence (or that timed
    out) waited for the lowest sequence, or for the ranks to blame."""
    seqs = [r.seq for r in ev.ranks.values() if r.seq is not None]
    low = min(seqs) if seqs else None
    targets = blamed or [r for r in ev.ranks.values() if low is not None and r.seq == low]
    waits = []
    for r in sorted(ev.ranks.values(), key=lambda r: r.rank):
        if r in targets:
            continue
        ahead = r.seq is not None and low is not None and r.seq > low
        if ahead or r.kind == "timeout":
            waits.append({
                "rank": r.rank,
                "seq": r.seq,
                "phase": r.flight.get("phase"),
                "call": r.flight.get("call"),
                "waited_for": [t.rank for t in targets],
                "their_seq": [t.seq for t in targets],
            })  # fmt: skip
    return waits


def _row(ev: Evidence, r: Rank) -> dict[str, Any]:
    f = r.flight
    exitcode = (r.agent or {}).get("exitcode")
    age = ev.age(r)
    return {
        "rank": r.rank,
        "host": r.host.get("host"),
        "addr": r.host.get("addr"),
        "pid": r.pid,
        "attempt": f.get("attempt"),
        "status": r.status,
        "exit": None if exitcode is None else describe_exit(exitcode),
        "exitcode": exitcode,
        "signal": r.signal,
        "steps_done": r.steps_done if f else None,
        "phase": f.get("phase"),
        "call": f.get("call"),
        "collective_seq": r.seq,
        "calls": f.get("calls"),
        "record_age_s": None if age is None else round(age, 2),
        "stale": age is not None and age >= ev.stale_s,
        "error": r.error,
        "error_kind": r.kind,
        "rss_bytes": (f.get("memory") or {}).get("rss_bytes"),
        "log": _log(ev, r),
    }


def _verdict(
    ev: Evidence, verdict: str, blamed: list[Rank], summary: str, advice: list[str]
) -> dict[str, Any]:
    report = ev.report or {}
    first = blamed[0] if blamed else None
    step, inside = _step_of(ev, first) if first is not None and first.flight else (None, False)
    status = report.get("status") if report.get("status") in ("completed", "stopped") else None
    status = status or ("stopped" if ev.stopped_by else "running" if ev.live else "failed")
    return {
        "verdict": verdict,
        "summary": summary,
        "run_dir": str(ev.run_dir),
        "status": status,
        "ranks": [r.rank for r in blamed],
        "hosts": [{"rank": r.rank, **r.host} for r in blamed],
        "step": step,
        "in_step": inside,
        "phase": first.flight.get("phase") if first is not None else None,
        "evidence": {
            "ranks": [_row(ev, r) for r in sorted(ev.ranks.values(), key=lambda r: r.rank)],
            "waits": _waits(ev, blamed) if verdict in ("hang", "network_partition") else [],
            "timeout_s": ev.timeout_s,
            "stale_after_s": ev.stale_s,
            "stragglers": report.get("stragglers") or [],
            "restarts": report.get("restarts") or [],
        },
        "advice": advice,
    }
