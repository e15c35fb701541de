"""Errors the user can act on. The CLI prints them as one line and exits 2."""


class MeshforgeError(Exception):
    """Base class for errors caused by the user's input (exit code 2)."""


class ConfigError(MeshforgeError):
    """A job config, override or cluster file is invalid."""


class DataError(MeshforgeError):
    """Input data is missing or malformed."""


class CheckpointError(MeshforgeError):
    """A checkpoint cannot be used."""


class ExportError(MeshforgeError):
    """An export of a model cannot be written."""
