"""The run directory's files and their formats, torch-free (DESIGN.md layer 1)."""
