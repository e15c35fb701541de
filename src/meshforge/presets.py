"""Named model shapes for the job file (`model.preset`) and the planner (`meshforge
plan --model NAME`), so that both read the same numbers. Pure data, no torch.

Shapes are those of the published checkpoints' config.json files on the Hugging Face
Hub (openai-community/gpt2*, meta-llama/Llama-2-7b-hf, meta-llama/Llama-3.2-1B and
-3B, meta-llama/Llama-3.1-8B and -70B, mistralai/Mixtral-8x7B-v0.1,
Qwen/Qwen3-30B-A3B); seq_len is the context the family was
pre-trained at. Any field given beside `model.preset` overrides the preset's.
"""

from __future__ import annotations

from typing import Any

_GPT2 = {"name": "gpt", "vocab_size": 50257, "seq_len": 1024, "mlp_ratio": 4}
_LLAMA3 = {"name": "llama", "vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5}

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": {**_GPT2, "d_model": 768, "n_layers": 12, "n_heads": 12},
    "gpt2-355m": {**_GPT2, "d_model": 1024, "n_layers": 24, "n_heads": 16},
    "gpt2-774m": {**_GPT2, "d_model": 1280, "n_layers": 36, "n_heads": 20},
    "gpt2-1.5b": {**_GPT2, "d_model": 1600, "n_layers": 48, "n_heads": 25},
    "llama2-7b": {
        "name": "llama",
        "vocab_size": 32000,
        "seq_len": 4096,
        "d_model": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 32,
        "ffn_hidden": 11008,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
    },  # fmt: skip
    "llama-1b": {
        **_LLAMA3,
        "seq_len": 8192,
        "d_model": 2048,
        "n_layers": 16,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_hidden": 8192,
        "tie_embeddings": True,
    },  # fmt: skip
    "llama-3b": {
        **_LLAMA3,
        "seq_len": 8192,
        "d_model": 3072,
        "n_layers": 28,
        "n_heads": 24,
        "n_kv_heads": 8,
        "ffn_hidden": 8192,
        "tie_embeddings": True,
    },  # fmt: skip
    "llama-8b": {
        **_LLAMA3,
        "seq_len": 8192,
        "d_model": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_hidden": 14336,
        "tie_embeddings": False,
    },  # fmt: skip
    "llama-70b": {
        **_LLAMA3,
        "seq_len": 8192,
        "d_model": 8192,
        "n_layers": 80,
        "n_heads": 64,
        "n_kv_heads": 8,
        "ffn_hidden": 28672,
        "tie_embeddings": False,
    },  # fmt: skip
    # mixture of experts (model.moe): routed experts, top-k, the experts' SwiGLU width
    "mixtral-8x7b": {
        "name": "llama",
        "vocab_size": 32000,
        "seq_len": 32768,
        "d_model": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_hidden": 14336,
        "rope_theta": 1000000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
        "moe": {"experts": 8, "top_k": 2, "expert_ffn": 14336, "aux_loss_coeff": 0.02},
    },  # fmt: skip
    "qwen3-30b-a3b": {
        "name": "llama",
        "vocab_size": 151936,
        "seq_len": 32768,
        "d_model": 2048,
        "n_layers": 48,
        "n_heads": 32,
        "n_kv_heads": 4,
        "head_dim": 128,
        "ffn_hidden": 6144,
        "rope_theta": 1000000.0,
        "norm_eps": 1e-6,
        "tie_embeddings": False,
        "moe": {"experts": 128, "top_k": 8, "expert_ffn": 768, "aux_loss_coeff": 0.001},
    },  # fmt: skip
    # a tiny mixture of experts for tests and first runs (4 experts, top-2, dropless)
    "moe-tiny": {
        "name": "llama",
        "vocab_size": 256,
        "seq_len": 64,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_hidden": 128,
        "tie_embeddings": False,
        "moe": {"experts": 4, "top_k": 2, "expert_ffn": 64},
    },  # fmt: skip
}
# presets whose seq_len is a published model's pre-training context (not moe-tiny's)
PUBLISHED = frozenset(PRESETS) - {"moe-tiny"}


def preset(name: str) -> dict[str, Any]:
    """The fields of preset `name`; ValueError naming the choices otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])
