"""What the benchmarks that build every side in the same torchrun processes share
(benchmarks/moe.py, benchmarks/long_context.py): starting one torchrun of the script's
own `--worker` on loopback and reading back the JSON its rank 0 prints last, and the
worker's start and end around the benchmark's paired rounds. Imported by the scripts
beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def launch(script: str, nproc: int, forwarded: list[str], what: str, timeout: int,
           env: dict[str, str] | None = None) -> dict:  # fmt: skip
    """`python -m torch.distributed.run` of SCRIPT --worker FORWARDED on NPROC local
    ranks (a fresh rendezvous port each run, on loopback); its rank 0's last stdout line
    as JSON. One retry; a second failure raises, naming WHAT and the errors' last lines."""
    from meshforge.launch.local import free_port

    for attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--nproc_per_node={nproc}",
            str(Path(script).resolve()), "--worker", *forwarded,
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        lines = out.stdout.strip().splitlines()
        if lines and lines[-1].startswith("{"):
            return json.loads(lines[-1])
        errors = [ln for ln in out.stderr.splitlines() if "Error" in ln] or out.stderr.splitlines()
        print(f"{what} failed (attempt {attempt + 1}, rc {out.returncode}): "
              + " | ".join(errors[-3:]), file=sys.stderr, flush=True)  # fmt: skip
    raise RuntimeError(f"{what} failed twice")


def worker(paired: Callable[[Any], dict], args: Any) -> None:
    """One rank of torchrun: the cores shared among the local ranks, gloo on loopback,
    `paired(args)` (every side, in rounds), its result printed by rank 0 as one JSON
    line; then gloo's pending work dropped and the group left."""
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo")
    result = paired(args)
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    gc.collect()  # as plain_loop.leave does: gloo's pending drops, then no teardown
    dist.barrier()
    dist.destroy_process_group()
