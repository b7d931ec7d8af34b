"""pagedattn: paged-attention backends for LLM inference (vLLM-compatible interface)."""

__version__ = "0.1.0"
