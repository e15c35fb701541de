"""`meshforge bench comm`: collective bus bandwidth (bench/comm.py), nccl-tests style.
`meshforge bench io`: storage read throughput and latency under the shards (bench/io.py).

`bench comm` standalone starts its ranks through the torch elastic agent, as `meshforge
train` does, and takes the same torchrun flags (`--nproc N`, `--nnodes`,
`--rdzv-endpoint`, ...); under torchrun, srun or mpirun each process is one rank. Rank 0
prints. Its command line is read by argparse, as `meshforge train`'s is, since
torchrun's flags come with it. `bench io` is one process (its readers are threads or
processes of its own) with ordinary options."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from meshforge.cli.app import app
from meshforge.errors import ConfigError

if TYPE_CHECKING:
    from meshforge.bench.comm import CommBenchOptions
    from meshforge.launch.torchrun import LaunchArgs

bench_app = typer.Typer(
    help="Benchmarks: collective bus bandwidth (comm), storage read throughput (io).",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench", rich_help_panel="Cluster")

_PROG = "meshforge bench comm"


@bench_app.command(
    "comm",
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "help_option_names": [],
    },
    add_help_option=False,
)
def comm(ctx: typer.Context) -> None:
    """Bus bandwidth of all_reduce, all_gather, reduce_scatter, broadcast and all_to_all
    over a range of sizes, printed as nccl-tests does: [--ops A,B] [--min-bytes 1K]
    [--max-bytes 256M] [--factor 2] [--warmup W] [--iters I] [--dtype float32] [--json]
    [torchrun's flags: --nproc N, ...]. See `meshforge bench comm --help`."""
    raise typer.Exit(run_comm(list(ctx.args)))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{_PROG}: {message}")


def build_parser() -> argparse.ArgumentParser:
    from meshforge.bench.comm import DTYPES, OPS, CommBenchOptions

    d = CommBenchOptions()
    p = _Parser(
        prog=_PROG,
        description="Collective bus bandwidth, nccl-tests style (size, count, type, redop, "
        "root, time, algbw, busbw, #wrong).",
        epilog="Also takes torchrun's launch flags as `meshforge train` does (--nproc N, "
        "--nnodes, --node-rank, --rdzv-endpoint, --standalone, --iface, ...); under "
        "torchrun, srun or mpirun each process is one rank.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--ops", default=",".join(OPS), help="Collectives, comma-separated (default: all)."
    )
    p.add_argument(
        "--min-bytes",
        default="1K",
        help="Smallest size (default: %(default)s; K, M, G are powers of 1024).",
    )
    p.add_argument("--max-bytes", default="256M", help="Largest size (default: %(default)s).")
    p.add_argument(
        "--factor",
        type=float,
        default=d.factor,
        help="Size multiplier per step (default: %(default)s).",
    )
    p.add_argument(
        "--warmup", type=int, default=d.warmup, help="Untimed runs per size (default: %(default)s)."
    )
    p.add_argument(
        "--iters", type=int, default=d.iters, help="Timed runs per size (default: %(default)s)."
    )
    p.add_argument("--dtype", default=d.dtype, help=f"Element type: {', '.join(DTYPES)}.")
    p.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    p.add_argument("--backend", default=d.backend, choices=("auto", "gloo", "nccl"))
    p.add_argument("--json", action="store_true", help="Print one JSON object instead.")
    return p


def parse_comm_args(argv: list[str]) -> tuple[CommBenchOptions, list[str]]:
    """(CommBenchOptions, the launch flags left over for torchrun's parser)."""
    from meshforge.bench.comm import CommBenchOptions, parse_size

    args, launch_argv = build_parser().parse_known_args(argv)
    options = CommBenchOptions(
        ops=tuple(op.strip() for op in args.ops.split(",") if op.strip()),
        min_bytes=parse_size(args.min_bytes, "--min-bytes"),
        max_bytes=parse_size(args.max_bytes, "--max-bytes"),
        factor=args.factor,
        warmup=args.warmup,
        iters=args.iters,
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        as_json=args.json,
    )
    return options, launch_argv


def parse_launch(launch_argv: list[str], device: str) -> LaunchArgs:
    """torchrun's flags through `meshforge train`'s own reading of them (launch/torchrun.py),
    so both commands take the same flags; the job's own flags are refused."""
    from meshforge.launch.torchrun import check_gpu_count, parse_launch_args

    try:
        launch = parse_launch_args(["<no job>", *launch_argv])
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("meshforge train:", f"{_PROG}:", 1)) from None
    a = launch.args
    for flag, given in (("--run-dir", a.run_dir), ("--set", a.overrides)):
        if given:
            raise ConfigError(f"{_PROG}: {flag} is for `meshforge train`; a benchmark has no job")
    check_gpu_count(launch.nproc_per_node, device, a.oversubscribe)
    return launch


def run_comm(argv: list[str]) -> int:
    from meshforge.runtime.env import detect_env

    options, launch_argv = parse_comm_args(argv)
    if detect_env().launcher == "single":
        return _launch(options, parse_launch(launch_argv, options.device))
    if launch_argv:
        raise ConfigError(
            f"{_PROG}: {' '.join(launch_argv)}: under a launcher (torchrun, srun, mpirun) "
            "each process is already one rank; launch flags are for a standalone run"
        )
    return _run_rank(options)


def _run_rank(options: CommBenchOptions) -> int:
    """This process is one rank: measure; rank 0 prints each row as it comes."""
    from meshforge.bench import comm as bench
    from meshforge.runtime.dist import distributed

    with distributed(options.device, options.backend) as rt:
        table = rt.is_main and not options.as_json

        def say(lines: list[str]) -> None:
            if table:
                print("\n".join(lines), flush=True)

        result = bench.new_result(options, rt.device, rt.backend)
        say(bench.header_lines(result))
        for op in options.ops:
            say(bench.op_header_lines(op, rt.world_size))
            for row in bench.measure_sizes(op, options, rt.device):
                result.rows.append(row)
                say([bench.format_row(row)])
        say(bench.footer_lines(result))
        if rt.is_main and options.as_json:
            print(json.dumps(result.to_dict(), indent=2), flush=True)
        if rt.is_main and result.wrong:
            print(
                f"{_PROG}: {result.wrong} wrong value(s) in the results (the #wrong column)",
                file=sys.stderr,
                flush=True,
            )
    return 1 if result.wrong else 0


def _launch(options: CommBenchOptions, launch: LaunchArgs) -> int:
    """Start the ranks on this node through the torch elastic agent, as `meshforge train`."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from meshforge.launch.local import run_elastic
    from meshforge.launch.torchrun import launch_config

    for note in launch.notes:
        print(f"meshforge: {note}", file=sys.stderr, flush=True)
    for warning in launch.warnings:
        print(f"meshforge: warning: {warning}", file=sys.stderr, flush=True)
    worker_args = ["bench", "comm", *options.to_argv()]
    with tempfile.TemporaryDirectory(prefix="meshforge-bench-comm-") as tmp:
        config, cmd, cmd_args = launch_config(launch, worker_args, Path(tmp) / "logs")
        try:
            diagnosis = run_elastic(config, cmd, cmd_args, Path(tmp))
        except SignalException as exc:
            name = signal.Signals(exc.sigval).name
            print(f"{_PROG}: stopped by {name}", file=sys.stderr, flush=True)
            return 128 + int(exc.sigval)
    if diagnosis is None:
        return 0
    first = diagnosis["first_failure"]
    print(
        f"{_PROG}: rank {first['rank']} failed ({first.get('exit', 'failed')}): "
        f"{first.get('error', '')}",
        file=sys.stderr,
        flush=True,
    )
    return 1


# -- bench io ----------------------------------------------------------------------------------

_JOB = "The job to feed (optional)"


def _counts(text: str, flag: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected counts such as 1,2,4") from None
    if not counts:
        raise ConfigError(f"{flag} {text!r}: expected counts such as 1,2,4")
    return counts


@bench_app.command("io")
def io(
    path: Annotated[
        Path,
        typer.Argument(help="A shard directory, a .bin token file, or any directory of files."),
    ],
    readers: Annotated[
        str, typer.Option("--readers", help="Concurrent reader counts, comma-separated.")
    ] = "1,2,4",
    mode: Annotated[str, typer.Option("--mode", help="Readers are threads or processes.")] = (
        "threads"
    ),
    order: Annotated[
        str, typer.Option("--order", help="Read orders, comma-separated: sequential, random.")
    ] = "sequential,random",
    seconds: Annotated[
        float | None, typer.Option("--seconds", help="Time per row (default 2).")
    ] = None,
    max_bytes: Annotated[
        str | None, typer.Option("--bytes", help="Bytes per row instead of a time (e.g. 1G).")
    ] = None,
    block: Annotated[str, typer.Option("--block", help="Bytes per read (K, M, G: 1024s).")] = (
        "4M"
    ),
    page_cache: Annotated[
        str,
        typer.Option(
            "--page-cache",
            help="Before each pass: fadvise (posix_fadvise DONTNEED on the files read), "
            "drop (also the whole machine's cache through drop_caches, as root) or keep.",
        ),
    ] = "fadvise",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    run: Annotated[
        Path | None,
        typer.Option(
            "--run", help="A finished run: its report.json's tokens/s.", rich_help_panel=_JOB
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="A job config: the planner's tokens/s.", rich_help_panel=_JOB
        ),
    ] = None,
    nodes: Annotated[
        int | None, typer.Option("--nodes", help="Nodes of the job.", rich_help_panel=_JOB)
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option("--gpus-per-node", help="Devices per node (default 8).", rich_help_panel=_JOB),
    ] = None,
    gpu: Annotated[
        str,
        typer.Option(
            "--gpu", help="Catalogue GPU for --config (a plan --gpu key).", rich_help_panel=_JOB
        ),
    ] = "h100",
) -> None:
    """Read throughput (MB/s, tokens/s) and latency percentiles of the storage under
    PATH for 1, 2, 4, ... concurrent readers, sequential and random, page cache dropped
    where allowed. With --run RUN_DIR or --config JOB.yaml --nodes N: the read bandwidth
    the job needs against what was measured, and the headroom."""
    from meshforge.bench import io as bench
    from meshforge.bench.io import parse_size

    options = bench.IoBenchOptions(
        path=str(path),
        readers=_counts(readers, "--readers"),
        mode=mode,
        orders=tuple(o.strip() for o in order.split(",") if o.strip()),
        seconds=seconds,
        max_bytes=None if max_bytes is None else parse_size(max_bytes, "--bytes"),
        block_bytes=parse_size(block, "--block"),
        page_cache=page_cache,
    )
    data = bench.find_files(path)
    need = None
    if run is not None and config is not None:
        raise ConfigError("give --run or --config, not both")
    if run is not None:
        need = bench.need_from_run(run, data.token_bytes, nodes, gpus_per_node)
    elif config is not None:
        if nodes is None:
            raise ConfigError("--config needs --nodes N (and --gpus-per-node G, default 8)")
        need = bench.need_from_plan(config, nodes, gpus_per_node or 8, data.token_bytes, gpu)
    elif nodes is not None or gpus_per_node is not None:
        raise ConfigError("--nodes and --gpus-per-node size a job: give --run or --config too")

    def show(row: bench.IoRow, _: str) -> None:
        print(bench.format_row(row), flush=True)

    if not as_json:
        print("\n".join(bench.header_lines(data, options)), flush=True)
    result = bench.run_bench(options, need, None if as_json else show)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2), flush=True)
    else:
        print("\n".join(bench.footer_lines(result)), flush=True)
