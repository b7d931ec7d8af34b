"""KV-cache specifications: what one attention layer stores per block.

A spec is what a metadata builder receives as ``kv_cache_spec``; it fixes the block
geometry (``block_size`` tokens x ``num_kv_heads`` x ``head_size``) and storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.config import BuilderConfig, _require_positive, validate_block_size
from pagedattn.paging import cdiv

_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8,
              torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class AttentionSpec:
    """Block geometry of a self-attention (decoder) layer's paged KV cache.

    ``sliding_window``: the layer's window in tokens (``None`` = full attention); a
    sliding-window layer never needs more than ``sliding_window - 1 + block_size`` tokens
    per request resident.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        validate_block_size(self.block_size)
        _require_positive("num_kv_heads", self.num_kv_heads)
        _require_positive("head_size", self.head_size)
        if self.dtype not in _KV_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {_KV_DTYPES}, got {self.dtype!r}")
        if self.sliding_window is not None:
            _require_positive("sliding_window", self.sliding_window)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block holding both K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize

    def max_tokens_resident(self, config: BuilderConfig) -> int:
        """Most tokens of one request this layer must keep in the cache."""
        max_len = config.model_config.max_model_len
        if self.sliding_window is not None:
            return min(max_len, self.sliding_window - 1 + self.block_size)
        return max_len

    def max_memory_usage_bytes(self, config: BuilderConfig) -> int:
        """Upper bound of cache bytes one request of maximal length needs."""
        return cdiv(self.max_tokens_resident(config), self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder-to-encoder attention: the cache holds the encoder's K/V, written once."""

    max_encoder_len: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None:
            raise ValueError(
                f"cross attention has no sliding window, got sliding_window={self.sliding_window}"
            )
        if self.max_encoder_len < 0:
            raise ValueError(f"max_encoder_len must be >= 0, got {self.max_encoder_len}")

    def max_tokens_resident(self, config: BuilderConfig) -> int:
        return self.max_encoder_len or config.model_config.max_model_len


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional encoder self-attention: K/V live only within one forward pass,
    so the layer needs no persistent cache."""

    def max_memory_usage_bytes(self, config: BuilderConfig) -> int:
        return 0
