"""pagedattn: paged-attention backends for LLM inference (vLLM-compatible interface)."""

__version__ = "0.1.0"

from pagedattn import thread_policy as _thread_policy

# Before anything imports torch: libgomp reads its wait policy once, as torch loads.
_thread_policy.apply_before_torch()


def __getattr__(name: str):
    # The engine pulls in the model code; import it only when asked for.
    if name in ("LLM", "SamplingParams", "StructuredOutput"):
        from pagedattn import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'pagedattn' has no attribute {name!r}")
