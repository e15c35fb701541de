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
  becomes a ``GPT2LMHeadModel``, the Llama-style model a ``LlamaForCausalLM``
  (`hf_weights` and `hf_config` hold the mapping). Everything is written here from
  meshforge's own config: ``transformers`` is never imported.

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
HF_ARCHITECTURES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
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
    out = _gpt2_weights(cfg, state) if cfg.name == "gpt" else _llama_weights(state)
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
    if cfg.name == "llama":
        return {
            "architectures": [HF_ARCHITECTURES["llama"]],
            "model_type": "llama",
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.d_model // cfg.n_heads,
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
