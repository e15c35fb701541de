"""Shards on a real distributed file system (MooseFS over namespace hosts, tests/cluster.py):
`data prepare` writes them there, a 2-rank run trains from them exactly as from local
disk, and `bench io` measures reading them."""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import MooseFS, moosefs, netns_hosts
from helpers import REPO, Job, meshforge

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# A small corpus of real text: the standard library's json package (~50 KB).
CORPUS = sorted(Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py"))


@pytest.fixture(scope="module")
def mfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooseFS]:
    """Master in one host, a chunk server in each of two others, goal 2, mounted here."""
    with (
        netns_hosts(3, prefix="dfs") as hosts,
        moosefs(hosts, tmp_path_factory.mktemp("mfs")) as fs,
    ):
        yield fs


def _prepare(src: Path, out: Path) -> None:
    proc = meshforge(["data", "prepare", str(src), str(out), "--shard-tokens", "16K"], timeout=60)
    assert proc.returncode == 0, proc.stderr


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_two_ranks_train_from_shards_on_moosefs_as_from_local_disk(
    mfs: MooseFS, tmp_path: Path
) -> None:
    src = tmp_path / "corpus"
    src.mkdir()
    for path in CORPUS:
        shutil.copyfile(path, src / path.name)
    on_dfs, on_disk = mfs.mount / "shards", tmp_path / "shards"
    _prepare(src, on_dfs)
    _prepare(src, on_disk)
    # the same bytes, and the shards really live on the chunk servers, `goal` copies each
    assert _tree(on_dfs) == _tree(on_disk)
    for shard in sorted(on_dfs.glob("shard-*.bin")):
        assert mfs.chunk_copies(shard) == {mfs.goal: 1}, shard

    dfs_job = Job(tmp_path, {"data": {"source": str(on_dfs)}}, name="dfs")
    disk_job = Job(tmp_path, {"data": {"source": str(on_disk)}}, name="disk")
    dfs_job.train(2)
    disk_job.train(2)

    assert dfs_job.report["status"] == "completed" and dfs_job.report["world_size"] == 2
    dfs_losses, disk_losses = dfs_job.losses(), disk_job.losses()
    assert len(dfs_losses) == 20
    assert dfs_losses.keys() == disk_losses.keys()
    for step, loss in disk_losses.items():
        assert abs(dfs_losses[step] - loss) <= 1e-6 * abs(loss), (step, dfs_losses[step], loss)


def test_bench_io_reads_shards_on_moosefs(mfs: MooseFS, tmp_path: Path) -> None:
    if not (REPO / "src" / "meshforge" / "bench" / "io.py").is_file():
        pytest.skip("bench io not built yet")
    src = tmp_path / "corpus"
    src.mkdir()
    for path in CORPUS:
        shutil.copyfile(path, src / path.name)
    shards = mfs.mount / "bench-shards"
    _prepare(src, shards)

    proc = meshforge(["bench", "io", str(shards), "--readers", "1,2", "--json"], timeout=60)

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["path"] == str(shards) and result["kind"] == "shards"
    rows = result["rows"]
    assert sorted((row["order"], row["readers"]) for row in rows) == [
        ("random", 1), ("random", 2), ("sequential", 1), ("sequential", 2),
    ], rows  # fmt: skip
    for row in rows:
        assert row["bytes"] > 0 and row["mb_per_s"] > 0 and row["tokens_per_s"] > 0, row


def test_moosefs_on_one_host_leaves_no_mount_or_process_behind(tmp_path: Path) -> None:
    root = tmp_path / "mfs"
    # (netns_hosts(1) needs the `dummy` link type, which this kernel lacks: use one of two)
    with netns_hosts(2, prefix="dfs1") as hosts, pytest.raises(RuntimeError, match="inside"):
        with moosefs(hosts[:1], root) as fs:
            assert fs.goal == 1 and fs.chunkservers == [fs.master]  # all in the one host
            (fs.mount / "a.txt").write_text("on MooseFS")
            assert fs.chunk_copies(fs.mount / "a.txt") == {1: 1}
            pids = fs.pids
            raise RuntimeError("an error inside the block")

    assert sorted(pids) == ["mfschunkserver-0", "mfsmaster", "mfsmount"]
    assert str(fs.mount) not in Path("/proc/self/mounts").read_text()
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists(), name
    assert not list((root / "cs0" / "hdd").glob("*"))  # chunk data removed
