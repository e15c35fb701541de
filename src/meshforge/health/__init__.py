"""Cluster health: preflight checks before a run, diagnosis when one fails."""
