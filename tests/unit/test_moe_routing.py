"""The mixture-of-experts layer (models/moe.py) computes what its definition says,
checked against a token-by-token reference; its routing counts add up; the
expert-parallel reordering (parallel/expert_parallel.py) groups tokens by expert."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshforge.models.moe import MoE, MoEArgs
from meshforge.parallel.expert_parallel import _expert_major

D = 16


def _layer(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    args = MoEArgs(**{"experts": 4, "top_k": 2, "expert_ffn": 8, **kw})
    moe = MoE(D, args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the renormalised top-k scores weight each chosen expert's SwiGLU."""
    a = moe.args
    out = torch.zeros_like(x)
    ex = moe.experts
    for t in range(x.shape[0]):
        logits = moe.router.weight.float() @ x[t].float()
        scores = logits.softmax(-1) if a.router == "softmax" else logits.sigmoid()
        top = scores.topk(a.top_k).indices
        w = scores[top] / scores[top].sum()
        for weight, e in zip(w, top.tolist(), strict=True):
            h = F.silu(ex.gate.weight[e] @ x[t]) * (ex.up.weight[e] @ x[t])
            out[t] += weight * (ex.proj.weight[e] @ h)
        if moe.shared is not None:
            out[t] += moe.shared(x[t : t + 1])[0]
    return out


@pytest.mark.parametrize(
    "kw", [{}, {"router": "sigmoid"}, {"shared_experts": 1}, {"top_k": 1}],
    ids=["softmax", "sigmoid", "shared", "top1"],
)  # fmt: skip
def test_the_layer_equals_its_token_by_token_definition(kw):
    moe = _layer(**kw)
    x = torch.randn(2, 5, D)
    got = moe(x)
    want = _reference(moe, x.reshape(-1, D)).reshape(2, 5, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_top_k_weights_are_renormalised_and_the_router_runs_in_fp32():
    moe = _layer().to(torch.bfloat16)
    chosen, weights, probs = moe.route(torch.randn(7, D, dtype=torch.bfloat16))
    assert weights.dtype == torch.float32 and probs.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))
    assert chosen.shape == (7, 2)


def test_under_autocast_the_router_stays_fp32_and_the_experts_compute_in_bf16():
    moe = _layer()
    x = torch.randn(9, D)
    plain = moe.route(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = moe.route(x)
        y = moe.experts(x[:4], torch.tensor([1, 2, 0, 1]))
    for a, b in zip(plain, cast, strict=True):  # a bf16 router matmul would not be equal
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert y.dtype == torch.bfloat16


def test_routing_counts_add_up_and_a_capacity_drops_the_excess():
    torch.manual_seed(1)
    x = torch.randn(3, 8, D)
    dropless = _layer()
    dropless.train()
    dropless(x)
    load, dropped, aux, forwards = dropless.take_stats()
    assert int(load.sum()) == 24 * 2 and int(dropped) == 0 and forwards == 1
    share = load.float() / 48
    probs = dropless.route(x.reshape(-1, D))[2].mean(0)
    assert aux.detach().item() == pytest.approx(4 * float((share * probs).sum()), rel=1e-5)
    assert dropless.take_stats() is None  # taken: the next interval starts empty

    capped = _layer(capacity_factor=0.5)
    capped.train()
    capped(x)
    load_c, dropped_c, _, _ = capped.take_stats()
    cap = math.ceil(0.5 * 24 * 2 / 4)
    assert torch.equal(load_c, load)  # the same router: the same choices before the drop
    assert int(dropped_c) == int((load - cap).clamp(min=0).sum())


def test_evaluation_and_recomputation_do_not_count():
    moe = _layer()
    moe.eval()
    moe(torch.randn(1, 4, D))
    assert moe.take_stats() is None


def test_bias_balancing_raises_the_bias_of_underused_experts():
    moe = _layer(load_balance="bias", bias_update_rate=0.1)
    moe.reset_buffers()
    moe.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert moe.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])


def test_received_tokens_are_reordered_expert_major():
    # from 2 source ranks, for 3 local experts: rank 0 sent (2, 0, 1), rank 1 sent (1, 2, 0)
    sizes = torch.tensor([[2, 0, 1], [1, 2, 0]])
    # buffer rows: r0e0 r0e0 r0e2 r1e0 r1e1 r1e1  ->  e0: r0 r0 r1, e1: r1 r1, e2: r0
    assert _expert_major(sizes).tolist() == [0, 1, 3, 4, 5, 2]
