"""`meshforge data ...` commands (filled in by the data layer)."""
