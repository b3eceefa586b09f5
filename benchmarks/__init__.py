"""Measurement scripts whose results docs/performance.md quotes with their commands (run from the repo root)."""
