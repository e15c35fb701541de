"""A job config remembers the file it was read from (its layout errors name it), and
that does not make two configs of the same settings differ."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshforge.config import load_config
from meshforge.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe-tiny.yaml"


def test_the_same_settings_read_from_two_files_are_equal(tmp_path) -> None:
    copy = tmp_path / "copy.yaml"
    shutil.copy(EXAMPLE, copy)
    a, b = load_config(EXAMPLE), load_config(copy)
    assert a == b
    assert a != load_config(copy, ["train.steps=7"])


def test_a_layout_error_names_the_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^.*moe-tiny\.yaml: parallel\.ep=2 does not divide"):
        load_config(EXAMPLE).dims(1)
