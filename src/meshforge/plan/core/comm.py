"""Collective cost: the ring formulas and the nccl-tests bus-bandwidth convention.

Ring all-reduce of S bytes over n ranks at link bandwidth β (REFERENCES.md,
nccl-tests doc/PERFORMANCE.md):  t ≈ 2(n-1)·α + 2·(n-1)/n·S/β.
Reported figures: algbw = S/t, busbw = algbw × factor, with the factor below. The
planner's links carry a *bus* bandwidth, so t = factor·S/busbw + steps·α.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshforge.errors import ConfigError

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")


def busbw_factor(collective: str, n: int) -> float:
    """busbw / algbw: 2(n-1)/n for all-reduce; (n-1)/n for reduce-scatter, all-gather
    and all-to-all (S = total size); 1 for broadcast and reduce."""
    if n < 1:
        raise ConfigError(f"collective size must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise ConfigError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def algbw(size_bytes: float, time_s: float) -> float:
    return size_bytes / time_s


def busbw(collective: str, size_bytes: float, time_s: float, n: int) -> float:
    """The nccl-tests bus bandwidth of one measured collective."""
    return algbw(size_bytes, time_s) * busbw_factor(collective, n)


def collective_time(
    collective: str, size_bytes: float, n: int, busbw_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Time of a ring collective of `size_bytes` (the full, unsharded size) over n ranks.

    All-reduce has 2(n-1) ring steps, reduce-scatter/all-gather n-1, a pipelined
    broadcast n-1 hops; each step pays the latency α."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    steps = 2 * (n - 1) if collective == "all_reduce" else n - 1
    return busbw_factor(collective, n) * size_bytes / busbw_bytes_per_s + steps * latency_s


def ring_allreduce_time(size_bytes: float, n: int, link_bytes_per_s: float, latency_s: float):
    """t = 2(n-1)·α + 2·(n-1)/n·S/β."""
    return collective_time("all_reduce", size_bytes, n, link_bytes_per_s, latency_s)


def tp_elements_per_layer(micro_batch: int, seq: int, hidden: int, tp: int) -> float:
    """Elements one rank moves per layer per micro-batch for tensor parallelism:
    four all-reduces (two forward, two backward) of b·s·h, each 2(t-1)/t·b·s·h,
    i.e. 8·b·s·h·(t-1)/t (REFERENCES.md). Sequence parallelism swaps each all-reduce
    for an all-gather plus a reduce-scatter: the same volume."""
    return 8.0 * micro_batch * seq * hidden * (tp - 1) / tp


def ep_alltoall_bytes(
    micro_batch: int, seq: int, hidden: int, top_k: int, tp: int, act_bytes: float
) -> float:
    """Bytes one rank hands to one all-to-all of expert parallelism (dispatch or
    combine, forward or backward), its full size S: the b·s tokens of its micro-batch,
    each sent to its top-k experts as a vector of h activations, b·s·k·h·e; a
    tensor-parallel rank dispatches 1/t of them (Megatron-Core's dispatcher splits the
    tokens over the tp ranks, which hold the same ones). Of S, the (ep-1)/ep share of
    the routed vectors whose experts live on other ranks crosses the link
    (`busbw_factor("all_to_all", ep)`, balanced routing). A MoE layer runs four per
    micro-batch (dispatch and combine, forward and backward), six with full
    recomputation (its forward again)."""
    return micro_batch * seq * top_k * hidden * act_bytes / tp


def cp_allgather_bytes(
    micro_batch: int, seq: int, kv_width: int, tp: int, act_bytes: float
) -> float:
    """Full size S of the all-gather of K and V over the cp ranks in one layer's forward
    (Llama 3's context parallelism, arXiv 2407.21783 §3.3.2): the whole sequence's K and
    V, 2·b·s·kv/t·e (kv = n_kv_heads·head_dim, 1/t of the heads on a tensor-parallel
    rank); each rank receives (cp-1)/cp of it (`busbw_factor("all_gather", cp)`). The
    backward reduce-scatters the gradients of K and V, the same S."""
    return 2.0 * micro_batch * seq * kv_width * act_bytes / tp


def cp_ring_block_bytes(
    micro_batch: int, seq: int, kv_width: int, tp: int, cp: int, act_bytes: float
) -> float:
    """Bytes one rank sends its ring neighbour in one of the cp-1 steps of ring attention:
    its K and V block, 2·b·(s/cp)·kv/t·e (the backward sends the K/V block and the
    partial dK/dV: twice that)."""
    return 2.0 * micro_batch * (seq / cp) * kv_width * act_bytes / tp


def cp_alltoall_bytes(
    micro_batch: int, seq: int, q_width: int, kv_width: int, tp: int, cp: int, act_bytes: float
) -> tuple[float, float, float]:
    """Full sizes S (what one rank hands in) of Ulysses' three all-to-alls of one layer's
    forward (DeepSpeed-Ulysses, Jacobs et al., arXiv 2309.14509): q, then k and v (sequence
    shards to head shards), then the attention output (back): b·(s/cp)·q/t·e,
    2·b·(s/cp)·kv/t·e and b·(s/cp)·q/t·e. Each crosses (cp-1)/cp of S; the backward runs
    the same three on the gradients."""
    tokens = micro_batch * (seq / cp) * act_bytes / tp
    return tokens * q_width, 2.0 * tokens * kv_width, tokens * q_width


def pp_elements_per_boundary(micro_batch: int, seq: int, hidden: int) -> float:
    """b·s·h per stage boundary per micro-batch, each way (activations forward,
    their gradients backward)."""
    return float(micro_batch * seq * hidden)


# -- a group's link at scale ------------------------------------------------------------
#
# nccl-tests on one node, or on a few, reach the link presets' bus bandwidth
# (hardware.py). A data-parallel group spread over hundreds of nodes does not: its rings
# cross the spine of the fat tree (a DGX SuperPOD scalable unit is 32 nodes under one
# set of leaf switches per rail), where flows from many rings collide on shared uplinks,
# and the slowest link sets a ring's pace. We model the achievable bus bandwidth of a
# group spanning N nodes as
#
#     busbw(N) = busbw(1 node's ports) / (1 + κ·log2 N)
#
# with κ stated in NETWORK_SCALING (0 for the shipped planner; see there). A ring
# visits every member of a node before leaving it (NCCL's rings follow the topology),
# so of each node's k members' ring steps k-1 cross the
# node's own link and one the network: the per-step latency is the mean of the two,
# ((k-1)·α_intra + α_inter)/k, and a collective of n ranks pays it n-1 or 2(n-1) times.


@dataclass(frozen=True)
class NetworkScaling:
    """How the achievable inter-node bandwidth falls with the nodes a group spans."""

    kappa: float  # busbw / (1 + κ·log2 nodes); see above

    def efficiency(self, nodes: float) -> float:
        return 1.0 / (1.0 + self.kappa * math.log2(max(1.0, nodes)))


# stated, not fitted: 0. Fitted to every published run it came out at 0 (no run asks
# for a slower network at scale once the runs' own overlaps are modelled); fitted with a
# source held out it only traded against that source's framework (docs/planner.md).
NETWORK_SCALING = NetworkScaling(kappa=0.0)


def group_link(
    cluster, size: int, stride: int, scaling: NetworkScaling = NETWORK_SCALING
) -> tuple[float, float]:
    """(bus bandwidth, per-step latency) of a collective over `size` ranks `stride` apart
    on `cluster` (a hardware.Cluster), at scale (see above)."""
    busbw, latency = cluster.group_busbw(size, stride)
    gpn = cluster.gpus_per_node
    if size * stride <= gpn or size <= 1:
        return busbw, latency
    per_node = min(size, max(1, gpn // stride)) if stride < gpn else 1
    nodes = size / per_node
    step = ((per_node - 1) * cluster.intra.latency_s + cluster.inter.latency_s) / per_node
    return busbw * scaling.efficiency(nodes), step
