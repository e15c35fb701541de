"""Published training-run throughput figures, with their sources, for validating the
planner's time model (pure data, no torch).

Every row is a figure as its source published it (`metric`, `value`), with the model
shape, the cluster and the parallel layout the source gives. What a source does not
state is None (or, where the planner needs a value, the usual default, said so in
`notes`). Sources, one key each (independent groups/code bases):

- "narayanan2021": Narayanan et al., "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", SC21, arXiv 2104.04473, Table 1 (weak scaling, GPT
  1.7B-1T on Selene, DGX A100 80GB). Same table as the Megatron-LM README of 2021
  (github NVIDIA/Megatron-LM, images/cases_april2021.png, removed in commit 2e90a342).
- "korthikanti2022": Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", arXiv 2205.05198 (GPT 22B-1T, TP 8, selective recompute +
  sequence parallel, DP 1); the figures of plan/calibration.py.
- "megatron-core2024": Megatron-Core r0.8.0 weak-scaling table on H100 (github
  NVIDIA/Megatron-LM README, "Performance Benchmarking", images/model_table.png, added
  in commit f2e5db40, July 2024). GPT 1.7B-462B, TP/PP/DP, 48-6144 GPUs.
- "llm-foundry": MosaicML llm-foundry, scripts/train/benchmarking/README.md ("MPT
  Training Benchmarks"), github mosaicml/llm-foundry. MPT 1B-70B with PyTorch FSDP
  (FULL_SHARD / SHARD_GRAD_OP) on A100 40GB, A100 80GB and H100 80GB, 8-512 GPUs.
- "torchtitan": the torchtitan team's benchmarks (Liang et al. 2024, arXiv 2410.06352),
  github pytorch/torchtitan: benchmarks/llama3_h100_202412_torchtitan.md,
  benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, and docs/performance.md of
  April-Dec 2024 (Llama 3 8B/70B on 64 A100 80GB; Llama 3.1 405B on 128 H100).
- "bloom2022": BLOOM-176B training README (github bigscience-workshop/bigscience,
  train/tr11-176B-ml/README.md), 384 A100 80GB, TP 4 PP 12 DP 8, ZeRO-1.
- "mtnlg2022": Smith et al., MT-NLG 530B, arXiv 2201.11990 Section 2.4 (280/350/420
  DGX A100 nodes, TP 8 PP 35).
- "llama3-2024": The Llama 3 Herd of Models, arXiv 2407.21783, Table 4 (405B on 8K and
  16K H100, TP 8 PP 16, CP 1 or 16).

Not included: OPT-175B ("up to 147 TFLOP/s per GPU": FLOP convention and layout details
not readable here), NeMo / Megatron-Bridge performance tables (H100 rows are FP8 only),
H200 (no bf16 figure with a layout found; torchtitan's H200 run is Float8).

A row on hardware the planner's GPU catalogue does not hold, as its source states it
(torchtitan's 500 W H100 96GB HBM2e), carries `excluded` with the source's words: it is
predicted and shown, but neither fitted on nor held to the bound.

Conventions. n_gpus = tp * pp * dp * cp. `global_batch` and `micro_batch` count
sequences (micro_batch: per data-parallel rank per forward/backward). FLOP-based
metrics follow the source's own FLOP convention, repeated in each row's notes:
"tflops_per_gpu_hardware" counts recomputation (Megatron eq. 3: 96·B·s·l·h²·(1 +
s/6h + V/16lh) with full recompute), "tflops_per_gpu_model" and "mfu" do not. Peaks
the sources use: A100 312 TFLOP/s, H100 SXM 989 TFLOP/s (bf16/fp16 dense).
"""

from __future__ import annotations

from dataclasses import dataclass, field

METRICS = (
    "tflops_per_gpu_hardware",  # achieved TFLOP/s per GPU, recomputation counted
    "tflops_per_gpu_model",  # achieved TFLOP/s per GPU, model FLOPs only
    "mfu",  # model FLOPs utilisation, a fraction of the GPU's dense bf16/fp16 peak
    "tokens_per_s_per_gpu",
    "tokens_per_s",  # whole job
    "iteration_s",  # seconds per optimizer step (one global batch)
)


@dataclass(frozen=True)
class PublishedRun:
    # --- provenance
    source: str  # short key, one per independent source (see module docstring)
    reference: str  # title + table/figure + URL or arXiv id
    name: str  # the source's name for the model/run, e.g. "GPT 39.1B", "MPT-7B"
    # --- model shape
    family: str  # "gpt": LayerNorm + GELU MLP; "llama": RMSNorm + SwiGLU + GQA + RoPE
    layers: int
    hidden: int
    heads: int
    kv_heads: int | None  # None: = heads (no GQA)
    ffn_hidden: int | None  # None: 4 * hidden (gpt)
    vocab: int
    seq: int
    published_params: float | None  # parameter count as the source states it
    tied_embeddings: bool | None  # output head shares the token embedding (None: unknown)
    # --- cluster
    gpu: str  # planner key: "a100-40gb", "a100-80gb", "h100", "h200"
    n_gpus: int
    gpus_per_node: int
    # inter-node network: a planner link key where one matches ("ib-hdr", "ib-ndr"),
    # otherwise a description ("roce-200g": 200 Gb/s RoCE ports); None: not stated
    network: str | None
    nics_per_node: int | None  # inter-node ports per node (None: not stated)
    # --- layout
    tp: int
    pp: int
    dp: int  # data-parallel (or FSDP-shard) degree
    zero: int  # 0: plain DP / DDP; 1: distributed optimizer; 2: SHARD_GRAD_OP; 3: FULL_SHARD
    virtual_stages: int  # interleaved-schedule model chunks per pipeline rank (1: none/unknown)
    sequence_parallel: bool
    micro_batch: int | None  # sequences per DP rank per micro-step (None: not published)
    global_batch: int  # sequences per optimizer step
    recompute: str  # "none" | "selective" | "full"
    precision: str  # "bf16" | "fp16"
    # --- the published figure, exactly as published
    metric: str  # one of METRICS
    value: float
    also: dict[str, float] = field(default_factory=dict, hash=False)  # other published figures
    notes: str = ""  # assumptions, FLOP convention, caveats
    cp: int = 1  # context-parallel degree
    cp_method: str = "allgather"  # how the cp ranks exchange K/V (layout.CP_METHODS)
    # dtype of the data-parallel gradient reduction as the source's code runs it: "fp32"
    # (Megatron with bf16, FSDP reduce_dtype fp32, Llama 3), "fp16" (Megatron-LM with
    # --fp16: grads reduced in the model dtype), "bf16" (FSDP mixed precision PURE)
    grad_reduce: str = "fp32"
    # hardware the planner's catalogue does not hold, as the source states it: the row
    # is still predicted and shown, but is neither fitted on nor held to the bound
    excluded: str | None = None
    # --- a mixture of experts (experts 0: dense; plan/core/published_moe.py)
    experts: int = 0  # routed experts per MoE layer
    top_k: int = 0
    expert_ffn: int = 0  # each expert's SwiGLU width
    shared_experts: int = 0
    dense_layers: int = 0  # dense layers before the first MoE one
    ep: int = 1  # expert-parallel degree (the source's; within dp for the planner)
    head_dim: int | None = None  # None: hidden / heads

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"{self.name}: unknown metric {self.metric!r}")
        if self.tp * self.pp * self.dp * self.cp != self.n_gpus:
            raise ValueError(f"{self.name}: tp*pp*dp*cp != n_gpus")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"{self.name}: unknown recompute {self.recompute!r}")
        if self.grad_reduce not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"{self.name}: unknown grad_reduce {self.grad_reduce!r}")

    @property
    def layout_kind(self) -> str:
        """ "dp" when the model is replicated or sharded only across data parallelism
        (DDP/ZeRO/FSDP), "3d" when tensor or pipeline parallelism splits it."""
        return "dp" if self.tp == 1 and self.pp == 1 else "3d"


# ----------------------------------------------------------------------------------
# Narayanan et al. 2021, Table 1. Selene: DGX A100 80GB, NVLink 3 in a node, 8x HDR
# InfiniBand (200 Gb/s) per node. GPT, vocab 51200, seq 2048. "Model-parallel size"
# in the README's copy is tp*pp; the README says tp = 8 for sizes above 8 (e.g. 145B:
# TP 8, PP 8), as the paper's Table 1 lists.
_NARAYANAN_REF = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM, arXiv 2104.04473, Table 1 (also Megatron-LM README 2021, "
    "images/cases_april2021.png); the runs' settings from the paper's own scripts, "
    "github NVIDIA/Megatron-LM examples/sc21/run_table_1.sh and CONFIG.sh"
)
_NARAYANAN_NOTES = (
    "Metric: achieved TFLOP/s per GPU by the paper's eq. 3 (hardware FLOPs with full "
    "activation recomputation, 4 passes: 96*B*s*l*h^2*(1+s/6h+V/16lh)); also: percent of "
    "the 312 TFLOP/s peak and aggregate PFLOP/s. End-to-end (data loading, optimizer, "
    "logging). Section 5.1: 'we use the interleaved pipeline schedule with the "
    "scatter/gather optimization enabled'. Micro-batch and chunks per device from "
    "examples/sc21/run_table_1.sh (--micro-batch-size; --num-layers-per-virtual-pipeline-"
    "stage: 5 for 76B and 145B, 3 for 310B, 1 for 530B, none for 39B and 1T), and "
    "CONFIG.sh: --fp16 without --accumulate-allreduce-grads-in-fp32, so gradients are "
    "all-reduced in fp16 (grad_reduce fp16); no optimizer sharding (Megatron-LM 2021: "
    "zero 0). Heads recalled from the paper's Table 1 (the README copy read here lacks "
    "them; they do not enter eq. 3)."
)


def _narayanan(name, params_b, heads, hidden, layers, tp, pp, gpus, batch, mbs, layers_per_chunk,
               tflops, frac, pflops):  # fmt: skip
    virtual = layers // pp // layers_per_chunk if layers_per_chunk else 1
    return PublishedRun(
        source="narayanan2021", reference=_NARAYANAN_REF, name=name,
        family="gpt", layers=layers, hidden=hidden, heads=heads, kv_heads=None,
        ffn_hidden=None, vocab=51200, seq=2048, published_params=params_b * 1e9,
        tied_embeddings=True,
        gpu="a100-80gb", n_gpus=gpus, gpus_per_node=8, network="ib-hdr", nics_per_node=8,
        tp=tp, pp=pp, dp=gpus // (tp * pp), zero=0, virtual_stages=virtual,
        sequence_parallel=False, micro_batch=mbs, global_batch=batch, recompute="full",
        precision="fp16", metric="tflops_per_gpu_hardware", value=tflops,
        also={"fraction_of_peak": frac, "aggregate_pflops": pflops}, notes=_NARAYANAN_NOTES,
        grad_reduce="fp16",
    )  # fmt: skip


NARAYANAN_2021 = (  # ..., batch, micro-batch, layers per interleaved chunk (None: 1F1B), ...
    _narayanan("GPT 1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 512, 16, None, 137, 0.44, 4.4),
    _narayanan("GPT 3.6B", 3.6, 32, 3072, 30, 2, 1, 64, 512, 16, None, 138, 0.44, 8.8),
    _narayanan("GPT 7.5B", 7.5, 32, 4096, 36, 4, 1, 128, 512, 16, None, 142, 0.46, 18.2),
    _narayanan("GPT 18.4B", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, None, 135, 0.43, 34.6),
    _narayanan("GPT 39.1B", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, None, 138, 0.44, 70.8),
    _narayanan("GPT 76.1B", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140, 0.45, 143.8),
    _narayanan("GPT 145.6B", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148, 0.47, 227.1),
    _narayanan("GPT 310.1B", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155, 0.50, 297.4),
    _narayanan("GPT 529.6B", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163, 0.52, 410.2),
    _narayanan("GPT 1T", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, None, 163, 0.52, 502.0),
)

# ----------------------------------------------------------------------------------
# Korthikanti et al. 2022 (the runs of plan/calibration.py): Selene DGX A100 80GB,
# TP 8, DP 1, selective recomputation + sequence parallelism, seq 2048, vocab 51200.
_KORTHIKANTI_REF = (
    "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models, "
    "arXiv 2205.05198, Table 3 (configurations) and Table 5 (iteration time, MFU, HFU of "
    "the end-to-end runs; MFU/HFU also in the Megatron-LM README from commit 2e90a342, May "
    "2022)"
)
_KORTHIKANTI_NOTES = (
    "Metric: seconds per iteration (one global batch); also MFU and HFU of the A100 312 "
    "TFLOP/s peak (model FLOPs without / hardware FLOPs with the selective recompute). "
    "Micro-batch from the paper's Table 3 (4 for 22B, 1 otherwise); Section 6: 'We use the "
    "interleaving schedule with three interleaving stages (m = 3) for the 175B and 530B "
    "models' (virtual_stages 3). Mixed precision, bf16 assumed (the README's runs); grads "
    "reduced in fp32 (Megatron's default with bf16; DP 1 here anyway)."
)


def _korthikanti(name, params_b, heads, hidden, layers, pp, gpus, batch, mbs, v, it_s, mfu, hfu):
    return PublishedRun(
        source="korthikanti2022", reference=_KORTHIKANTI_REF, name=name,
        family="gpt", layers=layers, hidden=hidden, heads=heads, kv_heads=None,
        ffn_hidden=None, vocab=51200, seq=2048, published_params=params_b * 1e9,
        tied_embeddings=True,
        gpu="a100-80gb", n_gpus=gpus, gpus_per_node=8, network="ib-hdr", nics_per_node=8,
        tp=8, pp=pp, dp=gpus // (8 * pp), zero=0, virtual_stages=v, sequence_parallel=True,
        micro_batch=mbs, global_batch=batch, recompute="selective", precision="bf16",
        metric="iteration_s", value=it_s, also={"mfu": mfu, "hfu": hfu},
        notes=_KORTHIKANTI_NOTES,
    )  # fmt: skip


KORTHIKANTI_2022 = (
    _korthikanti("GPT 22B", 22, 64, 6144, 48, 1, 8, 4, 4, 1, 1.10, 0.415, 0.437),
    _korthikanti("GPT 175B", 175, 96, 12288, 96, 8, 64, 64, 1, 3, 13.75, 0.514, 0.528),
    _korthikanti("GPT 530B", 530, 128, 20480, 105, 35, 280, 280, 1, 3, 37.83, 0.560, 0.570),
    _korthikanti("GPT 1T", 1000, 160, 25600, 128, 64, 512, 512, 1, 1, 71.49, 0.563, 0.570),
)

# ----------------------------------------------------------------------------------
# Megatron-Core r0.8.0 weak scaling on H100 (Megatron-LM README, July 2024): GPT,
# vocab 131072, seq 4096, DP 48 throughout. The parameter counts match 12*l*h^2 plus
# two vocab x h matrices (untied input/output embeddings), e.g. 177B for GPT-3's shape.
_MCORE_REF = (
    "Megatron-LM README (github NVIDIA/Megatron-LM), Performance Benchmarking / Weak Scaling "
    "Results, images/model_table.png (Megatron-Core r0.8.0, H100, added July 2024, commit "
    "f2e5db40)"
)
_MCORE_NOTES = (
    "Metric: per-GPU teraFLOP/s as tabulated; it equals MFU x 989 TFLOP/s (e.g. 408.8 -> "
    "41%), so model FLOPs. End-to-end (data loading, optimizer, communication, logging). "
    "README names --overlap-grad-reduce, --overlap-param-gather (distributed optimizer: "
    "zero 1) and --tp-comm-overlap (needs sequence parallelism: SP on where TP > 1). Not "
    "published: micro-batch, recompute (none assumed), interleaving (virtual_stages 1 "
    "recorded), network (NVIDIA's H100 systems: 8x NDR 400G InfiniBand per node, assumed), "
    "precision (bf16 assumed: MFU quoted against the bf16 peak)."
)


def _mcore(name, heads, hidden, layers, tp, pp, gpus, batch, tflops, mfu, pflops):
    return PublishedRun(
        source="megatron-core2024", reference=_MCORE_REF, name=name,
        family="gpt", layers=layers, hidden=hidden, heads=heads, kv_heads=None,
        ffn_hidden=None, vocab=131072, seq=4096,
        published_params=float(name.split()[-1].rstrip("B")) * 1e9, tied_embeddings=False,
        gpu="h100", n_gpus=gpus, gpus_per_node=8, network="ib-ndr", nics_per_node=8,
        tp=tp, pp=pp, dp=gpus // (tp * pp), zero=1, virtual_stages=1,
        sequence_parallel=tp > 1, micro_batch=None, global_batch=batch, recompute="none",
        precision="bf16", metric="tflops_per_gpu_model", value=tflops,
        also={"mfu": mfu, "aggregate_pflops": pflops}, notes=_MCORE_NOTES,
    )  # fmt: skip


MEGATRON_CORE_2024 = (
    _mcore("GPT 1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 0.41, 19.6),
    _mcore("GPT 7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 0.47, 44.7),
    _mcore("GPT 16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 0.49, 93.9),
    _mcore("GPT 32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 0.46, 176.5),
    _mcore("GPT 70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 0.42, 322.3),
    _mcore("GPT 119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 0.43, 645.9),
    _mcore("GPT 177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 0.44, 997.2),
    _mcore("GPT 314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 0.48, 1457.4),
    _mcore("GPT 462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 0.47, 2825.6),
)

# ----------------------------------------------------------------------------------
# MosaicML llm-foundry MPT throughput tables. Model shapes from
# scripts/train/yamls/pretrain/mpt-*.yaml: GPT-style blocks (LayerNorm, GELU MLP of
# 4h), vocab 50368 (GPT-NeoX tokenizer), flash attention, tied embeddings. NumParams
# in the tables grows with seq by seq*h, i.e. the benchmark runs had learned position
# embeddings. Columns kept: MFU, HFU, Model TFLOP, MicroBatchSize, GradAccum,
# GlobalBatchSize, Throughput (T/s), Throughput (T/s/GPU), Sharding, AC.
_FOUNDRY_REF = (
    "MosaicML llm-foundry, scripts/train/benchmarking/README.md, 'MPT Training Benchmarks' "
    "(github mosaicml/llm-foundry, read at commit 8c8dd48f), table: "
)
_FOUNDRY_SHAPES = {  # name: (layers, hidden, heads)
    "MPT-1B": (24, 2048, 16),
    "MPT-3B": (32, 2560, 20),
    "MPT-7B": (32, 4096, 32),
    "MPT-13B": (40, 5120, 40),
    "MPT-30B": (48, 7168, 56),
    "MPT-70B": (80, 8192, 64),
}
_FOUNDRY_NOTES = (
    "Metric: Throughput (T/s/GPU) as tabulated (tokens/s over all GPUs / #GPUs); also "
    "the table's MFU/HFU (fractions; README convention: (6*N + 12*l*h*s) FLOPs per token, "
    "N = NumParams incl. embeddings, attention s^2 not halved for causality, no norms/"
    "activations; HFU = 4/3 MFU when activation checkpointing is on; peaks 312 (A100) / "
    "989 (H100) TFLOP/s), Model TFLOP (per GPU) and total tokens/s. PyTorch FSDP, one "
    "shard group over all GPUs; activation checkpointing = every block recomputed "
    "('full'). Benchmarks of ~12 steps. Gradient reduction: Composer's FSDP mixed "
    "precision PURE reduces in the autocast dtype (grad_reduce bf16), DEFAULT (the "
    "amp_bf16 rows) in fp32. "
)


def _foundry(table, name, gpu, gpus, net, seq, mb, ga, gb, shard, ac, prec, tps_gpu, tps, mfu,
             hfu, model_tflop, params, extra=""):  # fmt: skip
    layers, hidden, heads = _FOUNDRY_SHAPES[name]
    assert gb == mb * ga * gpus, name
    return PublishedRun(
        source="llm-foundry", reference=_FOUNDRY_REF + table, name=name,
        family="gpt", layers=layers, hidden=hidden, heads=heads, kv_heads=None,
        ffn_hidden=None, vocab=50368, seq=seq, published_params=params,
        tied_embeddings=True,
        gpu=gpu, n_gpus=gpus, gpus_per_node=8, network=net, nics_per_node=8 if net else None,
        tp=1, pp=1, dp=gpus, zero={"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[shard],
        virtual_stages=1, sequence_parallel=False, micro_batch=mb, global_batch=gb,
        recompute="full" if ac else "none", precision="bf16",
        metric="tokens_per_s_per_gpu", value=tps_gpu,
        also={"mfu": mfu / 100, "hfu": hfu / 100, "tflops_per_gpu_model": model_tflop,
              "tokens_per_s": tps, "grad_accum": ga},
        notes=_FOUNDRY_NOTES + f"Precision column: {prec}. " + extra,
        grad_reduce="bf16" if "PURE" in prec else "fp32",
    )  # fmt: skip


_H100_LARGE = "'H100 80GB BF16 (Large Scale, >= 128 GPUs)'"
_H100 = "'H100 80GB BF16'"
_A100_80 = "'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'"
_A100_40 = "'A100 40GB with 1600 Gbps node-node interconnect (RoCE)'"
_H100_NET = "H100 cluster network not stated in the README (network None)."
_ROCE = "roce-200g"  # 1600 Gbps per node = 8 x 200 Gb/s RoCE ports (one per GPU assumed)

LLM_FOUNDRY = (
    # H100 80GB, large scale
    _foundry(_H100_LARGE, "MPT-70B", "h100", 512, None, 2048, 8, 1, 4096, "FULL_SHARD", True,
             "amp_bf16", 1007, 515636, 41.25, 55.0, 408, 64862437376, _H100_NET),
    _foundry(_H100_LARGE, "MPT-70B", "h100", 128, None, 2048, 8, 1, 1024, "FULL_SHARD", True,
             "amp_bf16", 1058, 135490, 43.36, 57.81, 428, 64862437376, _H100_NET),
    _foundry(_H100_LARGE, "MPT-30B", "h100", 512, None, 2048, 8, 1, 4096, "FULL_SHARD", True,
             "amp_bf16", 2115, 1083366, 40.27, 53.69, 398, 29975214080, _H100_NET),
    _foundry(_H100_LARGE, "MPT-7B", "h100", 512, None, 2048, 6, 1, 3072, "FULL_SHARD", False,
             "amp_bf16", 9670, 4951479, 42.2, 42.2, 417, 6658859008, _H100_NET),
    _foundry(_H100_LARGE, "MPT-3B", "h100", 512, None, 2048, 8, 1, 4096, "SHARD_GRAD_OP",
             False, "amp_bf16", 21664, 11092218, 39.24, 39.24, 388, 2651837440, _H100_NET),
    _foundry(_H100_LARGE, "MPT-1B", "h100", 512, None, 2048, 12, 1, 6144, "SHARD_GRAD_OP",
             False, "amp_bf16", 39837, 20396905, 36.65, 36.65, 362, 1315950592, _H100_NET),
    # H100 80GB, <= 64 GPUs
    _foundry(_H100, "MPT-70B", "h100", 64, None, 2048, 8, 4, 2048, "FULL_SHARD", True,
             "amp_bf16", 1039, 66523, 42.57, 56.76, 421, 64862437376, _H100_NET),
    _foundry(_H100, "MPT-7B", "h100", 8, None, 2048, 6, 1, 48, "FULL_SHARD", False,
             "amp_bf16", 10643, 85144, 46.44, 46.44, 459, 6658859008, _H100_NET),
    # A100 80GB, RoCE 1600 Gb/s per node
    _foundry(_A100_80, "MPT-70B", "a100-80gb", 64, _ROCE, 2048, 8, 4, 2048, "FULL_SHARD", True,
             "bf16 (FSDP mixed_precision PURE)", 410, 26274, 53.33, 71.1, 166, 64862437376),
    _foundry(_A100_80, "MPT-7B", "a100-80gb", 8, _ROCE, 2048, 6, 2, 96, "FULL_SHARD", False,
             "amp_bf16", 4641, 37130, 64.23, 64.23, 200, 6658859008),
    # A100 40GB, RoCE 1600 Gb/s per node
    _foundry(_A100_40, "MPT-70B", "a100-40gb", 128, _ROCE, 2048, 4, 1, 512, "FULL_SHARD", True,
             "bf16 (PURE)", 376, 48194, 48.91, 65.21, 152, 64862437376),
    _foundry(_A100_40, "MPT-13B", "a100-40gb", 128, _ROCE, 2048, 16, 1, 2048, "FULL_SHARD",
             True, "bf16 (PURE)", 1972, 252444, 51.93, 69.24, 162, 12853954560),
    _foundry(_A100_40, "MPT-7B", "a100-40gb", 128, _ROCE, 2048, 18, 1, 2304, "FULL_SHARD", True,
             "bf16 (PURE)", 3623, 463749, 50.14, 66.85, 156, 6658859008),
    _foundry(_A100_40, "MPT-1B", "a100-40gb", 128, _ROCE, 2048, 10, 1, 1280, "FULL_SHARD",
             False, "bf16 (PURE)", 18647, 2386897, 54.41, 54.41, 169, 1315950592),
)  # fmt: skip

# ----------------------------------------------------------------------------------
# torchtitan (PyTorch team). Llama 3/3.1 shapes from torchtitan/models/llama/__init__.py
# (ffn widths from ffn_dim_multiplier/multiple_of), vocab 128256, seq 8192 (the
# train_configs at the commits the tables name). bf16 rows only (Float8 rows skipped).
_TITAN_SHAPES = {  # name: (layers, hidden, heads, kv_heads, ffn, params)
    "Llama 3.1 8B": (32, 4096, 32, 8, 14336, 8e9),
    "Llama 3 8B": (32, 4096, 32, 8, 14336, 8e9),
    "Llama 3.1 70B": (80, 8192, 64, 8, 28672, 70e9),
    "Llama 3 70B": (80, 8192, 64, 8, 28672, 70e9),
    "Llama 3.1 405B": (126, 16384, 128, 8, 53248, 405e9),
}
_TITAN_H100 = (
    "Grand Teton hosts: 8 H100 with NVLink; the H100s are HBM2e 96GB SXM parts at a 500 W "
    "power limit (not the 700 W H100 SXM 80GB: peak between SXM and NVL, per the source); "
    "RDMA backend 400 Gb/s per GPU (RoCE). TPS/GPU read at iteration 90. "
)
# Why the H100 rows are not fitted: their GPU is none of the catalogue's (plan/core/gpus.py).
_TITAN_H100_EXCLUDED = (
    "the source's H100s are 'equipped with 96GB HBM2e with 2.4 TB/sec peak memory "
    "bandwidth' at 'the default 500W power limit', whose 'actual peak TFLOPs number is "
    "between SXM and NVL, and we don't know its exact value' (torchtitan benchmarks/"
    "llama3_h100_202412_torchtitan.md): a part the GPU catalogue does not hold"
)
_TITAN_2412 = (
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (github pytorch/torchtitan; "
    "same tables as docs/performance.md of Jan 2025 and the torchtitan paper, arXiv "
    "2410.06352), "
)
_TITAN_2506 = (
    "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (github pytorch/torchtitan), "
)
_TITAN_A100 = (
    "torchtitan docs/performance.md, 'Llama 3 performance numbers' (64 A100 80GB, FSDP2; "
    "github pytorch/torchtitan, from commit 504e7641, April 2024), "
)
_TITAN_405 = (
    "torchtitan docs/performance.md, 'Llama 3.1 performance numbers' (128 H100, FSDP2+TP; "
    "github pytorch/torchtitan, as of commit 4d88a8a4, Dec 2024), "
)
_TITAN_MFU = (
    "MFU convention (torchtitan train.py): (6*N + 12*l*h*s) FLOPs per token, N incl. "
    "embeddings, causal attention not halved, vs 989 (H100 SXM) / 312 (A100) TFLOP/s. "
)
_TITAN_SAC_OP = (
    "Selective AC 'op' (torchtitan policy: keeps matmul/SDPA outputs, recomputes every "
    "other matmul and the pointwise ops; not Megatron's attention-only selective). "
)


def _titan(ref, name, gpu, gpus, tp, pp, lb, ac, value, net, nics, notes, also=None, vs=1):
    layers, hidden, heads, kv, ffn, params = _TITAN_SHAPES[name]
    dp = gpus // (tp * pp)
    return PublishedRun(
        source="torchtitan", reference=ref, name=name,
        family="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
        ffn_hidden=ffn, vocab=128256, seq=8192, published_params=params,
        tied_embeddings=False,
        gpu=gpu, n_gpus=gpus, gpus_per_node=8, network=net, nics_per_node=nics,
        tp=tp, pp=pp, dp=dp, zero=3, virtual_stages=vs, sequence_parallel=tp > 1,
        micro_batch=lb, global_batch=lb * dp, recompute=ac, precision="bf16",
        metric="tokens_per_s_per_gpu", value=value, also=also or {}, notes=notes,
        excluded=_TITAN_H100_EXCLUDED if gpu == "h100" else None,
    )  # fmt: skip


TORCHTITAN = (
    _titan(_TITAN_2412 + "Table 1 (FSDP, eager)", "Llama 3.1 8B", "h100", 8, 1, 1, 2,
           "selective", 5762, "roce-400g", 8, _TITAN_H100 + _TITAN_SAC_OP + "Eager, no "
           "torch.compile. Memory 82.4 GiB."),
    _titan(_TITAN_2412 + "Table 1 (FSDP + torch.compile)", "Llama 3.1 8B", "h100", 8, 1, 1, 2,
           "selective", 6667, "roce-400g", 8, _TITAN_H100 + _TITAN_SAC_OP + "torch.compile."),
    _titan(_TITAN_2412 + "Table 3 (FSDP, eager)", "Llama 3.1 8B", "h100", 128, 1, 1, 2,
           "selective", 5605, "roce-400g", 8, _TITAN_H100 + _TITAN_SAC_OP + "Eager. The "
           "source adds: 1D 8B on 8 or 128 H100 without Float8 reaches 33-39% MFU."),
    _titan(_TITAN_2412 + "Table 3 (FSDP + torch.compile)", "Llama 3.1 8B", "h100", 128, 1, 1,
           2, "selective", 6514, "roce-400g", 8, _TITAN_H100 + _TITAN_SAC_OP + "torch.compile."),
    _titan(_TITAN_2506 + "Llama3 8b on 64 H100s, FSDP=8, TP=8, bfloat16, vanilla TP",
           "Llama 3.1 8B", "h100", 64, 8, 1, 12, "selective", 4378, "roce-400g", 8,
           _TITAN_H100 + _TITAN_SAC_OP + "torch.compile, TP with sequence parallel (torchtitan "
           "TP shards norms/sequence); async TP gives 4809.4. Column 'tokens/sec' read as per "
           "GPU (torchtitan logs TPS per GPU).", {"tokens_per_s_per_gpu_async_tp": 4809.4}),
    _titan(_TITAN_2506 + "Llama3 70b on 256 H100s, FSDP=32, TP=8, bfloat16, vanilla TP",
           "Llama 3.1 70B", "h100", 256, 8, 1, 16, "full", 597.3, "roce-400g", 8,
           _TITAN_H100 + "torch.compile, full AC; async TP gives 652.4. Column 'tokens/sec' "
           "read as per GPU (torchtitan logs TPS per GPU).",
           {"tokens_per_s_per_gpu_async_tp": 652.4}),
    _titan(_TITAN_A100 + "8B, selective op", "Llama 3 8B", "a100-80gb", 64, 1, 1, 1,
           "selective", 2973, None, None, _TITAN_MFU + _TITAN_SAC_OP + "WPS = tokens/s per GPU "
           "(MFU checks: 6*8.03e9+12*32*4096*8192 FLOPs/token * 2973 = 58% of 312). Network "
           "not stated.", {"mfu": 0.582}),
    _titan(_TITAN_A100 + "8B, selective layer", "Llama 3 8B", "a100-80gb", 64, 1, 1, 1,
           "selective", 2904, None, None, _TITAN_MFU + "Selective AC 'layer' (every n-th "
           "block fully recomputed; torchtitan's example value is every 2nd block, not "
           "stated here). Network not stated.", {"mfu": 0.568}),
    _titan(_TITAN_A100 + "70B, full AC", "Llama 3 70B", "a100-80gb", 64, 1, 1, 1, "full", 331,
           None, None, _TITAN_MFU + "Network not stated.", {"mfu": 0.517}),
    _titan(_TITAN_405 + "405B, no optimizations", "Llama 3.1 405B", "h100", 128, 8, 1, 2,
           "full", 109, None, None, _TITAN_MFU + "FSDP 16 x TP 8, bf16 (the 'None' "
           "optimizations row; Float8 rows skipped). H100 95GB HBM2e lower-TDP SXM (the "
           "source: MFU understated, true peak below 989). Network not stated here.",
           {"mfu": 0.290}),
)  # fmt: skip


# ----------------------------------------------------------------------------------
# BLOOM-176B (BigScience, Megatron-DeepSpeed) on Jean Zay: one logged iteration at the
# full global batch, from the training README.
BLOOM_2022 = (
    PublishedRun(
        source="bloom2022",
        reference=(
            "BigScience tr11-176B-ml training README (github bigscience-workshop/bigscience, "
            "train/tr11-176B-ml/README.md, 'Important checkpoints': log line of iteration "
            "85376); BLOOM paper, arXiv 2211.05100"
        ),
        name="BLOOM-176B",
        family="gpt", layers=70, hidden=14336, heads=112, kv_heads=None, ffn_hidden=None,
        vocab=250880, seq=2048, published_params=176e9, tied_embeddings=True,
        gpu="a100-80gb", n_gpus=384, gpus_per_node=8, network="omnipath-100g",
        nics_per_node=4,
        tp=4, pp=12, dp=8, zero=1, virtual_stages=1, sequence_parallel=False, micro_batch=2,
        global_batch=2048, recompute="full", precision="bf16",
        metric="tflops_per_gpu_hardware", value=149.77,
        also={"iteration_s": 104.70, "samples_per_s": 19.561},
        notes=(
            "One logged iteration (85376) at GBS 2048 (after the batch ramp-up), not an "
            "average; the README says ~100 s per iteration and ~150 TFLOP/s. The logged "
            "TFLOPs equal Megatron eq. 3 with full recompute (96*B*s*l*h^2*(1+s/6h+V/16lh) "
            "/ time / GPUs = 149.8 for V = 250880): hardware FLOPs. README: TP 4, PP 12, "
            "DP 8, MBS 2, ZeRO stage 1 (DeepSpeed BF16_Optimizer), DeepSpeed's pipeline engine "
            "(Megatron-DeepSpeed's PipelineModule), DeepSpeed activation "
            "checkpointing, bf16. Vocabulary 250680 tokens padded to 250880 (README's "
            "embedding size). ALiBi (no position embedding), embedding LayerNorm, GELU, "
            "tied embeddings; first and last pipeline stages hold 5 blocks + the embedding. "
            "Network: Omni-Path, 4 x 100 Gb/s links per node; intra-node NVLink."
        ),
    ),
)  # fmt: skip

# ----------------------------------------------------------------------------------
# Megatron-Turing NLG 530B (Microsoft + NVIDIA, Megatron-DeepSpeed) on Selene.
_MTNLG_REF = (
    "Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, "
    "arXiv 2201.11990, Section 2.4 (iteration time and TFLOP/s per GPU at 280/350/420 "
    "DGX A100 nodes); read as quoted in github cli99/llm-analysis "
    "examples/megatron-turing-nlg/README.md"
)
_MTNLG_NOTES = (
    "Metric: TFLOP/s per GPU as published; also the published seconds per iteration. "
    "Megatron eq. 3 with full recompute reproduces them within 1% (1.69e19 FLOPs per "
    "1920-sequence iteration / 60.1 s / 2240 GPUs = 125.7): hardware FLOPs. TP 8, PP 35 "
    "(8 x 35 = 280 GPUs per replica), batch 1920, seq 2048, bf16. The system 'combines "
    "pipeline parallelism and data parallelism from DeepSpeed with tensor slicing from "
    "Megatron' (the paper's 3D-parallelism section, as summarised by SyncedReview, "
    "2022-02-03): DeepSpeed's pipeline engine. Selene: DGX A100 80GB "
    "(NVIDIA/Microsoft blog; llm-analysis's script assumes 40GB), 8x HDR InfiniBand per "
    "node. Not published here: micro-batch (None), interleaving (1 recorded); ZeRO stage 1 "
    "data parallelism assumed (DeepSpeed in Megatron-DeepSpeed). Vocabulary: GPT-2 BPE "
    "(50257) padded by Megatron to 51200 (assumed; < 0.2% effect on eq. 3)."
)


def _mtnlg(nodes, it_s, tflops):
    gpus = nodes * 8
    return PublishedRun(
        source="mtnlg2022", reference=_MTNLG_REF, name=f"MT-NLG 530B ({nodes} nodes)",
        family="gpt", layers=105, hidden=20480, heads=128, kv_heads=None, ffn_hidden=None,
        vocab=51200, seq=2048, published_params=530e9, tied_embeddings=True,
        gpu="a100-80gb", n_gpus=gpus, gpus_per_node=8, network="ib-hdr", nics_per_node=8,
        tp=8, pp=35, dp=gpus // 280, zero=1, virtual_stages=1, sequence_parallel=False,
        micro_batch=None, global_batch=1920, recompute="full", precision="bf16",
        metric="tflops_per_gpu_hardware", value=tflops, also={"iteration_s": it_s},
        notes=_MTNLG_NOTES,
    )  # fmt: skip


MTNLG_2022 = (_mtnlg(280, 60.1, 126), _mtnlg(350, 50.2, 121), _mtnlg(420, 44.4, 113))

# ----------------------------------------------------------------------------------
# Llama 3 405B pre-training (Meta): the paper's table of scaling configurations.
_LLAMA3_REF = (
    "Llama Team 2024, The Llama 3 Herd of Models, arXiv 2407.21783, Section 3.3.2, Table 4 "
    "(scaling configurations and MFU of the 405B pre-training stages); the GPUs/TP/CP/PP/"
    "tokens-per-batch/TFLOPs columns also as presented at SC24 (Balaji, 'Herding Llamas'), "
    "quoted at glennklockwood.com/garden/llama-3.1"
)
_LLAMA3_NOTES = (
    "Metric: TFLOPs/GPU as published; 'BF16 MFU' equals it / 989 (430 -> 43%), so model "
    "FLOPs. Figures of the production run, one per stage (how they were averaged is not "
    "stated). 400/989 = 40.4% while the table says 41% (the source's rounding). H100 "
    "SXM 80GB HBM3 at 700 W, Grand Teton (8 GPUs, NVLink), RoCE 400 Gb/s "
    "per GPU. DP is the paper's FSDP, which shards optimizer states and gradients and does "
    "not reshard weights after the forward pass (ZeRO-2-like per step: zero 2); gradients "
    "reduce-scattered 'in FP32 across data parallel workers' (Section 3.3.2). Pipeline "
    "(Section 3.3.2): 'we use an interleaved schedule (Narayanan et al., 2021) with V "
    "pipeline stages on one pipeline rank'; V is not printed, but 'we reduce one "
    "Transformer layer each from the first and the last stages ... the first model chunk "
    "on the first stage has only the embedding, and the last model chunk on the last "
    "stage has only output projection and loss calculation' holds only with one layer per "
    "chunk: 126 layers + 2 layer-less chunks = 16 x 8, so virtual_stages 8. Micro-batch "
    "size not given (None). 'Pre-train Llama 3 on sequences of 8K tokens without "
    "activation checkpointing' (recompute none). "
    "Read here: GPUs, TP, CP, PP, tokens/batch (16M), TFLOPs/GPU; the MFU and batch-per-DP "
    "columns are recalled from the paper's Table 4 (batch/DP also follows from 16M tokens)."
)


def _llama3(gpus, cp, pp, seq, batch_per_dp, tflops, mfu, extra=""):
    dp = gpus // (8 * cp * pp)
    return PublishedRun(
        source="llama3-2024", reference=_LLAMA3_REF, name=f"Llama 3 405B ({gpus} GPUs, seq {seq})",
        family="llama", layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
        vocab=128256, seq=seq, published_params=405e9, tied_embeddings=False,
        gpu="h100", n_gpus=gpus, gpus_per_node=8, network="roce-400g", nics_per_node=8,
        tp=8, pp=pp, dp=dp, cp=cp, zero=2, virtual_stages=8, sequence_parallel=True,
        micro_batch=None, global_batch=dp * batch_per_dp, recompute="none", precision="bf16",
        metric="tflops_per_gpu_model", value=tflops,
        also={"mfu": mfu, "tokens_per_batch": dp * batch_per_dp * seq},
        notes=_LLAMA3_NOTES + extra,
    )  # fmt: skip


LLAMA3_2024 = (
    _llama3(8192, 1, 16, 8192, 32, 430, 0.43),
    _llama3(16384, 1, 16, 8192, 16, 400, 0.41),
    _llama3(16384, 16, 16, 131072, 16, 380, 0.38, " Long-context stage: context parallel 16."),
)

PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    NARAYANAN_2021
    + KORTHIKANTI_2022
    + MEGATRON_CORE_2024
    + LLM_FOUNDRY
    + TORCHTITAN
    + BLOOM_2022
    + MTNLG_2022
    + LLAMA3_2024
)


def sources() -> list[str]:
    """The source keys, in order of first appearance."""
    return list(dict.fromkeys(run.source for run in PUBLISHED_RUNS))


def runs_from(source: str) -> tuple[PublishedRun, ...]:
    return tuple(run for run in PUBLISHED_RUNS if run.source == source)
