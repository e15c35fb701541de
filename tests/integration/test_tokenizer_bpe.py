"""Tokenizers: byte-level BPE trained on the user's text round-trips any text exactly, is
saved beside the shards with a checksum, and refuses a changed or foreign tokenizer.json;
the byte tokenizer is unchanged; end to end, `data prepare --tokenizer bpe` shards train a
model whose vocabulary is checked against the tokenizer and `sample` decodes with it."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import REPO, Job, assert_one_line_error, meshforge
from meshforge.data import tokenizer as tokmod
from meshforge.data.tokenizer import (
    BPE_FILE,
    DOCUMENT_SEPARATOR,
    END_OF_TEXT,
    TOKEN_DTYPE,
    VOCAB_SIZE,
    BpeTokenizer,
    ByteTokenizer,
    Tokenizer,
    decode,
    encode,
    load_tokenizer_file,
    token_dtype,
    tokenizer_from_index,
    train_bpe,
)
from meshforge.errors import DataError

pytest.importorskip("tokenizers")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS_FILES = ("textwrap.py", "string.py", "bisect.py", "fnmatch.py", "colorsys.py")

VARIED_TEXTS = [
    "",
    "a",
    " ",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\t\ttabs\n\n\n   \n\t \r\n\r\nCRLF lines\r\n",
    "    def f(x):\n        return x ** 2  # square\n\n\n",
    "naïve café — “quotes” ‘single’ … ½ ∑ ∫ ≠ ≤",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 👩‍👩‍👧‍👦 🇺🇳 🏳️‍🌈 and combining e\u0301 a\u0308",
    "RTL: שלום עולם مرحبا بالعالم",
    "zero\u200bwidth\u00a0nbsp\u2028line\u2029para\u3000ideographic space",
    "controls \x00\x01\x1e\x1f\x7f and literal <|endoftext|> inside",
    "'s 't 're 've 'm 'll 'd contractions'll",
    "1234567890 3.14159 -1e-10 0xFF",
    '{"json": [1, 2, {"k": null}]}\n',
]


def _corpus_texts() -> list[str]:
    return [(STDLIB / name).read_text(encoding="utf-8") for name in CORPUS_FILES]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return _corpus_texts()


@pytest.fixture(scope="module")
def bpe(texts) -> BpeTokenizer:
    return train_bpe(texts, 600)


# --------------------------------------------------------------------------- training


def test_trained_bpe_round_trips_varied_text_exactly(bpe, texts) -> None:
    for text in VARIED_TEXTS + texts:
        ids = bpe.encode(text)
        assert ids.dtype == np.uint32 and ids.ndim == 1
        assert bpe.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300))
def test_trained_bpe_round_trips_any_text(bpe, text) -> None:
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_compresses_the_text_it_was_trained_on(bpe, texts) -> None:
    text = texts[0]
    assert len(bpe.encode(text)) < 0.6 * len(text.encode("utf-8"))


def test_vocab_size_is_respected_and_includes_bytes_and_end_of_text(bpe, texts) -> None:
    assert bpe.kind == "bpe" and isinstance(bpe, Tokenizer)
    assert bpe.vocab_size == 600  # a few KB of Python have more than 343 merges to learn
    small = train_bpe(texts, 300)
    assert small.vocab_size == 300
    assert bpe.eod_id == bpe.inner.token_to_id(END_OF_TEXT)
    assert bpe.decode([bpe.eod_id]) == END_OF_TEXT
    all_ids = np.arange(bpe.vocab_size)
    assert bpe.decode(all_ids)  # every id decodes
    with pytest.raises(ValueError, match="vocabulary"):
        bpe.decode([bpe.vocab_size])


def test_training_on_little_text_gives_at_most_the_vocab_asked_for() -> None:
    tok = train_bpe(["abab abab abab"], 5000)
    assert 257 <= tok.vocab_size < 5000
    assert tok.decode(tok.encode("abab, ünïcode")) == "abab, ünïcode"


@pytest.mark.parametrize("vocab", [0, 100, 256])
def test_a_vocab_without_room_for_bytes_and_end_of_text_is_refused(vocab) -> None:
    with pytest.raises(DataError, match=f"--vocab-size {vocab}.*at least 257"):
        train_bpe(["some text"], vocab)


def test_training_is_deterministic(texts, bpe) -> None:
    assert train_bpe(texts, 600).to_json() == bpe.to_json()


# --------------------------------------------------------------------------- long texts


def test_long_text_is_encoded_in_chunks_with_the_same_ids(bpe, texts) -> None:
    long = "\n".join(texts * 6)
    assert len(long) > 3 * tokmod._CHUNK_CHARS
    assert len(list(tokmod._chunks(long))) > 3
    whole = bpe.inner.encode(long, add_special_tokens=False).ids
    assert bpe.encode(long).tolist() == whole
    batch = bpe.encode_batch([long, "", texts[0]])
    assert batch[0].tolist() == whole and batch[1].size == 0
    assert batch[2].tolist() == bpe.encode(texts[0]).tolist()


_PIECES = st.sampled_from(
    [
        "a",
        "Z",
        "é",
        "日",
        "7",
        ".",
        "'",
        "'s",
        "(",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "\r\n",
        "👍",
        "\x1e",
    ]
)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(_PIECES, max_size=120), target=st.integers(1, 12))
def test_chunk_boundaries_never_change_the_ids(bpe, parts, target) -> None:
    text = "".join(parts)
    chunks = list(tokmod._chunks(text, target))
    assert "".join(chunks) == text
    ids = [i for c in chunks for i in bpe.inner.encode(c, add_special_tokens=False).ids]
    assert ids == bpe.inner.encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------- save and load


def test_save_then_tokenizer_from_index_gives_the_same_tokenizer(bpe, tmp_path) -> None:
    entry = bpe.save(tmp_path)
    assert json.loads(json.dumps(entry)) == entry  # fits in index.json
    assert entry["kind"] == "bpe" and entry["file"] == BPE_FILE
    assert entry["vocab_size"] == bpe.vocab_size and entry["eod_id"] == bpe.eod_id
    assert len(entry["sha256"]) == 64
    again = tokenizer_from_index(entry, tmp_path)
    user = load_tokenizer_file(tmp_path / BPE_FILE)
    for tok in (again, user):
        assert isinstance(tok, BpeTokenizer)
        assert (tok.vocab_size, tok.eod_id) == (bpe.vocab_size, bpe.eod_id)
        for text in VARIED_TEXTS:
            assert tok.encode(text).tolist() == bpe.encode(text).tolist()
    assert again.save(tmp_path / "copy") == entry  # saving is byte-stable


def test_a_changed_tokenizer_json_is_refused_by_name(bpe, tmp_path) -> None:
    entry = bpe.save(tmp_path)
    path = tmp_path / BPE_FILE
    path.write_text(path.read_text().replace('"<|endoftext|>"', '"<|endoftext|> "', 1))
    with pytest.raises(DataError, match=r"tokenizer\.json does not match its sha256"):
        tokenizer_from_index(entry, tmp_path)
    path.unlink()
    with pytest.raises(DataError, match=r"tokenizer\.json: listed in index\.json but missing"):
        tokenizer_from_index(entry, tmp_path)


@pytest.mark.parametrize(
    "entry",
    ["wordpiece", {"kind": "sentencepiece"}, {"kind": "bpe"}, {"kind": "bpe", "file": "x"}, 7],
)
def test_a_bad_index_entry_is_refused(entry, tmp_path) -> None:
    with pytest.raises(DataError):
        tokenizer_from_index(entry, tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        "not json at all {",
        '{"version": "1.0"}',
        '["a", "list"]',
        '{"model": {"type": "NoSuchModel"}}',
        b"\xff\xfe binary",
    ],
)
def test_a_file_that_is_not_a_tokenizer_json_is_refused(content, tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(DataError, match="tokenizer.json"):
        load_tokenizer_file(path)


def test_a_missing_or_directory_tokenizer_file_is_refused(tmp_path) -> None:
    with pytest.raises(DataError, match="no such tokenizer file"):
        load_tokenizer_file(tmp_path / "nope.json")
    with pytest.raises(DataError, match="is a directory"):
        load_tokenizer_file(tmp_path)


def test_a_user_tokenizer_without_end_of_text_gets_one(tmp_path) -> None:
    import tokenizers as tk

    inner = tk.Tokenizer(tk.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, "[UNK]"))
    inner.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    path = tmp_path / "user.json"
    path.write_text(inner.to_str())
    tok = load_tokenizer_file(path)
    assert tok.vocab_size == 4 and tok.eod_id == 3
    assert tok.encode("hello world").tolist() == [0, 1]
    entry = tok.save(tmp_path / "out")
    assert tokenizer_from_index(entry, tmp_path / "out").eod_id == 3


def test_sample_refuses_a_bad_tokenizer_file_in_one_line(tmp_path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{oops")
    proc = meshforge(["sample", str(tmp_path), "--prompt", "x", "--tokenizer", str(bad)])
    assert_one_line_error(proc, "tokenizer.json", "invalid JSON")


# --------------------------------------------------------------------------- byte tokenizer


def test_the_byte_tokenizer_is_unchanged() -> None:
    text = "héllo\n\x1e"
    ids = encode(text)
    assert ids.dtype == TOKEN_DTYPE == np.dtype("<u2") and VOCAB_SIZE == 256
    assert ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text and decode(iter(ids.tolist())) == text
    byte = ByteTokenizer()
    assert isinstance(byte, Tokenizer)
    assert (byte.kind, byte.name, byte.vocab_size) == ("byte", "byte", 256)
    assert byte.eod_id == DOCUMENT_SEPARATOR[0] == 0x1E
    assert byte.encode(text).dtype == np.uint32 and byte.encode(text).tolist() == ids.tolist()
    assert byte.encode_bytes(b"\xff\x00").tolist() == [255, 0]
    assert byte.decode(byte.encode(text)) == text
    with pytest.raises(ValueError, match="byte vocabulary"):
        decode([256])


def test_byte_index_entries_name_the_byte_tokenizer(tmp_path) -> None:
    assert ByteTokenizer().save(tmp_path) == "byte"
    assert not list(tmp_path.iterdir())
    assert isinstance(tokenizer_from_index("byte", tmp_path), ByteTokenizer)
    assert isinstance(tokenizer_from_index({"kind": "byte"}, tmp_path), ByteTokenizer)


def test_the_byte_path_never_imports_tokenizers() -> None:
    code = (
        "import sys, meshforge.data.tokenizer as t, meshforge.data.shards\n"
        "t.tokenizer_from_index('byte', '.').encode('x')\n"
        "assert 'tokenizers' not in sys.modules, 'tokenizers imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(256, "<u2"), (50304, "<u2"), (65536, "<u2"), (65537, "<u4")]
)
def test_token_dtype_fits_the_vocabulary(vocab, dtype) -> None:
    assert token_dtype(vocab) == np.dtype(dtype)


# --------------------------------------------------------------------------- end to end


def _prepare_has_tokenizer_options() -> bool:
    source = (REPO / "src" / "meshforge" / "cli" / "data.py").read_text()
    return "--tokenizer" in source and "--vocab-size" in source


needs_bpe_prepare = pytest.mark.skipif(
    not _prepare_has_tokenizer_options(),
    reason="`meshforge data prepare --tokenizer bpe --vocab-size` is not there yet",
)

E2E_VOCAB = 512


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory) -> Path:
    """`data prepare --tokenizer bpe` over a few stdlib files (about 150 KB)."""
    root = tmp_path_factory.mktemp("bpe-e2e")
    src = root / "src"
    src.mkdir()
    names = (*CORPUS_FILES, "shlex.py", "heapq.py", "calendar.py", "difflib.py")
    for name in names:
        (src / name).write_text((STDLIB / name).read_text(encoding="utf-8"))
    out = root / "shards"
    args = ["data", "prepare", str(src), str(out), "--tokenizer", "bpe"]
    proc = meshforge([*args, "--vocab-size", str(E2E_VOCAB)])
    assert proc.returncode == 0, proc.stderr
    return out


@needs_bpe_prepare
def test_prepare_records_the_bpe_tokenizer_and_its_ids_round_trip(bpe_shards) -> None:
    index = json.loads((bpe_shards / "index.json").read_text())
    entry = index["tokenizer"]
    assert entry["kind"] == "bpe" and (bpe_shards / entry["file"]).is_file()
    assert index["vocab_size"] == entry["vocab_size"] <= E2E_VOCAB
    assert index["dtype"] == "uint16"
    tok = tokenizer_from_index(entry, bpe_shards)
    ids = np.concatenate(
        [np.fromfile(bpe_shards / s["file"], dtype="<u2") for s in index["shards"]]
    )
    assert len(ids) == index["total_tokens"] and int(ids.max()) < tok.vocab_size
    docs = [d for d in tok.decode(ids).split(END_OF_TEXT) if d]
    src = bpe_shards.parent / "src"
    assert sorted(docs) == sorted(p.read_text() for p in src.iterdir())
    for text in VARIED_TEXTS:
        assert tok.decode(tok.encode(text)) == text


def _job(root: Path, shards: Path, vocab: int, name: str) -> Job:
    overrides = {
        "name": name,
        "model": {"vocab_size": vocab},
        "data": {"source": str(shards)},
        "train": {"steps": 30, "warmup": 3},
        "checkpoint": {"every": 30},
    }
    return Job(root, overrides, name=name)


@needs_bpe_prepare
@pytest.mark.slow
def test_a_model_trains_on_bpe_ids_and_sample_decodes(bpe_shards, tmp_path) -> None:
    job = _job(tmp_path, bpe_shards, E2E_VOCAB, "bpe")
    job.train(1)
    losses = [loss for _, loss in sorted(job.losses().items())]
    assert losses[0] > 5.0  # about ln(512) = 6.2 at the start: the ids span the vocabulary
    assert np.mean(losses[-5:]) < losses[0] - 0.5
    args = ["sample", str(job.run_dir), "--prompt", "def ", "--tokens", "20", "--temperature", "0"]
    proc = meshforge(args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def ") and len(proc.stdout) > len("def \n")
    given = meshforge([*args, "--tokenizer", str(bpe_shards / BPE_FILE)])
    assert given.returncode == 0 and given.stdout == proc.stdout, given.stderr


@needs_bpe_prepare
def test_a_model_vocab_smaller_than_the_tokenizer_is_exit_2(bpe_shards, tmp_path) -> None:
    job = _job(tmp_path, bpe_shards, 256, "small-vocab")
    proc = job.train(1, check=False)
    assert_one_line_error(proc, "vocab_size")
    assert not (job.run_dir / "report.json").exists()
