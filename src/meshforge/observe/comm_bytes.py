"""Bytes a rank hands to torch.distributed, and bytes its host sends on the wire.

Two measurements, side by side, because each answers its own question:

payload  what this rank gives its collectives and point-to-point sends, counted at
         the torch.distributed call (the input of an all-reduce, the local shard of
         an all-gather, the full input of a reduce-scatter, each tensor sent). A
         compression hook shrinks it by exactly what it compresses. DDP's own
         reducer (no communication hook) all-reduces from C++, past any Python
         call: `ddp_reducer_bytes` gives its payload, every gradient once per step.
         Tensor parallel's functional collectives are not counted here (their time
         is, by the profiler in observe/comm_time.py).
wire     what the host's network interfaces transmitted (the kernel's counters in
         /proc/net/dev, every interface, loopback included: ranks of one host talk
         over it), so protocol overhead and every other sender on the host count too.
         A ring all-reduce of P payload bytes over n ranks puts 2(n-1)/n x P on the
         wire per rank.

Counting is installed once per process and costs a dictionary update per call.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge.observe.sampler import parse_net_dev

# torch.distributed function -> the parameter holding what this rank contributes
_PAYLOAD_ARG = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "_all_gather_base": "input_tensor",
    "all_gather": "tensor",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "_reduce_scatter_base": "input",
    "reduce_scatter": "input_list",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "broadcast": "tensor",
    "reduce": "tensor",
    "send": "tensor",
    "batch_isend_irecv": "p2p_op_list",
}
# isend/irecv are left alone: P2POp checks that its op *is* torch.distributed.isend;
# batch_isend_irecv (what the pipeline schedules use) counts the sends it carries.

_lock = threading.Lock()
_installed = False
_local = threading.local()  # nesting depth: a collective built on another counts once
_bytes: dict[str, int] = {}
_calls: dict[str, int] = {}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _sent_bytes(ops: Iterable[Any]) -> int:
    return sum(_tensor_bytes(op.tensor) for op in ops if op.op is dist.isend)


def install() -> None:
    """Count payload bytes of every torch.distributed call in this process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        for name, arg in _PAYLOAD_ARG.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            if arg not in sig.parameters:
                continue
            position = list(sig.parameters).index(arg)

            def counted(*args, __fn=fn, __name=name, __arg=arg, __pos=position, **kwargs):
                depth = getattr(_local, "depth", 0)
                if depth == 0:
                    value = args[__pos] if len(args) > __pos else kwargs.get(__arg)
                    n = _sent_bytes(value) if __name == "batch_isend_irecv" else None
                    n = _tensor_bytes(value) if n is None else n
                    _bytes[__name] = _bytes.get(__name, 0) + n
                    _calls[__name] = _calls.get(__name, 0) + 1
                _local.depth = depth + 1
                try:
                    return __fn(*args, **kwargs)
                finally:
                    _local.depth = depth

            counted.__wrapped__ = fn  # type: ignore[attr-defined]
            counted.__name__ = name
            setattr(dist, name, counted)


def add(name: str, tensor: torch.Tensor) -> None:
    """Count a send that no wrapper sees (`isend`, which P2POp needs unwrapped)."""
    _bytes[name] = _bytes.get(name, 0) + _tensor_bytes(tensor)
    _calls[name] = _calls.get(name, 0) + 1


def payload_bytes() -> int:
    """Bytes handed to torch.distributed since install()."""
    return sum(_bytes.values())


def payload_by_call() -> dict[str, dict[str, int]]:
    return {n: {"bytes": _bytes[n], "calls": _calls[n]} for n in sorted(_bytes)}


def ddp_reducer_bytes(params: Iterable[torch.nn.Parameter]) -> int:
    """Payload of DDP's built-in reducer per synchronising backward: every gradient,
    in the gradient's dtype (that of the parameter)."""
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def host_tx_bytes(path: str | Path = "/proc/net/dev") -> int | None:
    """Bytes transmitted by every interface of this host's network namespace, from the
    kernel's counters; None where they cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return sum(tx for _rx, tx in parse_net_dev(text).values())
