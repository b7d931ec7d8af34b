"""The attention-backend interface (vLLM ``v1/attention/backend.py`` shape).

A backend is a class of capabilities (``supports_*`` / ``validate_configuration``) that
names three collaborators:

* ``get_builder_cls()`` -> an ``AttentionMetadataBuilder``, which turns one batch's
  ``CommonAttentionMetadata`` into the backend's own immutable metadata (plan), and
* ``get_impl_cls()`` -> an ``AttentionImpl``, whose ``forward`` consumes that metadata
  (run), and
* ``get_kv_cache_shape()``, the logical shape of one layer's paged KV cache.

Code written against vLLM's interface ports by changing imports: ``VllmConfig`` is
``pagedattn.config.BuilderConfig`` and the parallel state lives in
``pagedattn.distributed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Generic, Protocol, TypeVar, get_args

import numpy as np
import torch

from pagedattn import distributed
from pagedattn.checks import require_int
from pagedattn.common_metadata import CommonAttentionMetadata
from pagedattn.config import (
    CONFIGURABLE_BLOCK_SIZES,
    BlockSize,
    CacheDType,
    DeviceCapability,
    BuilderConfig,
    KVCacheLayoutType,
    _ParsableStrEnum,
)
from pagedattn.kv_cache_spec import AttentionSpec

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "CommonAttentionMetadata",
    "M",
    "MLAAttentionImpl",
    "MultipleOf",
    "T",
    "is_quantized_kv_cache",
    "subclass_attention_backend",
    "subclass_attention_backend_with_overrides",
]


@dataclass(frozen=True)
class MultipleOf:
    """A kernel block-size requirement: any block size divisible by ``base``.

    ``MultipleOf(16)`` accepts 16, 32, 48, ...; compare with a plain ``16`` in
    ``get_supported_kernel_block_sizes``, which (with hybrid blocks) accepts the same
    framework block sizes but asks the kernel to see exactly 16-token blocks.
    """

    base: int

    def __post_init__(self) -> None:
        require_int("MultipleOf base", self.base, 1)


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """Whether the cache stores a dtype other than the model's (``"auto"``).

    Accepts a ``CacheDType`` or its string value; an unknown name raises ``ValueError``
    listing the valid ones (instead of being silently treated as quantized).
    """
    return CacheDType.parse(kv_cache_dtype) is not CacheDType.AUTO


def check_request_tensors(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_table: torch.Tensor) -> None:
    """Raise ``ValueError`` unless a step's per-request tensors agree: ``num_reqs + 1``
    query offsets for the ``num_reqs = seq_lens.numel()`` requests, and a 2-D block table
    with a row for each (more rows are padding)."""
    num_reqs = seq_lens.numel()
    if query_start_loc.numel() != num_reqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.numel()} entries for "
                         f"{num_reqs} requests (expected {num_reqs + 1})")
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table must have at least {num_reqs} rows, got shape "
                         f"{tuple(block_table.shape)}")


def flash_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                         cache_dtype_str: str = "auto") -> tuple[int, ...]:
    """``(2, num_blocks, block_size, num_kv_heads, head_size)`` (K then V): the
    flash-attention cache layout, as a ``get_kv_cache_shape`` for the backends whose
    kernels read it (the cache dtype does not change it)."""
    return 2, num_blocks, block_size, num_kv_heads, head_size


class AttentionType(_ParsableStrEnum):
    """Attention type. A ``str`` enum so it stays a constant under ``torch.compile``.

    ``str(AttentionType.ENCODER)`` and f-strings give the plain value (``"encoder"``),
    so messages read the same whether the caller passed the member or its string.
    """

    DECODER = "decoder"
    """Decoder self-attention between the previous layer's Q/K/V (causal, cached)."""
    ENCODER = "encoder"
    """Encoder self-attention of an encoder-decoder model."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional self-attention of an encoder-only model (no persistent cache)."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention: decoder Q against the encoder's K/V."""


class AttentionCGSupport(Enum):
    """How far a builder supports CUDA-graph capture (cascade attention never does).

    Ordered: a larger value supports a superset of the batches of a smaller one.
    """

    ALWAYS = 3
    """Any batch, including mixed prefill and decode."""
    UNIFORM_BATCH = 2
    """Batches whose requests all have the same query length (e.g. spec-decode, where
    every "decode" has ``1 + num_speculative_tokens`` tokens)."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Batches of ``query_len == 1`` decodes only."""
    NEVER = 0
    """No CUDA-graph support."""


class AttentionMetadata:
    """Base of every backend's per-layer metadata (a marker type)."""


T = TypeVar("T", bound=AttentionMetadata)
M = TypeVar("M")


@dataclass(frozen=True)
class ModelAttention:
    """What an engine tells a backend about a model when it loads it (see
    :meth:`AttentionBackend.prepare_for_model`). ``batch_invariant`` and
    ``shared_prefix_attention`` are the engine's options, passed through as values."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    block_size: int
    attn_type: str
    sliding_window: int | None = None
    batch_invariant: bool = False
    shared_prefix_attention: bool = True


@dataclass(frozen=True)
class ModelPreparation:
    """A backend's answer to :meth:`AttentionBackend.prepare_for_model`: keyword arguments
    for its metadata builder, and one line per choice made (printed by ``generate
    --verbose``)."""

    builder_kwargs: dict = field(default_factory=dict)
    choices: tuple[str, ...] = ()


def _claims_nothing(cls: type) -> bool:
    return False


class AttentionBackend(ABC):
    """Abstract class for attention backends: capabilities plus factory methods.

    Every ``supports_*`` method is a classmethod answering from class data, so a
    selector can rule a backend out without instantiating anything.
    """

    accept_output_buffer: bool = False
    """True when ``forward`` writes into a caller-allocated ``output`` tensor (lets the
    caller allocate it inside a piecewise CUDA graph)."""
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto"]  # type: ignore[list-item]
    """Cache dtypes this backend stores; plain strings and ``CacheDType`` members mix
    freely since ``CacheDType`` is a str enum (``"auto" == CacheDType.AUTO``). An empty
    list means any."""

    @classmethod
    def prepare_for_model(cls, model: ModelAttention) -> ModelPreparation:
        """The engine's load-time hook: make the choices that depend on the model's
        attention geometry once (measuring where a backend measures) and return what its
        builder needs. The engine calls it for every backend, never naming one; the default
        has nothing to choose. Backends that cannot honour ``batch_invariant`` raise
        ValueError."""
        if model.batch_invariant:
            raise ValueError(f"the {cls.get_name()} backend has no batch-invariant mode")
        return ModelPreparation()

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        """Block sizes the kernel handles: exact ints and/or ``MultipleOf``. Empty = any."""
        return [MultipleOf(1)]

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """Logical shape of one layer's KV cache, e.g. ``(2, num_blocks, block_size,
        num_kv_heads, head_size)`` (dim 0 separates K and V)."""
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_stride_order(
        include_num_layers_dimension: bool = False,
    ) -> tuple[int, ...]:
        """Physical (memory) order of the logical KV-cache dimensions.

        For logical shape ``[2, num_blocks, block_size, num_heads, head_size]`` a return
        of ``(1, 3, 0, 2, 4)`` means memory is laid out as
        ``[num_blocks, num_heads, 2, block_size, head_size]``.

        Args:
            include_num_layers_dimension: if True, the answer covers an extra leading
                ``num_layers`` dimension prepended to the logical shape; e.g.
                ``(2, 4, 0, 1, 3, 5)`` lays memory out as
                ``[num_blocks, num_heads, num_layers, 2, block_size, head_size]``.
                If the returned tuple omits index 0, the physical layout has no layers
                dimension.

        Returns:
            A permutation of ``range(len(shape))``.

        Raises:
            NotImplementedError: (default) the physical layout equals the logical one.
        """
        raise NotImplementedError

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        """``(module, qualname)``: enough to re-import the class in another process."""
        return (cls.__module__, cls.__qualname__)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """Supported head sizes; empty = any."""
        return []

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        supported = cls.get_supported_head_sizes()
        return (not supported) or head_size in supported

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return list(cls.supported_dtypes)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: CacheDType | str | None) -> bool:
        """``None`` means "not decided yet" and is always accepted."""
        if kv_cache_dtype is None:
            return True
        return (not cls.supported_kv_cache_dtypes) or (
            kv_cache_dtype in cls.supported_kv_cache_dtypes
        )

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Whether ``block_size`` is a configurable block size (``CONFIGURABLE_BLOCK_SIZES``:
        the ``BlockSize`` literal and every size the native kernels run) the kernel serves.

        With hybrid blocks the framework block may be split into several kernel blocks,
        so it only has to be a multiple of some supported size, fixed (``16`` accepts
        16, 32, 64, ...) or ``MultipleOf``. ``None`` (not decided yet) is accepted.
        """
        if block_size is None:
            return True
        if block_size not in CONFIGURABLE_BLOCK_SIZES:
            return False
        kernel_sizes = cls.get_supported_kernel_block_sizes()
        if not kernel_sizes:
            return True
        for size in kernel_sizes:
            base = size.base if isinstance(size, MultipleOf) else size
            if block_size % base == 0:
                return True
        return False

    # ``is_mla``, ``supports_sink``, ``supports_mm_prefix``, ``is_sparse``: features a
    # backend has to claim, so every one defaults to no (a backend overrides those it has).
    is_mla = supports_sink = supports_mm_prefix = is_sparse = classmethod(_claims_nothing)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        """Default: decoder attention only; backends override to allow other types."""
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return True

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        """A reason the otherwise-supported values fail together, or ``None``."""
        return None

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
        attn_type: str,
    ) -> list[str]:
        """Every reason this backend cannot run the configuration; empty = usable.

        Reasons come in a fixed order (head size, dtype, cache dtype, block size,
        multimodal prefix, MLA, sink, sparse, capability, attention type, combination,
        device problems) so a selector's error message is stable.
        """
        reasons: list[str] = []
        if not cls.supports_head_size(head_size):
            reasons.append("head_size not supported")
        if not cls.supports_dtype(dtype):
            reasons.append("dtype not supported")
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            reasons.append("kv_cache_dtype not supported")
        if not cls.supports_block_size(block_size):
            reasons.append("block_size not supported")
        if use_mm_prefix and not cls.supports_mm_prefix():
            reasons.append("partial multimodal token full attention not supported")
        if use_mla != cls.is_mla():
            reasons.append("MLA not supported" if use_mla else "non-MLA not supported")
        if has_sink and not cls.supports_sink():
            reasons.append("sink setting not supported")
        if use_sparse != cls.is_sparse():
            reasons.append("sparse not supported" if use_sparse else "non-sparse not supported")
        if not cls.supports_compute_capability(device_capability):
            reasons.append("compute capability not supported")
        if not cls.supports_attn_type(attn_type):
            reasons.append(f"attention type {attn_type} not supported")
        combination = cls.supports_combination(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            use_mla,
            has_sink,
            use_sparse,
            device_capability,
        )
        if combination is not None:
            reasons.append(combination)
        reasons += cls.device_problems(device_capability)
        return reasons

    @classmethod
    def device_problems(cls, device_capability: DeviceCapability) -> list[str]:
        """What keeps the kernels from running on this machine whatever the configuration
        (a missing library, no launcher for the device); ``validate_configuration`` lists
        them last. Default: none."""
        return []

    @classmethod
    def get_required_kv_cache_layout(cls) -> KVCacheLayoutType | None:
        """A block layout every layer must share, or ``None`` for no constraint."""
        return None

    @staticmethod
    def use_cascade_attention(*args: Any, **kwargs: Any) -> bool:
        """Whether to split attention over a shared prefix (cascade attention); default
        never."""
        return False


class AttentionLayer(Protocol):
    """What an ``AttentionImpl.forward`` may read from the layer that calls it.

    The scales are the quantisation scales of Q, K, V and the softmax probabilities,
    as 0-d float32 tensors and (for K/V/Q) the same values as Python floats.
    """

    _q_scale: torch.Tensor
    _k_scale: torch.Tensor
    _v_scale: torch.Tensor
    _q_scale_float: float
    _k_scale_float: float
    _v_scale_float: float
    _prob_scale: torch.Tensor

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...


class AttentionImpl(ABC, Generic[T]):
    """One layer's attention computation (the "run" half of plan/run).

    ``__new__`` fills the context-parallel attributes for every subclass, before its
    ``__init__`` runs, from ``pagedattn.distributed`` when the groups are initialised,
    else as a single rank (world size 1, rank 0):

    * ``dcp_world_size`` / ``dcp_rank``: decode-context-parallel group.
    * ``pcp_world_size`` / ``pcp_rank``: prefill-context-parallel group.
    * ``total_cp_world_size = pcp_world_size * dcp_world_size`` and
      ``total_cp_rank = pcp_rank * dcp_world_size + dcp_rank`` (DCP varies fastest).
    * ``need_to_return_lse_for_decode``: ``dcp_world_size > 1`` and the impl
      ``can_return_lse_for_decode`` (partial results across ranks merge by LSE).
    """

    num_heads: int
    head_size: int
    scale: float

    can_return_lse_for_decode: bool = False
    """Whether forward can return the softmax log-sum-exp of decodes (DCP needs it)."""
    supports_pcp: bool = False
    """Whether prefill context parallelism is supported."""
    supports_mtp_with_cp_non_trivial_interleave_size: bool = False
    """Whether multi-token prediction works with ``cp_kv_cache_interleave_size > 1``."""
    need_to_return_lse_for_decode: bool = False
    """Set by ``__new__``; an impl may return the LSE only when asked, for speed."""
    supports_quant_query_input: bool = False
    """Whether the layer should hand forward an already-quantised query (set in
    ``__init__``), letting ``torch.compile`` fuse the quantisation upstream."""

    dcp_world_size: int
    dcp_rank: int
    pcp_world_size: int
    pcp_rank: int
    total_cp_world_size: int
    total_cp_rank: int

    def __new__(cls, *args: Any, **kwargs: Any):
        # Done in __new__ so that subclasses get it without calling super().__init__.
        self = super().__new__(cls)
        try:
            dcp = distributed.get_dcp_group()
            self.dcp_world_size, self.dcp_rank = dcp.world_size, dcp.rank_in_group
        except distributed.ParallelStateNotInitializedError:
            # Single-process use (and tests) never initialise the groups.
            self.dcp_world_size, self.dcp_rank = 1, 0
        try:
            pcp = distributed.get_pcp_group()
            self.pcp_world_size, self.pcp_rank = pcp.world_size, pcp.rank_in_group
        except distributed.ParallelStateNotInitializedError:
            self.pcp_world_size, self.pcp_rank = 1, 0
        self.total_cp_world_size = self.pcp_world_size * self.dcp_world_size
        self.total_cp_rank = self.pcp_rank * self.dcp_world_size + self.dcp_rank
        self.need_to_return_lse_for_decode = (
            self.dcp_world_size > 1 and self.can_return_lse_for_decode
        )
        return self

    @abstractmethod
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
    ) -> None:
        raise NotImplementedError

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: T,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend the batch's queries to the paged cache (after writing key/value).

        Args:
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: ``[num_tokens, num_kv_heads, head_size]``; only the first
                ``num_actual_tokens`` rows are real (the rest is graph padding).
            kv_cache: the layer's cache in ``get_kv_cache_shape`` layout.
            attn_metadata: what the backend's builder returned for this step.
            output: ``[num_tokens, num_heads, head_size]``, written in place when the
                backend ``accept_output_buffer``.
            output_scale, output_block_scale: fused output quantisation scales.

        Returns:
            ``[num_tokens, num_heads, head_size]`` (``output`` itself when given).
        """
        raise NotImplementedError

    # Checks and settings most impls share in ``__init__`` and ``forward`` (each impl
    # keeps vLLM's signature; these only save it writing the same lines again).

    def _set_heads(self, num_heads: int, head_size: int, scale: float,
                   num_kv_heads: int) -> None:
        """Check that ``num_heads`` is a positive multiple of ``num_kv_heads``; set
        ``num_heads``, ``head_size``, ``scale`` (a float), ``num_kv_heads`` and
        ``num_queries_per_kv``."""
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads

    @staticmethod
    def _check_sliding_window(sliding_window: int | None) -> None:
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")

    def _set_alibi_and_sinks(self, alibi_slopes: list[float] | None,
                             sinks: torch.Tensor | None) -> None:
        """Set ``alibi_slopes`` (fp32, one per head, or ``None``) and ``sinks`` (``[num_heads]``
        or ``None``), checking their lengths against ``num_heads``."""
        self.alibi_slopes = (torch.tensor(alibi_slopes, dtype=torch.float32)
                             if alibi_slopes is not None else None)
        if self.alibi_slopes is not None and self.alibi_slopes.numel() != self.num_heads:
            raise ValueError(f"alibi_slopes must have num_heads={self.num_heads} entries, got "
                             f"{self.alibi_slopes.numel()}")
        if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != self.num_heads):
            raise ValueError(f"sinks must have shape [num_heads={self.num_heads}], got "
                             f"{tuple(sinks.shape)}")
        self.sinks = sinks

    def _check_output_args(self, output: torch.Tensor | None, output_scale: Any,
                           output_block_scale: Any, missing_output: str, impl_name: str) -> None:
        """``forward``'s shared checks: an output buffer is given (else ``ValueError
        (missing_output)``) and no fused output quantisation is asked for (which
        ``impl_name`` does not support)."""
        if output is None:
            raise ValueError(missing_output)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                f"fused output quantization is not supported by {impl_name}")

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        """Whether forward can quantise its output as ``quant_key`` describes."""
        return False

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Hook after the model's weights load; default does nothing."""


class MLAAttentionImpl(AttentionImpl[T], Generic[T]):
    """Multi-head latent attention: the cache holds the compressed ``kv_c`` + rope key."""

    @abstractmethod
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        # MLA-specific
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        qk_head_dim: int,
        v_head_dim: int,
        kv_b_proj: Any,
        indexer: object | None = None,
    ) -> None:
        raise NotImplementedError

    @abstractmethod
    def forward(  # type: ignore[override]
        self,
        layer: AttentionLayer,
        hidden_states_or_cq: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: T,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args:
            hidden_states_or_cq: ``[num_tokens, q_lora_rank or hidden_size]``.
            kv_c_normed: ``[num_tokens, kv_lora_rank]`` compressed, normalised KV.
            k_pe: ``[num_tokens, 1, qk_rope_head_dim]`` rotary key part.
            output: ``[num_tokens, num_heads * v_head_dim]``.
        """
        raise NotImplementedError


def _check_threshold(value: int | None) -> None:
    require_int("reorder_batch_threshold", value, 1, allow_none=True)


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns one batch's ``CommonAttentionMetadata`` into backend metadata ``M``.

    One builder serves every layer of a KV-cache group (``layer_names``).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    """Read it through ``get_cudagraph_support`` (which may depend on the config)."""
    reorder_batch_threshold: int | None = None
    """Requests with ``query_len <= threshold`` are moved to the front of the batch and
    treated as decodes; ``None`` = the builder does not reorder."""
    supports_update_block_table: bool = False
    """Whether ``update_block_table`` is implemented."""

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: BuilderConfig,
        device: torch.device,
    ) -> None:
        if not isinstance(kv_cache_spec, AttentionSpec):
            raise TypeError(
                f"kv_cache_spec must be an AttentionSpec, got {type(kv_cache_spec).__name__}"
            )
        if not isinstance(vllm_config, BuilderConfig):
            raise TypeError(
                f"vllm_config must be a pagedattn.config.BuilderConfig, "
                f"got {type(vllm_config).__name__}"
            )
        if not isinstance(layer_names, (list, tuple)) or not all(
            isinstance(n, str) for n in layer_names
        ):
            raise TypeError(f"layer_names must be a list of str, got {layer_names!r}")
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = list(layer_names)
        self.vllm_config = vllm_config
        self.device = torch.device(device)

    @classmethod
    def get_cudagraph_support(
        cls,
        vllm_config: BuilderConfig,
        kv_cache_spec: AttentionSpec,
    ) -> AttentionCGSupport:
        """The CUDA-graph support level of this builder class for the given config."""
        return cls._cudagraph_support

    def _init_reorder_batch_threshold(
        self,
        reorder_batch_threshold: int | None = 1,
        supports_spec_as_decode: bool = False,
        supports_dcp_with_varlen: bool = False,
    ) -> None:
        """Set ``reorder_batch_threshold`` from the config.

        A backend whose decode kernel takes several query tokens
        (``supports_spec_as_decode``) raises it to ``1 + num_speculative_tokens`` so
        speculative verification runs as decode. Under DCP > 1 without varlen decode
        support it is forced to 1 (even when ``None`` was asked for), since only
        single-token decodes can be split across ranks.
        """
        _check_threshold(reorder_batch_threshold)
        self.reorder_batch_threshold = reorder_batch_threshold
        if reorder_batch_threshold is not None and supports_spec_as_decode:
            spec = self.vllm_config.speculative_config
            if spec is not None and spec.num_speculative_tokens is not None:
                self.reorder_batch_threshold = max(
                    reorder_batch_threshold, 1 + spec.num_speculative_tokens
                )
        if (
            self.vllm_config.parallel_config.decode_context_parallel_size > 1
            and not supports_dcp_with_varlen
        ):
            self.reorder_batch_threshold = 1

    @abstractmethod
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> M:
        """Build this backend's metadata for one batch.

        Args:
            common_prefix_len: tokens every request shares (cascade attention), else 0.
            common_attn_metadata: the batch, in backend-neutral form.
            fast_build: favour build speed over run speed (spec-decode drafting, where
                the result serves only a few layers or steps).
        """
        raise NotImplementedError

    def update_block_table(
        self,
        metadata: M,
        blk_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> M:
        """Copy of ``metadata`` with another KV-cache group's block table
        (``[num_reqs, max_blocks]`` int32) and slot mapping (``[num_tokens]`` int64).

        Only required when ``supports_update_block_table`` is True.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement update_block_table "
            f"(supports_update_block_table={self.supports_update_block_table})"
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Metadata for CUDA-graph capture; overrides should call ``self.build`` or
        ``super().build_for_cudagraph_capture``."""
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)

    def build_for_drafting(
        self,
        common_attn_metadata: CommonAttentionMetadata,
        draft_index: int,
    ) -> M:
        """Metadata for a draft model step (built with ``fast_build=True``).

        Args:
            draft_index: which draft step: the i-th speculated token of a chain, or the
                i-th level of a token tree.
        """
        return self.build(
            common_prefix_len=0,
            common_attn_metadata=common_attn_metadata,
            fast_build=True,
        )

    def use_cascade_attention(
        self,
        common_prefix_len: int,
        query_lens: np.ndarray,
        num_query_heads: int,
        num_kv_heads: int,
        use_alibi: bool,
        use_sliding_window: bool,
        use_local_attention: bool,
        num_sms: int,
        dcp_world_size: int,
    ) -> bool:
        """Whether to split attention over the shared prefix; default never."""
        return False


def _check_backend_cls(attention_backend_cls: object) -> None:
    if not (isinstance(attention_backend_cls, type)
            and issubclass(attention_backend_cls, AttentionBackend)):
        raise TypeError(
            "attention_backend_cls must be an AttentionBackend subclass, "
            f"got {attention_backend_cls!r}"
        )


def subclass_attention_backend(
    name_prefix: str,
    attention_backend_cls: type[AttentionBackend],
    builder_cls: type[AttentionMetadataBuilder[M]],
) -> type[AttentionBackend]:
    """A subclass named ``name_prefix + attention_backend_cls.__name__`` whose
    ``get_builder_cls`` returns ``builder_cls``."""
    _check_backend_cls(attention_backend_cls)
    name = name_prefix + attention_backend_cls.__name__
    return type(
        name,
        (attention_backend_cls,),
        {"get_builder_cls": staticmethod(lambda: builder_cls)},
    )


def subclass_attention_backend_with_overrides(
    name_prefix: str,
    attention_backend_cls: type[AttentionBackend],
    overrides: dict[str, Any],
) -> type[AttentionBackend]:
    """A subclass named ``name_prefix + attention_backend_cls.__name__`` with the
    class attributes in ``overrides`` (wrap callables in staticmethod/classmethod as
    the overridden attribute is)."""
    _check_backend_cls(attention_backend_cls)
    if not isinstance(overrides, dict):
        raise TypeError(f"overrides must be a dict, got {type(overrides).__name__}")
    name = name_prefix + attention_backend_cls.__name__
    return type(name, (attention_backend_cls,), dict(overrides))

