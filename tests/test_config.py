"""Config objects and KV-cache specs validate at construction."""

import pytest
import torch

from pagedattn.config import (
    CacheConfig,
    CacheDType,
    DeviceCapability,
    BuilderConfig,
    KVCacheLayoutType,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from pagedattn.kv_cache_spec import AttentionSpec, CrossAttentionSpec, EncoderOnlyAttentionSpec


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128, 256])
def test_cache_config_accepts_every_block_size_of_the_literal(block_size):
    assert CacheConfig(block_size=block_size).block_size == block_size


@pytest.mark.parametrize("block_size", [48, 80, 320, 512])
def test_cache_config_accepts_every_block_size_the_kernels_run(block_size):
    assert CacheConfig(block_size=block_size).block_size == block_size


@pytest.mark.parametrize("block_size", [0, 2, 24, 40, 528, 1024, -16])
def test_cache_config_rejects_block_size_outside_literal_and_kernel_sizes(block_size):
    with pytest.raises(ValueError, match=f"block_size must be one of .* got {block_size}"):
        CacheConfig(block_size=block_size)


def test_cache_dtype_parses_strings_once_and_compares_equal_to_them():
    cfg = CacheConfig(cache_dtype="fp8_e5m2")
    assert cfg.cache_dtype is CacheDType.FP8_E5M2 and cfg.cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match=r"invalid CacheDType 'int4'; expected one of 'auto'"):
        CacheConfig(cache_dtype="int4")
    assert KVCacheLayoutType.parse("HND") is KVCacheLayoutType.HND


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_attention_heads=0), "num_heads must be a positive int, got 0"),
        (dict(num_kv_heads=-2), "num_kv_heads must be a positive int, got -2"),
        (dict(num_attention_heads=12, num_kv_heads=5), r"num_heads \(12\) must be divisible by num_kv_heads \(5\)"),
        (dict(head_size=0), "head_size must be a positive int, got 0"),
        (dict(dtype=torch.int8), "model dtype must be one of"),
    ],
)
def test_model_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_model_config_heads_per_tensor_parallel_rank():
    model = ModelConfig(num_attention_heads=32, num_kv_heads=8)
    assert model.get_num_attention_heads(ParallelConfig(tensor_parallel_size=4)) == 8
    assert model.get_num_kv_heads(ParallelConfig(tensor_parallel_size=4)) == 2
    # More ranks than KV heads: each rank keeps (a replica of) one KV head.
    assert model.get_num_kv_heads(ParallelConfig(tensor_parallel_size=16)) == 1


def test_parallel_and_speculative_configs_validate():
    with pytest.raises(ValueError, match="decode_context_parallel_size must be a positive int, got 0"):
        ParallelConfig(decode_context_parallel_size=0)
    with pytest.raises(ValueError, match="num_speculative_tokens must be None or an int >= 0, got -1"):
        SpeculativeConfig(num_speculative_tokens=-1)


def test_engine_config_type_checks_members_and_alias():
    assert VllmConfig is BuilderConfig
    cfg = BuilderConfig(speculative_config=SpeculativeConfig(2))
    assert cfg.speculative_config.num_speculative_tokens == 2
    with pytest.raises(TypeError, match="cache_config must be a CacheConfig, got dict"):
        BuilderConfig(cache_config={"block_size": 16})


def test_device_capability():
    cap = DeviceCapability(9, 0)
    assert cap.as_version_str() == "9.0" and cap.to_int() == 90
    assert DeviceCapability(8, 6) > DeviceCapability(8, 0)


def test_attention_spec_validates_and_sizes_pages():
    spec = AttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2
    cfg = BuilderConfig(model_config=ModelConfig(max_model_len=1000))
    assert spec.max_memory_usage_bytes(cfg) == 63 * spec.page_size_bytes  # ceil(1000/16)
    windowed = AttentionSpec(16, 8, 128, torch.bfloat16, sliding_window=100)
    assert windowed.max_memory_usage_bytes(cfg) == 8 * spec.page_size_bytes  # ceil(115/16)
    with pytest.raises(ValueError, match="block_size must be one of"):
        AttentionSpec(block_size=12, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int, got 0"):
        AttentionSpec(block_size=16, num_kv_heads=0, head_size=128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KV cache dtype must be one of"):
        AttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.int32)


def test_cross_and_encoder_only_specs():
    cfg = BuilderConfig()
    cross = CrossAttentionSpec(16, 8, 64, torch.float32, max_encoder_len=100)
    assert cross.max_memory_usage_bytes(cfg) == 7 * cross.page_size_bytes
    with pytest.raises(ValueError, match="cross attention has no sliding window"):
        CrossAttentionSpec(16, 8, 64, torch.float32, sliding_window=4)
    assert EncoderOnlyAttentionSpec(16, 8, 64, torch.float32).max_memory_usage_bytes(cfg) == 0
