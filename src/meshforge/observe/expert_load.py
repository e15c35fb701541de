"""The load of a mixture-of-experts model's experts, read from the rows of
metrics.jsonl (their `moe` section, written by train/moe_load.py): report.json's `moe`
section, and the cause of a straggler that holds the busiest experts. Torch-free."""

from __future__ import annotations

from typing import Any

from meshforge.layout import ParallelDims

# a rank whose experts get this much more than the mean share of the tokens is named
# as slowed by them when it is a straggler
HOT_SHARE = 1.25


def max_over_mean(tokens: list[int]) -> float:
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean else 0.0


def ep_per_segment(segments: list[dict[str, Any]], ep: int) -> list[dict[str, Any]]:
    """Each segment's expert-parallel degree (from the layout its start recorded; `ep`,
    the current layout's, for a segment without one), with the steps it trained."""
    out = []
    for s in segments:
        layout = s.get("layout")
        seg_ep = int(layout.get("ep") or 1) if isinstance(layout, dict) else ep
        out.append({
            "segment": s.get("segment"),
            "start_step": s.get("start_step"),
            "end_step": s.get("end_step"),
            "ep": seg_ep,
        })  # fmt: skip
    return out


def moe_summary(
    cfg: Any,
    dims: ParallelDims,
    rows: list[dict[str, Any]],
    segments: list[dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """report.json's `moe` section from the run's rows: the tokens each expert of
    each layer got over the run, its balance, drops and the mean auxiliary loss.
    `ep` is the expert-parallel degree when every segment that trained had the same
    (else None: `ep_per_segment` says which segment had which)."""
    moe = cfg.model.moe
    if moe is None:
        return None
    totals: dict[int, list[int]] = {}
    dropped = 0
    aux_values: list[float] = []
    for row in rows:
        section = row.get("moe")
        if not isinstance(section, dict):
            continue
        for layer, tokens in zip(
            section.get("layers", []), section.get("tokens_per_expert", []), strict=False
        ):
            acc = totals.setdefault(int(layer), [0] * len(tokens))
            totals[int(layer)] = [a + int(t) for a, t in zip(acc, tokens, strict=False)]
        dropped += int(section.get("dropped", 0))
        if isinstance(section.get("aux_loss"), int | float):
            aux_values.append(float(section["aux_loss"]))
    layers = sorted(totals)
    tokens = [totals[i] for i in layers]
    balance = [max_over_mean(t) for t in tokens]
    assigned = sum(sum(t) for t in tokens)
    per_segment = ep_per_segment(segments or [], dims.ep)
    trained = [s for s in per_segment if (s["end_step"] or 0) > (s["start_step"] or 0)]
    eps = {s["ep"] for s in trained or per_segment} or {dims.ep}
    return {
        "experts": moe.experts,
        "top_k": moe.top_k,
        "ep": eps.pop() if len(eps) == 1 else None,
        "ep_per_segment": per_segment,
        "router": moe.router,
        "load_balance": moe.load_balance,
        "capacity_factor": moe.capacity_factor,
        "layers": layers,
        "tokens_per_expert": tokens,
        "load_max_over_mean": [round(b, 4) for b in balance],
        "max_load": round(max(balance), 4) if balance else None,
        "dropped": dropped,
        "dropped_fraction": dropped / assigned if assigned else 0.0,
        # the mean over the logged intervals (each a mean over its micro-batches)
        "aux_loss": sum(aux_values) / len(aux_values) if aux_values else None,
    }


def hot_expert_cause(rank: int, dims: ParallelDims, section: dict[str, Any] | None) -> str | None:
    """Why `rank` is slow, when it holds the experts that got the most tokens: its
    share of the interval's routed tokens against the mean share of its expert group."""
    if section is None or not dims.ep_enabled:
        return None
    tokens = section.get("tokens_per_expert") or []
    if not tokens:
        return None
    per_rank = len(tokens[0]) // dims.ep
    shares = [0] * dims.ep
    for layer in tokens:
        for r in range(dims.ep):
            shares[r] += sum(layer[r * per_rank : (r + 1) * per_rank])
    mean = sum(shares) / dims.ep
    ep_rank = dims.coords(rank)["dp"] % dims.ep
    if not mean or shares[ep_rank] / mean < HOT_SHARE:
        return None
    # the hottest expert it holds, over the layers
    best = max(
        (
            (count, layer_index, e)
            for layer_index, layer in zip(section.get("layers", []), tokens, strict=False)
            for e, count in enumerate(layer)
            if e // per_rank == ep_rank
        ),
        default=None,
    )
    hottest = f"; hottest: expert {best[2]} of layer {best[1]}" if best else ""
    return (
        f"hot experts: its experts got {shares[ep_rank] / mean:.2f}x the mean share of "
        f"the routed tokens{hottest}"
    )
