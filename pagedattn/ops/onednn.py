"""torch's own CPU GEMMs, as the linear paths use them: whether torch has a native
half-precision GEMM here, and its prepacked oneDNN linear (private ``torch.ops.mkldnn``
ops, so probed once with a tiny layer rather than trusted). Model code reaches them
through these functions, as it reaches pagedattn's kernels through :mod:`pagedattn.ops`.
"""

from __future__ import annotations

import functools

import torch


def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether torch has a native ``dtype`` GEMM on this CPU (oneDNN with AVX512-BF16/AMX
    for bf16, AVX512-FP16/AMX-FP16 for fp16); without one its half linear is emulated,
    far slower than fp32 (docs/performance.md)."""
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported",
             torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    try:
        return probe is not None and bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def linear_error(dtype: torch.dtype) -> str | None:
    """Why the prepacked oneDNN linear does not run ``dtype`` here, or None."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    try:
        y = linear(torch.ones(1, 2, dtype=dtype), pack_weight(torch.ones(2, 2, dtype=dtype)))
    except (AttributeError, RuntimeError) as exc:
        return f"torch's prepacked oneDNN linear failed: {str(exc).splitlines()[0][:120]}"
    return None if torch.equal(y.float(), torch.full((1, 2), 2.0)) else \
        "torch's prepacked oneDNN linear gave a wrong result"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[out_features, in_features]`` reordered once into oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` (no bias) for a weight from :func:`pack_weight`; ``x`` in its dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [None], "")
