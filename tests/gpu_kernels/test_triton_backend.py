"""TRITON_ATTN end to end: builder -> metadata -> impl.forward, against the reference.

Each step starts from a cache holding only the context (the new tokens' slots are NaN),
so forward must write this step's K/V (reshape_and_cache_flash) before attending
(unified_attention), exactly as one model step does.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from backend_helpers import (
    build,
    context_only_kv_cache,
    flash_batch,
    full_kv_cache,
    layer_with_scales,
    reference_output,
)
from gpu_env import INTERPRETED, ON_GPU

from pagedattn import registry
from pagedattn.backend import AttentionType
from pagedattn.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from pagedattn.ops import triton as triton_ops
from pagedattn.testing import TOLERANCES, BatchSpec

H, HKV, D, BS = 6, 2, 40, 16  # a GQA group of 3 and a head size that is not a power of 2
BATCHES = {
    "decode": BatchSpec("decode", (37, 1, 70), (1, 1, 1)),
    "prefill": BatchSpec("prefill", (33, 20), (33, 20)),
    "mixed": BatchSpec("mixed", (70, 1, 45, 33), (1, 1, 9, 33)),
}
FEATURES = {
    "plain": dict(),
    "window": dict(sliding_window=16),
    "alibi": dict(alibi=True),
    "softcap": dict(softcap=3.0),
    "sinks": dict(sinks=True),
    "fp8": dict(kv_cache_dtype="fp8_e4m3"),
}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
K_SCALE, V_SCALE = 0.02, 0.015  # fp8: values of ~N(0, 1) stored as x / scale


def make_impl(sliding_window=None, alibi=False, softcap=None, sinks=False,
              kv_cache_dtype="auto", **kw):
    gen = torch.Generator().manual_seed(3)
    return TritonAttentionImpl(
        num_heads=H, head_size=D, scale=D ** -0.5, num_kv_heads=HKV,
        alibi_slopes=(torch.rand(H, generator=gen) * 0.2).tolist() if alibi else None,
        sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype,
        logits_soft_cap=softcap, sinks=torch.randn(H, generator=gen) if sinks else None, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("batch_name", BATCHES)
def test_forward_writes_cache_and_matches_reference(batch_name, feature, dtype, device):
    options = FEATURES[feature]
    batch = flash_batch(BATCHES[batch_name], dtype=dtype, block_size=BS, num_heads=H,
                        num_kv_heads=HKV, head_size=D)
    impl = make_impl(**options)
    _, metadata = build(TritonAttentionMetadataBuilder, batch, dtype=dtype, block_size=BS,
                        num_heads=H, num_kv_heads=HKV, head_size=D, device=device,
                        sliding_window=options.get("sliding_window"))
    fp8 = torch.float8_e4m3fn if "kv_cache_dtype" in options else None
    scales = (K_SCALE, V_SCALE) if fp8 else (1.0, 1.0)
    kv_cache = context_only_kv_cache(batch, fp8, *scales).to(device)
    output = torch.full_like(batch.query, math.nan).to(device)
    returned = impl.forward(layer_with_scales(*scales, device), batch.query.to(device),
                            batch.new_keys.to(device), batch.new_values.to(device), kv_cache,
                            metadata, output=output)
    assert returned is output
    expected_cache = full_kv_cache(batch, fp8, *scales)
    # The cache now holds exactly the full batch (unused slots stay NaN).
    assert torch.equal(kv_cache.cpu().float().nan_to_num(7.0),
                       expected_cache.float().nan_to_num(7.0))
    atol, rtol = TOLERANCES[dtype]
    if fp8:
        atol = rtol = max(atol, 2e-3)  # dequantized keys are rounded to the query dtype
    torch.testing.assert_close(output.cpu().float(),
                               reference_output(impl, batch, expected_cache, *scales),
                               atol=atol, rtol=rtol)


def test_the_builder_plans_the_split_once_and_every_layer_uses_it(device):
    # The split count and the partial buffers are made once per step by the builder;
    # two layers run on one plan (here a forced 3-way split) and both match the reference.
    dtype = torch.float32
    batch = flash_batch(BATCHES["mixed"], dtype=dtype, block_size=BS, num_heads=H,
                        num_kv_heads=HKV, head_size=D, seed=4)
    _, metadata = build(TritonAttentionMetadataBuilder, batch, dtype=dtype, block_size=BS,
                        num_heads=H, num_kv_heads=HKV, head_size=D, device=device)
    plan = metadata.kv_split_plan
    assert plan is not None and (plan.num_kv_splits > 1) == (plan.partial_acc is not None)
    forced = triton_ops.plan_kv_splits(
        device, dtype, num_tokens=metadata.num_actual_tokens, num_reqs=metadata.num_reqs,
        num_heads=H, num_kv_heads=HKV, head_size=D, max_seqlen_q=metadata.max_query_len,
        max_seqlen_k=metadata.max_seq_len, num_kv_splits=3)
    metadata = dataclasses.replace(metadata, kv_split_plan=forced)
    for impl in (make_impl(), make_impl(sliding_window=16)):
        kv_cache = context_only_kv_cache(batch).to(device)
        output = torch.full_like(batch.query, math.nan).to(device)
        impl.forward(layer_with_scales(1.0, 1.0, device), batch.query.to(device),
                     batch.new_keys.to(device), batch.new_values.to(device), kv_cache,
                     metadata, output=output)
        torch.testing.assert_close(output.cpu().float(),
                                   reference_output(impl, batch, full_kv_cache(batch), 1.0, 1.0),
                                   atol=TOLERANCES[dtype][0], rtol=TOLERANCES[dtype][1])


def test_uint8_cache_is_read_as_fp8_and_padding_rows_are_left_alone(device):
    dtype = torch.float16
    batch = flash_batch(BATCHES["mixed"], dtype=dtype, block_size=BS, num_heads=H,
                        num_kv_heads=HKV, head_size=D, seed=2)
    impl = make_impl(kv_cache_dtype="fp8")
    _, metadata = build(TritonAttentionMetadataBuilder, batch, dtype=dtype, block_size=BS,
                        num_heads=H, num_kv_heads=HKV, head_size=D, device=device)
    kv_cache = context_only_kv_cache(batch, torch.float8_e4m3fn, K_SCALE, V_SCALE)
    kv_cache = kv_cache.view(torch.uint8).to(device)
    pad = 3  # graph padding rows past num_actual_tokens
    query = torch.cat([batch.query, torch.randn(pad, H, D, dtype=dtype)]).to(device)
    keys = torch.cat([batch.new_keys, torch.randn(pad, HKV, D, dtype=dtype)]).to(device)
    values = torch.cat([batch.new_values, torch.randn(pad, HKV, D, dtype=dtype)]).to(device)
    output = torch.full_like(query, 5.0)
    impl.forward(layer_with_scales(K_SCALE, V_SCALE, device), query, keys, values, kv_cache,
                 metadata, output=output)
    assert torch.equal(output[-pad:].cpu(), torch.full((pad, H, D), 5.0, dtype=dtype))
    expected_cache = full_kv_cache(batch, torch.float8_e4m3fn, K_SCALE, V_SCALE)
    torch.testing.assert_close(
        output[:-pad].cpu().float(),
        reference_output(impl, batch, expected_cache, K_SCALE, V_SCALE), atol=3e-3, rtol=3e-3)


def test_profiling_run_and_argument_errors(device):
    impl = make_impl()
    out = torch.zeros(2, H, D, device=device)
    assert impl.forward(None, out, None, None, torch.zeros(2, 1, BS, HKV, D, device=device),
                        None, output=out) is out
    with pytest.raises(ValueError, match="output=None"):
        impl.forward(None, out, None, None, torch.zeros(2, 1, BS, HKV, D), None)
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(None, out, None, None, torch.zeros(2, 1, BS, HKV, D), None, output=out,
                     output_scale=torch.ones(1))
    with pytest.raises(NotImplementedError, match="decoder attention only"):
        make_impl(attn_type=AttentionType.ENCODER_ONLY)
    with pytest.raises(NotImplementedError, match="fp8_inc"):
        make_impl(kv_cache_dtype="fp8_inc")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TritonAttentionImpl(5, D, 1.0, 2, None, None, "auto")
    with pytest.raises(ValueError, match="sinks must have shape"):
        TritonAttentionImpl(H, D, 1.0, HKV, None, None, "auto", sinks=torch.zeros(2))
    fp8_impl = make_impl(kv_cache_dtype="fp8")
    with pytest.raises(TypeError, match="needs a torch.float8_e4m3fn"):
        fp8_impl._cache_views(torch.zeros(2, 1, BS, HKV, D, dtype=torch.float16))


def test_backend_capabilities_and_selection(device):
    assert TritonAttentionBackend.get_kv_cache_shape(10, 16, 2, 40) == (2, 10, 16, 2, 40)
    assert TritonAttentionBackend.supports_sink()
    assert TritonAttentionBackend.supports_kv_cache_dtype("fp8_e5m2")
    assert not TritonAttentionBackend.supports_kv_cache_dtype("fp8_inc")
    config = registry.default_selector_config(D, torch.float16, device=device.type,
                                              has_sink=True, kv_cache_dtype="fp8")
    assert registry.unsupported_reasons("TRITON_ATTN", config) == []
    assert registry.select_backend(config, backend="TRITON_ATTN") is TritonAttentionBackend


@pytest.mark.skipif(not INTERPRETED, reason="checks the interpreter-only reason")
def test_cuda_is_refused_while_the_kernels_are_interpreted():
    config = registry.default_selector_config(D, torch.float16, device="cpu")
    config = type(config)(**{**config.__dict__, "device": "cuda",
                             "device_capability": type(config.device_capability)(9, 0)})
    reasons = registry.unsupported_reasons("TRITON_ATTN", config)
    assert any("TRITON_INTERPRET" in r for r in reasons), reasons
