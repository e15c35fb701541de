"""`meshforge bench comm`: collective bus bandwidth, measured and printed as nccl-tests does.

For each collective and each size (a geometric series from --min-bytes to --max-bytes):
warm-up runs, then timed runs, each started after a barrier and timed by the wall clock
(with a device synchronise on CUDA); the time of a run is the slowest rank's, as a
collective ends when its last rank does. The figures follow nccl-tests'
doc/PERFORMANCE.md (REFERENCES.md):

    algbw = S / t                  S the collective's size (below), t the mean time
    busbw = algbw x factor         2(n-1)/n all_reduce; (n-1)/n all_gather,
                                   reduce_scatter, all_to_all; 1 broadcast

S is the buffer for all_reduce and broadcast, the gathered output for all_gather, the
input for reduce_scatter, and what each rank sends for all_to_all; sizes are rounded
down to whole elements (and to a multiple of n for the sharded collectives).

After the timed runs every collective runs once more on known values (rank r holds
r + 1, ...) and the elements that differ from the expected result are counted in the
#wrong column (summed over ranks); any wrong value fails the run (exit 1).

The collectives are torch.distributed's own; the process group comes from
`runtime.dist.distributed` (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshforge.bench.sizes import parse_size as parse_size
from meshforge.errors import ConfigError
from meshforge.plan.core.comm import busbw_factor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
ROOT = 0  # broadcast's source rank


def size_steps(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min_bytes, min_bytes*factor, ... up to max_bytes (nccl-tests' -b, -e, -f)."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = max(size + 1, int(size * factor))
    return sizes


@dataclass(frozen=True)
class CommBenchOptions:
    ops: tuple[str, ...] = OPS
    min_bytes: int = 1 << 10
    max_bytes: int = 256 << 20
    factor: float = 2.0
    warmup: int = 5
    iters: int = 20
    dtype: str = "float32"
    device: str = "auto"
    backend: str = "auto"
    as_json: bool = False

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise ConfigError(
                f"--ops {','.join(self.ops) or '(none)'}: unknown collective "
                f"{', '.join(unknown) or '(none given)'}; known: {', '.join(OPS)}"
            )
        if self.min_bytes < 1:
            raise ConfigError(f"--min-bytes {self.min_bytes}: must be at least 1 byte")
        if self.min_bytes > self.max_bytes:
            raise ConfigError(f"--min-bytes {self.min_bytes} is above --max-bytes {self.max_bytes}")
        if not self.factor > 1 or not math.isfinite(self.factor):
            raise ConfigError(f"--factor {self.factor}: must be greater than 1")
        if self.warmup < 0:
            raise ConfigError(f"--warmup {self.warmup}: must be >= 0")
        if self.iters < 1:
            raise ConfigError(f"--iters {self.iters}: must be >= 1")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: expected one of {', '.join(DTYPES)}")

    @property
    def sizes(self) -> list[int]:
        return size_steps(self.min_bytes, self.max_bytes, self.factor)

    def to_argv(self) -> list[str]:
        """The flags that give these options back (what each launched worker is given)."""
        argv = [
            *("--ops", ",".join(self.ops)),
            *("--min-bytes", str(self.min_bytes), "--max-bytes", str(self.max_bytes)),
            *("--factor", repr(self.factor), "--warmup", str(self.warmup)),
            *("--iters", str(self.iters), "--dtype", self.dtype),
            *("--device", self.device, "--backend", self.backend),
        ]
        return [*argv, "--json"] if self.as_json else argv


# -- what each collective moves and what it must produce ----------------------------------


def bus_bandwidth_gbps(op: str, size_bytes: int, time_s: float, world_size: int) -> float:
    """nccl-tests' busbw in GB/s (1e9 bytes/s): S / t x busbw_factor(op, n)."""
    return size_bytes / time_s * busbw_factor(op, world_size) / 1e9


def element_count(op: str, size_bytes: int, element_bytes: int, world_size: int) -> int:
    """Elements of the collective's size S: whole elements, and for the sharded
    collectives a multiple of the world size (each rank's share is whole)."""
    unit = world_size if op in ("all_gather", "reduce_scatter", "all_to_all") else 1
    return size_bytes // (element_bytes * unit) * unit


@dataclass
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor  # the same tensor for the in-place collectives


def make_buffers(
    op: str, count: int, dtype: torch.dtype, device: torch.device, world_size: int
) -> Buffers:
    share = count // world_size
    if op in ("all_reduce", "broadcast"):  # in place
        buf = torch.zeros(count, dtype=dtype, device=device)
        return Buffers(buf, buf)
    if op == "all_gather":
        return Buffers(
            torch.zeros(share, dtype=dtype, device=device),
            torch.zeros(count, dtype=dtype, device=device),
        )
    if op == "reduce_scatter":
        return Buffers(
            torch.zeros(count, dtype=dtype, device=device),
            torch.zeros(share, dtype=dtype, device=device),
        )
    return Buffers(  # all_to_all: each rank sends S and receives S
        torch.zeros(count, dtype=dtype, device=device),
        torch.zeros(count, dtype=dtype, device=device),
    )


def collective_call(op: str, bufs: Buffers) -> Callable[[], None]:
    # torch >= 2.10 names the flat-tensor collectives *_single; older ones *_tensor.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {
        "all_reduce": lambda: dist.all_reduce(bufs.send),
        "all_gather": lambda: all_gather(bufs.recv, bufs.send),
        "reduce_scatter": lambda: reduce_scatter(bufs.recv, bufs.send),
        "broadcast": lambda: dist.broadcast(bufs.send, ROOT),
        "all_to_all": lambda: dist.all_to_all_single(bufs.recv, bufs.send),
    }
    return calls[op]


def fill_known(op: str, bufs: Buffers, rank: int, n: int) -> None:
    """Known inputs: rank r holds r + 1; the sharded collectives mark each chunk too."""
    if op in ("all_reduce", "all_gather"):
        bufs.send.fill_(rank + 1)
    elif op == "broadcast":
        bufs.send.fill_(ROOT + 1 if rank == ROOT else 0)
    else:  # reduce_scatter: chunk j holds r + 1 + j; all_to_all: chunk j holds r*n + j + 1
        base = rank + 1 if op == "reduce_scatter" else rank * n + 1
        chunks = bufs.send.view(n, -1)
        chunks.copy_((base + torch.arange(n, device=chunks.device)).view(n, 1).to(chunks.dtype))
    if bufs.recv is not bufs.send:
        bufs.recv.zero_()


def expected_values(op: str, rank: int, n: int) -> torch.Tensor:
    """What this rank must hold afterwards: a scalar, or one value per chunk (n x 1)."""
    if op == "all_reduce":
        return torch.tensor(n * (n + 1) // 2)
    if op == "broadcast":
        return torch.tensor(ROOT + 1)
    if op == "all_gather":  # chunk i came from rank i
        return torch.arange(1, n + 1).view(n, 1)
    if op == "reduce_scatter":  # sum over ranks q of (q + 1 + rank)
        return torch.tensor(n * (n + 1) // 2 + n * rank)
    return (torch.arange(n) * n + rank + 1).view(n, 1)  # all_to_all: chunk i from rank i


def count_wrong(op: str, bufs: Buffers, rank: int, n: int) -> int:
    """Elements of this rank's result that differ from the expected values (after a run
    on `fill_known` inputs). Half-precision sums are allowed their rounding."""
    result = bufs.recv
    expected = expected_values(op, rank, n).to(device=result.device, dtype=result.dtype)
    if op in ("all_gather", "all_to_all"):
        result = result.view(n, -1)
    if result.dtype in (torch.float16, torch.bfloat16):
        ok = torch.isclose(result, expected, rtol=n * torch.finfo(result.dtype).eps, atol=0)
    else:
        ok = result == expected
    return int((~ok).sum())


# -- the measurement (a collective: every rank runs it) -----------------------------------


@dataclass
class CommRow:
    op: str
    size_bytes: int
    count: int  # elements of S
    type: str
    redop: str  # sum | none, as nccl-tests prints it
    root: int  # broadcast's root, else -1
    time_us: float  # mean over the timed runs (slowest rank each)
    min_time_us: float
    algbw_gbps: float
    busbw_gbps: float
    busbw_factor: float
    wrong: int


@dataclass
class CommBenchResult:
    world_size: int
    backend: str
    device: str
    dtype: str
    warmup: int
    iters: int
    rows: list[CommRow] = field(default_factory=list)

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.rows)

    def avg_busbw_gbps(self, op: str) -> float | None:
        values = [r.busbw_gbps for r in self.rows if r.op == op]
        return statistics.fmean(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        ops = list(dict.fromkeys(r.op for r in self.rows))
        return {
            "world_size": self.world_size,
            "backend": self.backend,
            "device": self.device,
            "dtype": self.dtype,
            "warmup": self.warmup,
            "iters": self.iters,
            "definition": "algbw = size / time; busbw = algbw x factor (nccl-tests); "
            "time = mean over runs of the slowest rank; GB/s = 1e9 bytes/s",
            "rows": [asdict(r) for r in self.rows],
            "avg_busbw_gbps": {op: self.avg_busbw_gbps(op) for op in ops},
            "wrong": self.wrong,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_op(
    op: str, size_bytes: int, options: CommBenchOptions, device: torch.device
) -> CommRow | None:
    """One row: warm-up, timed runs, the correctness run, reduced over the ranks. None
    where the size holds no whole element (every rank skips it alike)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, options.dtype)
    element_bytes = torch.empty(0, dtype=dtype).element_size()
    count = element_count(op, size_bytes, element_bytes, n)
    if count == 0:
        return None
    bufs = make_buffers(op, count, dtype, device, n)
    run = collective_call(op, bufs)
    for _ in range(options.warmup):
        run()
    _sync(device)
    times_s = []
    for _ in range(options.iters):
        dist.barrier()
        start = time.perf_counter()
        run()
        _sync(device)
        times_s.append(time.perf_counter() - start)
    fill_known(op, bufs, rank, n)
    run()
    _sync(device)
    wrong = torch.tensor([count_wrong(op, bufs, rank, n)], dtype=torch.int64, device=device)
    slowest = torch.tensor(times_s, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a run ends with its slowest rank
    dist.all_reduce(wrong)
    mean_s, min_s = slowest.mean().item(), slowest.min().item()
    size = count * element_bytes
    return CommRow(
        op=op,
        size_bytes=size,
        count=count,
        type=options.dtype,
        redop="sum" if op in ("all_reduce", "reduce_scatter") else "none",
        root=ROOT if op == "broadcast" else -1,
        time_us=mean_s * 1e6,
        min_time_us=min_s * 1e6,
        algbw_gbps=size / mean_s / 1e9,
        busbw_gbps=bus_bandwidth_gbps(op, size, mean_s, n),
        busbw_factor=busbw_factor(op, n),
        wrong=int(wrong.item()),
    )


def measure_sizes(op: str, options: CommBenchOptions, device: torch.device) -> Iterator[CommRow]:
    """The rows of one collective, size by size as they are measured."""
    seen: set[int] = set()
    for size in options.sizes:
        row = measure_op(op, size, options, device)
        if row is None or row.size_bytes in seen:  # rounded onto a size already run
            continue
        seen.add(row.size_bytes)
        yield row


def new_result(options: CommBenchOptions, device: torch.device, backend: str) -> CommBenchResult:
    return CommBenchResult(
        world_size=dist.get_world_size(),
        backend=backend,
        device=str(device),
        dtype=options.dtype,
        warmup=options.warmup,
        iters=options.iters,
    )


def measure(options: CommBenchOptions, device: torch.device, backend: str) -> CommBenchResult:
    """Every collective at every size."""
    result = new_result(options, device, backend)
    for op in options.ops:
        result.rows.extend(measure_sizes(op, options, device))
    return result


# -- nccl-tests' table ------------------------------------------------------------------------

_COLUMNS = (
    f"#{'size':>11}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>5}  "
    f"{'time':>9}  {'min':>9}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}\n"
    f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>5}  "
    f"{'(us)':>9}  {'(us)':>9}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}"
)
_FACTOR_TEXT = {
    "all_reduce": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "broadcast": "1",
}


def header_lines(result: CommBenchResult) -> list[str]:
    return [
        f"# meshforge bench comm: {result.world_size} rank(s), backend {result.backend}, "
        f"device {result.device}, type {result.dtype}, warm-up {result.warmup}, "
        f"timed runs {result.iters}",
        "# time: mean (and min) over the timed runs of the slowest rank; "
        "algbw = size / time; busbw = algbw x factor (nccl-tests); GB/s = 1e9 B/s",
    ]


def op_header_lines(op: str, world_size: int) -> list[str]:
    formula, factor = _FACTOR_TEXT[op], busbw_factor(op, world_size)
    value = "" if formula == "1" else f" = {factor:.3g} at n = {world_size}"
    return ["#", f"# {op}  (busbw = algbw x {formula}{value})", _COLUMNS]


def format_row(row: CommRow) -> str:
    return (
        f"{row.size_bytes:>12}  {row.count:>12}  {row.type:>8}  {row.redop:>6}  {row.root:>5}  "
        f"{row.time_us:>9.1f}  {row.min_time_us:>9.1f}  {row.algbw_gbps:>7.2f}  "
        f"{row.busbw_gbps:>7.2f}  {row.wrong:>6}"
    )


def footer_lines(result: CommBenchResult) -> list[str]:
    ops = list(dict.fromkeys(r.op for r in result.rows))
    lines = ["#"]
    for op in ops:
        lines.append(f"# Avg bus bandwidth {op:<15}: {result.avg_busbw_gbps(op):.3f} GB/s")
    verdict = "OK" if result.wrong == 0 else "FAILED"
    lines.append(f"# Out of bounds values : {result.wrong} {verdict}")
    return lines


def format_table(result: CommBenchResult) -> str:
    lines = header_lines(result)
    for op in dict.fromkeys(r.op for r in result.rows):
        lines += op_header_lines(op, result.world_size)
        lines += [format_row(r) for r in result.rows if r.op == op]
    return "\n".join(lines + footer_lines(result))
