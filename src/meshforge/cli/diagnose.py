"""`meshforge diagnose RUN_DIR`: what happened to a run, in one line, then the evidence.

The judging is health/diagnose.py's; this module prints it: the summary line first,
then one row per rank (what its flight record, its own error and the agent say), who
waited for whom, and the advice. `--json` prints the whole diagnosis instead."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from meshforge.cli.app import app

# gloo/NCCL prefix their errors with a source location: noise in a table
_SOURCE_LOCATION = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _short(text: str | None, width: int = 72) -> str:
    if not text:
        return "-"
    text = _SOURCE_LOCATION.sub("", text).split(". ")[0]
    return text if len(text) <= width else text[: width - 3] + "..."


def _host(row: dict[str, Any]) -> str:
    addr = row.get("addr")
    return f"{row['host']} ({addr})" if addr and addr != "127.0.0.1" else _cell(row["host"])


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def format_diagnosis(d: dict[str, Any]) -> str:
    lines = [d["summary"], "", f"verdict: {d['verdict']}    run: {d['run_dir']} ({d['status']})"]
    rows = d["evidence"]["ranks"]
    if rows:
        header = ["rank", "host", "pid", "status", "exit", "steps", "phase", "call", "seq",
                  "record age", "error"]  # fmt: skip
        table = [
            [
                str(r["rank"]),
                _host(r),
                _cell(r["pid"]),
                r["status"],
                _cell(r["exit"]),
                _cell(r["steps_done"]),
                _cell(r["phase"]),
                _cell(r["call"]),
                _cell(r["collective_seq"]),
                "-"
                if r["record_age_s"] is None
                else f"{r['record_age_s']:.1f} s" + (" (stale)" if r["stale"] else ""),
                _short(r["error"]),
            ]
            for r in rows
        ]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *table, strict=True)]
        lines.append("")
        for row in [header, *table]:
            cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=False)]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
        lines.append(
            f"(record age: how long before the last record this rank's was written; stale "
            f"after {d['evidence']['stale_after_s']:.0f} s; collective timeout "
            f"{d['evidence']['timeout_s']:.0f} s)"
        )
    for w in d["evidence"]["waits"]:
        where = w["call"] or w["phase"]
        their = ", ".join(f"{r} (seq {_cell(s)})" for r, s in zip(w["waited_for"], w["their_seq"],
                                                                  strict=True))  # fmt: skip
        lines.append(
            f"rank {w['rank']} (seq {_cell(w['seq'])}, in {where}) waited for rank {their}"
        )
    causes = d["evidence"].get("straggler_causes") or {}
    for s in d["evidence"]["stragglers"]:
        cause = (causes.get(str(s["rank"])) or {}).get("cause")
        lines.append(
            f"straggler: rank {s['rank']} on {s.get('host')}: {s['slowdown']:.2f}x"
            + (f" ({cause})" if cause else "")
        )
    for r in d["evidence"]["restarts"]:
        redone = r.get("steps_redone")
        lines.append(
            f"restart {r.get('attempt')}: resumed from step {r.get('resumed_from')}"
            + ("" if redone is None else f", {redone} step(s) redone")
        )
    if d["advice"]:
        lines += ["", "advice:", *(f"  - {a}" for a in d["advice"])]
    return "\n".join(lines)


@app.command("diagnose", rich_help_panel="Inspect")
def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of a `meshforge train` run.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the diagnosis as JSON.")] = False,
) -> None:
    """Explain a failed, hung, stopped or finished run: a verdict (rank_crashed, oom,
    network_partition, hang, straggler, ok, stopped, ended, running), the ranks and hosts
    to blame, the evidence and advice."""
    from meshforge.health.diagnose import diagnose_run

    d = diagnose_run(run_dir)
    print(json.dumps(d, indent=2) if as_json else format_diagnosis(d))
