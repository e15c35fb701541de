"""`meshforge submit k8s` (being written; see issue 7)."""

from __future__ import annotations

from meshforge.cli.submit import submit_app  # noqa: F401
