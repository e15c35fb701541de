"""How a pipeline splits a model's layers into stages, shared by the trainer
(parallel/pipeline.py builds each stage from it) and the planner (the busiest and
the slowest stage). Pure Python: the planner never imports torch.

Stages are contiguous layer ranges that differ by at most one layer, so any number
of stages up to the layer count works (BLOOM-176B trained 70 layers on 12 stages).
Stage 0 also holds the embeddings, the last stage the final norm, the head and the
loss. A pipeline rank holds one stage, or several (interleaved 1F1B: stages r,
r+pp, r+2pp, ...; ZB-V: stages r and 2pp-1-r).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate


def layer_split(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges differing by at most one layer. Spare layers go to the
    interior stages first (they carry neither embeddings nor head), then to stage 0,
    whose embedding lookup is cheaper than the last stage's head and loss."""
    if n_stages < 1 or n_layers < n_stages:
        # an empty stage would be an identity whose output is its input: nothing to pipeline
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} non-empty stages")
    sizes = [n_layers // n_stages] * n_stages
    order = list(range(1, n_stages - 1)) + [0, n_stages - 1]
    for s in order[: n_layers % n_stages]:
        sizes[s] += 1
    bounds = [0, *accumulate(sizes)]
    return [range(bounds[i], bounds[i + 1]) for i in range(n_stages)]


def rank_stage_ids(pp_rank: int, pp: int, virtual_stages: int = 1, zbv: bool = False) -> list[int]:
    """The global stage indices pipeline rank `pp_rank` holds ("loop" placement, or the
    "v" placement of ZB-V: two stages per rank)."""
    if zbv:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual_stages)]


@dataclass(frozen=True)
class RankStages:
    """What one pipeline rank holds."""

    pp_rank: int
    layers: int  # transformer layers over all its stages
    stage_layers: tuple[int, ...]  # layers of each of its stages, in stage order
    embedding: bool  # stage 0: the token (and position) embedding
    head: bool  # the last stage: final norm, output head and loss


def pipeline_ranks(
    n_layers: int, pp: int, virtual_stages: int = 1, zbv: bool = False
) -> list[RankStages]:
    """Every pipeline rank's share of the model (ValueError: more stages than layers)."""
    n_stages = pp * (2 if zbv else virtual_stages)
    split = layer_split(n_layers, n_stages)
    out = []
    for r in range(pp):
        ids = sorted(rank_stage_ids(r, pp, virtual_stages, zbv))
        sizes = tuple(len(split[i]) for i in ids)
        out.append(RankStages(r, sum(sizes), sizes, 0 in ids, n_stages - 1 in ids))
    return out
