"""Memory health: what the CUDA caching allocator and the host say, turned into advice.

Four signs, each read from counters the run already has:

fragmentation  reserved memory that holds no tensor, (reserved - allocated) / reserved:
               the allocator keeps blocks it cannot reuse for the sizes now asked for.
               Only judged on ranks reserving at least `min_reserved_bytes`, where the
               share means something.
retries        `num_alloc_retries`: an allocation failed, the allocator freed its cached
               blocks (synchronising the device) and tried again. Memory pressure, and a
               slow step.
ooms           `num_ooms`: out-of-memory errors raised (and perhaps caught).
host memory    available below 10% of the host's total: the next allocation may swap or
               meet the kernel's OOM killer.

`memory_advice` is pure: it takes numbers and returns one short sentence per finding,
ranks that share a finding named together.
"""

from __future__ import annotations

from typing import Any

import torch

HOST_AVAILABLE_FLOOR = 0.10  # host memory is "nearly exhausted" below this share available

# torch.cuda.memory_stats key -> our name
_CUDA_STATS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
    "allocated_bytes.all.peak": "peak_bytes",
}


def cuda_memory_stats(device: torch.device | str | int | None) -> dict[str, int] | None:
    """The caching allocator's counters for `device`; None off CUDA."""
    if device is None:
        return None
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats(device)
    return {ours: int(stats.get(key, 0)) for key, ours in _CUDA_STATS.items()}


def fragmentation(allocated: int, reserved: int) -> float:
    """Share of reserved memory holding no tensor: (reserved - allocated) / reserved."""
    if reserved <= 0:
        return 0.0
    return max(reserved - allocated, 0) / reserved


def memory_advice(
    per_rank: list[dict[str, Any]],
    host_memory: dict[str, Any] | None = None,
    threshold: float = 0.3,
    min_reserved_bytes: int = 1 << 30,
) -> list[str]:
    """Advice on the ranks' memory, most severe first; [] when all is well.

    per_rank: {"rank", "allocated_bytes", "reserved_bytes", "alloc_retries", "ooms"} per
    rank (None or 0 where not measured, as on CPU). host_memory: {"mem_available_bytes",
    "mem_total_bytes", "host"} of a host, or None."""
    ooms: dict[int, int] = {}
    retries: dict[int, int] = {}
    fragmented: dict[int, float] = {}
    for entry in per_rank:
        rank = entry.get("rank")
        if rank is None:
            continue
        if entry.get("ooms"):
            ooms[rank] = int(entry["ooms"])
        if entry.get("alloc_retries"):
            retries[rank] = int(entry["alloc_retries"])
        allocated, reserved = entry.get("allocated_bytes"), entry.get("reserved_bytes")
        if allocated is not None and reserved and reserved >= min_reserved_bytes:
            share = fragmentation(allocated, reserved)
            if share > threshold:
                fragmented[rank] = share

    advice = []
    if ooms:
        advice.append(
            f"{_ranks(ooms)} hit {_span(ooms, '{:d}')} CUDA out-of-memory "
            f"error{_plural(ooms)}: set train.activation_checkpointing (selective or full) "
            "or lower train.micro_batch."
        )
    if retries:
        advice.append(
            f"{_ranks(retries)} retried GPU allocations {_span(retries, '{:d}')} "
            f"time{_plural(retries)} after freeing the allocator's cache (memory pressure, "
            "and a stall each time): set train.activation_checkpointing (selective or full) "
            "or lower train.micro_batch."
        )
    if fragmented:
        advice.append(
            f"{_ranks(fragmented)} {'has' if len(fragmented) == 1 else 'have'} "
            f"{_span(fragmented, '{:.0%}')} of reserved GPU memory holding no tensor "
            "(fragmentation): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or "
            "train.activation_checkpointing to lower the peaks."
        )
    if host_memory:
        available = host_memory.get("mem_available_bytes")
        total = host_memory.get("mem_total_bytes")
        if available is not None and total and available < HOST_AVAILABLE_FLOOR * total:
            host = host_memory.get("host") or "this host"
            advice.append(
                f"Host {host} has only {available / total:.0%} of its memory available "
                f"({_gib(available)} of {_gib(total)}), nearly exhausted: run fewer ranks "
                "on it or lower data.prefetch."
            )
    return advice


def _ranks(by_rank: dict[int, Any]) -> str:
    """'Rank 3', 'Ranks 0-3 and 6'."""
    ranks = sorted(by_rank)
    runs: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    if len(ranks) == 1:
        return f"Rank {runs[0]}"
    text = runs[0] if len(runs) == 1 else ", ".join(runs[:-1]) + " and " + runs[-1]
    return f"Ranks {text}"


def _span(by_rank: dict[int, Any], fmt: str) -> str:
    """The number, or its range over the ranks named."""
    low, high = min(by_rank.values()), max(by_rank.values())
    return (
        fmt.format(low)
        if fmt.format(low) == fmt.format(high)
        else f"{fmt.format(low)}-{fmt.format(high)}"
    )


def _plural(by_rank: dict[int, Any]) -> str:
    return "" if max(by_rank.values()) == 1 else "s"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"
