"""`meshforge export` takes a model out of meshforge: whatever layout wrote the
checkpoint, the Hugging Face directory loads in `transformers` (no custom code) and
computes meshforge's logits; the torch and safetensors files load into a fresh
meshforge model with the run's final parameter digest; a failed or refused export
loses nothing already there."""

from __future__ import annotations

import errno
import json
import os
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model as load_safetensors_into

from helpers import assert_one_line_error, meshforge, run_python
from layouts import job, train_layout
from meshforge.config import build_config, load_config, save_config
from meshforge.data.tokenizer import ByteTokenizer, tokenizer_from_index
from meshforge.errors import CheckpointError, ConfigError, ExportError
from meshforge.models import export as formats
from meshforge.models.registry import build_model
from meshforge.parallel.parallelize import digest_of
from meshforge.train.run_export import export_run
from meshforge.train.saved_run import load_model

transformers = pytest.importorskip("transformers")

STEPS = 4
ATOL = 1e-4
LLAMA = {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 4,
         "n_kv_heads": 2, "ffn_hidden": 64, "seq_len": 32}  # fmt: skip
GPT = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32}
FACTORY = {"name": "user_models:tiny_lm", "kwargs": {"width": 32, "layers": 2}, "seq_len": 32}
# (model section, parallel section): each family tied and untied, under ZeRO-3 and tp2
CASES = {
    "gpt-tied-zero3": ({**GPT, "tie_embeddings": True}, {"zero": 3}),
    "gpt-untied-tp2": ({**GPT, "tie_embeddings": False}, {"tp": 2}),
    "llama-untied-zero3": (LLAMA, {"zero": 3}),
    "llama-tied-tp2": ({**LLAMA, "tie_embeddings": True}, {"tp": 2}),
}
TEXTS = [
    "def f(x):\n    return x ** 2\n",
    "naïve café — ½ ∑ 日本語 👩‍👩‍👧",
    " \t\r\n",
    "Ğ\x1e<|endoftext|>",
]


def _train_run(gloo, root: Path, model: dict, parallel: dict, world: int, **data) -> dict:
    """A run directory (config.yaml, one checkpoint at the last step) trained in the
    gloo pool; returns its path and the final parameter digest."""
    raw = job(parallel, train={"steps": STEPS, "warmup": 1}, **({"data": data} if data else {}))
    raw["model"] = dict(model)
    run_dir = root / "run"
    run_dir.mkdir(parents=True)
    save_config(build_config(raw), run_dir / "config.yaml")
    results = gloo.run(world, train_layout, raw, STEPS, str(run_dir / "checkpoints"), STEPS)
    assert results[0]["digest_saved"] == results[0]["digest_final"]
    return {"dir": run_dir, "digest": results[0]["digest_final"], "model": model}


@pytest.fixture(scope="module")
def runs(gloo, tmp_path_factory):
    """Each case's run, trained once for the module when a test first asks for it."""
    made: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in made:
            model, parallel = CASES[name]
            made[name] = _train_run(gloo, tmp_path_factory.mktemp(name), model, parallel, 2)
        return made[name]

    return get


def _tokens(vocab: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", list(CASES))
def test_hf_export_loads_in_transformers_with_meshforge_logits(runs, case, tmp_path):
    run = runs(case)
    model, step = load_model(run["dir"])
    assert step == STEPS and digest_of(model.named_parameters()) == run["digest"]
    exported = export_run(run["dir"], "hf", out=tmp_path / "hf")
    assert exported.files == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]  # fmt: skip

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    family = "gpt" if run["model"].get("name", "gpt") == "gpt" else "llama"
    assert type(hf).__name__ == formats.HF_ARCHITECTURES[family] == exported.architecture
    assert not any(info.values()), info  # no weight missing, unexpected or reshaped
    tied = model.cfg.tie_embeddings
    shares = hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    assert shares == tied
    idx = _tokens(256, 32)
    with torch.no_grad():
        ours, theirs = model(idx), hf.eval()(idx).logits
    assert ours.shape == theirs.shape == (2, 32, 256)
    assert torch.allclose(ours, theirs, rtol=0, atol=ATOL), (ours - theirs).abs().max()

    # the run's data is the built-in corpus: the byte tokenizer, as tokenizer.json
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert tok(text)["input_ids"] == ByteTokenizer().encode(text).tolist()
    assert tok.decode(ByteTokenizer().encode(TEXTS[1]).tolist()) == TEXTS[1]
    assert hf.config.eos_token_id == ByteTokenizer.eod_id


@pytest.mark.parametrize("case", list(CASES))
def test_torch_and_safetensors_exports_load_with_the_runs_digest(runs, case, tmp_path):
    run = runs(case)
    cfg = load_config(run["dir"] / "config.yaml")
    for fmt in ("torch", "safetensors"):
        exported = export_run(run["dir"], fmt, out=tmp_path / fmt)
        assert exported.digest == run["digest"]
        assert load_config(tmp_path / fmt / "config.yaml") == cfg  # rebuilds the model
        fresh = build_model(cfg.model)
        assert digest_of(fresh.named_parameters()) != run["digest"]
        if fmt == "torch":
            fresh.load_state_dict(torch.load(tmp_path / fmt / "model.pt", weights_only=True))
        else:
            load_safetensors_into(fresh, tmp_path / fmt / "model.safetensors")
        assert digest_of(fresh.named_parameters()) == run["digest"], fmt
    with safe_open(tmp_path / "safetensors" / "model.safetensors", "pt") as f:
        names, metadata = set(f.keys()), f.metadata()
    assert "embed.tok.weight" in names
    if cfg.model.tie_embeddings:  # stored once; the other name recorded for load_model
        assert "head.weight" not in names
        assert metadata["head.weight"] == "embed.tok.weight"
        assert fresh.head.weight is fresh.embed.tok.weight
    else:
        assert "head.weight" in names


def test_a_factory_model_exports_to_torch_and_safetensors(gloo, tmp_path):
    run = _train_run(gloo, tmp_path, FACTORY, {}, 1)
    cfg = load_config(run["dir"] / "config.yaml")
    for fmt in ("torch", "safetensors"):
        exported = export_run(run["dir"], fmt, trust_model_code=True)
        assert exported.out == run["dir"] / "export" / f"step-{STEPS:08d}-{fmt}"
        assert exported.digest == run["digest"]
        fresh = build_model(cfg.model)
        if fmt == "torch":
            fresh.load_state_dict(torch.load(exported.out / "model.pt", weights_only=True))
        else:
            load_safetensors_into(fresh, exported.out / "model.safetensors")
        assert digest_of(fresh.named_parameters()) == run["digest"]
    with pytest.raises(ConfigError, match="factory.*--format torch or safetensors"):
        export_run(run["dir"], "hf")


def test_a_bpe_run_exports_its_tokenizer_for_transformers(gloo, tmp_path):
    from meshforge.data.shards import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    src = tmp_path / "text"
    src.mkdir()
    for name in ("textwrap.py", "string.py", "bisect.py"):
        (src / name).write_text((stdlib / name).read_text(encoding="utf-8"))
    index = prepare(src, tmp_path / "shards", tokenizer="bpe", vocab_size=300)
    bpe = tokenizer_from_index(index["tokenizer"], tmp_path / "shards")
    model = {**GPT, "vocab_size": 320}
    run = _train_run(gloo, tmp_path, model, {}, 1, source=str(tmp_path / "shards"))
    exported = export_run(run["dir"], "hf", out=tmp_path / "hf")
    assert "tokenizer.json" in exported.files and not exported.notes

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert tok(text)["input_ids"] == bpe.encode(text).tolist()
        assert tok.decode(bpe.encode(text).tolist()) == text
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == bpe.eod_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.eos_token_id == bpe.eod_id and hf.config.vocab_size == 320


def test_an_existing_export_is_kept_unless_forced_and_kept_when_forcing_fails(
    runs, tmp_path, monkeypatch
):
    run = runs("gpt-tied-zero3")
    out = tmp_path / "export"
    export_run(run["dir"], "torch", out=out)
    before = (out / "model.pt").read_bytes()
    with pytest.raises(ConfigError, match="exists; pass --force"):
        export_run(run["dir"], "safetensors", out=out)

    def full_disk(model, directory, metadata):
        (directory / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(formats, "write_safetensors", full_disk)
    with pytest.raises(ExportError, match="No space left on device"):
        export_run(run["dir"], "safetensors", out=out, replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary left
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.pt"]
    assert (out / "model.pt").read_bytes() == before

    monkeypatch.undo()
    exported = export_run(run["dir"], "safetensors", out=out, replace=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors"]
    assert exported.digest == run["digest"]
    with pytest.raises(CheckpointError, match=f"no checkpoint of step 3 .*steps: {STEPS}"):
        export_run(run["dir"], "torch", out=tmp_path / "other", step=3)
    assert not (tmp_path / "other").exists()


def test_meshforge_export_prints_one_line_or_refuses_bad_input_in_one(runs, tmp_path):
    run = runs("gpt-tied-zero3")
    proc = meshforge(["export", str(run["dir"]), "--format", "safetensors"])
    assert proc.returncode == 0, proc.stderr
    out = run["dir"] / "export" / f"step-{STEPS:08d}-safetensors"
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and run["digest"] in lines[0], lines
    assert (out / "model.safetensors").is_file()
    assert [p.name for p in out.parent.iterdir()] == [out.name]

    again = meshforge(["export", str(run["dir"]), "--format", "safetensors"])
    assert_one_line_error(again, str(out), "exists", "--force")
    assert_one_line_error(meshforge(["export", str(tmp_path / "nowhere"), "--format", "hf"]),
                          "run directory not found")  # fmt: skip
    assert_one_line_error(meshforge(["export", str(run["dir"]), "--format", "onnx"]),
                          "--format", "onnx")  # fmt: skip
    assert_one_line_error(meshforge(["export", str(run["dir"]), "--format", "hf", "--step", "3"]),
                          "no checkpoint of step 3", f"steps: {STEPS}")  # fmt: skip
    factory = tmp_path / "factory"
    factory.mkdir()
    save_config(build_config({"model": FACTORY}), factory / "config.yaml")
    assert_one_line_error(meshforge(["export", str(factory), "--format", "hf"]),
                          "user_models:tiny_lm", "factory")  # fmt: skip


def test_hf_export_never_imports_transformers(runs, tmp_path):
    run = runs("llama-untied-zero3")
    args = ["export", str(run["dir"]), "--format", "hf", "--out", str(tmp_path / "hf")]
    code = (
        "import sys\n"
        "from meshforge.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "finally:\n"
        "    assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "LlamaForCausalLM" in proc.stdout
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
