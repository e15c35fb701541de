"""Credentials out of what a run records: URLs with their secrets replaced by `***`.

A `data.source` such as `s3://user:PASSWORD@bucket/shards` or
`https://host/shards?X-Amz-Signature=...&token=...` carries a credential. Whatever a
run writes (config.yaml, report.json, report.html, logs, metrics sinks) is read by more
people than the job's owner, so every URL written there goes through `redact_url`: the
password of its userinfo (a lone user name too: `https://TOKEN@github.com` is a
common way to pass a token) and the values of credential-like query or fragment
parameters become `***`. Everything else is kept byte for byte, so a redacted URL still
names the same data (the remote-shard cache is keyed by it: data/corpus.py).

Plain Python, no meshforge import: it sits at the bottom of the layers so that any
writer can use it."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

MASK = "***"

# scheme://netloc then the rest, up to whitespace, a quote or an angle bracket
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
_URL = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<netloc>[^/?#]*)(?P<tail>.*)", re.S)
# words of a parameter name (snake, kebab, dotted or camelCase) that make it a credential
_CREDENTIAL_WORDS = frozenset(
    {
        "token",
        "key",
        "secret",
        "signature",
        "sig",
        "password",
        "passwd",
        "pwd",
        "credential",
        "credentials",
        "apikey",
        "auth",
        "authorization",
    }
)
_CREDENTIAL_PREFIXES = ("x-amz-", "x-goog-")  # every AWS / GCS signed-URL parameter
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def is_credential_name(name: str) -> bool:
    """Whether a query parameter named `name` holds a credential: `token`, `api_key`,
    `AWSAccessKeyId`, `X-Amz-Signature`, `sig` (Azure SAS), `access_token`, ..."""
    name = unquote(name)
    if name.lower().startswith(_CREDENTIAL_PREFIXES):
        return True
    return any(word.lower() in _CREDENTIAL_WORDS for word in _WORD.findall(name))


def _redact_params(params: str) -> str:
    out = []
    for param in params.split("&"):
        name, eq, _ = param.partition("=")
        out.append(f"{name}={MASK}" if eq and is_credential_name(name) else param)
    return "&".join(out)


def redact_url(url: str) -> str:
    """`url` with its userinfo password (or lone userinfo) and the values of its
    credential-like query and fragment parameters replaced by `***`; a string that is
    not a `scheme://` URL comes back unchanged."""
    match = _URL.fullmatch(url)
    if match is None:
        return url
    head, netloc, tail = match["head"], match["netloc"], match["tail"]
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{MASK}@{host}"
    rest, hash_, fragment = tail.partition("#")
    path, qmark, query = rest.partition("?")
    if qmark:
        query = _redact_params(query)
    if hash_:
        fragment = _redact_params(fragment)
    return f"{head}{netloc}{path}{qmark}{query}{hash_}{fragment}"


def has_credentials(url: str) -> bool:
    """Whether `url` carries something `redact_url` would hide (not yet hidden)."""
    return redact_url(url) != url


def is_redacted(url: str) -> bool:
    """Whether `url` is a redacted URL: a credential position of it holds `***`, so
    it cannot be used to reach its data (only to name it)."""
    match = _URL.fullmatch(url)
    if match is None or MASK not in url:
        return False
    netloc = match["netloc"]
    if "@" in netloc:
        userinfo = netloc.rsplit("@", 1)[0]
        if userinfo == MASK or userinfo.partition(":")[2] == MASK:
            return True
    rest, _, fragment = match["tail"].partition("#")
    params = [*rest.partition("?")[2].split("&"), *fragment.split("&")]
    return any(
        is_credential_name(name) and value == MASK
        for name, eq, value in (p.partition("=") for p in params)
        if eq
    )


def redact_text(text: str) -> str:
    """Every URL inside free text (a log line, an error message, a YAML file) redacted."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(_redact_match, text)


def _redact_match(match: re.Match[str]) -> str:
    # punctuation that ends a sentence or a bracket is the text's, not the URL's
    url = match.group(0)
    core = url.rstrip(").,;:]}!")
    return redact_url(core) + url[len(core) :]


def redact_tree(tree: Any) -> Any:
    """A copy of a JSON-like tree (dicts, lists, tuples, strings, numbers) with every
    URL in its strings redacted; keys are kept."""
    if isinstance(tree, str):
        return redact_text(tree)
    if isinstance(tree, dict):
        return {key: redact_tree(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(redact_tree(value) for value in tree)
    return tree


def credential_fields(tree: Any, prefix: str = "") -> list[str]:
    """Dotted names of the string values of `tree` that hold a credential
    (`["data.source"]`): what a manifest or a shared file must not carry."""
    if isinstance(tree, str):
        return [prefix] if redact_text(tree) != tree else []
    if isinstance(tree, dict):
        items = [(f"{prefix}.{key}" if prefix else str(key), v) for key, v in tree.items()]
    elif isinstance(tree, list | tuple):
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(tree)]
    else:
        return []
    return [name for key, value in items for name in credential_fields(value, key)]
