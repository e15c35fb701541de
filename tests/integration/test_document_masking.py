"""data.document_masking trains end to end, the same under every layout it allows, and
is refused, in one line, where it cannot apply."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import TINY_JOB, assert_one_line_error, merge, meshforge, short_documents_jsonl
from layouts import assert_same_losses, job, train_layout

STEPS = 6
RTOL = 1e-4
TESTS = str(Path(__file__).parents[1])  # user_models.py, a factory model


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    """Byte-token shards of many short documents, separated by the byte tokenizer's 0x1e."""
    from meshforge.data.shards import prepare

    root = tmp_path_factory.mktemp("docmask")
    prepare(short_documents_jsonl(root, 2000, max_words=8, max_chars=40), root / "shards")
    return str(root / "shards")


def _masked(parallel: dict, source: str, **train) -> dict:
    return job(
        parallel,
        data={"source": source, "document_masking": True},
        train={"steps": STEPS, **train},
    )


@pytest.fixture(scope="module")
def reference(gloo, short_docs) -> dict[int, float]:
    (out,) = gloo.run(1, train_layout, _masked({}, short_docs), STEPS)
    return out["losses"]


def test_masking_changes_what_world_1_learns_from_packed_documents(gloo, short_docs, reference):
    plain = job({}, data={"source": short_docs}, train={"steps": STEPS})
    (out,) = gloo.run(1, train_layout, plain, STEPS)
    assert out["losses"][1] != pytest.approx(reference[1], rel=1e-4)


PS = {"mode": "parameter_server", "ps": {"servers": 1}}  # one worker, one server


@pytest.mark.parametrize(
    "parallel",
    [{"zero": 0}, {"zero": 3}, {"tp": 2}, {"tp": 2, "sequence_parallel": True}, PS],
    ids=["dp2", "zero3-dp2", "tp2", "tp2-sp", "parameter-server"],
)
def test_masked_training_at_world_2_matches_world_1(gloo, short_docs, reference, parallel):
    results = gloo.run(2, train_layout, _masked(parallel, short_docs), STEPS)
    for out in results:
        assert_same_losses(out["losses"], reference, str(parallel), RTOL)


def test_masked_training_runs_through_the_cli(job_factory, short_docs):
    job = job_factory(
        {"data": {"source": short_docs, "document_masking": True}, "train": {"steps": 3}}
    )
    job.train(1)
    assert job.report["status"] == "completed"
    assert job.cfg["data"]["document_masking"] is True


def _refused(tmp_path: Path, changes: dict, nproc: int = 1) -> str:
    """The one-line refusal of the tiny job with document masking and `changes`."""
    raw = merge(TINY_JOB, {"data": {"document_masking": True}})
    for section, values in changes.items():
        raw[section] = (
            values
            if section == "model" and "name" in values
            else {**raw.get(section, {}), **values}
        )
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(raw))
    args = ["train", str(config), "--nproc", str(nproc), "--run-dir", str(tmp_path / "run")]
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    proc = meshforge(args, env={"PYTHONPATH": path}, timeout=120)
    assert not (tmp_path / "run" / "checkpoints").exists()
    return proc


def test_document_masking_under_a_pipeline_is_refused(tmp_path):
    proc = _refused(tmp_path, {"model": {"tie_embeddings": False}, "parallel": {"pp": 2}}, 2)
    words = ["data.document_masking=true", "not yet supported under a pipeline", "parallel.pp=2"]
    assert_one_line_error(proc, *words)


def test_document_masking_with_a_factory_model_is_refused(tmp_path):
    factory = {"name": "user_models:tiny_lm", "kwargs": {"width": 32}, "seq_len": 32}
    proc = _refused(tmp_path, {"model": factory})
    assert_one_line_error(proc, "data.document_masking=true", "model.name=user_models:tiny_lm")


def test_data_without_separators_is_refused_naming_the_source(tmp_path):
    from meshforge.data.shards import prepare

    (tmp_path / "one.txt").write_text("print('a single document, no separator') " * 20)
    prepare(tmp_path / "one.txt", tmp_path / "shards")  # byte: separators go between documents
    source = str(tmp_path / "shards")
    proc = _refused(tmp_path, {"data": {"source": source}})
    assert_one_line_error(proc, f"data.source {source}", "no end-of-text token (id 30)")


def test_a_bin_file_is_refused_it_records_no_tokenizer(tmp_path):
    path = tmp_path / "train.bin"
    (np.arange(4096) % 256).astype("<u2").tofile(path)
    proc = _refused(tmp_path, {"data": {"source": str(path)}})
    assert_one_line_error(proc, f"data.source {path}", "records no tokenizer")


def test_masked_llama_under_tensor_and_sequence_parallel_matches_world_1(gloo, short_docs):
    """Rotary angles from the positions inside documents, the mask replicated over tp."""
    raw = _masked({}, short_docs)
    raw["model"] = {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 2,
                    "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "seq_len": 32}  # fmt: skip
    (ref,) = gloo.run(1, train_layout, raw, STEPS)
    raw["parallel"] = {"tp": 2, "sequence_parallel": True}
    for out in gloo.run(2, train_layout, raw, STEPS):
        assert_same_losses(out["losses"], ref["losses"], "llama tp2-sp", RTOL)
