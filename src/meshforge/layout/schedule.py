"""The pipeline schedules meshforge runs and torch.distributed.pipelining's rules for
them: how many stages a pipeline rank holds and how many micro-batches a step needs."""

from __future__ import annotations

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Pipeline stages each pipeline rank holds: v for interleaved, two for the V shape."""
    if schedule == "interleaved_1f1b":
        return virtual_stages
    if schedule == "zbv":
        return 2
    return 1


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step torch.distributed.pipelining accepts: 1F1B
    needs one per stage; GPipe, interleaved 1F1B and ZB-V run with fewer, with a
    bigger bubble (ZB-V plans its warm-up for 2p-1 and idles the missing slots)."""
    return pp if schedule == "1f1b" else 1


def interleaved_accepts(microbatches: int, pp: int) -> bool:
    """torch's rule for interleaved 1F1B (ScheduleInterleaved1F1B): with
    rounds = max(1, m // pp), m must be a multiple of rounds. Every m < 2pp and every
    multiple of pp passes; at pp=4, m=9 does not."""
    rounds = max(1, microbatches // pp)
    return microbatches % rounds == 0
