"""Context parallelism's split (parallel/context_parallel.py) and its layout rules: each
cp rank keeps a chunk from each end of every sequence, and its queries against the
gathered keys, under its mask, give exactly world 1's attention at its positions; so
does alltoall (Ulysses), each rank's heads over the whole sequence, and ring (ring
attention), the keys and values passed round the ranks. The cp ranks run as threads
here; the collectives and ring's point-to-point exchange themselves run in
tests/integration/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshforge.config import build_config
from meshforge.errors import ConfigError
from meshforge.layout import JOB_NAMES, LayoutRequest, ModelShape, check, derive
from meshforge.models.attention import documents_of
from meshforge.models.gpt import GPT, GPTArgs
from meshforge.parallel.context_parallel import (
    ContextSplit,
    apply_context_parallel,
    attention_modules,
    chunk_positions,
    key_positions,
)

EOT = 9
SHAPE = ModelShape(n_layers=4, d_model=64, n_heads=4, kv_heads=4, mlp_hidden=256,
                   vocab_size=256, seq_len=32)  # fmt: skip


def test_head_tail_chunks_cover_every_position_once_with_balanced_causal_work():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert key_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    for cp in (1, 2, 4):
        ranks = [chunk_positions(64, cp, r) for r in range(cp)]
        assert sorted(torch.cat(ranks).tolist()) == list(range(64))
        # causal work of a query at position t: t + 1 keys; the same on every rank
        work = {int((pos + 1).sum()) for pos in ranks}
        assert len(work) == 1, (cp, work)
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 4"):
        chunk_positions(10, 2, 0)


def _tokens(b: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 12, (b, s), generator=g)  # EOT=9 appears: several documents


class _GivenKV:
    """An AllGatherAttend whose all-gather hands back `kv`, every rank's K and V."""

    def __new__(cls, kv: torch.Tensor):
        from meshforge.parallel.context_parallel import AllGatherAttend

        class Given(AllGatherAttend):
            def gather(self, t):
                assert t.shape[0] * self.size == kv.shape[0]
                return kv

        attend = Given(group=None)  # type: ignore[arg-type]
        return attend


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("masking", [False, True], ids=["causal", "documents"])
def test_local_queries_against_gathered_keys_equal_world_1_attention(cp, masking):
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 16, 8
    x = _tokens(b, s, seed=1)
    y = torch.roll(x, -1, dims=1)
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    if masking:
        ref_docs = documents_of(x, EOT)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_docs.mask)
        ref_positions = ref_docs.positions
    else:
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref_positions = torch.arange(s).expand(b, s)
    w = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    keys = key_positions(s, cp)
    seen = torch.zeros(b, s, dtype=torch.long)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        xs, ys, docs = ContextSplit(rank, cp).shard(x, y, EOT if masking else None)
        mine = chunk_positions(s, cp, rank)
        assert torch.equal(xs, x[:, mine]) and torch.equal(ys, y[:, mine])
        assert torch.equal(docs.positions, ref_positions[:, mine])
        assert (docs.mask is not None) == masking  # plain causal: no mask at all
        # what the all-gather hands every rank: (S, 2, b, h, d), the keys in rank order
        attend = _GivenKV(torch.stack((k, v)).permute(3, 0, 1, 2, 4)[keys])
        attend.size = cp
        out = attend(q[:, :, mine], k[:, :, mine], v[:, :, mine], docs)
        torch.testing.assert_close(out, ref[:, :, mine], rtol=1e-5, atol=1e-6)
        mine_grads = torch.autograd.grad((out * w[:, :, mine]).sum(), (q, k, v))
        for total, g in zip(grads, mine_grads, strict=True):
            total += g
        seen[:, mine] += 1
    assert torch.equal(seen, torch.ones(b, s, dtype=torch.long))  # the loss covers each once
    for g, ref_g in zip(grads, ref_grads, strict=True):  # block by block, or masked
        torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=1e-5)


def test_the_model_keeps_its_attend_until_context_parallelism_swaps_it():
    model = GPT(GPTArgs(vocab_size=32, d_model=16, n_layers=2, n_heads=2, seq_len=8))
    layers = attention_modules(model)
    assert len(layers) == 2  # one per block; the model itself names no cp

    class FakeMesh:
        def get_group(self):
            return "cp-group"

    apply_context_parallel(model, FakeMesh(), "allgather")  # type: ignore[arg-type]
    assert all(m.attend.group == "cp-group" for m in layers)
    assert attention_modules(model) == []  # swapped
    ulysses = GPT(GPTArgs(vocab_size=32, d_model=16, n_layers=2, n_heads=2, seq_len=8))
    apply_context_parallel(ulysses, FakeMesh(), "alltoall")  # type: ignore[arg-type]
    assert {type(m.attend).__name__ for m in ulysses.modules() if hasattr(m, "attend")} == {
        "AllToAllAttend"
    }
    ring = GPT(GPTArgs(vocab_size=32, d_model=16, n_layers=2, n_heads=2, seq_len=8))
    apply_context_parallel(ring, FakeMesh(), "ring")  # type: ignore[arg-type]
    assert {type(m.attend).__name__ for m in ring.modules() if hasattr(m, "attend")} == {
        "RingAttend"
    }
    with pytest.raises(ValueError, match="cp_method=zigzag is not built"):
        apply_context_parallel(ulysses, FakeMesh(), "zigzag")  # type: ignore[arg-type]
    fresh = GPT(GPTArgs(vocab_size=32, d_model=16, n_layers=2, n_heads=2, seq_len=8))
    assert len(attention_modules(fresh)) == 2  # an instance's attend, not the class's


# -- the layout rules ------------------------------------------------------------------------


def test_cp_is_a_mesh_dimension_of_its_own_between_dp_and_tp():
    req = LayoutRequest(cp=2, tp=2, global_batch=8, micro_batch=2)
    dims = derive(req, SHAPE, world_size=8)
    assert (dims.dp, dims.cp, dims.tp, dims.world_size, dims.microbatches) == (2, 2, 2, 8, 2)
    assert dims.mesh_layout() == (("pp", "dp", "cp", "tp"), (1, 2, 2, 2))
    # rank = tp + tp * (cp + cp * dp)
    assert dims.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}
    assert dims.coords(2) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0}
    assert dims.as_dict()["cp"] == 2 and dims.as_dict()["cp_method"] == "allgather"
    plain = derive(LayoutRequest(global_batch=8, micro_batch=2), SHAPE, world_size=2)
    assert "cp" not in plain.as_dict() and plain.mesh_layout() == (("pp", "dp", "tp"), (1, 2, 1))
    with pytest.raises(ConfigError, match="world size 6 is not divisible by parallel.tp=2 x "
                                          "parallel.pp=1 x parallel.cp=2 = 4"):  # fmt: skip
        derive(req, SHAPE, world_size=6)


@pytest.mark.parametrize(
    ("req", "shape", "words"),
    [
        (LayoutRequest(cp=3), SHAPE, ["parallel.cp=3 needs model.seq_len=32", "2 x cp = 6"]),
        (
            LayoutRequest(cp=2, cp_method="ring", device="cpu"),
            SHAPE,
            [
                "parallel.cp_method=ring needs CUDA devices, and this job's workers would run "
                "on cpu (runtime.device); use parallel.cp_method=allgather or alltoall"
            ],
        ),  # fmt: skip
        (
            LayoutRequest(cp=2, cp_method="ring", device="cuda", document_masking=True),
            SHAPE,
            ["parallel.cp_method=ring with data.document_masking=true is not yet built"],
        ),
        (
            LayoutRequest(cp=2, cp_method="ring", device="cuda"),
            ModelShape(**{**SHAPE.__dict__, "dropout": 0.1}),
            ["parallel.cp_method=ring with model.dropout=0.1"],
        ),
        (
            LayoutRequest(cp=4, tp=2, cp_method="alltoall"),
            SHAPE,
            [
                "parallel.cp_method=alltoall needs model.n_heads=4 / parallel.tp=2 divisible by "
                "parallel.cp=4"
            ],
        ),  # fmt: skip
        (
            LayoutRequest(cp=4, cp_method="alltoall"),
            ModelShape(**{**SHAPE.__dict__, "n_heads": 2, "kv_heads": 1}),
            ["parallel.cp_method=alltoall needs model.n_heads=2 divisible by parallel.cp=4"],
        ),
        (LayoutRequest(cp=2, servers=1), SHAPE, ["parallel.cp=2 with parallel.mode"]),
        (LayoutRequest(cp=2, compile=True), SHAPE, ["train.compile=true", "parallel.cp=2"]),
        (
            LayoutRequest(cp=2),
            ModelShape(**{**SHAPE.__dict__, "experts": 4, "capacity_factor": 1.25}),
            ["parallel.cp=2 with model.moe.capacity_factor=1.25 is not yet supported"],
        ),
        (LayoutRequest(cp=2), ModelShape(factory="m:f"), ["parallel.cp=2 needs meshforge's"]),
    ],
    ids=[
        "seq-len",
        "ring-on-cpu",
        "ring-documents",
        "ring-dropout",
        "alltoall-tp-heads",
        "alltoall-heads",
        "parameter-server",
        "compile",
        "moe-capacity",
        "factory",
    ],
)
def test_what_cp_cannot_run_is_refused_naming_the_fields(req, shape, words):
    problems = check(req, shape, JOB_NAMES)
    assert any(all(w in p for w in words) for p in problems), problems


@pytest.mark.parametrize("device", ["cuda", None], ids=["cuda", "not-known-yet"])
def test_ring_is_accepted_on_cuda_and_until_the_device_is_known(device):
    # unlike alltoall, cp need not divide a tensor-parallel rank's heads (4 / 2)
    req = LayoutRequest(cp=4, tp=2, pp=2, cp_method="ring", device=device)
    assert check(req, ModelShape(**{**SHAPE.__dict__, "kv_heads": 2}), JOB_NAMES) == []


def test_cp_with_a_dropless_mixture_of_experts_is_accepted_with_and_without_ep():
    moe = ModelShape(**{**SHAPE.__dict__, "experts": 4})
    for req, world in ((LayoutRequest(cp=2), 2), (LayoutRequest(cp=2, ep=2, zero=3), 4)):
        assert check(req, moe, JOB_NAMES, world_size=world) == [], req


def test_cp_under_a_pipeline_is_accepted():
    problems = check(LayoutRequest(cp=2, pp=2), SHAPE, JOB_NAMES, world_size=4)
    assert not [p for p in problems if "cp" in p], problems


@pytest.mark.parametrize(
    ("req", "kv_heads"),
    [
        (LayoutRequest(cp=2, cp_method="alltoall"), 4),
        (LayoutRequest(cp=4, cp_method="alltoall"), 1),  # kv heads repeated before the exchange
        (LayoutRequest(cp=2, tp=2, cp_method="alltoall"), 2),
    ],
    ids=["cp2", "cp4-gqa1", "tp2xcp2"],
)
def test_alltoall_runs_where_cp_divides_a_tensor_parallel_ranks_heads(req, kv_heads):
    shape = ModelShape(**{**SHAPE.__dict__, "kv_heads": kv_heads})
    assert check(req, shape, JOB_NAMES) == []


def test_the_job_file_carries_cp_and_its_method():
    raw = {
        "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32},
        "train": {"global_batch": 8, "micro_batch": 2},
        "parallel": {"cp": 2},
    }
    cfg = build_config(raw)
    assert (cfg.parallel.cp, cfg.parallel.cp_method) == (2, "allgather")
    dims = cfg.dims(4)
    assert (dims.dp, dims.cp) == (2, 2)
    ulysses = build_config({**raw, "parallel": {"cp": 2, "cp_method": "alltoall"}}).dims(2)
    assert ulysses.as_dict()["cp_method"] == "alltoall"
    ring = build_config({**raw, "parallel": {"cp": 2, "cp_method": "ring"}})
    assert ring.dims(2, "cuda").as_dict()["cp_method"] == "ring"
    assert ring.dims(2).cp == 2  # runtime.device: auto, not known until a launch decides
    with pytest.raises(ConfigError, match="parallel.cp_method=ring needs CUDA devices"):
        ring.dims(2, "cpu")  # what the launcher and the workers pass
    with pytest.raises(ConfigError, match=r"ring needs CUDA .* run on cpu \(runtime.device\)"):
        build_config({**raw, "parallel": {"cp": 2, "cp_method": "ring"},
                      "runtime": {"device": "cpu"}})  # fmt: skip


# -- the whole model, its cp ranks as threads --------------------------------------------------


class _ThreadGroup:
    """cp ranks as threads of this process: an all-gather (and, backward, a reduce-
    scatter) exchanging tensors through a barrier, as the gloo collective would."""

    def __init__(self, size: int) -> None:
        import threading

        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.barrier.wait()  # everyone has read the previous exchange
        self.slots[rank] = t
        self.barrier.wait()
        return list(self.slots)  # type: ignore[arg-type]


class _ThreadGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group, rank):
        ctx.group, ctx.rank = group, rank
        return torch.cat(group.exchange(rank, t.detach().clone()))

    @staticmethod
    def backward(ctx, grad):
        blocks = ctx.group.exchange(ctx.rank, grad.detach().clone())
        mine = [b.chunk(ctx.group.size)[ctx.rank] for b in blocks]
        return torch.stack(mine).sum(0), None, None


class _ThreadAllToAll(torch.autograd.Function):
    """All-to-all of (cp, ...) blocks: block j to rank j; backward, the reverse."""

    @staticmethod
    def forward(ctx, t, group, rank):
        ctx.group, ctx.rank = group, rank
        return torch.stack([b[rank] for b in group.exchange(rank, t.detach().clone())])

    @staticmethod
    def backward(ctx, grad):
        blocks = ctx.group.exchange(ctx.rank, grad.detach().clone())
        return torch.stack([b[ctx.rank] for b in blocks]), None, None


def _threaded_attend(group: _ThreadGroup, rank: int, method: str = "allgather"):
    from meshforge.parallel.context_parallel import AllGatherAttend, AllToAllAttend, RingAttend

    class ThreadGatherAttend(AllGatherAttend):
        def gather(self, t):
            return _ThreadGather.apply(t, group, rank)

    class ThreadAllToAllAttend(AllToAllAttend):
        def exchange(self, t):
            assert t.shape[0] == group.size
            return _ThreadAllToAll.apply(t, group, rank)

    class ThreadRingAttend(RingAttend):
        def rotate(self, tensors):
            # every rank sends to rank + 1: this one receives rank - 1's
            sent = group.exchange(rank, [t.detach().clone() for t in tensors])
            got = sent[(rank - 1) % group.size]
            assert [(g.shape, g.dtype) for g in got] == [(t.shape, t.dtype) for t in tensors]
            return lambda: got

    cls = {"allgather": ThreadGatherAttend, "alltoall": ThreadAllToAllAttend,
           "ring": ThreadRingAttend}[method]  # fmt: skip
    return cls(group=None)  # type: ignore[arg-type]


def _run_threads(cp: int, rank_main) -> None:
    """rank_main(rank, group) on cp threads; the first error of any is raised."""
    import threading

    group = _ThreadGroup(cp)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            rank_main(rank, group)
        except BaseException as exc:  # reported below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa1"])
@pytest.mark.parametrize(
    ("method", "masking"),
    [("alltoall", False), ("alltoall", True), ("ring", False)],
    ids=["alltoall-causal", "alltoall-documents", "ring-causal"],
)
def test_alltoall_and_ring_attention_on_cp_threads_equal_world_1_attention(
    cp, kv_heads, method, masking
):
    """Ulysses: each rank's h/cp heads over the whole sequence, exchanged and back;
    grouped-query heads travel unrepeated where cp divides them (gqa2 under cp 2),
    repeated first where not (gqa2 under cp 4, gqa1). Ring attention: each rank's two
    query chunks against every rank's key chunks as they come round (full, causal or
    skipped by chunk index), merged by log-sum-exp; backward, the key/value gradients
    travel round with them. Both give world 1's attention at the rank's tokens and,
    summed over the ranks, its gradients."""
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 32, 8
    x = _tokens(b, s, seed=1)
    y = torch.roll(x, -1, dims=1)
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, requires_grad=True) for _ in range(2))
    group_size = h // kv_heads
    k_rep, v_rep = (t.repeat_interleave(group_size, dim=1) for t in (k, v))
    if masking:
        ref = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=documents_of(x, EOT).mask)
    else:
        ref = F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
    w = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    outs: dict[int, torch.Tensor] = {}
    grads: dict[int, tuple[torch.Tensor, ...]] = {}

    def rank_main(rank: int, group: _ThreadGroup) -> None:
        _, _, docs = ContextSplit(rank, cp).shard(x, y, EOT if masking else None)
        mine = chunk_positions(s, cp, rank)
        attend = _threaded_attend(group, rank, method)
        out = attend(q[:, :, mine], k[:, :, mine], v[:, :, mine], docs)
        outs[rank] = out.detach()
        grads[rank] = torch.autograd.grad((out * w[:, :, mine]).sum(), (q, k, v))

    _run_threads(cp, rank_main)
    for rank in range(cp):
        mine = chunk_positions(s, cp, rank)
        torch.testing.assert_close(outs[rank], ref[:, :, mine], rtol=1e-5, atol=1e-6)
    for i, ref_g in enumerate(ref_grads):
        total = sum(grads[rank][i] for rank in range(cp))
        torch.testing.assert_close(total, ref_g, rtol=1e-4, atol=1e-5)


def test_alltoall_refuses_heads_the_cp_ranks_cannot_split():
    from meshforge.models.attention import Documents
    from meshforge.parallel.context_parallel import AllToAllAttend

    attend = AllToAllAttend(group=None)  # type: ignore[arg-type]
    x = _tokens(1, 8, seed=0)
    _, _, docs = ContextSplit(0, 4).shard(x, x)
    q = torch.randn(1, 2, 2, 4)
    with pytest.raises(ValueError, match="2 heads on this rank, not divisible by cp 4"):
        attend(q, q, q, docs)
    with pytest.raises(RuntimeError, match="ContextDocuments"):
        attend(q, q, q, Documents(x, x, None))  # type: ignore[arg-type]


def test_ring_attention_in_bf16_keeps_its_dtype_and_world_1s_values():
    """bf16 queries, keys and values: the output and gradients come back in bf16 (merged
    and accumulated in float32 in between), within bf16's rounding of world 1's float32
    attention."""
    torch.manual_seed(0)
    cp, b, h, s, d = 4, 2, 4, 64, 16
    x = _tokens(b, s, seed=1)
    q = torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, 2, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        qf, kf.repeat_interleave(2, dim=1), vf.repeat_interleave(2, dim=1), is_causal=True
    )
    w = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), (qf, kf, vf))
    outs: dict[int, torch.Tensor] = {}
    grads: dict[int, tuple[torch.Tensor, ...]] = {}

    def rank_main(rank: int, group: _ThreadGroup) -> None:
        _, _, docs = ContextSplit(rank, cp).shard(x, x)
        mine = chunk_positions(s, cp, rank)
        out = _threaded_attend(group, rank, "ring")(q[:, :, mine], k[:, :, mine], v[:, :, mine],
                                                    docs)  # fmt: skip
        outs[rank] = out.detach()
        grads[rank] = torch.autograd.grad((out.float() * w[:, :, mine]).sum(), (q, k, v))

    _run_threads(cp, rank_main)
    for rank in range(cp):
        assert outs[rank].dtype == torch.bfloat16
        mine = chunk_positions(s, cp, rank)
        torch.testing.assert_close(outs[rank].float(), ref[:, :, mine], rtol=2e-2, atol=2e-2)
    for i, ref_g in enumerate(ref_grads):
        assert all(grads[rank][i].dtype == torch.bfloat16 for rank in range(cp))
        total = sum(grads[rank][i].float() for rank in range(cp))
        torch.testing.assert_close(total, ref_g, rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["flash", "efficient"])
def test_ring_attention_on_a_cuda_device_equals_world_1_attention(dtype):
    """scripts/gpu_check.sh: the CUDA kernels (`_CudaFlash`) inside the ring, the cp ranks
    as threads on one GPU, against world 1's attention in float32 (the real NCCL
    exchange needs one GPU a rank)."""
    torch.manual_seed(0)
    cp, b, h, s, d, dev = 4, 2, 8, 1024, 64, torch.device("cuda")
    q = torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, 2, s, d, device=dev, dtype=dtype, requires_grad=True)
            for _ in range(2))  # fmt: skip
    qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        qf, kf.repeat_interleave(4, dim=1), vf.repeat_interleave(4, dim=1), is_causal=True
    )
    w = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), (qf, kf, vf))
    x = torch.zeros(b, s, dtype=torch.long, device=dev)
    outs: dict[int, torch.Tensor] = {}
    grads: dict[int, tuple[torch.Tensor, ...]] = {}

    def rank_main(rank: int, group: _ThreadGroup) -> None:
        _, _, docs = ContextSplit(rank, cp).shard(x, x)
        mine = chunk_positions(s, cp, rank).to(dev)
        out = _threaded_attend(group, rank, "ring")(q[:, :, mine], k[:, :, mine], v[:, :, mine],
                                                    docs)  # fmt: skip
        outs[rank] = out.detach()
        grads[rank] = torch.autograd.grad((out.double() * w[:, :, mine]).sum(), (q, k, v))
        torch.cuda.synchronize()

    _run_threads(cp, rank_main)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    for rank in range(cp):
        mine = chunk_positions(s, cp, rank).to(dev)
        assert outs[rank].dtype == dtype
        torch.testing.assert_close(outs[rank].double(), ref[:, :, mine], **tol)
    for i, ref_g in enumerate(ref_grads):
        total = sum(grads[rank][i].double() for rank in range(cp))
        torch.testing.assert_close(total, ref_g, rtol=tol["rtol"], atol=5 * tol["atol"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["flash", "efficient"])
def test_the_cuda_kernels_are_called_as_their_schemas_say(dtype):
    """No GPU here: the CUDA kernels' calls (flash for bf16, memory-efficient for fp32,
    its log-sum-exp padded to 32) run on meta tensors, which checks their arguments
    and the shapes and dtypes they give back, not their values."""
    from meshforge.parallel.context_parallel import _CudaFlash

    q = torch.empty(2, 4, 40, 64, dtype=dtype, device="meta")
    out, lse = _CudaFlash.forward(q, q, q, True, 0.125)
    assert (out.shape, out.dtype) == (q.shape, dtype)
    assert (lse.shape, lse.dtype) == ((2, 4, 40), torch.float32)
    grads = _CudaFlash.backward(out, q, q, q, out, lse, False, 0.125)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, dtype)] * 3


def test_ring_pairs_attend_each_earlier_chunk_once_and_its_own_causally():
    from meshforge.parallel.context_parallel import _ring_pairs

    for cp in (1, 2, 4):
        for rank in range(cp):
            mine = (rank, 2 * cp - 1 - rank)
            seen = []
            for src in range(cp):
                theirs = (src, 2 * cp - 1 - src)
                for n, m, causal in _ring_pairs(rank, src, cp):
                    assert causal == (theirs[m] == mine[n])
                    seen.append((mine[n], theirs[m]))
            # every key chunk at or before each query chunk, once
            assert sorted(seen) == sorted((i, j) for i in mine for j in range(i + 1))


def test_ring_refuses_documents_and_attention_dropout():
    from meshforge.models.attention import Documents
    from meshforge.parallel.context_parallel import RingAttend, _CudaFlash, _Flash

    attend = RingAttend(group=None)  # type: ignore[arg-type]
    x = _tokens(1, 8, seed=0)
    q = torch.randn(1, 2, 4, 4)
    _, _, masked = ContextSplit(0, 2).shard(x, x, EOT)
    with pytest.raises(ValueError, match="ring: document masking is not yet built"):
        attend(q, q, q, masked)
    _, _, plain = ContextSplit(0, 2).shard(x, x)
    with pytest.raises(ValueError, match="ring: attention dropout"):
        attend(q, q, q, plain, dropout_p=0.1)
    with pytest.raises(RuntimeError, match="ContextDocuments"):
        attend(q, q, q, Documents(x, x, None))  # type: ignore[arg-type]
    # the kernels by device: CPU's here, CUDA's where the tensors are
    assert _Flash.of(torch.device("cpu")) is _Flash
    assert _Flash.of(torch.device("cuda", 0)) is _CudaFlash


def _models():
    from meshforge.models.llama import Llama, LlamaArgs

    gpt = GPTArgs(
        vocab_size=16, d_model=16, n_layers=2, n_heads=2, seq_len=16, tie_embeddings=False
    )
    llama = LlamaArgs(vocab_size=16, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                      seq_len=16, ffn_hidden=32)  # fmt: skip
    return {"gpt": lambda: GPT(gpt), "llama": lambda: Llama(llama)}


@pytest.mark.parametrize(
    ("method", "masking"),
    [("allgather", False), ("allgather", True), ("alltoall", False), ("alltoall", True),
     ("ring", False)],  # ring: plain causal attention only (the layout rules)
    ids=["allgather-causal", "allgather-documents", "alltoall-causal", "alltoall-documents",
         "ring-causal"],
)  # fmt: skip
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_cp_ranks_as_threads_give_world_1s_loss_and_gradients(model, masking, method):
    from meshforge.train.step import cross_entropy

    cp, s = 2, 16
    build = _models()[model]
    x = _tokens(2, s, seed=3)
    y = _tokens(2, s, seed=4)
    torch.manual_seed(0)
    ref_model = build()
    eot = EOT if masking else None
    docs = documents_of(x, EOT) if masking else None
    ref_loss = cross_entropy(ref_model(x, docs=docs), y)
    ref_loss.backward()

    results: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}

    def rank_main(rank: int, group: _ThreadGroup) -> None:
        torch.manual_seed(0)
        m = build()
        for layer in attention_modules(m):
            layer.attend = _threaded_attend(group, rank, method)
        xs, ys, d = ContextSplit(rank, cp).shard(x, y, eot)
        loss = cross_entropy(m(xs, docs=d), ys)
        loss.backward()
        results[rank] = (loss.item(), {n: p.grad for n, p in m.named_parameters()})

    _run_threads(cp, rank_main)
    # the mean of the ranks' losses is world 1's; so is the mean of their gradients
    mean_loss = sum(results[r][0] for r in range(cp)) / cp
    assert mean_loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for name, p in ref_model.named_parameters():
        mean_grad = sum(results[r][1][name] for r in range(cp)) / cp
        torch.testing.assert_close(mean_grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_under_cp_each_packed_token_has_the_loss_of_its_document_alone(model, method):
    """Two documents packed into one sequence of 16 tokens, split over cp2 ranks (the
    separator falls inside a chunk, so each rank holds tokens of both): every token's
    loss equals the one it has when its document runs alone, at world 1 (1e-5)."""
    import torch.nn.functional as F

    cp = 2
    build = _models()[model]
    doc_a = torch.tensor([1, 2, 3, 4, 5, 6])
    doc_b = torch.tensor([7, 8, 2, 1, 3, 5, 4, 6, 2, 1])
    packed = torch.cat([doc_a, torch.tensor([EOT]), doc_b]).view(1, -1)  # 17 ids
    x, y = packed[:, :-1], packed[:, 1:]
    torch.manual_seed(0)
    ref = build().eval()

    def token_losses(m, idx):
        with torch.no_grad():
            return F.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[0, 1:], reduction="none")

    want_a = token_losses(ref, torch.cat([doc_a, torch.tensor([EOT])]).view(1, -1))
    want_b = token_losses(ref, doc_b.view(1, -1))
    got = torch.full((x.shape[1],), float("nan"))

    def rank_main(rank: int, group: _ThreadGroup) -> None:
        torch.manual_seed(0)
        m = build().eval()
        for layer in attention_modules(m):
            layer.attend = _threaded_attend(group, rank, method)
        xs, ys, d = ContextSplit(rank, cp).shard(x, y, EOT)
        with torch.no_grad():
            losses = F.cross_entropy(m(xs, docs=d).flatten(0, 1), ys[0], reduction="none")
        got[chunk_positions(x.shape[1], cp, rank)] = losses

    _run_threads(cp, rank_main)
    n_a = len(doc_a)  # targets doc_a[1:] and the separator: one per token of doc_a
    torch.testing.assert_close(got[:n_a], want_a, rtol=0, atol=1e-5)
    # the separator predicts doc_b's first token: no document-alone counterpart
    torch.testing.assert_close(got[n_a + 1 :], want_b, rtol=0, atol=1e-5)
