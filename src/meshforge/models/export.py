"""A model's weights in the formats other tools read, written into a directory.

- ``torch``: ``model.pt``, ``torch.save(model.state_dict())`` with meshforge's
  parameter names; a tied head shares its storage with the token embedding, as in the
  model. Loads with ``model.load_state_dict(torch.load(path, weights_only=True))``.
- ``safetensors``: ``model.safetensors``, the same names. safetensors stores no shared
  tensors, so a tied tensor is stored once under the name that sorts first
  (``embed.tok.weight``) and the other name is recorded in the file's metadata
  (``{"head.weight": "embed.tok.weight"}``), as ``safetensors.torch.save_model`` does;
  ``safetensors.torch.load_model(model, path)`` ties it back.
- ``hf``: a Hugging Face model directory that ``transformers`` loads with no custom
  code: ``config.json``, ``model.safetensors`` and, when the tokenizer is known,
  ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``. The GPT
  becomes a ``GPT2LMHeadModel``, the Llama-style model a ``LlamaForCausalLM``, a
  Llama-style mixture of experts a ``MixtralForCausalLM`` (`hf_weights` and
  `hf_config` hold the mapping; `hf_refusal` says why a model has none). Everything is
  written here from meshforge's own config: ``transformers`` is never imported.

The MoE to Mixtral mapping: Mixtral routes every token of every layer by a softmax
over the router's logits to its top ``num_experts_per_tok`` experts, their weights
renormalised to sum to 1, each expert a SwiGLU ``w2(silu(w1 x) * w3 x)``: meshforge's
MoE with the softmax router, no dense layers, no shared experts and no routing bias.
The router becomes ``block_sparse_moe.gate``; the stacked expert weights are split
into the Hub's per-expert layout, expert e's gate, proj and up as
``block_sparse_moe.experts.{e}.w1``, ``w2`` and ``w3`` (transformers 5 merges them back
into its fused ``gate_up_proj`` and ``down_proj`` when it loads them). Mixtral has no
capacity: a model trained with ``capacity_factor`` exports, and Mixtral then routes
every token (a note says so).

The GPT to GPT-2 mapping: GPT-2's ``Conv1D`` holds its weight as (in, out), the
transpose of ``nn.Linear``'s; its ``c_attn`` is q, k and v side by side; its
``"gelu"`` is the exact erf GELU, as ``F.gelu`` here; its LayerNorm epsilon is
``nn.LayerNorm``'s default. meshforge's GPT drops out attention weights and
embeddings (``model.dropout``) but not the residual branches, so ``resid_pdrop`` is 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from meshforge.config import ModelConfig


class Tokenizer(Protocol):
    """What an hf export needs of a tokenizer (data/tokenizer.py's ByteTokenizer and
    BpeTokenizer): its kind, its end-of-document id and its tokenizer.json."""

    kind: str  # "byte" | "bpe"
    eod_id: int

    def to_json(self) -> str: ...


TORCH_FILE = "model.pt"
SAFETENSORS_FILE = "model.safetensors"
HF_ARCHITECTURES = {
    "gpt": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "llama-moe": "MixtralForCausalLM",
}
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which models/gpt.py uses

# meshforge's Llama-style names -> LlamaForCausalLM's, applied in order: prefixes
# first, then the parts of a block.
_LLAMA_PREFIXES = (
    ("embed.tok.", "model.embed_tokens."),
    ("ln_f.", "model.norm."),
    ("head.", "lm_head."),
    ("blocks.", "model.layers."),
)
_LLAMA_PARTS = (
    (".ln1.", ".input_layernorm."),
    (".ln2.", ".post_attention_layernorm."),
    (".attn.q.", ".self_attn.q_proj."),
    (".attn.k.", ".self_attn.k_proj."),
    (".attn.v.", ".self_attn.v_proj."),
    (".attn.proj.", ".self_attn.o_proj."),
    (".mlp.gate.", ".mlp.gate_proj."),
    (".mlp.up.", ".mlp.up_proj."),
    (".mlp.proj.", ".mlp.down_proj."),
)


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers class an hf export of `cfg` loads as (see `hf_refusal`)."""
    if cfg.name == "llama" and cfg.moe is not None:
        return HF_ARCHITECTURES["llama-moe"]
    return HF_ARCHITECTURES[cfg.name]


def hf_refusal(cfg: ModelConfig) -> str | None:
    """Why `cfg`'s model has no transformers architecture that computes what it does
    (one clause), or None when it has one. A mixture of experts maps to Mixtral only."""
    moe = cfg.moe
    if cfg.name != "llama" or moe is None:
        return None
    why = []
    if moe.dense_layers:
        why.append(f"dense_layers={moe.dense_layers} (every Mixtral layer is a mixture)")
    if moe.shared_experts:
        why.append(f"shared_experts={moe.shared_experts} (Mixtral has none)")
    if moe.router != "softmax":
        why.append(f"router={moe.router} (Mixtral's is softmax)")
    if moe.load_balance == "bias":
        why.append("load_balance=bias (Mixtral has no routing bias)")
    if not why:
        return None
    return (
        f"model.moe has {', '.join(why)}: --format hf writes a mixture of experts as "
        "MixtralForCausalLM only; use --format torch or safetensors"
    )


def hf_notes(cfg: ModelConfig) -> list[str]:
    """What an hf export of `cfg` computes differently, one note each."""
    if cfg.moe is not None and cfg.moe.capacity_factor is not None:
        return [
            f"model.moe.capacity_factor={cfg.moe.capacity_factor} is not exported: "
            "Mixtral routes every token (an expert over capacity drops none)"
        ]
    return []


def write_torch(model: nn.Module, directory: Path) -> list[str]:
    """``model.pt`` in `directory`; the names of the files written."""
    torch.save(model.state_dict(), directory / TORCH_FILE)
    return [TORCH_FILE]


def write_safetensors(model: nn.Module, directory: Path, metadata: dict[str, str]) -> list[str]:
    """``model.safetensors`` in `directory` (see the module docstring for tied tensors)."""
    from safetensors.torch import save_model

    save_model(model, str(directory / SAFETENSORS_FILE), metadata={"format": "pt", **metadata})
    return [SAFETENSORS_FILE]


def write_hf(
    model: nn.Module, cfg: ModelConfig, directory: Path, tokenizer: Tokenizer | None
) -> list[str]:
    """A Hugging Face model directory of meshforge's GPT or Llama-style `model`."""
    from safetensors.torch import save_file

    eod = tokenizer.eod_id if tokenizer is not None else None
    # meshforge_export marks the directory as an export (`export --force` replaces only
    # one); transformers keeps an unknown key as a plain attribute of the config
    files = {"config.json": {**hf_config(cfg, eod), "meshforge_export": {"format": "hf"}}}
    if eod is not None:
        files["generation_config.json"] = {"bos_token_id": eod, "eos_token_id": eod}
    if tokenizer is not None:
        files["tokenizer_config.json"] = hf_tokenizer_config(tokenizer, cfg.seq_len)
        (directory / "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=2) + "\n")
    weights = hf_weights(cfg, model.state_dict())
    save_file(weights, str(directory / SAFETENSORS_FILE), metadata={"format": "pt"})
    written = [*files, SAFETENSORS_FILE] + (["tokenizer.json"] if tokenizer is not None else [])
    return sorted(written)


def hf_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """meshforge's state dict under transformers' names and layouts, each tensor stored
    once (a tied head is left to ``tie_word_embeddings``)."""
    state = {k: v for k, v in state.items() if not (cfg.tie_embeddings and k == "head.weight")}
    if cfg.name == "gpt":
        out = _gpt2_weights(cfg, state)
    elif cfg.moe is not None:
        out = _llama_weights(_mixtral_experts(cfg, state))
    else:
        out = _llama_weights(state)
    return {k: v.detach().contiguous() for k, v in out.items()}


def _llama_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        new = name
        for old, hf in _LLAMA_PREFIXES:
            if new.startswith(old):
                new = hf + new[len(old) :]
                break
        for old, hf in _LLAMA_PARTS:
            new = new.replace(old, hf)
        out[new] = tensor
    return out


def _mixtral_experts(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each MoE layer's router and stacked experts under Mixtral's per-expert names
    (prefixed with meshforge's `blocks.{i}.`, renamed by `_llama_weights`)."""
    problem = hf_refusal(cfg)
    if problem is not None:
        raise ValueError(problem)
    assert cfg.moe is not None
    state = dict(state)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layers):
        b, moe = f"blocks.{i}.mlp.", f"blocks.{i}.block_sparse_moe."
        out[f"{moe}gate.weight"] = state.pop(f"{b}router.weight")
        for ours, theirs in (("gate", "w1"), ("proj", "w2"), ("up", "w3")):
            stacked = state.pop(f"{b}experts.{ours}.weight")  # (experts, out, in)
            for e in range(cfg.moe.experts):
                out[f"{moe}experts.{e}.{theirs}.weight"] = stacked[e]
    left = [k for k in state if ".mlp." in k]
    if left:
        raise ValueError(f"no Mixtral name for {sorted(left)}")
    return {**state, **out}


def _gpt2_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = dict(state)
    take = state.pop  # every tensor is taken once; anything left over is a mapping gap
    out = {
        "transformer.wte.weight": take("embed.tok.weight"),
        "transformer.wpe.weight": take("embed.pos.weight"),
        "transformer.ln_f.weight": take("ln_f.weight"),
        "transformer.ln_f.bias": take("ln_f.bias"),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = take("head.weight")
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            for kind in ("weight", "bias"):
                out[f"{h}{theirs}.{kind}"] = take(f"{b}{ours}.{kind}")
        qkv = [take(f"{b}attn.{p}.weight") for p in "qkv"]
        out[f"{h}attn.c_attn.weight"] = torch.cat(qkv, dim=0).t()  # Conv1D: (in, out)
        out[f"{h}attn.c_attn.bias"] = torch.cat([take(f"{b}attn.{p}.bias") for p in "qkv"])
        for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                             ("mlp.proj", "mlp.c_proj")):  # fmt: skip
            out[f"{h}{theirs}.weight"] = take(f"{b}{ours}.weight").t()
            out[f"{h}{theirs}.bias"] = take(f"{b}{ours}.bias")
    if state:
        raise ValueError(f"no GPT-2 name for {sorted(state)}")
    return out


def hf_config(cfg: ModelConfig, eod_id: int | None) -> dict[str, Any]:
    """config.json of the transformers model that computes what `cfg`'s model does."""
    common = {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if cfg.name == "gpt":
        return {
            "architectures": [HF_ARCHITECTURES["gpt"]],
            "model_type": "gpt2",
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.mlp_hidden,
            "activation_function": "gelu",
            "layer_norm_epsilon": LAYER_NORM_EPS,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "resid_pdrop": 0.0,
            "scale_attn_weights": True,
            **common,
        }
    if cfg.name == "llama" and cfg.moe is not None:
        return _mixtral_config(cfg, common)
    if cfg.name == "llama":
        return {
            "architectures": [HF_ARCHITECTURES["llama"]],
            "model_type": "llama",
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.attention_head_dim,
            "max_position_embeddings": cfg.seq_len,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            # transformers < 5 reads rope_theta; 5 reads rope_parameters
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            **common,
        }
    raise ValueError(f"model.name={cfg.name} has no Hugging Face architecture")


def _mixtral_config(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    problem = hf_refusal(cfg)
    if problem is not None:
        raise ValueError(problem)
    moe = cfg.moe
    assert moe is not None
    return {
        "architectures": [HF_ARCHITECTURES["llama-moe"]],
        "model_type": "mixtral",
        "hidden_size": cfg.d_model,
        "intermediate_size": moe.expert_ffn,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.attention_head_dim,
        "max_position_embeddings": cfg.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers < 5; 5 reads rope_parameters
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": moe.aux_loss_coeff if moe.load_balance == "aux_loss" else 0.0,
        "router_jitter_noise": 0.0,
        **common,
    }


def hf_tokenizer_config(tokenizer: Tokenizer, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the fast tokenizer of tokenizer.json as it is, adding no
    token of its own. BPE's end-of-document token is its eos token; the byte
    tokenizer's (byte 0x1e) stays an ordinary token, since a special token would also
    match its printable stand-in character in text."""
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.kind == "bpe":  # a BpeTokenizer: `inner` is its tokenizers.Tokenizer
        out["eos_token"] = tokenizer.inner.id_to_token(tokenizer.eod_id)
    return out
