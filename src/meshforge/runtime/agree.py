"""One decision per job: global rank 0's config is every rank's config.

Each node's launcher reads the job itself, and two nodes can differ: a different file,
different `--set` overrides, or `parallel: auto` resolved from different machine
measurements. Once the process group is up, rank 0 resolves what is still open (the
layout under `parallel: auto`) and broadcasts its config; every rank trains with it and
logs where its own copy differed. Each node's local rank 0 writes it as
RUN_DIR/config.yaml, so the run directory reads the same whichever launcher started
the job."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from meshforge.config import JobConfig, build_config, dump_config
from meshforge.fileio import write_text_atomic

log = logging.getLogger(__name__)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}


def differing_keys(mine: str, theirs: str) -> list[str]:
    a, b = _flatten(yaml.safe_load(mine)), _flatten(yaml.safe_load(theirs))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def agree_on_config(
    cfg: JobConfig,
    rank: int,
    world: int,
    local_rank: int,
    run_dir: Path,
    resolve: Callable[[JobConfig, int], JobConfig],
):
    """Every rank returns rank 0's config; RUN_DIR/config.yaml holds it afterwards.
    `resolve(cfg, world)` decides on rank 0 what is still open once the world is known
    (plan.jobs.auto.resolve_open_decisions: `parallel: auto`)."""
    if rank == 0:
        cfg = resolve(cfg, world)
    mine = dump_config(cfg)
    box = [mine if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    agreed = box[0]
    assert isinstance(agreed, str)
    if agreed != mine:
        keys = differing_keys(mine, agreed)
        if cfg.parallel == "auto":
            keys = [k for k in keys if not k.startswith("parallel")]
        if keys:
            message = (
                f"this node's job config differs from global rank 0's in {', '.join(keys)}; "
                "training with rank 0's (one config per job)"
            )
            log.warning("%s", message)
            if local_rank == 0:  # once per node, on that node's console too
                print(f"meshforge: warning: {message}", file=sys.stderr, flush=True)
        cfg = build_config(yaml.safe_load(agreed))
    if local_rank == 0:
        target = Path(run_dir) / "config.yaml"
        try:
            if not target.exists() or target.read_text() != agreed:
                write_text_atomic(target, agreed)
        except OSError as exc:
            log.warning("cannot write %s: %s", target, exc)
    return cfg


def host_of_rank(master_addr: str | None = None) -> dict[str, Any]:
    """Where this rank runs: host name, the address it reaches rank 0's node from (the
    address of the interface its traffic leaves by), and its node as the launcher numbers
    it."""
    master = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    addr = None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # UDP connect sends nothing; it picks the route
            addr = s.getsockname()[0]
    except OSError:
        pass
    node = None
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(key, "").isdigit():
            node = int(os.environ[key])
            break
    return {"host": socket.gethostname(), "addr": addr, "node": node}


def count_nodes(hosts: list[dict[str, Any]]) -> int:
    """Distinct nodes among the ranks' hosts: the launcher's node numbers when every rank
    has one (torchrun's agents, srun), else distinct host names and addresses (hosts
    made from network namespaces share a name but not an address)."""
    known = [h for h in hosts if h]
    if known and all(h.get("node") is not None for h in known):
        return len({h["node"] for h in known})
    return len({(h.get("host"), h.get("addr")) for h in known})
