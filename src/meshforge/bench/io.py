"""`meshforge bench io PATH`: can the storage under the shards feed the job?

PATH is a shard directory (its ``index.json`` names the files and the token width), a
``.bin`` token file or a directory holding ``train.bin``/``val.bin``, or any directory
of files. The files are cut into blocks of ``--block`` bytes; a pass (one row) reads
them with N concurrent readers, threads or processes, through read-only memory maps as
the loader does (``np.memmap``, each block copied out), in one of two orders:

    sequential  reader j of N streams the j-th contiguous 1/N of the blocks, in order
    random      the blocks in a seeded random order, dealt round-robin to the readers
                (the loader's reads land at random offsets)

A pass stops at ``--seconds`` (default 2 s) or after ``--bytes`` in all, or when every
block has been read once (a block is never read twice in a pass: that would be a cache
read). The figures of a row:

    MB/s       bytes read by all readers / wall time of the pass (1 MB = 1e6 bytes)
    tokens/s   MB/s / bytes per token (the index's dtype; 2 for other files)
    p50/90/99  latency of one block read (ms), over every read of every reader
    scaling    MB/s at N readers / MB/s at 1 reader (the fewest run), same order

Before each pass the page cache is emptied of the files where the system allows it:
``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file (``--page-cache fadvise``, the
default: only these files' pages), and with ``drop``, as root, also writing 1 to
``/proc/sys/vm/drop_caches`` (the whole machine's page cache: other jobs on the node
feel it); ``keep`` does neither. Whether it worked is then measured, not assumed:
``mincore(2)`` counts the pages of the pass's first blocks still in memory, and a row
that starts with more than 5% of them cached is said to read from the cache.

With a job (``need_from_run``: a finished run's report.json; ``need_from_plan``: the
planner's tokens/s for a job config on a cluster), the aggregate read bandwidth the job
needs, tokens/s x bytes per token, is set against what one client measured here, and
the headroom is their ratio (per node: the measurement is one node's).
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.bench.sizes import parse_size as parse_size
from meshforge.errors import ConfigError, DataError
from meshforge.rundir.report import read_report, report_path

ORDERS = ("sequential", "random")
MODES = ("threads", "processes")
PAGE_CACHE = ("drop", "fadvise", "keep")
DEFAULT_SECONDS = 2.0
CACHED_WARNING = 0.05  # a pass starting with more of its first blocks cached reads the cache
_RESIDENCY_BLOCKS = 256  # blocks whose pages mincore() checks before a pass
_PAGE = mmap.PAGESIZE
_DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_INDEX = "index.json"
_TOKEN_BYTES = {"uint16": 2, "uint32": 4}
_OPEN_MAPS = 64  # memory maps a reader keeps open (each holds a file descriptor)


@dataclass(frozen=True)
class IoBenchOptions:
    path: str
    readers: tuple[int, ...] = (1, 2, 4)
    mode: str = "threads"
    orders: tuple[str, ...] = ORDERS
    seconds: float | None = None  # per pass; DEFAULT_SECONDS when neither budget is given
    max_bytes: int | None = None  # per pass, all readers together
    block_bytes: int = 4 << 20
    page_cache: str = "fadvise"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.readers or any(n < 1 for n in self.readers):
            shown = ",".join(str(n) for n in self.readers) or "(none)"
            raise ConfigError(f"--readers {shown}: counts must be >= 1")
        if self.mode not in MODES:
            raise ConfigError(f"--mode {self.mode}: expected one of {', '.join(MODES)}")
        bad = [o for o in self.orders if o not in ORDERS]
        if bad or not self.orders:
            raise ConfigError(
                f"--order {','.join(self.orders) or '(none)'}: expected {', '.join(ORDERS)}"
            )
        if self.seconds is not None and self.max_bytes is not None:
            raise ConfigError("give --seconds or --bytes, not both")
        if self.seconds is not None and not self.seconds > 0:
            raise ConfigError(f"--seconds {self.seconds}: must be > 0")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ConfigError(f"--bytes {self.max_bytes}: must be >= 1")
        if self.block_bytes < 1:
            raise ConfigError(f"--block {self.block_bytes}: must be >= 1 byte")
        if self.page_cache not in PAGE_CACHE:
            raise ConfigError(f"--page-cache {self.page_cache}: expected {', '.join(PAGE_CACHE)}")

    @property
    def budget_s(self) -> float | None:
        if self.max_bytes is not None:
            return None
        return self.seconds if self.seconds is not None else DEFAULT_SECONDS


# -- what is read --------------------------------------------------------------------------


@dataclass(frozen=True)
class DataFiles:
    root: str
    kind: str  # shards | bin | files
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    token_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def _shard_files(root: Path) -> tuple[list[Path], int]:
    try:
        index = json.loads((root / _INDEX).read_text())
        names = [entry["file"] for entry in index["shards"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{root / _INDEX}: not a readable shard index") from None
    return [root / name for name in names], _TOKEN_BYTES.get(index.get("dtype"), 2)


def find_files(path: str | os.PathLike[str]) -> DataFiles:
    """The files of PATH that the benchmark reads, as the loader would find them."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"{path}: no such file or directory")
    token_bytes = 2
    if root.is_file():
        kind, files = ("bin" if root.suffix == ".bin" else "files"), [root]
    elif (root / _INDEX).is_file():
        kind = "shards"
        files, token_bytes = _shard_files(root)
    elif (root / "train.bin").is_file():
        kind = "bin"
        files = [root / n for n in ("train.bin", "val.bin") if (root / n).is_file()]
    else:
        kind = "files"
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
    sizes = []
    for f in files:
        try:
            sizes.append(f.stat().st_size)
        except OSError as exc:
            raise DataError(f"{f}: cannot read ({exc.strerror})") from None
    kept = [(str(f), s) for f, s in zip(files, sizes, strict=True) if s > 0]
    if not kept:
        raise DataError(f"{path}: no non-empty files to read")
    return DataFiles(
        str(root), kind, tuple(f for f, _ in kept), tuple(s for _, s in kept), token_bytes
    )


def plan_blocks(data: DataFiles, block_bytes: int) -> np.ndarray:
    """int64 [n, 3]: (file index, offset, length) of every block, in file order."""
    rows = []
    for i, size in enumerate(data.sizes):
        offsets = np.arange(0, size, block_bytes, dtype=np.int64)
        lengths = np.minimum(block_bytes, size - offsets)
        rows.append(np.stack([np.full_like(offsets, i), offsets, lengths], axis=1))
    return np.concatenate(rows)


def reader_blocks(blocks: np.ndarray, order: str, readers: int, seed: int) -> list[np.ndarray]:
    """Each reader's blocks, in the order it reads them (module docstring)."""
    if order == "sequential":
        return [part for part in np.array_split(blocks, readers)]
    shuffled = blocks[np.random.default_rng([seed, readers]).permutation(len(blocks))]
    return [shuffled[j::readers] for j in range(readers)]


# -- the page cache ------------------------------------------------------------------------


def drop_page_cache(files: tuple[str, ...], how: str) -> str:
    """Empty the page cache of ``files`` as far as allowed; returns what was used."""
    if how == "keep":
        return "not dropped (--page-cache keep)"
    used = []
    advised = 0
    for name in files:
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += 1
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)
    if advised:
        used.append("posix_fadvise(POSIX_FADV_DONTNEED)")
    if how == "drop" and os.geteuid() == 0:
        try:
            _DROP_CACHES.write_text("1\n")
            used.append(str(_DROP_CACHES))
        except OSError:
            pass
    return " + ".join(used) if used else "nothing allowed here"


_libc: Any = None


def _mincore() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc.mincore


def resident_fraction(files: tuple[str, ...], blocks: np.ndarray) -> float | None:
    """Share of the pages of ``blocks`` in the page cache now (mincore(2); it reads
    nothing), or None where mincore is unavailable."""
    try:
        mincore = _mincore()
    except (OSError, AttributeError):
        return None
    total = cached = 0
    for i, offset, length in blocks.tolist():
        start = offset - offset % _PAGE
        size = length + offset - start
        mapped = np.memmap(files[i], dtype=np.uint8, mode="r", offset=start, shape=(size,))
        pages = (size + _PAGE - 1) // _PAGE
        vec = np.zeros(pages, dtype=np.uint8)
        if mincore(mapped.ctypes.data, size, vec.ctypes.data) != 0:
            return None
        total += pages
        cached += int(np.count_nonzero(vec & 1))
        del mapped
    return cached / total if total else None


# -- one pass ------------------------------------------------------------------------------


@dataclass
class ReaderStats:
    bytes: int
    latencies_s: list[float]
    first_s: float  # time.monotonic() of the first read's start
    last_s: float  # and of the last read's end


def read_blocks(
    files: tuple[str, ...],
    blocks: np.ndarray,
    budget_s: float | None,
    budget_bytes: int | None,
    block_bytes: int,
) -> ReaderStats:
    """Read ``blocks`` in order through memory maps (copied out, as the loader copies
    its sequences) until a budget runs out; one reader's work in a pass."""
    maps: dict[int, np.ndarray] = {}
    buf = np.zeros(block_bytes, dtype=np.uint8)
    buf.fill(1)  # touched now, so the first read does not pay for its pages
    latencies: list[float] = []
    done = 0
    first = time.monotonic()
    deadline = first + budget_s if budget_s is not None else math.inf
    end = first
    for i, offset, length in blocks.tolist():
        if end >= deadline or (budget_bytes is not None and done >= budget_bytes):
            break
        mapped = maps.get(i)
        if mapped is None:
            if len(maps) >= _OPEN_MAPS:
                del maps[next(iter(maps))]
            mapped = maps[i] = np.memmap(files[i], dtype=np.uint8, mode="r")
        start = time.monotonic()
        if budget_bytes is not None:
            length = min(length, budget_bytes - done)  # exactly the budget, no more
        np.copyto(buf[:length], mapped[offset : offset + length])
        end = time.monotonic()
        latencies.append(end - start)
        done += length
    return ReaderStats(done, latencies, first, end)


def _process_reader(args: tuple, barrier: Any, results: Any) -> None:
    try:
        barrier.wait()
        results.put(asdict(read_blocks(*args)))
    except BaseException as exc:  # reported to the parent, which raises it
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def run_readers(
    files: tuple[str, ...],
    parts: list[np.ndarray],
    mode: str,
    budget_s: float | None,
    budget_bytes: int | None,
    block_bytes: int,
) -> list[ReaderStats]:
    """One pass: every reader starts together (a barrier), each on its own blocks."""
    share = None if budget_bytes is None else -(-budget_bytes // len(parts))
    work = [(files, part, budget_s, share, block_bytes) for part in parts]
    if mode == "threads":
        barrier = threading.Barrier(len(parts))
        stats: list[ReaderStats | BaseException | None] = [None] * len(parts)

        def reader(j: int) -> None:
            try:
                barrier.wait()
                stats[j] = read_blocks(*work[j])
            except BaseException as exc:  # raised below, in the caller's thread
                stats[j] = exc

        threads = [threading.Thread(target=reader, args=(j,)) for j in range(len(parts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in stats:
            if isinstance(s, BaseException):
                raise DataError(f"bench io: a reader failed: {type(s).__name__}: {s}")
        return [s for s in stats if isinstance(s, ReaderStats)]
    ctx = multiprocessing.get_context("spawn")  # no fork of a threaded parent
    barrier, results = ctx.Barrier(len(parts)), ctx.Queue()
    procs = [ctx.Process(target=_process_reader, args=(w, barrier, results)) for w in work]
    for p in procs:
        p.start()
    timeout = 120.0 + (budget_s or 0.0)
    try:
        got = [results.get(timeout=timeout) for _ in procs]
    except queue.Empty:
        raise DataError(f"bench io: a reader process gave no result in {timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        raise DataError(f"bench io: a reader process failed: {errors[0]}")
    return [ReaderStats(**g) for g in got]


# -- rows ------------------------------------------------------------------------------------


@dataclass
class IoRow:
    order: str
    readers: int
    bytes: int
    reads: int
    seconds: float
    mb_per_s: float
    tokens_per_s: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    scaling: float | None  # mb_per_s / mb_per_s at the fewest readers of this order
    cached_before: float | None  # share of the first blocks' pages cached at the start
    whole_data: bool  # every block was read before the budget ran out


def measure_row(
    data: DataFiles, blocks: np.ndarray, order: str, readers: int, options: IoBenchOptions
) -> tuple[IoRow, str]:
    """(the row, how the page cache was dropped before it)."""
    parts = reader_blocks(blocks, order, readers, options.seed)
    dropped = drop_page_cache(data.files, options.page_cache)
    first = np.concatenate([p[: max(1, _RESIDENCY_BLOCKS // readers)] for p in parts])
    cached = resident_fraction(data.files, first)
    stats = run_readers(
        data.files, parts, options.mode, options.budget_s, options.max_bytes, options.block_bytes
    )
    done = sum(s.bytes for s in stats)
    reads = sum(len(s.latencies_s) for s in stats)
    wall = max(s.last_s for s in stats) - min(s.first_s for s in stats)
    wall = max(wall, 1e-9)
    lat_ms = np.array([x for s in stats for x in s.latencies_s]) * 1e3
    p50, p90, p99 = (
        (float(np.percentile(lat_ms, q)) for q in (50, 90, 99)) if reads else (None,) * 3
    )
    row = IoRow(
        order=order,
        readers=readers,
        bytes=done,
        reads=reads,
        seconds=wall,
        mb_per_s=done / wall / 1e6,
        tokens_per_s=done / data.token_bytes / wall,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        scaling=None,
        cached_before=cached,
        whole_data=done == int(blocks[:, 2].sum()),
    )
    return row, dropped


def add_scaling(rows: list[IoRow]) -> None:
    for order in dict.fromkeys(r.order for r in rows):
        mine = [r for r in rows if r.order == order]
        base = min(mine, key=lambda r: r.readers)
        for r in mine:
            r.scaling = r.mb_per_s / base.mb_per_s if base.mb_per_s > 0 else None


# -- the job's need ------------------------------------------------------------------------


@dataclass(frozen=True)
class JobNeed:
    """What a job reads: tokens/s per device, on `devices` devices over `nodes` nodes."""

    source: str  # where the tokens/s came from, in words
    tokens_per_s_per_device: float
    devices: int
    nodes: int
    bytes_per_token: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_s_per_device * self.devices

    @property
    def bytes_per_s(self) -> float:
        """Aggregate read bandwidth of the whole job: tokens/s x bytes per token."""
        return self.tokens_per_s * self.bytes_per_token

    @property
    def bytes_per_s_per_node(self) -> float:
        return self.bytes_per_s / self.nodes

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "bytes_per_s": self.bytes_per_s,
            "bytes_per_s_per_node": self.bytes_per_s_per_node,
        }


def _cluster_size(nodes: int | None, gpus_per_node: int | None) -> None:
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes {nodes}: must be >= 1")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {gpus_per_node}: must be >= 1")


def need_from_run(
    run_dir: str | os.PathLike[str],
    bytes_per_token: int,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
) -> JobNeed:
    """A finished run's tokens/s per device (report.json), scaled to ``nodes`` x
    ``gpus_per_node`` devices (default: the run's own size)."""
    _cluster_size(nodes, gpus_per_node)
    path = report_path(run_dir)
    try:
        report = read_report(run_dir)
    except DataError:  # not readable, not JSON, not an object
        raise ConfigError(f"{path}: no tokens_per_s and world_size in it") from None
    if report is None:
        raise ConfigError(f"--run {run_dir}: no report.json in it")
    try:
        tokens_per_s = float(report["tokens_per_s"])
        world = int(report["world_size"])
        run_nodes = int(report.get("nodes") or 1)
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{path}: no tokens_per_s and world_size in it") from None
    if not tokens_per_s > 0 or world < 1:
        raise ConfigError(f"{path}: tokens_per_s and world_size must be > 0")
    per_node = gpus_per_node or max(world // run_nodes, 1)
    n_nodes = nodes or (run_nodes if gpus_per_node is None else max(world // per_node, 1))
    devices = n_nodes * per_node if (nodes or gpus_per_node) else world
    return JobNeed(
        f"run {run_dir} (report.json: {tokens_per_s:,.0f} tokens/s on {world} device(s))",
        tokens_per_s / world,
        devices,
        n_nodes,
        bytes_per_token,
    )


def need_from_plan(
    config: str | os.PathLike[str],
    nodes: int,
    gpus_per_node: int,
    bytes_per_token: int,
    gpu: str = "h100",
) -> JobNeed:
    """The planner's tokens/s for the job in ``config`` on ``nodes`` x ``gpus_per_node``
    catalogue GPUs (plan/): its own layout where it fixes one, the best layout where it
    says ``parallel: auto``; a global batch the data-parallel degree does not divide is
    rounded up to one it does (weak scaling, said in the source line)."""
    from meshforge.config import load_config
    from meshforge.plan.core.cluster import build_cluster
    from meshforge.plan.core.flops import shape_of
    from meshforge.plan.core.layout import Training
    from meshforge.plan.core.search import LayoutChoice, best_layout

    _cluster_size(nodes, gpus_per_node)
    cfg = load_config(config)
    n = nodes * gpus_per_node
    t, p = cfg.train, cfg.parallel
    if p == "auto":
        choice, unit = LayoutChoice(micro_batch=t.micro_batch), n * t.micro_batch
    else:
        if p.mode == "parameter_server":
            raise ConfigError(f"{config}: the planner models parallel.mode=collective only")
        if n % (p.tp * p.pp):
            raise ConfigError(
                f"{nodes} x {gpus_per_node} devices are not divisible by "
                f"parallel.tp x parallel.pp = {p.tp * p.pp}"
            )
        choice = LayoutChoice(
            tp=p.tp, pp=p.pp, zero=p.zero, micro_batch=t.micro_batch,
            virtual_stages=p.virtual_stages, sequence_parallel=p.sequence_parallel,
        )  # fmt: skip
        unit = n // (p.tp * p.pp) * t.micro_batch
    global_batch = -(-t.global_batch // unit) * unit
    training = Training(
        global_batch, t.micro_batch, cfg.precision.dtype, t.activation_checkpointing
    )
    cluster = build_cluster(n, gpu, gpus_per_node)
    prediction = best_layout(shape_of(cfg), training, cluster, choice)
    tokens_per_s = prediction.tokens_per_s or 0.0
    scaled = "" if global_batch == t.global_batch else f", global_batch {global_batch}"
    source = (
        f"planner: {Path(config).name} on {nodes} x {gpus_per_node} {gpu} "
        f"({prediction.layout.dp}-way dp{scaled}: {tokens_per_s:,.0f} tokens/s)"
    )
    return JobNeed(source, tokens_per_s / n, n, nodes, bytes_per_token)


@dataclass(frozen=True)
class Verdict:
    measured_bytes_per_s: float  # the best row of the loader's order (random), one client
    row: str  # which row that was
    headroom: float  # measured / the job's need per node
    word: str  # OK | TIGHT | TOO SLOW
    line: str


def verdict(need: JobNeed, rows: list[IoRow]) -> Verdict:
    """Headroom = what this client read / what one node of the job needs."""
    pool = [r for r in rows if r.order == "random"] or rows
    best = max(pool, key=lambda r: r.mb_per_s)
    measured = best.mb_per_s * 1e6
    headroom = measured / need.bytes_per_s_per_node if need.bytes_per_s_per_node > 0 else math.inf
    if headroom >= 2:
        word = "OK"
        line = f"OK: this node reads {headroom:,.1f}x what each node of the job needs"
    elif headroom >= 1:
        word = "TIGHT"
        line = (
            f"TIGHT: {headroom:.2f}x what each node needs, under 2x: expect data waits when "
            "the storage is busy (more data.readers, data.prefetch, or faster storage)"
        )
    else:
        word = "TOO SLOW"
        line = (
            f"TOO SLOW: this node reads {headroom:.2f}x what each node needs; the devices "
            "would wait for data"
        )
    if need.nodes > 1:
        line += (
            f"; the storage must serve {_rate(need.bytes_per_s)} to {need.nodes} nodes at "
            "once (measured here: one client)"
        )
    return Verdict(measured, f"{best.order}, {best.readers} reader(s)", headroom, word, line)


# -- the whole benchmark and its table ---------------------------------------------------------


@dataclass
class IoBenchResult:
    data: DataFiles
    options: IoBenchOptions
    rows: list[IoRow] = field(default_factory=list)
    page_cache: list[str] = field(default_factory=list)  # how it was dropped, per row
    need: JobNeed | None = None

    @property
    def verdict(self) -> Verdict | None:
        return verdict(self.need, self.rows) if self.need is not None and self.rows else None

    @property
    def cache_reads(self) -> list[IoRow]:
        """Rows that started with their data in the page cache."""
        return [r for r in self.rows if (r.cached_before or 0) > CACHED_WARNING]

    def to_dict(self) -> dict[str, Any]:
        o, d, v = self.options, self.data, self.verdict
        return {
            "path": d.root,
            "kind": d.kind,
            "files": len(d.files),
            "total_bytes": d.total_bytes,
            "token_bytes": d.token_bytes,
            "mode": o.mode,
            "block_bytes": o.block_bytes,
            "seconds_per_row": o.budget_s,
            "bytes_per_row": o.max_bytes,
            "page_cache": {
                "requested": o.page_cache,
                "method": sorted(set(self.page_cache)),
                "rows_reading_cache": len(self.cache_reads),
            },
            "definition": "MB/s = bytes read by all readers / wall time of the pass, "
            "1 MB = 1e6 B; latency per block read; scaling = MB/s at N readers / at 1",
            "rows": [asdict(r) for r in self.rows],
            "scaling": {
                order: {r.readers: r.scaling for r in self.rows if r.order == order}
                for order in dict.fromkeys(r.order for r in self.rows)
            },
            "need": None if self.need is None else self.need.to_dict(),
            "verdict": None if v is None else asdict(v),
        }


def run_bench(
    options: IoBenchOptions,
    need: JobNeed | None = None,
    on_row: Callable[[IoRow, str], None] | None = None,
) -> IoBenchResult:
    data = find_files(options.path)
    blocks = plan_blocks(data, options.block_bytes)
    result = IoBenchResult(data, options, need=need)
    for order in options.orders:
        for readers in options.readers:
            row, dropped = measure_row(data, blocks, order, readers, options)
            result.rows.append(row)
            result.page_cache.append(dropped)
            if on_row is not None:
                on_row(row, dropped)
    add_scaling(result.rows)
    return result


def _rate(bytes_per_s: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:,.1f} {unit}"
    return f"{bytes_per_s:,.0f} B/s"


def _size(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def header_lines(data: DataFiles, options: IoBenchOptions) -> list[str]:
    budget = (
        f"{options.budget_s:g} s per row"
        if options.budget_s is not None
        else f"{_size(options.max_bytes or 0)} per row"
    )
    return [
        f"# meshforge bench io: {data.root} ({data.kind}: {len(data.files)} file(s), "
        f"{_size(data.total_bytes)}, {data.token_bytes} B/token)",
        f"# {options.mode}, block {_size(options.block_bytes)}, {budget}; "
        "MB/s = 1e6 B/s over the pass's wall time; latency per block read",
        f"#{'order':>11}  {'readers':>7}  {'MB/s':>9}  {'tokens/s':>14}  {'p50 ms':>8}  "
        f"{'p90 ms':>8}  {'p99 ms':>8}  {'reads':>7}  {'cached':>6}",
    ]


def _ms(value: float | None) -> str:
    return f"{value:8.3f}" if value is not None else f"{'-':>8}"


def format_row(row: IoRow) -> str:
    cached = f"{row.cached_before:.0%}" if row.cached_before is not None else "?"
    whole = "  (all data read)" if row.whole_data else ""
    return (
        f"{row.order:>12}  {row.readers:>7}  {row.mb_per_s:>9.1f}  {row.tokens_per_s:>14,.0f}  "
        f"{_ms(row.p50_ms)}  {_ms(row.p90_ms)}  {_ms(row.p99_ms)}  {row.reads:>7}  "
        f"{cached:>6}{whole}"
    )


def footer_lines(result: IoBenchResult) -> list[str]:
    lines = ["#"]
    for order in dict.fromkeys(r.order for r in result.rows):
        mine = [r for r in result.rows if r.order == order]
        base = min(r.readers for r in mine)
        steps = ", ".join(
            f"{r.readers}: {r.scaling:.2f}x" if r.scaling is not None else f"{r.readers}: -"
            for r in mine
        )
        lines.append(f"# scaling ({order}, MB/s at N readers / at {base}): {steps}")
    methods = ", ".join(sorted(set(result.page_cache)))
    lines.append(f"# page cache before each pass: {methods}")
    stale = result.cache_reads
    unknown = [r for r in result.rows if r.cached_before is None]
    if stale:
        worst = max(r.cached_before or 0 for r in stale)
        lines.append(
            f"# page cache NOT dropped: {len(stale)} of {len(result.rows)} pass(es) began with "
            f"up to {worst:.0%} of their first blocks in memory; those rows include page-cache "
            "reads, not only storage reads (see the cached column)"
        )
    elif unknown:
        lines.append("# page cache state unknown: mincore(2) is not available here")
    else:
        lines.append("# page cache dropped: every pass began with its data out of memory")
    need, v = result.need, result.verdict
    if need is not None and v is not None:
        lines += [
            "#",
            f"# job: {need.source}",
            f"#   {need.tokens_per_s_per_device:,.0f} tokens/s per device x {need.devices} "
            f"device(s) on {need.nodes} node(s) = {need.tokens_per_s:,.0f} tokens/s",
            f"#   needs {_rate(need.bytes_per_s)} in aggregate ({need.bytes_per_token} B/token), "
            f"{_rate(need.bytes_per_s_per_node)} per node",
            f"#   measured: {_rate(v.measured_bytes_per_s)} ({v.row}, one client)",
            f"#   headroom: {v.headroom:,.2f}x per node",
            f"verdict: {v.line}",
        ]
    return lines


def format_table(result: IoBenchResult) -> str:
    lines = header_lines(result.data, result.options)
    lines += [format_row(r) for r in result.rows]
    return "\n".join(lines + footer_lines(result))
