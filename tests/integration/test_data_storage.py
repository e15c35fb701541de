"""Issue 11, parts 2 (.bin), 4 and 5: nanoGPT .bin token files, shards read by many
ranks at once with no coordination, URL sources through fsspec with a local cache, and
reader threads that never change the batches."""

from __future__ import annotations

import builtins
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import REPO, assert_one_line_error, meshforge
from meshforge.data.corpus import check_source, fetch_remote, load_tokens, remote_cache_path
from meshforge.data.loader import DistributedBatchLoader, global_batch_offsets
from meshforge.data.shards import prepare
from meshforge.errors import DataError

SEQ_LEN = 32


def _text(n_bytes: int, seed: int = 0) -> str:
    """Varied text, so that a window of tokens says where it came from."""
    rng = np.random.default_rng(seed)
    return "".join(chr(c) for c in rng.integers(32, 127, size=n_bytes))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shard directory of small shards, so that sequences cross shard boundaries."""
    root = tmp_path_factory.mktemp("shards")
    (root / "corpus.txt").write_text(_text(60_000))
    prepare(root / "corpus.txt", root / "shards", shard_tokens=7_000)
    return root / "shards"


def _write_bin(path: Path, tokens: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens.astype("<u2").tofile(path)
    return path


def _all_rows(loader: DistributedBatchLoader, steps: int) -> list[np.ndarray]:
    """[steps] arrays of this rank's sequences (seq_len + 1 tokens each) per step."""
    out = []
    for _ in range(steps):
        batch = next(loader)
        x = torch.cat([x for x, _ in batch.micro_batches])
        y = torch.cat([y for _, y in batch.micro_batches])
        out.append(torch.cat([x, y[:, -1:]], dim=1).numpy())
    return out


# -- .bin token files (nanoGPT) ----------------------------------------------------------------


def test_a_bin_file_is_read_as_raw_uint16_tokens_and_split(tmp_path: Path) -> None:
    tokens = np.random.default_rng(1).integers(0, 50_000, size=10_000)
    path = _write_bin(tmp_path / "data" / "tokens.bin", tokens)
    splits = load_tokens(str(path), 0.1, seq_len=SEQ_LEN, vocab_size=50_304)
    assert isinstance(splits.train, np.memmap) and splits.train.dtype == np.dtype("<u2")
    assert len(splits.val) == 1_000 and splits.vocab_size == 50_304
    np.testing.assert_array_equal(np.concatenate([splits.train, splits.val]), tokens)
    # without the model's vocabulary: the largest id + 1
    assert load_tokens(str(path), 0.1).vocab_size == int(tokens.max()) + 1
    check_source(str(path))


def test_a_directory_of_train_bin_and_val_bin_gives_the_two_splits(tmp_path: Path) -> None:
    train = np.arange(5_000) % 300
    val = np.arange(700) % 200
    _write_bin(tmp_path / "owt" / "train.bin", train)
    _write_bin(tmp_path / "owt" / "val.bin", val)
    splits = load_tokens(str(tmp_path / "owt"), 0.3, seq_len=SEQ_LEN, vocab_size=512)
    np.testing.assert_array_equal(splits.train, train)
    np.testing.assert_array_equal(splits.val, val)  # val.bin, not val_fraction
    check_source(str(tmp_path / "owt"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"tokens\.bin is empty"),
        (b"\x01\x00\x02", r"has 3 bytes, not a whole number of uint16 tokens"),
        (np.array([1, 2, 300], "<u2").tobytes(), r"token id 300, beyond model.vocab_size=256"),
    ],
)
def test_a_bad_bin_file_is_named(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "tokens.bin"
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"^data.source .*tokens\.bin: .*{message}"):
        load_tokens(str(path), 0.1, vocab_size=256)


def test_a_missing_bin_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.source .*nope\.bin: no such file"):
        load_tokens(str(tmp_path / "nope.bin"), 0.1)


def test_a_bin_source_trains(tmp_path: Path, job_factory) -> None:
    tokens = np.frombuffer(_text(40_000, seed=3).encode(), dtype=np.uint8)
    _write_bin(tmp_path / "bin" / "train.bin", tokens[:36_000])
    _write_bin(tmp_path / "bin" / "val.bin", tokens[36_000:])
    job = job_factory(
        {
            "data": {"source": str(tmp_path / "bin")},
            "train": {"steps": 8, "eval_every": 4},
            "observe": {"log_every": 4},
        }
    )
    job.train(1)
    report = job.report
    assert report["steps"] == 8 and np.isfinite(list(job.losses().values())).all()


# -- shared storage: many readers, no coordination ---------------------------------------------

_RANK_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numpy as np, torch
    from meshforge.data.corpus import load_tokens
    from meshforge.data.loader import DistributedBatchLoader

    source, rank, out, seq_len = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    train = load_tokens(source, 0.05).train
    (out.parent / f"ready-{rank}").touch()
    while not (out.parent / "go").exists():  # every rank starts reading at once
        time.sleep(0.01)
    rows = []
    with DistributedBatchLoader(
        train, seq_len, 16, 2, rank, 4, seed=5, prefetch=2, readers=2
    ) as loader:
        for _ in range(50):
            batch = next(loader)
            x = torch.cat([x for x, _ in batch.micro_batches])
            y = torch.cat([y for _, y in batch.micro_batches])
            rows.append(torch.cat([x, y[:, -1:]], dim=1).numpy())
    np.save(out, np.stack(rows))
    """
)


def test_four_processes_reading_the_same_shards_each_get_exactly_their_slices(
    shards: Path, tmp_path: Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("MESHFORGE_DATA_DELAY_S", None)
    outs = [tmp_path / f"rank-{r}.npy" for r in range(4)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(shards), str(r), str(outs[r]), str(SEQ_LEN)], env=env
        )
        for r in range(4)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{r}").exists() for r in range(4)):
        assert time.monotonic() < deadline and all(p.poll() in (None, 0) for p in procs)
        time.sleep(0.05)
    (tmp_path / "go").touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    got = [np.load(out) for out in outs]  # [rank][step, 4 sequences, seq_len + 1]

    tokens = np.asarray(load_tokens(str(shards), 0.05).train[:]).astype(np.int64)
    for step in range(50):
        offsets = global_batch_offsets(5, step, len(tokens), SEQ_LEN, 16)
        expected = tokens[offsets[:, None] + np.arange(SEQ_LEN + 1)]
        for r in range(4):  # rank r holds sequences [4r, 4r + 4) of the global batch
            np.testing.assert_array_equal(got[r][step], expected[4 * r : 4 * r + 4])
        # together: the whole global batch, in order, nothing twice and nothing missing
        np.testing.assert_array_equal(np.concatenate([g[step] for g in got]), expected)


def _snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    return {
        p.name: (p.stat().st_mtime_ns, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(directory.iterdir())
    }


def test_reading_shards_writes_nothing_and_takes_no_lock(
    shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _snapshot(shards)
    touched: list[str] = []
    inside = str(shards.resolve())

    def _ours(path: object) -> bool:
        try:
            return os.path.realpath(os.fspath(path)).startswith(inside)  # type: ignore[arg-type]
        except TypeError:
            return False  # a file descriptor

    real_open, real_os_open = builtins.open, os.open

    def checked_open(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        if _ours(file) and any(c in mode for c in "wax+"):
            touched.append(f"open({file}, {mode!r})")
        return real_open(file, mode, *args, **kwargs)

    def checked_os_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
        if _ours(path) and flags & writing:
            touched.append(f"os.open({path}, {flags:#o})")
        return real_os_open(path, flags, *args, **kwargs)

    def no_lock(name: str):  # type: ignore[no-untyped-def]
        def lock(*args, **kwargs):  # type: ignore[no-untyped-def]
            touched.append(f"fcntl.{name}{args}")
            raise AssertionError(f"the read path took a lock: fcntl.{name}")

        return lock

    monkeypatch.setattr(builtins, "open", checked_open)
    monkeypatch.setattr(io, "open", checked_open)
    monkeypatch.setattr(os, "open", checked_os_open)
    for name in ("flock", "lockf"):
        monkeypatch.setattr(fcntl, name, no_lock(name))

    check_source(str(shards))
    train = load_tokens(str(shards), 0.05, seq_len=SEQ_LEN).train
    for rank in range(2):
        with DistributedBatchLoader(train, SEQ_LEN, 8, 2, rank, 2, prefetch=2, readers=2) as dl:
            _all_rows(dl, 10)
    monkeypatch.undo()
    assert touched == []
    assert _snapshot(shards) == before  # no lock files, no new files, nothing rewritten


# -- the loader: reader threads, prefetch, the delay hook ---------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_one_and_three_readers_give_identical_batches(shards: Path, prefetch: int) -> None:
    train = load_tokens(str(shards), 0.05).train
    kwargs = dict(seq_len=SEQ_LEN, global_batch=24, micro_batch=2, dp_rank=1, dp_size=2, seed=9)
    with (
        DistributedBatchLoader(train, **kwargs, prefetch=prefetch, readers=1) as one,
        DistributedBatchLoader(train, **kwargs, prefetch=prefetch, readers=3) as three,
    ):
        assert three.readers == 3
        for a, b in zip(_all_rows(one, 12), _all_rows(three, 12), strict=True):
            np.testing.assert_array_equal(a, b)
    assert not any(t.name.startswith("meshforge-read") for t in threading.enumerate())


def test_the_delay_hook_makes_a_slow_reader_and_readers_share_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = np.arange(10_000, dtype=np.uint16)
    monkeypatch.setenv("MESHFORGE_DATA_DELAY_S", "0.02")  # per sequence read

    def wait_of_one_step(readers: int, dp_rank: int = 0) -> float:
        with DistributedBatchLoader(
            tokens, SEQ_LEN, 16, 4, dp_rank, 2, prefetch=0, readers=readers
        ) as loader:
            next(loader)
            return loader.last_wait_s

    one, four = wait_of_one_step(1), wait_of_one_step(4)
    assert one >= 8 * 0.02  # 8 sequences on this rank, one reader
    assert four < one * 0.6  # four readers sleep side by side
    monkeypatch.setenv("MESHFORGE_DATA_DELAY_S", "0.02:1")  # dp rank 1 only
    assert wait_of_one_step(1, dp_rank=0) < 0.1 <= wait_of_one_step(1, dp_rank=1)


# -- URL sources (fsspec) --------------------------------------------------------------------


def _copy_to_memory(local: Path, prefix: str) -> str:
    import fsspec

    fs = fsspec.filesystem("memory")
    for f in local.iterdir():
        fs.pipe_file(f"/{prefix}/{f.name}", f.read_bytes())
    return f"memory://{prefix}"


def test_a_url_source_is_copied_once_into_the_cache_and_read_like_local_shards(
    shards: Path, tmp_path: Path
) -> None:
    import fsspec

    url = _copy_to_memory(shards, "bucket-a/shards")
    cache = tmp_path / "cache"
    splits = load_tokens(url, 0.05, seq_len=SEQ_LEN, cache_dir=cache)
    local = load_tokens(str(shards), 0.05)
    np.testing.assert_array_equal(splits.train[:], local.train[:])
    copy = remote_cache_path(url, cache)
    assert sorted(p.name for p in copy.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in shards.iterdir()
    )
    assert not list(copy.glob("*.tmp")) and not list(copy.glob(".*.tmp"))

    # a second load reads nothing but the index from the remote
    fs = fsspec.filesystem("memory")
    opened: list[str] = []
    real = fs.open
    fs.open = lambda path, *a, **k: opened.append(path) or real(path, *a, **k)  # type: ignore[method-assign]
    try:
        load_tokens(url, 0.05, cache_dir=cache)
        assert [p for p in opened if p.endswith(".bin")] == []
        # a changed shard (its sha256 in the index changes too) is fetched again
        index = json.loads(fs.cat_file("/bucket-a/shards/index.json"))
        data = fs.cat_file("/bucket-a/shards/shard-00000.bin")
        flipped = bytes([data[0] ^ 1]) + data[1:]
        entry = index["shards"][0]  # a small shard: its head and tail are the whole file
        for key in ("sha256", "head_sha256", "tail_sha256"):
            if key in entry:
                entry[key] = hashlib.sha256(flipped).hexdigest()
        fs.pipe_file("/bucket-a/shards/shard-00000.bin", flipped)
        fs.pipe_file("/bucket-a/shards/index.json", json.dumps(index).encode())
        opened.clear()
        assert load_tokens(url, 0.05, cache_dir=cache).train[0] == flipped[0]
        assert [Path(p).name for p in opened if p.endswith(".bin")] == ["shard-00000.bin"]
    finally:
        del fs.open


def test_a_remote_shard_that_does_not_match_its_sha256_is_refused(
    shards: Path, tmp_path: Path
) -> None:
    import fsspec

    url = _copy_to_memory(shards, "bucket-b/shards")
    fsspec.filesystem("memory").pipe_file("/bucket-b/shards/shard-00001.bin", b"\0" * 14_000)
    with pytest.raises(DataError, match=r"memory://bucket-b/shards: shard-00001\.bin does not"):
        load_tokens(url, 0.05, cache_dir=tmp_path / "cache")
    assert not (remote_cache_path(url, tmp_path / "cache") / "index.json").exists()


def test_remote_bin_files_and_train_val_directories_are_fetched(tmp_path: Path) -> None:
    _write_bin(tmp_path / "owt" / "train.bin", np.arange(3_000) % 256)
    _write_bin(tmp_path / "owt" / "val.bin", np.arange(500) % 256)
    cache = tmp_path / "cache"
    directory = load_tokens(f"file://{tmp_path / 'owt'}", 0.1, vocab_size=256, cache_dir=cache)
    assert len(directory.train) == 3_000 and len(directory.val) == 500
    single = load_tokens(f"file://{tmp_path / 'owt' / 'train.bin'}", 0.1, cache_dir=cache)
    assert len(single.train) + len(single.val) == 3_000


def test_ranks_filling_one_cache_at_once_never_corrupt_it(shards: Path, tmp_path: Path) -> None:
    url, cache = f"file://{shards}", tmp_path / "cache"
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            fetch_remote(url, cache)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    copy = remote_cache_path(url, cache)
    for f in shards.iterdir():
        assert (copy / f.name).read_bytes() == f.read_bytes()
    assert not [p.name for p in copy.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed")
def test_a_missing_fsspec_backend_is_one_line_naming_the_pip_package(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.source s3://bucket/shards: .*pip install s3fs"):
        load_tokens("s3://bucket/shards", 0.05)
    with pytest.raises(DataError, match=r"nosuch://x: .*nosuch"):
        check_source("nosuch://x")
    config = tmp_path / "job.yaml"
    config.write_text("data:\n  source: s3://bucket/shards\n")
    proc = meshforge(["train", str(config), "--nproc", "1", "--run-dir", str(tmp_path / "run")])
    assert_one_line_error(proc, "s3://bucket/shards", "pip install s3fs")


def test_a_file_url_source_with_a_cache_dir_trains_on_two_ranks(
    shards: Path, tmp_path: Path, job_factory
) -> None:
    cache = tmp_path / "shard-cache"
    job = job_factory(
        {
            "data": {"source": f"file://{shards}", "cache_dir": str(cache)},
            "train": {"steps": 6},
            "observe": {"log_every": 3},
        }
    )
    user_cache = tmp_path / "user-cache"
    job.train(2, env={"MESHFORGE_CACHE": str(user_cache)})  # both ranks fill the cache at once
    assert job.report["steps"] == 6
    copy = remote_cache_path(f"file://{shards}", cache)
    assert (copy / "index.json").is_file()
    assert not (user_cache / "remote").exists()  # data.cache_dir, not the default
    assert not [p.name for p in copy.iterdir() if p.name.endswith(".tmp")]
