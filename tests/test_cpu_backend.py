"""CPU_ATTN end to end: builder -> metadata -> impl.forward, against the reference.

Each decoder test starts from a cache that holds only the *context* (the new tokens'
slots are NaN), so forward must write the new K/V through reshape_and_cache before it
attends, exactly as one model step does.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from pagedattn import ops, tuning
from pagedattn.backends import cpu_runtime
from pagedattn.backend import AttentionType, CommonAttentionMetadata
from pagedattn.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from pagedattn.config import CacheConfig, BuilderConfig, ModelConfig
from pagedattn.kv_cache_spec import AttentionSpec, CrossAttentionSpec
from pagedattn.ops import reference as ref
from pagedattn.ops.isa import IsaHint
from pagedattn.testing import BATCH_SPECS, TOLERANCES, BatchSpec, make_paged_batch

H, HKV, D = 8, 2, 64
FP32_TOL = dict(zip(("atol", "rtol"), TOLERANCES[torch.float32]))
BF16_TOL = dict(zip(("atol", "rtol"), TOLERANCES[torch.bfloat16]))

FEATURES = {
    "plain": dict(),
    "window": dict(sliding_window=24),
    "alibi": dict(alibi=True),
    "softcap": dict(softcap=4.0),
    "sinks": dict(sinks=True),
}


def engine_config(dtype, block_size):
    return BuilderConfig(
        model_config=ModelConfig(dtype=dtype, num_attention_heads=H, num_kv_heads=HKV, head_size=D),
        cache_config=CacheConfig(block_size=block_size),
    )


def make_impl(attn_type=AttentionType.DECODER, sliding_window=None, alibi=False, softcap=None,
              sinks=False, kv_sharing_target_layer_name=None, kv_cache_dtype="auto"):
    gen = torch.Generator().manual_seed(3)
    return CPUAttentionBackendImpl(
        num_heads=H, head_size=D, scale=D ** -0.5, num_kv_heads=HKV,
        alibi_slopes=(torch.rand(H, generator=gen) * 0.2).tolist() if alibi else None,
        sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=softcap,
        attn_type=attn_type, kv_sharing_target_layer_name=kv_sharing_target_layer_name,
        sinks=torch.randn(H, generator=gen) if sinks else None,
    )


def reference_for(impl, batch, causal=True):
    return ref.paged_attention(
        batch.query.float(), batch.key_cache.float(), batch.value_cache.float(),
        batch.query_start_loc, batch.seq_lens, batch.block_table, scale=impl.scale,
        causal=causal, sliding_window=impl.sliding_window, softcap=impl.logits_soft_cap,
        alibi_slopes=impl.alibi_slopes, s_aux=impl.sinks,
    )


def context_only_kv_cache(batch):
    """[2, nb, nkv, bs, hs] cache with the new tokens' slots poisoned (NaN)."""
    kv_cache = torch.stack([batch.key_cache, batch.value_cache])
    bs = batch.key_cache.shape[2]
    for slot in batch.slot_mapping.tolist():
        kv_cache[:, slot // bs, :, slot % bs] = math.nan
    return kv_cache


def build_metadata(batch, dtype, block_size, sliding_window=None):
    spec = AttentionSpec(block_size, HKV, D, dtype, sliding_window=sliding_window)
    builder = CPUAttentionMetadataBuilder(
        spec, ["layer0"], engine_config(dtype, block_size), torch.device("cpu"))
    common = CommonAttentionMetadata.from_lens(
        batch.spec.query_lens, batch.spec.seq_lens, batch.block_table, batch.slot_mapping,
        block_size=block_size,
    )
    return builder, builder.build(common_prefix_len=0, common_attn_metadata=common)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("batch_name", BATCH_SPECS)
def test_decoder_forward_writes_cache_and_matches_reference(batch_name, feature, dtype):
    block_size = 16
    batch = make_paged_batch(BATCH_SPECS[batch_name], num_heads=H, num_kv_heads=HKV, head_size=D,
                             block_size=block_size, dtype=dtype, seed=1)
    impl = make_impl(**FEATURES[feature])
    _, metadata = build_metadata(batch, dtype, block_size, FEATURES[feature].get("sliding_window"))
    kv_cache = context_only_kv_cache(batch)
    output = torch.full_like(batch.query, math.nan)
    returned = impl.forward(None, batch.query, batch.new_keys, batch.new_values, kv_cache,
                            metadata, output=output)
    assert returned is output
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(output.float(), reference_for(impl, batch), atol=atol, rtol=rtol)
    # The cache now holds exactly what the reference read (unused slots stay NaN).
    assert torch.equal(kv_cache[0].nan_to_num(7.0), batch.key_cache.nan_to_num(7.0))
    assert torch.equal(kv_cache[1].nan_to_num(7.0), batch.value_cache.nan_to_num(7.0))


# Decodes first, then prefills: fresh, with cached context (chunked prefill / prefix hit),
# long and short interleaved. Every one of them runs on the kernel, in one plan.
MIXED_PREFILLS = BatchSpec("mixed_prefills", (70, 9, 40, 150, 7, 60), (1, 1, 40, 53, 7, 60))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("feature", FEATURES)
def test_step_of_decodes_and_long_prefills_matches_reference(feature, dtype):
    block_size = 16
    batch = make_paged_batch(MIXED_PREFILLS, num_heads=H, num_kv_heads=HKV, head_size=D,
                             block_size=block_size, dtype=dtype, seed=2)
    impl = make_impl(**FEATURES[feature])
    _, metadata = build_metadata(batch, dtype, block_size, FEATURES[feature].get("sliding_window"))
    output = torch.full_like(batch.query, math.nan)
    impl.forward(None, batch.query, batch.new_keys, batch.new_values,
                 context_only_kv_cache(batch), metadata, output=output)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(output.float(), reference_for(impl, batch), **tol)


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.ENCODER])
@pytest.mark.parametrize("feature", ["plain", "window", "alibi", "softcap", "sinks"])
def test_encoder_attention_is_bidirectional_and_cache_free(attn_type, feature):
    dtype = torch.float32
    spec = BatchSpec("encoder", (30, 17, 45), (30, 17, 45))
    batch = make_paged_batch(spec, num_heads=H, num_kv_heads=HKV, head_size=D, block_size=16,
                             dtype=dtype, seed=4)
    impl = make_impl(attn_type=attn_type, **FEATURES[feature])
    builder_spec = AttentionSpec(16, HKV, D, dtype)
    builder = CPUAttentionMetadataBuilder(builder_spec, ["enc"], engine_config(dtype, 16), torch.device("cpu"))
    common = CommonAttentionMetadata.from_lens(spec.query_lens, spec.seq_lens, causal=False, block_size=16)
    metadata = builder.build(0, common)
    poisoned_cache = torch.full((2, 1, HKV, 16, D), math.nan)
    output = torch.full_like(batch.query, math.nan)
    impl.forward(None, batch.query, batch.new_keys, batch.new_values, poisoned_cache, metadata, output=output)
    want = reference_for(impl, batch, causal=False)
    torch.testing.assert_close(output, want, **FP32_TOL)
    if feature == "window":  # the seed's pairs: only encoder-only layers look both ways
        assert impl.sliding_window == ((23, 23) if attn_type == AttentionType.ENCODER_ONLY
                                       else (23, 0))


def test_cross_attention_writes_encoder_kv_once_then_reads_the_cache():
    dtype, block_size = torch.bfloat16, 16
    enc_lens, dec_q_step1, dec_seq_step1 = (24, 40), (5, 3), (5, 3)
    enc = make_paged_batch(BatchSpec("enc", enc_lens, enc_lens), num_heads=H, num_kv_heads=HKV,
                           head_size=D, block_size=block_size, dtype=dtype, seed=5)
    spec = CrossAttentionSpec(block_size, HKV, D, dtype, max_encoder_len=64)
    builder = CPUAttentionMetadataBuilder(spec, ["cross"], engine_config(dtype, block_size), torch.device("cpu"))
    impl = make_impl(attn_type=AttentionType.ENCODER_DECODER)
    kv_cache = torch.full((2, *enc.key_cache.shape), math.nan, dtype=dtype)

    def step(query_lens, seq_lens, key, value, slot_mapping):
        common = CommonAttentionMetadata.from_lens(
            query_lens, seq_lens, enc.block_table, slot_mapping, block_size=block_size)
        common = dataclasses.replace(common, encoder_seq_lens=torch.tensor(enc_lens, dtype=torch.int32))
        metadata = builder.build(0, common)
        assert metadata.causal is False
        query = torch.randn(sum(query_lens), H, D).to(dtype)
        output = torch.empty_like(query)
        impl.forward(None, query, key, value, kv_cache, metadata, output=output)
        want = []
        for r, q in enumerate(query.split(list(query_lens))):  # dense, non-causal
            out = F.scaled_dot_product_attention(
                q.float().transpose(0, 1), enc.keys[r].float().transpose(0, 1),
                enc.values[r].float().transpose(0, 1), scale=impl.scale, enable_gqa=True)
            want.append(out.transpose(0, 1))
        torch.testing.assert_close(output.float(), torch.cat(want), **BF16_TOL)

    # Step 1 (prefill of the decoder): the encoder's K/V arrive and are cached.
    step(dec_q_step1, dec_seq_step1, enc.new_keys, enc.new_values, enc.slot_mapping)
    assert torch.equal(kv_cache[0].nan_to_num(7.0), enc.key_cache.nan_to_num(7.0))
    assert torch.equal(kv_cache[1].nan_to_num(7.0), enc.value_cache.nan_to_num(7.0))
    # Step 2 (decode): key/value are None; only the cache is read.
    step((1, 1), (6, 4), None, None, torch.full((2,), -1))
    # More decoder queries than encoder keys (the kernel alone would reject it).
    step((30, 2), (30, 6), None, None, torch.full((32,), -1))


def test_kv_sharing_layer_does_not_write_the_cache():
    batch = make_paged_batch(BATCH_SPECS["mixed"], num_heads=H, num_kv_heads=HKV, head_size=D,
                             block_size=16, dtype=torch.float32)
    _, metadata = build_metadata(batch, torch.float32, 16)
    impl = make_impl(kv_sharing_target_layer_name="layers.0.attn")
    kv_cache = torch.stack([batch.key_cache, batch.value_cache])
    before = kv_cache.clone()
    garbage = torch.full_like(batch.new_keys, 1e4)
    output = torch.empty_like(batch.query)
    impl.forward(None, batch.query, garbage, garbage, kv_cache, metadata, output=output)
    assert torch.equal(kv_cache.nan_to_num(0.5), before.nan_to_num(0.5))
    torch.testing.assert_close(output, reference_for(impl, batch), **FP32_TOL)


def test_warm_up_call_without_metadata_leaves_output_untouched():
    impl = make_impl()
    output = torch.full((4, H, D), 3.0)
    assert impl.forward(None, torch.zeros(4, H, D), None, None, torch.zeros(2, 1, HKV, 16, D),
                        None, output=output) is output
    assert torch.all(output == 3.0)


def test_unsupported_features_raise_clear_errors():
    with pytest.raises(NotImplementedError, match="kv_cache_dtype 'fp8_inc' is unsupported in CPU_ATTN"):
        make_impl(kv_cache_dtype="fp8_inc")
    impl = make_impl()
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(None, torch.zeros(1, H, D), None, None, torch.zeros(2, 1, HKV, 16, D), None,
                     output=torch.zeros(1, H, D), output_scale=torch.ones(1))
    with pytest.raises(ValueError, match="output=None"):
        impl.forward(None, torch.zeros(1, H, D), None, None, torch.zeros(2, 1, HKV, 16, D), None)
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads=8\], got \(4,\)"):
        CPUAttentionBackendImpl(H, D, 0.1, HKV, None, None, "auto", sinks=torch.zeros(4))
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be a positive multiple of num_kv_heads \(3\)"):
        CPUAttentionBackendImpl(H, D, 0.1, 3, None, None, "auto")
    with pytest.raises(ValueError, match="cross attention needs common_attn_metadata.encoder_seq_lens"):
        spec = CrossAttentionSpec(16, HKV, D, torch.float32)
        builder = CPUAttentionMetadataBuilder(spec, ["x"], engine_config(torch.float32, 16), torch.device("cpu"))
        builder.build(0, CommonAttentionMetadata.from_lens([1], [5], block_size=16))


def test_backend_class_contract():
    assert CPUAttentionBackend.get_name() == "CPU_ATTN"
    assert CPUAttentionBackend.get_kv_cache_shape(10, 16, 4, 128) == (2, 10, 4, 16, 128)
    assert CPUAttentionBackend.get_impl_cls() is CPUAttentionBackendImpl
    assert CPUAttentionBackend.get_builder_cls() is CPUAttentionMetadataBuilder
    for attn_type in AttentionType:
        assert CPUAttentionBackend.supports_attn_type(attn_type)
    assert CPUAttentionBackend.validate_configuration(
        head_size=80, dtype=torch.float16, kv_cache_dtype="auto", block_size=32, use_mla=False,
        has_sink=True, use_sparse=False, use_mm_prefix=False, device_capability=(0, 0),
        attn_type=AttentionType.DECODER) == []
    assert CPUAttentionBackend.validate_configuration(
        head_size=36, dtype=torch.float16, kv_cache_dtype="fp8_inc", block_size=24, use_mla=False,
        has_sink=False, use_sparse=False, use_mm_prefix=False, device_capability=(0, 0),
        attn_type=AttentionType.DECODER) == [
        "head_size not supported", "kv_cache_dtype not supported", "block_size not supported"]


@pytest.mark.skipif(ops.on_arm(), reason="on Arm every block size runs the neon variant")
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_builder_picks_hint_and_decode_first_threshold(block_size, monkeypatch):
    # One vector variant for every block size (the kernels read it from the cache) when
    # prefills are forced onto the vector kernels.
    hint = IsaHint.VEC16
    monkeypatch.setenv(cpu_runtime.PREFILL_KERNEL_ENV, "vector")
    batch = make_paged_batch(BATCH_SPECS["decode"], num_heads=H, num_kv_heads=HKV, head_size=D,
                             block_size=block_size, dtype=torch.float32)
    builder, metadata = build_metadata(batch, torch.float32, block_size)
    assert builder.reorder_batch_threshold == 1
    assert metadata.isa is hint  # the enum member, parsed once by the builder
    assert metadata.scheduler_metadata is not None


@pytest.mark.skipif(not ops.matrix_engine_available(), reason="torch's brgemm does not run here")
def test_builder_takes_the_measured_prefill_kernel(monkeypatch):
    """The builder plans with prefill_variant's choice: forced here both ways, and measured
    (and recorded in pagedattn.tuning, which `pagedattn info` prints) otherwise."""
    batch = make_paged_batch(BATCH_SPECS["prefill"], num_heads=H, num_kv_heads=HKV, head_size=D,
                             block_size=16, dtype=torch.float32)
    for forced, hint in (("matrix", IsaHint.AMX), ("vector", IsaHint.VEC16)):
        monkeypatch.setenv(cpu_runtime.PREFILL_KERNEL_ENV, forced)
        assert build_metadata(batch, torch.float32, 16)[1].isa is hint
    monkeypatch.delenv(cpu_runtime.PREFILL_KERNEL_ENV)
    isa = build_metadata(batch, torch.float32, 16)[1].isa
    choice = tuning.recorded("attention-prefill", f"float32 cache float32 heads {H}/{HKV} x {D} block 16")
    assert choice is not None and choice.source in ("measured", "cached")
    assert isa is {"matrix": IsaHint.AMX, "vector": IsaHint.VEC16}[choice.chosen]
    monkeypatch.setenv(cpu_runtime.PREFILL_KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="PAGEDATTN_PREFILL_KERNEL='fastest'"):
        build_metadata(batch, torch.float32, 16)


def test_metadata_is_frozen_and_sdpa_biases_live_with_the_step():
    spec = BatchSpec("encoder", (40, 23), (40, 23))
    batch = make_paged_batch(spec, num_heads=H, num_kv_heads=HKV, head_size=D, block_size=16,
                             dtype=torch.float32)
    builder = CPUAttentionMetadataBuilder(AttentionSpec(16, HKV, D, torch.float32), ["enc"],
                                          engine_config(torch.float32, 16), torch.device("cpu"))

    def plan():
        return builder.build(0, CommonAttentionMetadata.from_lens(
            spec.query_lens, spec.seq_lens, causal=False, block_size=16))

    metadata = plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        metadata.sdpa = None
    cache = torch.full((2, 1, HKV, 16, D), math.nan)
    layers = [make_impl(AttentionType.ENCODER_ONLY, alibi=True) for _ in range(2)]
    for impl in layers:  # same config: one bias per length
        output = torch.empty_like(batch.query)
        impl.forward(None, batch.query, batch.new_keys, batch.new_values, cache, metadata,
                     output=output)
        torch.testing.assert_close(output, reference_for(impl, batch, causal=False), **FP32_TOL)
    # One bias per sequence length, kept by the step's plan (and dropped with it); the
    # next step's plan starts with none.
    assert sorted(key[1] for key in metadata.sdpa_biases) == [23, 40]
    assert plan().sdpa_biases == {}


@pytest.mark.parametrize("attn_type, window, expected", [
    (AttentionType.DECODER, 24, (23, 0)),
    (AttentionType.ENCODER, 24, (23, 0)),
    (AttentionType.ENCODER_DECODER, 24, (23, 0)),
    (AttentionType.ENCODER_ONLY, 24, (23, 23)),
    (AttentionType.DECODER, None, (-1, -1)),
    (AttentionType.ENCODER_ONLY, None, (-1, -1)),
])
def test_impl_window_pair_is_the_interface_contract(attn_type, window, expected):
    """The impl's public ``sliding_window`` is the seed's pair for every attention type:
    only encoder-only layers see the window on both sides."""
    assert make_impl(attn_type=attn_type, sliding_window=window).sliding_window == expected
