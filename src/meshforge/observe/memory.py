"""Memory a rank holds: its peak, and the bytes of the tensors it keeps.

``tensor_bytes`` is how ``report.json`` measures ``model_state_bytes`` per
rank: it counts what each rank actually stores (a DTensor's local shard, not
its global size) and counts memory shared by several tensors once.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import psutil
import torch

try:  # DTensor is public from torch 2.5; a build without distributed has none
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def current_memory_bytes(device: torch.device | str) -> int:
    """Memory this process holds on ``device`` now: the caching allocator's allocated
    tensor memory on CUDA, the resident set elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return int(psutil.Process().memory_info().rss)


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory of this process on ``device``.

    CUDA: the caching allocator's peak of allocated tensor memory
    (``torch.cuda.max_memory_allocated``). Elsewhere: the process's peak
    resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS), at least the current RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    max_rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024
    # Linux syncs the high-water mark lazily; never report less than what is resident now.
    return int(max(max_rss_bytes, psutil.Process().memory_info().rss))


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _iter_tensors(value)
    elif isinstance(obj, Iterable) and not isinstance(obj, str | bytes):
        for item in obj:
            yield from _iter_tensors(item)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor._local_tensor  # the shard this rank stores, no autograd detour
    return tensor


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of ``tensor`` within its storage, views and strides included."""
    item = tensor.element_size()
    extent = 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    start = tensor.storage_offset() * item
    return start, start + extent * item


def tensor_bytes(tensors: Iterable[Any] | Mapping[Any, Any] | torch.Tensor) -> int:
    """Bytes of memory held by ``tensors`` on this rank, each byte counted once.

    Accepts tensors, DTensors (their local shard) and nested lists, tuples and
    dicts of them (a state dict, ``optimizer.state``); other values are skipped.
    Tensors sharing a storage (a tied weight, views into one flat buffer) count
    the union of the byte ranges they cover, so a tied weight counts once and
    a slice of a larger buffer counts only its slice. Meta tensors hold nothing."""
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for tensor in _iter_tensors(tensors):
        local = _local(tensor)
        # a functional collective's result (AsyncCollectiveTensor) wraps the real one
        local = getattr(local, "elem", local)
        if local.device.type == "meta" or local.numel() == 0:
            continue
        try:
            pointer = local.untyped_storage().data_ptr()
        except RuntimeError:  # another wrapper subclass: no storage of its own to count
            continue
        storage_key = (str(local.device), pointer)
        spans.setdefault(storage_key, []).append(_byte_span(local))
    return sum(_union_length(ranges) for ranges in spans.values())


def _union_length(ranges: list[tuple[int, int]]) -> int:
    total, reach = 0, 0
    for start, end in sorted(ranges):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


class SavedActivations:
    """Bytes autograd keeps for backward while the context is open: the activation
    memory a forward pass leaves behind (what activation checkpointing trades for
    recomputation). Parameters are not counted; tensors sharing storage count once.

        with SavedActivations() as saved:
            loss = model(x)
        saved.bytes

    It hooks `torch.autograd.graph.saved_tensors_hooks`, so it measures the same on
    CPU and GPU; recomputed blocks (torch.utils.checkpoint, non-reentrant) keep only
    their inputs, which the checkpoint holds itself, so their saved tensors do not
    reach this hook."""

    def __init__(self) -> None:
        self._seen: list[torch.Tensor] = []
        self.bytes = 0
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):
            self._seen.append(t)
        return t

    def __enter__(self) -> SavedActivations:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        self.bytes = tensor_bytes(self._seen)
        self._seen = []
