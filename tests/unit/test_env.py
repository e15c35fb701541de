"""Rank, world size and rendezvous address from torchrun, Slurm and OpenMPI variables."""

from __future__ import annotations

import pytest

from meshforge.runtime.env import detect_env, first_host_in_nodelist


def test_torchrun_variables():
    env = detect_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "10.1.2.3",
            "MASTER_PORT": "29555",
        }
    )
    assert (env.rank, env.world_size, env.local_rank) == (3, 8, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("10.1.2.3", 29555, "torchrun")


def test_slurm_variables_take_master_from_node_list():
    env = detect_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "6",
            "SLURM_LOCALID": "2",
            "SLURM_JOB_NODELIST": "gpu[07-09,12]",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 6, 2, "slurm")
    assert env.master_addr == "gpu07"
    assert env.master_port == 29500


def test_slurm_explicit_master_addr_wins():
    env = detect_env(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_NODELIST": "n1",
            "MASTER_ADDR": "127.0.0.1",
        }
    )
    assert env.master_addr == "127.0.0.1"


def test_openmpi_variables():
    env = detect_env(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "MASTER_ADDR": "node0",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (1, 4, 1, "mpi")
    assert env.master_addr == "node0"


def test_torchrun_wins_over_slurm_when_both_present():
    # torchrun inside an sbatch allocation: the agent's variables describe the worker.
    env = detect_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.rank, env.world_size, env.launcher) == (1, 2, "torchrun")


def test_single_process_default():
    env = detect_env({})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 1, 0, "single")


def test_export_writes_env_vars():
    env = detect_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    out: dict[str, str] = {}
    env.export(out)
    assert out == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


@pytest.mark.parametrize(
    "nodelist, first",
    [("n1", "n1"), ("n[3-5]", "n3"), ("gpu-[010-012],cpu1", "gpu-010"), ("a[2,7]", "a2")],
)
def test_first_host_in_nodelist(nodelist, first):
    assert first_host_in_nodelist(nodelist) == first


def test_non_integer_rank_is_reported():
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        detect_env({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})
