"""`meshforge train`'s command line: torchrun's own launch flags, taken from
`torch.distributed.run`'s parser (so every flag, spelling and `PET_*` variable torchrun
reads is read the same way), plus meshforge's own: the job, the run directory,
overrides, `--fresh`, `--trace`, `--iface` and `--oversubscribe`.

The flags become a `LaunchConfig` through torchrun's own `config_from_args`; what
torchrun's `run()` does before that (`--standalone`, a single node without a
rendezvous endpoint) is repeated here, and so is what torchrun leaves to the user on a
cluster: choosing the interface, the address to advertise, and which node serves the
c10d store."""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from meshforge.errors import ConfigError
from meshforge.runtime import netif

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

# torchrun flags that choose the program to run: meshforge decides that (its worker).
_NOT_FOR_MESHFORGE = {"module", "no_python", "run_path", "help"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"meshforge train: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The parser for `meshforge train`. Built per call: torchrun's defaults come from
    the `PET_*` environment variables present when it is built."""
    from torch.distributed.run import get_args_parser

    parser = _Parser(
        prog="meshforge train",
        description="Train a job: start the torch elastic agent (torchrun) on this node, "
        "which starts and watches the worker processes.",
        allow_abbrev=False,
    )
    parser.add_argument("config", type=Path, help="Job config (YAML).")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="Run directory (default: runs/NAME, NAME the job's `name`).",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="Override a config key (repeatable).",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="Start over on a run directory that holds a run: remove what meshforge wrote "
        "there first (files of yours stay). Without it, a run with nothing left to train is "
        "left as it is, a run of another model (or a folder that is not a meshforge run) is "
        "refused, and any other run resumes from its newest checkpoint.",
    )
    parser.add_argument(
        "--trace",
        metavar="STEPS",
        default=None,
        help="Write a Chrome/Perfetto timeline of these steps (e.g. 5, 5-7 or 5,9; numbered "
        "from 1), every rank's compute and communication, to RUN_DIR/trace.json "
        "(observe.trace_steps).",
    )
    parser.add_argument(
        "--iface",
        default=os.environ.get("MESHFORGE_IFACE"),
        metavar="NAME",
        help="Network interface for rendezvous and collectives: sets GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME and advertises its address (unless --local-addr is given).",
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="Measure this machine again for the planner (matmul rate, optimizer, "
        "all-reduce) instead of reusing the cached figures; the new ones replace them.",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="Allow more worker processes than GPUs on a GPU node.",
    )
    launch = parser.add_argument_group(
        "launch", "torchrun's flags, with its defaults and PET_* environment variables"
    )
    for action in get_args_parser()._actions:
        if not action.option_strings or action.dest in _NOT_FOR_MESHFORGE:
            continue
        if action.dest == "nproc_per_node":
            action.option_strings = [*action.option_strings, "--nproc"]
        if action.dest in _MESHFORGE_DEFAULTS:  # meshforge sets these unless given
            action.help = _MESHFORGE_DEFAULTS[action.dest]
        launch._add_action(action)
    return parser


_MESHFORGE_DEFAULTS = {
    "monitor_interval": "Seconds between the agent's checks of its workers (meshforge: "
    "0.05 unless given; torchrun: 0.1).",
    "shutdown_timeout": "Seconds the agent waits for its workers to leave after SIGTERM "
    "before it kills them (meshforge: runtime.grace_s + 10 unless given).",
}


@dataclass
class LaunchArgs:
    args: argparse.Namespace
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    notes: list[str]  # what meshforge decided for the user, printed at launch
    warnings: list[str]  # what will probably go wrong, printed at launch (stderr)


def parse_nnodes(text: str) -> tuple[int, int]:
    parts = str(text).split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--nnodes {text}: expected N or MIN:MAX (integers)") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2:
        raise ConfigError(f"--nnodes {text}: expected N or MIN:MAX")
    low, high = values
    if low < 1:
        raise ConfigError(f"--nnodes {text}: needs at least one node")
    if low > high:
        raise ConfigError(f"--nnodes {text}: the minimum ({low}) is above the maximum ({high})")
    return low, high


def local_world_size(value: str) -> int:
    """--nproc-per-node as torchrun reads it: a number, or gpu, cpu, xpu, auto."""
    from torch.distributed.run import determine_local_world_size

    logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
    try:
        n = determine_local_world_size(str(value))
    except ValueError as exc:
        cause = exc.args[0] if exc.args else "invalid"
        if str(value) == "gpu":
            cause = "no CUDA device is visible"
        raise ConfigError(f"--nproc/--nproc-per-node {value}: {cause}") from None
    if n < 1:
        raise ConfigError(f"--nproc/--nproc-per-node {value}: needs at least one process")
    return n


def check_gpu_count(nproc: int, device: str, oversubscribe: bool, gpus: int | None = None) -> None:
    """More workers than GPUs on a GPU node would share devices: refused unless forced."""
    if device == "cpu":
        return
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and nproc > gpus and not oversubscribe:
        raise ConfigError(
            f"--nproc-per-node {nproc} is more than the {gpus} GPU(s) on this node "
            "(use --oversubscribe to share GPUs, or runtime.device: cpu)"
        )


def parse_launch_args(argv: list[str]) -> LaunchArgs:
    """Parse and check the command line; nothing is started and nothing is written."""
    args = build_parser().parse_args(argv)
    if args.trace is not None:  # the job's setting, checked with the rest of the config
        args.overrides.append(f"observe.trace_steps={args.trace}")
    notes: list[str] = []
    warnings: list[str] = []
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    nproc = local_world_size(args.nproc_per_node)
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts must be >= 0")
    if args.monitor_interval is not None and args.monitor_interval <= 0:
        raise ConfigError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    # What torchrun's run() does before config_from_args.
    if args.standalone:
        if max_nodes > 1:
            raise ConfigError("--standalone starts a single node; it cannot take --nnodes > 1")
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if max_nodes == 1:
            args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.rdzv_backend == "static" and min_nodes != max_nodes:
        raise ConfigError(
            f"--nnodes {args.nnodes}: an elastic range needs a dynamic rendezvous "
            "(--rdzv-backend c10d --rdzv-endpoint HOST:PORT)"
        )
    if args.rdzv_backend == "static" and not 0 <= args.node_rank < max_nodes:
        raise ConfigError(f"--node-rank {args.node_rank} is outside 0..{max_nodes - 1}")
    # What torchrun leaves to the user on a cluster.
    if args.local_addr:
        own = netif.is_own_address(args.local_addr)
        if own is None:
            raise ConfigError(f"--local-addr {args.local_addr}: the name does not resolve")
        if not own:
            raise ConfigError(
                f"--local-addr {args.local_addr} is not an address of this host "
                "(the other nodes would wait for it forever)"
            )
    if args.iface:
        address = netif.interface_address(args.iface)
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
        os.environ["NCCL_SOCKET_IFNAME"] = args.iface
        if not args.local_addr:
            args.local_addr = address
            notes.append(f"interface {args.iface}: advertising {address}")
    elif args.local_addr and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = netif.interface_with_address(args.local_addr)
        if iface and iface != "lo":
            os.environ["GLOO_SOCKET_IFNAME"] = iface
            os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
            notes.append(f"--local-addr {args.local_addr} is on {iface}: collectives use it")
    if args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        _decide_store_host(args, notes)
    if max_nodes > 1:
        warnings += _unreachable_name_warning(args)
    return LaunchArgs(args, min_nodes, max_nodes, nproc, notes, warnings)


def _unreachable_name_warning(args: argparse.Namespace) -> list[str]:
    """Across hosts, with no interface or address given, gloo and the agent advertise
    what the host name resolves to; a loopback address there cannot be reached from
    another node, and the job would wait until its timeout."""
    if args.local_addr or os.environ.get("GLOO_SOCKET_IFNAME"):
        return []
    meeting = (args.rdzv_endpoint or "").rsplit(":", 1)[0] or args.master_addr
    if not meeting or netif.is_loopback(meeting):
        return []  # every node is on this host
    addr = netif.hostname_address()
    if addr is None or not netif.is_loopback(addr):
        return []
    return [
        f"this host's name resolves to {addr} (loopback), which other nodes cannot reach: "
        "pass --iface NAME (the cluster network) or --local-addr ADDR"
    ]


def _decide_store_host(args: argparse.Namespace, notes: list[str]) -> None:
    """Which node serves the c10d store. torchrun compares the endpoint with the host
    name and its primary address; an address on a second interface (a cluster network)
    is missed and then no node serves it. An explicit is_host always wins."""
    if "is_host" in str(args.rdzv_conf):
        return
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    except ValueError as exc:
        raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint}: {exc}") from None
    if netif.is_loopback(host):
        return  # torchrun's own rule already covers it (and falls back to a client)
    local = netif.endpoint_is_local(host, port)
    if local is None:
        return
    conf = f"is_host={int(local)}"
    args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
    if local:
        notes.append(f"this node serves the rendezvous store at {host}:{port}")


def launch_config(
    launch: LaunchArgs, worker_args: list[str], default_log_dir: Path
) -> tuple[LaunchConfig, str, list[str]]:
    """torchrun's own config_from_args on the parsed flags, running meshforge's worker."""
    from torch.distributed.run import config_from_args

    args = launch.args
    args.module, args.no_python, args.run_path = True, False, False
    args.training_script, args.training_script_args = "meshforge", worker_args
    if args.log_dir is None:
        args.log_dir = str(default_log_dir)
    logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
    omp = os.environ.get("OMP_NUM_THREADS")
    try:
        config, cmd, cmd_args = config_from_args(args)
    except (ValueError, AssertionError) as exc:
        raise ConfigError(f"meshforge train: {exc}") from None
    finally:
        # torchrun pins one thread per worker; meshforge shares the node's cores instead
        # (runtime/dist.py) unless the user set OMP_NUM_THREADS.
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return config, cmd, cmd_args
