"""Shared set-up of the GPU-backend tests: configs, paged batches in the flash layout
with only the context cached, and the reference output."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from pagedattn.backend import CommonAttentionMetadata
from pagedattn.config import CacheConfig, BuilderConfig, ModelConfig
from pagedattn.kv_cache_spec import AttentionSpec
from pagedattn.ops import reference as ref
from pagedattn.testing import make_paged_batch


def engine_config(dtype, block_size, num_heads, num_kv_heads, head_size):
    return BuilderConfig(
        model_config=ModelConfig(dtype=dtype, num_attention_heads=num_heads,
                                 num_kv_heads=num_kv_heads, head_size=head_size),
        cache_config=CacheConfig(block_size=block_size),
    )


def build(builder_cls, batch, *, dtype, block_size, num_heads, num_kv_heads, head_size,
          device, sliding_window=None):
    """``(builder, metadata)`` for ``batch`` through ``CommonAttentionMetadata``."""
    spec = AttentionSpec(block_size, num_kv_heads, head_size, dtype,
                         sliding_window=sliding_window)
    builder = builder_cls(spec, ["layer0"],
                          engine_config(dtype, block_size, num_heads, num_kv_heads, head_size),
                          device)
    common = CommonAttentionMetadata.from_lens(
        batch.spec.query_lens, batch.spec.seq_lens, batch.block_table, batch.slot_mapping,
        device=device, block_size=block_size)
    return builder, builder.build(common_prefix_len=0, common_attn_metadata=common)


def flash_batch(spec, *, dtype, block_size, num_heads, num_kv_heads, head_size, seed=1):
    return make_paged_batch(spec, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_size=head_size, block_size=block_size, dtype=dtype,
                            layout="flash", seed=seed)


def context_only_kv_cache(batch, cache_dtype=None, k_scale=1.0, v_scale=1.0):
    """``[2, nb, bs, nkv, hs]`` cache holding the context only: the new tokens' slots
    are NaN, so forward must write them before it attends. With an fp8 ``cache_dtype``
    the context is stored quantized (``x / scale``, saturated) as the cache writer
    would have stored it; NaN slots become fp8 NaN."""
    kv = torch.stack([batch.key_cache, batch.value_cache]).float()
    bs = kv.shape[2]
    for slot in batch.slot_mapping.tolist():
        kv[:, slot // bs, slot % bs] = math.nan
    return _as_cache(kv, batch, cache_dtype, k_scale, v_scale)


def _as_cache(kv, batch, cache_dtype, k_scale, v_scale):
    """``kv`` (float) as the cache stores it: the batch's dtype, or fp8 of ``x / scale``."""
    if cache_dtype is None:
        return kv.to(batch.key_cache.dtype)
    fmax = torch.finfo(cache_dtype).max
    kv[0] = (kv[0] / k_scale).clamp(-fmax, fmax)
    kv[1] = (kv[1] / v_scale).clamp(-fmax, fmax)
    return kv.to(cache_dtype)


def full_kv_cache(batch, cache_dtype=None, k_scale=1.0, v_scale=1.0):
    """What the cache must hold after forward (same quantization as above)."""
    kv = torch.stack([batch.key_cache, batch.value_cache]).float()
    return _as_cache(kv, batch, cache_dtype, k_scale, v_scale)


def reference_output(impl, batch, kv_cache, k_scale=1.0, v_scale=1.0):
    """The reference over the (dequantized) full cache, fp32."""
    key_cache = kv_cache[0].float() * k_scale
    value_cache = kv_cache[1].float() * v_scale
    return ref.paged_attention(
        batch.query.float(), key_cache, value_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_table, scale=impl.scale, causal=True, sliding_window=impl.sliding_window,
        softcap=impl.logits_soft_cap, alibi_slopes=_cpu(impl.alibi_slopes),
        s_aux=_cpu(getattr(impl, "sinks", None)), layout="flash")


def _cpu(t):
    return None if t is None else t.cpu()


def layer_with_scales(k_scale, v_scale, device):
    """Stand-in for the attention layer: the fp32 K/V scales forward reads."""
    return SimpleNamespace(_k_scale=torch.tensor(k_scale, device=device),
                           _v_scale=torch.tensor(v_scale, device=device),
                           _k_scale_float=k_scale, _v_scale_float=v_scale)
