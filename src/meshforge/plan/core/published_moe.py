"""Published mixture-of-experts training runs, with their sources, to check the planner's
MoE model against (pure data, no torch). Not fitted on: the planner's constants are the
fit on the dense runs (plan/core/published.py), so every row here is held out.

Sources, one key each:

- "megatron-core-moe": NVIDIA's Megatron-Core MoE figures. The MoE README
  (github NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md, MCore v0.9):
  "468 TFLOPS for Mixtral 8X7B bf16 training" on H100, without its layout. The layout
  is the benchmark configuration the same team publishes for that model in
  github yanring/Megatron-MoE-ModelZoo (runtime_configs/benchmarking/runtime.conf:
  Mixtral-8x7B TP 1, PP 4, EP 8, VPP 8, MBS 1, GBS 256, 8 nodes, seq 4096, all-to-all
  dispatcher, grouped GEMM): assumed, not stated, to be the README's run.
- "megatron-moe-modelzoo": github yanring/Megatron-MoE-ModelZoo (the Megatron-Core MoE
  team's benchmark scripts): best_practice/Mixtral/run_mixtral_8x22B.sh ("Dropless
  training, stable performance should be around 455TFLOPS for H100", layout from
  runtime.conf, flags from model_configs/benchmarking/Mixtral-8x22B.yaml) and
  best_practice/qwen3/readme.md (Qwen3-235B-A22B on 256 H100, step time and TFLOPS per
  GPU with the layout in the table).
- "deepseek-v3": DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv 2412.19437: 2048
  H800, pre-training 2664K GPU hours for 14.8T tokens (Table 1; 2.788M GPU hours with
  context extension and post-training), PP 16, EP 64 over 8 nodes, ZeRO-1 data
  parallel (Section 3.2), batch 15360 sequences of 4096 tokens at its largest
  (Section 4.2), FP8 mixed precision (Section 3.3), MLA attention. Excluded: the
  catalogue does not hold the H800, and the planner models neither FP8 nor MLA.

Conventions as in published.py. Megatron's TFLOPS per GPU count the model FLOPs of the
active parameters (top-k and shared experts, the router) and the attention, no
recomputation; the planner converts its prediction with its own count
(flops.microbatch_flops: full s x s attention, where Megatron-Core's newer releases
count the causal half: a few % at seq 4096).
"""

from __future__ import annotations

from meshforge.plan.core.published import PublishedRun

_MCORE_MOE_REF = (
    "Megatron-Core MoE README (github NVIDIA/Megatron-LM "
    "megatron/core/transformer/moe/README.md, MCore v0.9): 468 TFLOPS, Mixtral 8x7B bf16, "
    "H100; layout from github yanring/Megatron-MoE-ModelZoo "
    "runtime_configs/benchmarking/runtime.conf"
)
_ZOO = "github yanring/Megatron-MoE-ModelZoo"
_MCORE_MOE_NOTES = (
    "Megatron-Core: distributed optimizer (zero 1), --overlap-grad-reduce, "
    "--overlap-param-gather, --tp-comm-overlap, sequence parallel, flash attention, "
    "grouped GEMM, dropless all-to-all dispatcher (the ModelZoo's Mixtral flags). "
    "Recomputation not in the configuration (none). TFLOPS: Megatron's model FLOPs of the "
    "active parameters, no recomputation."
)

MIXTRAL_8X7B = PublishedRun(
    source="megatron-core-moe", reference=_MCORE_MOE_REF, name="Mixtral 8x7B",
    family="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
    vocab=32000, seq=4096, published_params=46.7e9, tied_embeddings=False,
    gpu="h100", n_gpus=64, gpus_per_node=8, network=None, nics_per_node=None,
    tp=1, pp=4, dp=16, zero=1, virtual_stages=8, sequence_parallel=False, micro_batch=1,
    global_batch=256, recompute="none", precision="bf16",
    metric="tflops_per_gpu_model", value=468.0,
    notes=_MCORE_MOE_NOTES + " The README gives the figure only; the layout is the "
    "ModelZoo's benchmark configuration for this model (TP 1 PP 4 EP 8 VPP 8).",
    experts=8, top_k=2, expert_ffn=14336, ep=8,
)  # fmt: skip

MIXTRAL_8X22B = PublishedRun(
    source="megatron-moe-modelzoo",
    reference=f"{_ZOO} best_practice/Mixtral/run_mixtral_8x22B.sh, "
    "runtime_configs/benchmarking/runtime.conf, model_configs/benchmarking/Mixtral-8x22B.yaml",
    name="Mixtral 8x22B", family="llama", layers=56, hidden=6144, heads=48, kv_heads=8,
    ffn_hidden=16384, vocab=32768, seq=4096, published_params=141e9, tied_embeddings=False,
    gpu="h100", n_gpus=128, gpus_per_node=8, network=None, nics_per_node=None,
    tp=2, pp=8, dp=8, zero=1, virtual_stages=1, sequence_parallel=True, micro_batch=1,
    global_batch=256, recompute="none", precision="bf16",
    metric="tflops_per_gpu_model", value=455.0,
    notes=_MCORE_MOE_NOTES + " 'Dropless training, stable performance should be around "
    "455TFLOPS for H100' (an expected figure, not a logged one). "
    "--expert-tensor-parallel-size 1: Megatron does not split the experts by tp (the "
    "planner does, as meshforge's trainer).",
    experts=8, top_k=2, expert_ffn=16384, ep=8,
)  # fmt: skip

_QWEN3_235B = dict(
    source="megatron-moe-modelzoo", family="llama", layers=94, hidden=4096, heads=64,
    kv_heads=4, head_dim=128, ffn_hidden=12288, vocab=151936, seq=4096,
    published_params=235e9, tied_embeddings=False, gpu="h100", n_gpus=256, gpus_per_node=8,
    network="ib-ndr", nics_per_node=8, global_batch=2048, precision="bf16",
    metric="iteration_s", experts=128, top_k=8, expert_ffn=1536,
)  # fmt: skip

QWEN3_235B_FSDP = PublishedRun(
    **_QWEN3_235B,
    reference=f"{_ZOO} best_practice/qwen3/readme.md, H100 table, intra-node EP, first row",
    name="Qwen3-235B-A22B (EP 8, FSDP)", tp=2, pp=1, dp=128, zero=3, virtual_stages=1,
    sequence_parallel=True, micro_batch=4, recompute="full", value=17.6,
    also={"tflops_per_gpu_model": 276.0},
    notes="Megatron-Core with Megatron FSDP (zero 3), DeepEP dispatcher, full "
    "recomputation, MBS 4, GA 4, 'disable log para norm'. 256 H100, NVLink 4, InfiniBand "
    "8 x 50 GB/s per node. Step time 17.6 s, 276 TFLOPS per GPU.",
    ep=8,
)  # fmt: skip

QWEN3_235B_PP = PublishedRun(
    **_QWEN3_235B,
    reference=f"{_ZOO} best_practice/qwen3/readme.md, H100 table, intra-node EP, A2A row",
    name="Qwen3-235B-A22B (EP 8 over TP x DP, PP 32)", tp=2, pp=32, dp=4, zero=1,
    virtual_stages=3, sequence_parallel=True, micro_batch=1, recompute="selective",
    value=24.2, also={"tflops_per_gpu_model": 200.0},
    notes="Megatron-Core, all-to-all dispatcher, TP 2 PP 32 VPP 3 DP 4 EP 8: the experts "
    "folded over tp x dp (MoE Parallel Folding), recompute of norms and activations. "
    "Step time 24.2 s, 200 TFLOPS per GPU.",
    ep=8,
)  # fmt: skip

DEEPSEEK_V3 = PublishedRun(
    source="deepseek-v3",
    reference="DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv 2412.19437: Table 1 "
    "(2664K H800 GPU hours of pre-training for 14.8T tokens), Sections 3.2, 3.3, 4.2",
    name="DeepSeek-V3 671B", family="llama", layers=61, hidden=7168, heads=128, kv_heads=8,
    head_dim=128, ffn_hidden=18432, vocab=129280, seq=4096, published_params=671e9,
    tied_embeddings=False, gpu="h100", n_gpus=2048, gpus_per_node=8, network="ib-ndr",
    nics_per_node=8, tp=1, pp=16, dp=128, zero=1, virtual_stages=1,
    sequence_parallel=False, micro_batch=None, global_batch=15360, recompute="none",
    precision="bf16", metric="tokens_per_s_per_gpu", value=14.8e12 / (2664e3 * 3600),
    notes="A mean over the whole pre-training (batch ramped from 3072 to 15360 over the "
    "first 469B tokens; the largest taken). DualPipe overlaps the all-to-alls and the "
    "pipeline (planned as 1F1B without overlap); MLA attention planned as 128 heads of "
    "128 over 8 kv heads (attention matrices ~1.3x MLA's); the multi-token prediction "
    "module left out; FP8 GEMMs planned at the bf16 peak; node-limited routing (4 nodes "
    "at most) not modelled.",
    excluded="H800 (NVLink 400 GB/s), FP8 training and MLA attention: the catalogue does "
    "not hold the H800 and the planner models neither FP8 nor MLA",
    experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3, ep=64,
)  # fmt: skip

PUBLISHED_MOE_RUNS: tuple[PublishedRun, ...] = (
    MIXTRAL_8X7B,
    MIXTRAL_8X22B,
    QWEN3_235B_FSDP,
    QWEN3_235B_PP,
    DEEPSEEK_V3,
)
