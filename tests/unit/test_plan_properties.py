"""Properties any step-time model of the planner must keep, whatever its constants: on
catalogue GPUs and shapes drawn from reasonable ranges, through `plan.core.predict.evaluate`.

* More GPUs at a fixed global batch never raise the per-GPU throughput (ZeRO-3, data
  parallel only, same micro-batch): the work per sequence is the same, and more ranks
  only add communication and take away micro-batches to hide it under.
* A faster network (a link at least as fast and no slower to start) never slows a step.
* More micro-batches (a larger global batch at the same dp and micro-batch) never
  grow the 1F1B pipeline's bubble fraction.
"""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from meshforge.plan.core.cluster import build_cluster
from meshforge.plan.core.flops import GPTShape
from meshforge.plan.core.hardware import LINK_PRESETS
from meshforge.plan.core.layout import Layout, Training, is_valid
from meshforge.plan.core.predict import evaluate

GPUS = ["a100-80gb", "h100"]
REL = 1e-9  # float noise only


def _dominated_pairs() -> list[tuple[str, str]]:
    """(slower, faster) link presets where the faster one has at least the bandwidth and
    at most the latency, and is better in one of them."""
    links = LINK_PRESETS.values()
    return sorted(
        (slow.name, fast.name)
        for slow in links
        for fast in links
        if fast.busbw_bytes_per_s >= slow.busbw_bytes_per_s
        and fast.latency_s <= slow.latency_s
        and (fast.busbw_bytes_per_s, -fast.latency_s) != (slow.busbw_bytes_per_s, -slow.latency_s)
    )


LINK_PAIRS = _dominated_pairs()

shapes = st.builds(
    lambda layers, heads, head_dim, vocab, seq: GPTShape(
        layers, heads * head_dim, heads, vocab, seq
    ),
    layers=st.integers(2, 48),
    heads=st.sampled_from([8, 16, 32]),
    head_dim=st.sampled_from([64, 128]),
    vocab=st.sampled_from([32000, 50304, 128256]),
    seq=st.sampled_from([512, 1024, 2048, 4096]),
)


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    gpu=st.sampled_from(GPUS),
    gpus_per_node=st.sampled_from([4, 8]),
    n_small=st.sampled_from([1, 2, 4, 8, 16, 32]),
    factor=st.sampled_from([2, 4, 8]),
    micro_batch=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 8),
    recompute=st.sampled_from(["none", "full"]),
)
def test_more_gpus_at_a_fixed_global_batch_never_raise_per_gpu_throughput(
    shape, gpu, gpus_per_node, n_small, factor, micro_batch, per_rank, recompute
):
    n_large = n_small * factor
    global_batch = n_large * micro_batch * per_rank  # both sizes split it evenly
    training = Training(global_batch, micro_batch, recompute=recompute)

    def per_gpu(n: int) -> float:
        cluster = build_cluster(n, gpu, gpus_per_node)
        prediction = evaluate(shape, Layout(dp=n, zero=3 if n > 1 else 0), training, cluster)
        return prediction.tokens_per_s / n

    small, large = per_gpu(n_small), per_gpu(n_large)
    assert large <= small * (1 + REL), (
        f"{n_large} GPUs: {large:.1f} tokens/s/GPU > {n_small} GPUs: {small:.1f}"
    )


@st.composite
def layouts(draw, min_pp: int = 1):
    """A valid (shape, layout, training, GPUs per node) with every kind of parallelism,
    on whole nodes."""
    shape = draw(shapes)
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if shape.n_heads % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 3, 4) if min_pp <= p <= shape.n_layers]))
    dp = draw(st.sampled_from([1, 2, 4, 8]))
    v = draw(st.sampled_from([1, 2])) if pp > 1 and 2 * pp <= shape.n_layers else 1
    micro_batch = draw(st.sampled_from([1, 2]))
    m = pp * draw(st.integers(1, 4))  # >= pp, and a multiple of pp for interleaving
    training = Training(
        dp * micro_batch * m,
        micro_batch,
        precision=draw(st.sampled_from(["bf16", "fp32"])),
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
    )
    zero = draw(st.sampled_from([0, 1, 2, 3])) if dp > 1 else 0
    layout = Layout(dp, tp, pp, zero, v, tp > 1 and draw(st.booleans()))
    assume(is_valid(layout, training, shape))
    gpus_per_node = draw(st.sampled_from([2, 4, 8]))
    n = layout.world_size
    assume(n <= gpus_per_node or n % gpus_per_node == 0)
    return shape, layout, training, gpus_per_node


@settings(max_examples=60, deadline=None)
@given(
    case=layouts(),
    gpu=st.sampled_from(GPUS),
    pair=st.sampled_from(LINK_PAIRS),
    which=st.sampled_from(["inter", "intra"]),
)
def test_a_faster_network_never_slows_a_step(case, gpu, pair, which):
    shape, layout, training, gpus_per_node = case
    n = layout.world_size
    slow, fast = pair

    def step_s(link: str) -> float:
        links = {"network": link} if which == "inter" else {"intra_network": link}
        cluster = build_cluster(n, gpu, gpus_per_node, **links)
        return evaluate(shape, layout, training, cluster).step_time_s

    assert step_s(fast) <= step_s(slow) * (1 + REL), f"{which} {fast} slower than {slow}"


@settings(max_examples=60, deadline=None)
@given(
    case=layouts(min_pp=2),
    gpu=st.sampled_from(GPUS),
    more=st.integers(1, 16),
)
def test_more_microbatches_never_grow_the_1f1b_bubble_fraction(case, gpu, more):
    shape, layout, training, gpus_per_node = case
    layout = Layout(layout.dp, layout.tp, layout.pp, layout.zero, 1, layout.sequence_parallel)
    cluster = build_cluster(layout.world_size, gpu, gpus_per_node)
    per_microbatch = layout.dp * training.micro_batch
    bigger = Training(
        training.global_batch + more * per_microbatch,
        training.micro_batch,
        training.precision,
        training.recompute,
    )
    fewer = evaluate(shape, layout, training, cluster).bubble_fraction
    many = evaluate(shape, layout, bigger, cluster).bubble_fraction
    assert many <= fewer * (1 + REL), (
        f"m={training.microbatches(layout.dp)}: {fewer:.4f}, "
        f"m={bigger.microbatches(layout.dp)}: {many:.4f}"
    )


def test_the_link_pairs_cover_both_kinds_of_link():
    names = {name for pair in LINK_PAIRS for name in pair}
    assert {"ib-hdr", "ib-ndr", "nvlink3", "nvlink4"} <= names
    assert ("ib-hdr", "ib-ndr") in LINK_PAIRS
