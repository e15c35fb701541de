"""meshforge.redact: URLs lose their credentials, and nothing else, before anything is written."""

from __future__ import annotations

import pickle

import pytest
import yaml

from helpers import TINY_JOB, merge
from meshforge.config import build_config, dump_config, save_config
from meshforge.errors import ConfigError, DataError
from meshforge.redact import (
    credential_fields,
    has_credentials,
    is_credential_name,
    is_redacted,
    redact_text,
    redact_tree,
    redact_url,
)

CASES = [
    ("s3://AKIAEXAMPLE:s3cr3t@bucket/shards", "s3://AKIAEXAMPLE:***@bucket/shards"),
    ("https://user:p%40ss@host:8443/d/", "https://user:***@host:8443/d/"),
    ("https://ghp_token123@github.com/org/data", "https://***@github.com/org/data"),
    (
        "https://b.s3.amazonaws.com/x.bin?X-Amz-Algorithm=A&X-Amz-Credential=C"
        "&X-Amz-Signature=S&versionId=3",
        "https://b.s3.amazonaws.com/x.bin?X-Amz-Algorithm=***&X-Amz-Credential=***"
        "&X-Amz-Signature=***&versionId=3",
    ),
    (
        "https://acct.blob.core.windows.net/c/d?sv=2022-11-02&sig=Zm9v&se=2030",
        "https://acct.blob.core.windows.net/c/d?sv=2022-11-02&sig=***&se=2030",
    ),
    (
        "gs://b/d?token=t&api_key=k&AWSAccessKeyId=a&client_secret=c&password=p&monkey=1",
        "gs://b/d?token=***&api_key=***&AWSAccessKeyId=***&client_secret=***&password=***&monkey=1",
    ),
    ("https://h/p#access_token=t&state=1", "https://h/p#access_token=***&state=1"),
]


@pytest.mark.parametrize("url,redacted", CASES, ids=[c[0][:24] for c in CASES])
def test_redact_url_masks_the_password_and_credential_parameters_only(url, redacted):
    assert redact_url(url) == redacted
    assert has_credentials(url) and not has_credentials(redacted)
    assert is_redacted(redacted) and not is_redacted(url)
    assert redact_url(redacted) == redacted  # idempotent


@pytest.mark.parametrize(
    "value",
    [
        "builtin:python-stdlib",
        "/data/shards",
        "runs/tiny",
        "s3://bucket/shards",
        "https://host/shards/?version=3&limit=10",
        "file:///srv/data/train.bin",
        "hdfs://namenode:8020/x",
        "",
    ],
)
def test_values_without_credentials_are_unchanged(value):
    assert redact_url(value) == value and redact_text(value) == value
    assert not has_credentials(value) and not is_redacted(value)


@pytest.mark.parametrize(
    "name",
    [
        "token",
        "Token",
        "access_token",
        "api-key",
        "apiKey",
        "X-Amz-Date",
        "x-goog-signature",
        "sig",
        "secret",
        "AWSAccessKeyId",
        "pass%77ord",
        "password",
    ],  # fmt: skip
)
def test_credential_like_parameter_names(name):
    assert is_credential_name(name)


@pytest.mark.parametrize("name", ["version", "monkey", "keyframes", "se", "sv", "prefix", "limit"])
def test_ordinary_parameter_names(name):
    assert not is_credential_name(name)


def test_redact_text_finds_every_url_in_a_line():
    line = "error: data.source s3://u:pw@b/x: denied (see https://h/a?token=tk), retry"
    assert redact_text(line) == (
        "error: data.source s3://u:***@b/x: denied (see https://h/a?token=***), retry"
    )


def test_redact_tree_keeps_structure_types_and_keys():
    tree = {"a": ["s3://u:pw@b/x", 3, None, 1.5], "b": ("https://h?sig=s",), "token": "plain"}
    assert redact_tree(tree) == {
        "a": ["s3://u:***@b/x", 3, None, 1.5],
        "b": ("https://h?sig=***",),
        "token": "plain",  # keys and plain strings are not URLs
    }


def test_credential_fields_name_the_fields_holding_one():
    tree = {"data": {"source": "s3://u:pw@b/x", "cache_dir": None}, "x": ["ok", "https://h?key=1"]}
    assert credential_fields(tree) == ["data.source", "x[1]"]
    assert credential_fields({"data": {"source": "s3://b/x"}}) == []


def job(source: str):
    return build_config(merge(TINY_JOB, {"data": {"source": source}}))


def test_saved_config_never_holds_the_credential_and_still_names_the_data(tmp_path):
    cfg = job("s3://AKIAEXAMPLE:s3cr3t@bucket/shards?token=tk123&region=eu")
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "s3cr3t" not in text and "tk123" not in text
    assert text == dump_config(cfg)
    saved = yaml.safe_load(text)
    assert saved["data"]["source"] == "s3://AKIAEXAMPLE:***@bucket/shards?token=***&region=eu"
    # the rest of the record is the config, field for field: a resume compares model.*
    expected = cfg.model_dump(mode="json")
    expected["data"]["source"] = saved["data"]["source"]
    assert saved == expected
    assert build_config(saved).model == cfg.model  # a redacted config.yaml still loads


def test_a_redacted_source_finds_the_copy_its_credential_fetched(tmp_path):
    from meshforge.data.corpus import remote_cache_path

    url = "s3://AKIAEXAMPLE:s3cr3t@bucket/shards?token=tk123"
    cached = remote_cache_path(url, tmp_path)
    assert cached == remote_cache_path(redact_url(url), tmp_path)
    assert "s3cr3t" not in str(cached) and "tk123" not in str(cached)
    # credential-free URLs keep the cache they had
    assert remote_cache_path("s3://bucket/shards", tmp_path) != cached


def test_a_redacted_source_without_a_cached_copy_says_how_to_pass_the_credential(tmp_path):
    from meshforge.data.corpus import fetch_remote

    with pytest.raises(DataError) as err:
        fetch_remote("s3://AKIAEXAMPLE:***@bucket/shards", tmp_path)
    message = str(err.value)
    assert "redacted" in message and "environment" in message
    assert "s3://AKIAEXAMPLE:***@bucket/shards" in message


def test_error_messages_are_redacted_when_made_and_after_pickling():
    for kind in (ConfigError, DataError):
        err = kind("data.source https://u:hunter2@h/d?token=tk: no such directory")
        for seen in (err, pickle.loads(pickle.dumps(err))):
            assert "hunter2" not in str(seen) and "tk" not in str(seen).split("?")[1]
            assert "https://u:***@h/d?token=***" in str(seen)
