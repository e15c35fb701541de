"""Who am I? Rank, world size and rendezvous address from the launcher's environment.

Recognised, in order: torchrun / the elastic agent (RANK, WORLD_SIZE, LOCAL_RANK),
OpenMPI (OMPI_COMM_WORLD_*), Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID),
and a plain single process.

A Slurm task is one that `srun` started: srun sets SLURM_STEP_ID (and its older
spelling SLURM_STEPID) in every task. The shell of an `sbatch` batch script carries
SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id (as a real Slurm 22.05
sets them; tests/integration/test_fabric_launch.py), and `salloc`'s shell has neither: it is no task
of a step, no other rank will ever join it, so both count as a plain single process
(which then starts its own workers) instead of rank 0 of SLURM_NTASKS waiting forever."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | mpi | slurm | single
    local_world_size: int = 1  # workers on this node: they share its cores

    def export(self, environ: dict[str, str] | None = None) -> None:
        """Write the torch.distributed env:// variables so init_process_group can read them."""
        env = os.environ if environ is None else environ
        env["RANK"] = str(self.rank)
        env["WORLD_SIZE"] = str(self.world_size)
        env["LOCAL_RANK"] = str(self.local_rank)
        env["MASTER_ADDR"] = self.master_addr
        env["MASTER_PORT"] = str(self.master_port)


def first_host_in_nodelist(nodelist: str) -> str:
    """The first host of a Slurm node list: 'n[3-5,9],m1' -> 'n3', 'gpu-01' -> 'gpu-01'."""
    nodelist = nodelist.strip()
    m = re.match(r"^([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _local_world_size(env: Mapping[str, str], *keys: str) -> int:
    """The first of LOCAL_WORLD_SIZE and the launcher's own `keys` that is set, else 1."""
    for key in ("LOCAL_WORLD_SIZE", *keys):
        if key in env:
            return _int(env, key)
    return 1


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task that srun started (one rank of SLURM_NTASKS).

    False in the shell of an sbatch batch script or of salloc: a job id, maybe
    SLURM_PROCID=0, but no step id. Without a job id (variables set by hand, or an
    older launcher that passes only these) SLURM_PROCID and SLURM_NTASKS suffice."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    if "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
        return True
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    port = int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=port,
            launcher="torchrun",
            local_world_size=_local_world_size(env),
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        return DistEnv(
            rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            world_size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_rank=int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
            # mpirun does not say where rank 0 lives: the job passes MASTER_ADDR with -x.
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=port,
            launcher="mpi",
            local_world_size=_local_world_size(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        )
    if in_slurm_step(env):
        master = env.get("MASTER_ADDR")
        if master is None:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            master = first_host_in_nodelist(nodelist) if nodelist else "127.0.0.1"
        return DistEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=master,
            master_port=port,
            launcher="slurm",
            local_world_size=_local_world_size(env, "SLURM_NTASKS_PER_NODE"),
        )
    return DistEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")
