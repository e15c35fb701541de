"""Published long-context (context-parallel) training runs, with their sources, to check
the planner's cp model against (pure data, no torch). Not fitted on: the planner's
constants are the fit on the dense cp-1 runs (plan/core/published.py,
`validation.fitted`), so every row here is held out; `validation.cp_validation_table`
also predicts each with the constants fitted without its source at all.

- "llama3-2024": The Llama 3 Herd of Models, arXiv 2407.21783, Table 4: the 405B
  long-context stage, 16,384 H100, TP 8, CP 16, PP 16, DP 8, sequences of 131,072
  tokens, 16M tokens per batch, 380 TFLOPs/GPU (38% BF16 MFU). Its context parallelism
  is the all-gather method (§3.3.2: "all-gather the key (K) and value (V) tensors, and
  then compute attention output for the local query (Q) tensor chunk"). The row is
  published.py's (LLAMA3_2024), where its other fields and their sources are stated.

Sought and not used:

- NVIDIA NeMo's long-sequence table (NeMo docs, performance/performance_long_sequence.md:
  Llama 3 8B on DGX-B200 and Llama 2 7B, seq 8k-1M, CP up to 16): FP8 runs, which the
  planner does not model (nor the B200).
- Megatron-Core's and torchtitan's context-parallel figures: no step time or TFLOPS with
  the layout was found in the references this planner cites (/work/shared/REFERENCES.md
  and the sources in published.py); none is invented here.
"""

from __future__ import annotations

from meshforge.plan.core.published import LLAMA3_2024, PublishedRun

PUBLISHED_CP_RUNS: tuple[PublishedRun, ...] = tuple(r for r in LLAMA3_2024 if r.cp > 1)
