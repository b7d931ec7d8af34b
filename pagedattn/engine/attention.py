"""The engine's attention stack: the backend, the cache spec, one metadata builder for the
whole model (planned once per step) and one impl per layer (run per layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn import registry
from pagedattn.backend import AttentionType, ModelAttention
from pagedattn.config import BuilderConfig, CacheConfig, ModelConfig
from pagedattn.engine.args import EngineArgs
from pagedattn.kv_cache_spec import AttentionSpec, EncoderOnlyAttentionSpec


@dataclass(frozen=True)
class AttentionGeometry:
    """What attention needs to know of a model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    attn_type: str  # AttentionType.DECODER or ENCODER_ONLY
    layer_windows: tuple[int | None, ...] | None = None
    """Per-layer windows (``None`` in it = full attention) where layers differ (Gemma 3:
    five sliding layers, then a global one); ``None``: every layer has ``sliding_window``."""
    scale: float | None = None
    """Softmax scale; ``None`` = ``head_dim ** -0.5``."""
    logits_soft_cap: float | None = None

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def cache_window(self) -> int | None:
        """The window the KV cache spec (and the step plan's load-balancing hint) gets: the
        common one, or ``None`` when any layer attends to everything. With ``None`` every
        layer keeps every block of a request: a sliding layer's kernel masks the keys
        outside its window, so the result is exact and only memory is spent."""
        windows = {self.window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None


@dataclass(frozen=True)
class AttentionStack:
    backend_cls: type
    spec: AttentionSpec
    builder: object
    impls: list
    prefill_plan: str = ""
    """The choices the backend made for this model, and why (its ``prepare_for_model``)."""

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.spec
        return self.backend_cls.get_kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads,
                                                   s.head_size)


def build_attention(args: EngineArgs, geo: AttentionGeometry, max_model_len: int) -> AttentionStack:
    """Select the backend for ``args`` and build the builder and per-layer impls."""
    selector = registry.default_selector_config(
        geo.head_dim, args.dtype, block_size=args.block_size, attn_type=geo.attn_type,
        device="cpu", kv_cache_dtype=args.kv_cache_dtype)
    backend_cls = registry.select_backend(selector, args.backend)
    spec_cls = EncoderOnlyAttentionSpec if geo.attn_type == AttentionType.ENCODER_ONLY else AttentionSpec
    spec = spec_cls(block_size=args.block_size, num_kv_heads=geo.num_kv_heads,
                    head_size=geo.head_dim, dtype=args.cache_dtype,
                    sliding_window=geo.cache_window)
    builder_config = BuilderConfig(
        model_config=ModelConfig(dtype=args.dtype, num_attention_heads=geo.num_heads,
                                 num_kv_heads=geo.num_kv_heads, head_size=geo.head_dim,
                                 max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=args.block_size, cache_dtype=args.kv_cache_dtype))
    names = [f"layers.{i}.attn" for i in range(geo.num_layers)]
    prepared = backend_cls.prepare_for_model(ModelAttention(
        num_heads=geo.num_heads, num_kv_heads=geo.num_kv_heads, head_size=geo.head_dim,
        dtype=args.dtype, cache_dtype=args.cache_dtype, block_size=args.block_size,
        attn_type=geo.attn_type, sliding_window=geo.cache_window,
        batch_invariant=args.batch_invariant,
        shared_prefix_attention=args.shared_prefix_attention))
    builder = backend_cls.get_builder_cls()(spec, names, builder_config, torch.device("cpu"),
                                            **prepared.builder_kwargs)
    scale = geo.head_dim ** -0.5 if geo.scale is None else geo.scale
    impls = [backend_cls.get_impl_cls()(geo.num_heads, geo.head_dim, scale, geo.num_kv_heads,
                                        None, geo.window(i), args.kv_cache_dtype,
                                        logits_soft_cap=geo.logits_soft_cap,
                                        attn_type=geo.attn_type)
             for i in range(geo.num_layers)]
    return AttentionStack(backend_cls, spec, builder, impls, "; ".join(prepared.choices))
