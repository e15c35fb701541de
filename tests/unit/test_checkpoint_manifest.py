"""The checkpoint manifest is assembled from hashes each rank computed of its own files."""

from __future__ import annotations

import hashlib
import json

from meshforge.rundir.checkpoints import MANIFEST, hash_own_files, verify, write_manifest


def _write(directory, name: str, data: bytes) -> None:
    (directory / name).write_bytes(data)


def test_each_rank_hashes_only_the_files_it_wrote(tmp_path):
    _write(tmp_path, "__0_0.distcp", b"rank zero shard")
    _write(tmp_path, "__1_0.distcp", b"rank one shard")
    _write(tmp_path, "__1_1.distcp", b"rank one, second file")
    _write(tmp_path, "rng-rank-1.pt", b"rng")
    _write(tmp_path, ".metadata", b"coordinator")
    own = hash_own_files(tmp_path, 1)
    assert sorted(own) == ["__1_0.distcp", "__1_1.distcp", "rng-rank-1.pt"]
    assert own["__1_0.distcp"]["sha256"] == hashlib.sha256(b"rank one shard").hexdigest()
    assert own["__1_0.distcp"]["bytes"] == len(b"rank one shard")


def test_the_manifest_uses_the_ranks_hashes_and_covers_every_file(tmp_path):
    _write(tmp_path, "__0_0.distcp", b"rank zero shard")
    _write(tmp_path, "__1_0.distcp", b"rank one shard")
    _write(tmp_path, ".metadata", b"coordinator")
    from_ranks = {**hash_own_files(tmp_path, 0), **hash_own_files(tmp_path, 1)}
    manifest = write_manifest(tmp_path, 10, from_ranks)
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # a rank's entry is taken as given (not hashed again by rank 0) ...
    marked = {**from_ranks, "__1_0.distcp": {"sha256": "0" * 64, "bytes": 14}}
    manifest = write_manifest(tmp_path, 10, marked)
    assert manifest["files"]["__1_0.distcp"]["sha256"] == "0" * 64
    # ... and verification, which rehashes, then rejects a wrong one
    assert "checksum mismatch in __1_0.distcp" in verify(tmp_path)
    write_manifest(tmp_path, 10, from_ranks)
    assert verify(tmp_path) is None
    assert json.loads((tmp_path / MANIFEST).read_text())["step"] == 10
