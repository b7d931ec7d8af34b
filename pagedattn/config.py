"""Configuration objects that attention metadata builders receive.

These mirror the parts of vLLM's ``VllmConfig`` that attention backends read, as plain
dataclasses validated at construction so a bad value fails where it is written, not deep
inside a kernel.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, get_args

import torch

from pagedattn.checks import require_int
from pagedattn.ops import kernel_shapes

BlockSize = Literal[1, 8, 16, 32, 64, 128, 256]
"""vLLM's framework-level KV-cache block sizes (tokens per block)."""

CONFIGURABLE_BLOCK_SIZES: tuple[int, ...] = tuple(
    sorted(set(get_args(BlockSize)) | set(kernel_shapes.SUPPORTED_BLOCK_SIZES))
)
"""Block sizes a ``CacheConfig`` takes: the ``BlockSize`` literal and every size the native
kernels run (:mod:`pagedattn.ops.kernel_shapes`, e.g. 48 or 512)."""

SUPPORTED_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _ParsableStrEnum(str, enum.Enum):
    """A str-valued enum that compares equal to its string value and parses once."""

    @classmethod
    def parse(cls, value: "str | _ParsableStrEnum") -> "_ParsableStrEnum":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in cls)
            raise ValueError(
                f"invalid {cls.__name__} {value!r}; expected one of {valid}"
            ) from None

    def __str__(self) -> str:  # print the plain value, like the vLLM literal would
        return str(self.value)


class CacheDType(_ParsableStrEnum):
    """Storage dtype of the KV cache. ``AUTO`` stores in the model dtype."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    FP8_INC = "fp8_inc"
    FP8_DS_MLA = "fp8_ds_mla"


class KVCacheLayoutType(_ParsableStrEnum):
    """Physical layout of one KV block: tokens-major (NHD) or heads-major (HND)."""

    NHD = "NHD"
    HND = "HND"


class DeviceCapability(NamedTuple):
    """Compute capability of an accelerator (``major.minor``); CPUs report ``(0, 0)``."""

    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        """``major * 10 + minor``, e.g. 90 for sm_90; only for single-digit minors."""
        if not 0 <= self.minor < 10:
            raise ValueError(f"minor must be in [0, 10), got {self.minor}")
        return self.major * 10 + self.minor


def current_device_capability(device: torch.device | str | None = None) -> DeviceCapability:
    """Capability of ``device`` (default: CUDA if available, else CPU = (0, 0))."""
    device = torch.device(device) if device is not None else None
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda")
    if device is not None and device.type == "cuda":
        return DeviceCapability(*torch.cuda.get_device_capability(device))
    return DeviceCapability(0, 0)


def _require_positive(name: str, value: int) -> None:
    require_int(name, value, 1, expected="a positive int")


def validate_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or block_size not in CONFIGURABLE_BLOCK_SIZES:
        raise ValueError(
            f"block_size must be one of the BlockSize literal {get_args(BlockSize)} or a size "
            f"the kernels run ({kernel_shapes.BLOCK_SIZE_RULE}), got {block_size!r}"
        )
    return block_size


def validate_head_counts(num_heads: int, num_kv_heads: int) -> None:
    _require_positive("num_heads", num_heads)
    _require_positive("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )


@dataclass(frozen=True)
class ModelConfig:
    """What attention needs to know about the model.

    ``hf_text_config`` is an optional HF-style config object (any attribute bag) read
    by helpers such as ``get_mla_dims``.
    """

    dtype: torch.dtype = torch.bfloat16
    num_attention_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    max_model_len: int = 8192
    hf_text_config: Any = None

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_MODEL_DTYPES:
            raise ValueError(
                f"model dtype must be one of {SUPPORTED_MODEL_DTYPES}, got {self.dtype!r}"
            )
        validate_head_counts(self.num_attention_heads, self.num_kv_heads)
        _require_positive("head_size", self.head_size)
        _require_positive("max_model_len", self.max_model_len)

    def get_num_attention_heads(self, parallel_config: "ParallelConfig") -> int:
        """Query heads held by one tensor-parallel rank."""
        return max(1, self.num_attention_heads // parallel_config.tensor_parallel_size)

    def get_num_kv_heads(self, parallel_config: "ParallelConfig") -> int:
        """KV heads held by one tensor-parallel rank (replicated when TP > num_kv_heads)."""
        return max(1, self.num_kv_heads // parallel_config.tensor_parallel_size)

    def get_head_size(self) -> int:
        return self.head_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    cache_dtype: CacheDType = CacheDType.AUTO

    def __post_init__(self) -> None:
        validate_block_size(self.block_size)
        object.__setattr__(self, "cache_dtype", CacheDType.parse(self.cache_dtype))


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require_positive("tensor_parallel_size", self.tensor_parallel_size)
        _require_positive("decode_context_parallel_size", self.decode_context_parallel_size)
        _require_positive("prefill_context_parallel_size", self.prefill_context_parallel_size)


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        require_int("num_speculative_tokens", self.num_speculative_tokens, 0, allow_none=True)


@dataclass(frozen=True)
class BuilderConfig:
    """The config a metadata builder receives (vLLM's ``VllmConfig``): the model's attention
    geometry, the cache and the parallelism. The engine's own settings are
    ``pagedattn.engine.EngineArgs``; the engine derives one of these from them."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name, cls in (
            ("model_config", ModelConfig),
            ("cache_config", CacheConfig),
            ("parallel_config", ParallelConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(
                    f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}"
                )
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise TypeError(
                f"speculative_config must be a SpeculativeConfig or None, got {type(spec).__name__}"
            )


VllmConfig = BuilderConfig
"""Alias so code written against vLLM's builder signature ports by changing imports."""
