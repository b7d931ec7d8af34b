"""Integrations of pagedattn's kernels into other inference engines (optional extras)."""
