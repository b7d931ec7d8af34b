"""XFORMERS_VLLM_V1 forward against the reference.

Prefills (and, for layers with a sliding window or soft-cap, decodes too) run through
the Triton ops: checked here under the interpreter or on a GPU. Plain decodes run
through xformers' CUDA kernel: checked only on a GPU with xformers' kernels (``gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch
from backend_helpers import build, context_only_kv_cache, flash_batch, reference_output
from gpu_env import ON_GPU

from pagedattn.backends.xformers import (
    XFormersAttentionImpl,
    XFormersAttentionMetadataBuilder,
    xformers_problems,
)
from pagedattn.testing import TOLERANCES, BatchSpec

pytest.importorskip("xformers.ops.fmha.attn_bias",
                    reason="xformers is not installed (make setup installs it)")

H, HKV, D, BS = 4, 2, 32, 16
DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
PREFILLS = BatchSpec("prefills", (40, 21, 33), (12, 21, 33))  # chunked + whole
MIXED = BatchSpec("mixed", (37, 1, 70, 40, 21), (1, 1, 1, 12, 21))
FEATURES = {
    "plain": dict(),
    "window": dict(sliding_window=16),
    "softcap": dict(logits_soft_cap=3.0),
}
XFORMERS_PROBLEMS = xformers_problems()


def run_forward(spec, dtype, device, **impl_args):
    batch = flash_batch(spec, dtype=dtype, block_size=BS, num_heads=H, num_kv_heads=HKV,
                        head_size=D)
    impl = XFormersAttentionImpl(num_heads=H, head_size=D, scale=D ** -0.5, num_kv_heads=HKV,
                                 alibi_slopes=None, kv_cache_dtype="auto",
                                 sliding_window=impl_args.get("sliding_window"),
                                 logits_soft_cap=impl_args.get("logits_soft_cap"))
    _, metadata = build(XFormersAttentionMetadataBuilder, batch, dtype=dtype, block_size=BS,
                        num_heads=H, num_kv_heads=HKV, head_size=D, device=device)
    kv_cache = context_only_kv_cache(batch).to(device)
    output = torch.full_like(batch.query, math.nan).to(device)
    impl.forward(None, batch.query.to(device), batch.new_keys.to(device),
                 batch.new_values.to(device), kv_cache, metadata, output=output)
    full = torch.stack([batch.key_cache, batch.value_cache])
    assert torch.equal(kv_cache.cpu().nan_to_num(7.0), full.nan_to_num(7.0))
    return output.cpu().float(), reference_output(impl, batch, full)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("feature", FEATURES)
def test_prefill_path_matches_reference(feature, dtype, device):
    out, expected = run_forward(PREFILLS, dtype, device, **FEATURES[feature])
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("feature", ["window", "softcap"])
def test_windowed_or_capped_decodes_run_unified_and_match_reference(feature, device):
    out, expected = run_forward(MIXED, torch.float16, device, **FEATURES[feature])
    atol, rtol = TOLERANCES[torch.float16]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.skipif(ON_GPU and not XFORMERS_PROBLEMS, reason="checks the CPU refusal")
def test_plain_decodes_without_xformers_kernels_raise_the_reason(device):
    with pytest.raises(RuntimeError, match="cannot run its decode path here"):
        run_forward(MIXED, torch.float16, device)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or bool(XFORMERS_PROBLEMS),
                    reason=f"needs a CUDA GPU with xformers' kernels: {XFORMERS_PROBLEMS}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_decode_path_through_xformers_matches_reference(dtype, device):
    out, expected = run_forward(MIXED, dtype, device)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
