"""`meshforge preflight`: check this node and the cluster before a run.

Standalone it starts its processes through the elastic agent, with the same torchrun
flags as `meshforge train` (--nproc, --nnodes, --rdzv-endpoint, --iface, ...; run on
every node, as `meshforge train` is). Under torchrun, srun or mpirun every process runs
the checks itself: `meshforge preflight --worker`, or plain `meshforge preflight` when
the launcher's variables (RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID) are set and no
launch flag is given.

Prints one row per check (or `--json`), writes RUN_DIR/health/preflight.json (default
run directory: runs/preflight), and exits 1 when any check FAILs, else 0."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer

from meshforge.cli.app import app
from meshforge.errors import ConfigError
from meshforge.rundir.outputs import claim_all

DEFAULT_RUN_DIR = Path("runs/preflight")
PROG = "meshforge preflight"
# `meshforge train` flags that have no meaning here (or that preflight defines itself).
_NOT_FOR_PREFLIGHT = {"help", "config", "run_dir", "overrides", "trace"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{PROG}: {message}")


def _parser(with_launch_flags: bool) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Check this node and the cluster before a run: versions, GPUs, "
        "InfiniBand, NCCL_/GLOO_ variables, disk, the rendezvous port, an all-reduce's "
        "result and bandwidth. Exit 1 when a check fails.",
        allow_abbrev=False,
        add_help=with_launch_flags,
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=DEFAULT_RUN_DIR,
        help=f"Directory to test for space and writes; health/preflight.json goes there "
        f"(default {DEFAULT_RUN_DIR}).",
    )
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="Also check that this port on global rank 0's host is reachable from every "
        "rank (rank 0 listens on it during the test).",
    )
    parser.add_argument(
        "--bandwidth-mb",
        type=float,
        default=64.0,
        metavar="MiB",
        help="All-reduce size of the bandwidth test (0: skip it). Default 64.",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="Seconds to wait for the other nodes to join and for each collective. Default 120.",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        metavar="PATH",
        help="Training data (a shard directory on the nodes' shared storage): each node "
        "reads it for a second as the loader does.",
    )
    parser.add_argument(
        "--data-run",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="With --data: a previous run of the job, whose tokens/s per device says what "
        "each node must read (FAIL under it, WARN under 2x).",
    )
    parser.add_argument(
        "--worker",
        action="store_true",
        help="Run the checks in this process only (under torchrun, srun or mpirun).",
    )
    parser.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    if with_launch_flags:
        from meshforge.launch.torchrun import build_parser

        launch = parser.add_argument_group(
            "launch", "as `meshforge train` takes them (torchrun's flags, --iface, ...)"
        )
        for action in build_parser()._actions:
            if action.option_strings and action.dest not in _NOT_FOR_PREFLIGHT:
                launch._add_action(action)
    return parser


def _options(own: argparse.Namespace):
    from meshforge.health.preflight import PreflightOptions

    if own.port is not None and not 1 <= own.port <= 65535:
        raise ConfigError(f"{PROG}: --port {own.port} is outside 1..65535")
    if own.bandwidth_mb < 0:
        raise ConfigError(f"{PROG}: --bandwidth-mb {own.bandwidth_mb:g} must be >= 0")
    if not own.timeout > 0:
        raise ConfigError(f"{PROG}: --timeout {own.timeout:g} must be > 0")
    per_device = None
    if own.data_run is not None:
        if own.data is None:
            raise ConfigError(f"{PROG}: --data-run needs --data PATH (the data to read)")
        from meshforge.bench.io import need_from_run

        per_device = need_from_run(own.data_run, 2).tokens_per_s_per_device
    if own.data is not None and not own.data.exists():
        raise ConfigError(f"{PROG}: --data {own.data}: no such file or directory")
    return PreflightOptions(
        own.run_dir, own.port, own.bandwidth_mb, own.timeout, own.data, own.data_run, per_device
    )


def _launch_args(rest: list[str]):
    """`meshforge train`'s launch flags, parsed and checked by its own code (a placeholder
    stands for the job config that preflight does not take)."""
    from meshforge.launch.torchrun import parse_launch_args

    try:
        return parse_launch_args(["preflight", *rest])
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("meshforge train:", f"{PROG}:", 1)) from None


def run_preflight(argv: list[str]) -> int:
    from meshforge.runtime.env import detect_env

    own, rest = _parser(with_launch_flags=False).parse_known_args(argv)
    options = _options(own)
    if own.worker and rest and not {"-h", "--help"} & set(rest):
        raise ConfigError(
            f"{PROG}: --worker runs under a launcher; it takes no launch flags ({rest[0]})"
        )
    _parser(with_launch_flags=True).parse_args(argv)  # every flag checked; --help exits here
    if own.worker or (not rest and detect_env().launcher != "single"):
        return _run_worker(options, render=not own.launched, as_json=own.json)
    return _launch(options, _launch_args(rest), as_json=own.json)


def _run_worker(options, render: bool, as_json: bool) -> int:
    from meshforge.health.preflight import FAIL, run_checks
    from meshforge.rundir.failures import record_failure
    from meshforge.runtime.env import detect_env

    rank = detect_env().rank
    try:
        doc = run_checks(options)
    except BaseException as exc:
        record_failure(options.run_dir, rank, exc)  # the launcher names the root cause
        raise
    if not render or rank != 0:
        return 0
    _render(doc, options.run_dir, as_json)
    return 1 if doc["status"] == FAIL else 0


def _launch(options, launch, as_json: bool) -> int:
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from meshforge.health.preflight import FAIL, read_result, result_path
    from meshforge.launch.local import run_elastic
    from meshforge.launch.torchrun import check_gpu_count, launch_config

    check_gpu_count(launch.nproc_per_node, "auto", launch.args.oversubscribe)
    info = sys.stderr if as_json else sys.stdout  # --json: stdout holds the JSON alone
    for note in launch.notes:
        print(f"meshforge: {note}", file=info, flush=True)
    for warning in launch.warnings:
        print(f"meshforge: warning: {warning}", file=sys.stderr, flush=True)
    low, high = launch.min_nodes, launch.max_nodes
    nodes = high if low == high else f"{low}..{high}"
    print(
        f"meshforge: preflight on {nodes} node(s) x {launch.nproc_per_node} process(es) "
        f"-> {options.run_dir}",
        file=info,
        flush=True,
    )
    try:  # the launcher itself writes its logs there
        claim_all(options.run_dir, ["logs", "health"])  # meshforge's, for --fresh
        (options.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        result_path(options.run_dir).unlink(missing_ok=True)  # never report an older result
    except OSError as exc:
        raise ConfigError(
            f"cannot write to run directory {options.run_dir}: {exc.strerror} "
            "(the disk check fails here already; choose another --run-dir)"
        ) from None
    worker_args = [
        *("preflight", "--worker", "--launched", "--run-dir", str(options.run_dir)),
        *("--bandwidth-mb", str(options.bandwidth_mb), "--timeout", str(options.timeout_s)),
        *(("--port", str(options.port)) if options.port else ()),
        *(("--data", str(options.data.resolve())) if options.data else ()),
        *(("--data-run", str(options.data_run.resolve())) if options.data_run else ()),
    ]
    config, cmd, cmd_args = launch_config(launch, worker_args, options.run_dir / "logs" / "elastic")
    if config.rdzv_backend == "c10d":
        config.rdzv_configs.setdefault("join_timeout", max(1, round(options.timeout_s)))
    try:
        diagnosis = run_elastic(config, cmd, cmd_args, options.run_dir)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"meshforge: preflight stopped by {name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    if diagnosis is not None:
        first = diagnosis["first_failure"]
        print(
            f"meshforge: preflight: rank {first['rank']} failed ({first['exit']}): "
            f"{first['error']} [{options.run_dir / 'health' / 'diagnosis.json'}]",
            file=sys.stderr,
        )
        return 1
    doc = read_result(options.run_dir)
    if doc is None:
        print(
            f"meshforge: preflight: the workers left no result in {result_path(options.run_dir)}",
            file=sys.stderr,
        )
        return 1
    _render(doc, options.run_dir, as_json)
    return 1 if doc["status"] == FAIL else 0


_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


def _render(doc: dict[str, Any], run_dir: Path, as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc, indent=2, default=str), flush=True)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from meshforge.health.preflight import result_path

    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough for the details
        console = Console(width=160)
    hosts = ", ".join(doc["hosts"][:4]) + (" ..." if len(doc["hosts"]) > 4 else "")
    table = Table(
        title=f"preflight: {doc['world_size']} rank(s) on {doc['nodes']} node(s) ({hosts}), "
        f"{doc['backend']}"
    )
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for check in doc["checks"]:
        status = Text(check["status"], style=_STYLE.get(check["status"], ""))
        table.add_row(check["name"], status, check["detail"])
    console.print(table)
    counts = {s: sum(c["status"] == s for c in doc["checks"]) for s in ("FAIL", "WARN")}
    console.print(
        f"preflight: {doc['status']} ({counts['FAIL']} failed, {counts['WARN']} warning(s)) "
        f"-> {result_path(run_dir)}",
        highlight=False,
    )


@app.command(
    "preflight",
    rich_help_panel="Cluster",
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "help_option_names": [],
    },
    add_help_option=False,
)
def preflight(ctx: typer.Context) -> None:
    """Check this node and the cluster before a run: [--nproc N] [--run-dir D] [--json]
    [--port P] [--bandwidth-mb M] [--timeout S] [torchrun's flags as `meshforge train`].
    See `meshforge preflight --help`."""
    raise typer.Exit(run_preflight(list(ctx.args)))
