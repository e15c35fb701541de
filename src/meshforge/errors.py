"""Errors the user can act on. The CLI prints them as one line and exits 2."""

from meshforge.redact import redact_text


class MeshforgeError(Exception):
    """Base class for errors caused by the user's input (exit code 2). Its message is
    printed, logged and written to diagnosis.json, so a URL in it is redacted here, once
    for every error (`s3://user:***@bucket/...`)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact_text(a) if isinstance(a, str) else a for a in args))


class ConfigError(MeshforgeError):
    """A job config, override or cluster file is invalid."""


class DataError(MeshforgeError):
    """Input data is missing or malformed."""


class CheckpointError(MeshforgeError):
    """A checkpoint cannot be used."""


class ExportError(MeshforgeError):
    """An export of a model cannot be written."""
