"""TRITON_ATTN: decoder attention through the Triton kernels of :mod:`pagedattn.ops.triton`.

One launch of ``unified_attention`` serves the whole step — decodes, chunked prefills
with prior context and whole prefills, in any order — so the builder neither reorders
nor splits the batch: it checks and packages ``CommonAttentionMetadata`` and plans the
step's split-KV launch once (:func:`pagedattn.ops.triton.plan_kv_splits`: the split
count and the partial buffers every layer's launch shares).

Cache: flash layout ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then
V), in the model dtype or fp8 (``kv_cache_dtype`` ``"fp8"``/``"fp8_e4m3"``/
``"fp8_e5m2"``, values stored as ``x / layer._k_scale``; a uint8 cache tensor is viewed
as the fp8 dtype). Features: GQA/MQA, ALiBi, logits soft-cap, sliding window, attention
sinks. Usable wherever Triton launches on the tensors' device: CUDA, or CPU tensors
under ``TRITON_INTERPRET=1`` (slow; for tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedattn.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    check_request_tensors,
    flash_kv_cache_shape,
    is_quantized_kv_cache,
)
from pagedattn.config import CacheDType, DeviceCapability, BuilderConfig
from pagedattn.kv_cache_spec import AttentionSpec
from pagedattn.ops import triton as triton_ops


class TritonAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        CacheDType.AUTO, CacheDType.FP8, CacheDType.FP8_E4M3, CacheDType.FP8_E5M2,
    ]

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    get_kv_cache_shape = staticmethod(flash_kv_cache_shape)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, device_capability) -> str | None:
        on_gpu = tuple(device_capability) != (0, 0)
        e4m3 = kv_cache_dtype in (CacheDType.FP8, CacheDType.FP8_E4M3)
        if on_gpu and e4m3 and tuple(device_capability) < triton_ops.FP8_E4M3_MIN_CAPABILITY:
            return (f"kv_cache_dtype {kv_cache_dtype} (float8_e4m3fn) needs compute capability "
                    f">= 8.9 with Triton, got {device_capability[0]}.{device_capability[1]}; "
                    "use fp8_e5m2")
        return None

    @classmethod
    def launch_problem(cls, device_capability: DeviceCapability) -> str | None:
        """Why the kernels cannot launch here (a capability of (0, 0) means the CPU)."""
        device = "cpu" if tuple(device_capability) == (0, 0) else "cuda"
        return triton_ops.launch_problem(device)

    @classmethod
    def device_problems(cls, device_capability: DeviceCapability) -> list[str]:
        problem = cls.launch_problem(device_capability)
        return [] if problem is None else [problem]


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """One step's batch for TRITON_ATTN, shared by every layer of the step.

    Tensors live on the device of the cache.
    """

    num_actual_tokens: int
    """Real query tokens (rows past it are padding and are not computed)."""
    max_query_len: int
    query_start_loc: torch.Tensor
    """int32 ``[num_reqs + 1]``: request r's query rows."""
    max_seq_len: int
    seq_lens: torch.Tensor
    """int32 ``[num_reqs]``: keys of each request (context + new tokens)."""
    block_table: torch.Tensor
    """int32 ``[num_reqs, max_blocks]``."""
    slot_mapping: torch.Tensor
    """int64 ``[num_actual_tokens]``: cache slot of each new token, ``-1`` = skip."""
    causal: bool = True
    kv_split_plan: triton_ops.KVSplitPlan | None = None
    """The step's split-KV choice and partial buffers, made once by the builder and
    read by every layer; ``None``: each launch chooses."""

    def __post_init__(self) -> None:
        check_request_tensors(self.query_start_loc, self.seq_lens, self.block_table)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.numel()


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[TritonAttentionMetadata]):
    """Packages ``CommonAttentionMetadata`` for the unified kernel (no reorder needed:
    one launch handles decodes and prefills in any order)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: BuilderConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TritonAttentionMetadata:
        if common_prefix_len:
            raise NotImplementedError(
                f"TRITON_ATTN has no cascade attention; got common_prefix_len={common_prefix_len}")
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        seq_lens = cm.seq_lens[:num_reqs].to(torch.int32)
        model = self.vllm_config.model_config
        # Plan once per step: every layer shares the split count and the partial buffers.
        split_plan = triton_ops.plan_kv_splits(
            seq_lens.device, model.dtype, num_tokens=cm.num_actual_tokens, num_reqs=num_reqs,
            num_heads=model.num_attention_heads, num_kv_heads=self.kv_cache_spec.num_kv_heads,
            head_size=self.kv_cache_spec.head_size, max_seqlen_q=cm.max_query_len,
            max_seqlen_k=cm.max_seq_len)
        return TritonAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc[: num_reqs + 1].to(torch.int32),
            max_seq_len=cm.max_seq_len,
            seq_lens=seq_lens,
            block_table=cm.block_table_tensor[:num_reqs].to(torch.int32),
            slot_mapping=cm.slot_mapping[: cm.num_actual_tokens],
            causal=cm.causal,
            kv_split_plan=split_plan,
        )


def layer_scale(layer: AttentionLayer | None, name: str, device: torch.device) -> torch.Tensor:
    """The layer's fp32 K/V scale as a one-element tensor (1.0 without a layer)."""
    scale = getattr(layer, name, None) if layer is not None else None
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    return scale.reshape(1).to(device=device, dtype=torch.float32)


def unified_step(impl: AttentionImpl, meta: Any, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, output: torch.Tensor, *, causal: bool = True,
                 alibi_slopes: torch.Tensor | None = None,
                 k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None,
                 kv_split_plan: triton_ops.KVSplitPlan | None = None) -> None:
    """One ``unified_attention`` launch over the requests of ``meta`` (a step's metadata
    with ``query_start_loc``, ``max_query_len``, ``seq_lens``, ``max_seq_len`` and
    ``block_table``), with ``impl``'s ``scale``, ``sliding_window`` (a window pair) and
    ``logits_soft_cap``: the launch TRITON_ATTN makes for a whole step and XFORMERS_VLLM_V1
    for its prefills. ``query`` and ``output`` hold those requests' rows only."""
    triton_ops.unified_attention(
        q=query, k=key_cache, v=value_cache, out=output,
        cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
        seqused_k=meta.seq_lens, max_seqlen_k=meta.max_seq_len,
        softmax_scale=impl.scale, causal=causal, alibi_slopes=alibi_slopes,
        window_size=impl.sliding_window, block_table=meta.block_table,
        softcap=impl.logits_soft_cap, q_descale=None, k_descale=k_descale,
        v_descale=v_descale, sinks=sinks, kv_split_plan=kv_split_plan)


class TritonAttentionImpl(AttentionImpl[TritonAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self._set_heads(num_heads, head_size, scale, num_kv_heads)
        if head_size <= 0:
            raise ValueError(f"head_size must be positive, got {head_size}")
        self.attn_type = AttentionType.parse(attn_type)
        if self.attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"TRITON_ATTN implements decoder attention only, got attn_type="
                f"{self.attn_type.value}; use CPU_ATTN for encoder attention")
        if is_quantized_kv_cache(kv_cache_dtype) and \
                kv_cache_dtype not in triton_ops.FP8_CACHE_DTYPES:
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported by TRITON_ATTN; use one "
                f"of {['auto', *triton_ops.FP8_CACHE_DTYPES]}")
        self._check_sliding_window(sliding_window)
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0 or None, got {logits_soft_cap}")
        self.kv_cache_dtype = str(CacheDType.parse(kv_cache_dtype).value)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        # A window of w tokens: the query and the w - 1 keys before it.
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self._set_alibi_and_sinks(alibi_slopes, sinks)

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError("kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                             f"head_size], got shape {tuple(kv_cache.shape)}")
        if self.kv_cache_dtype != "auto":
            fp8 = triton_ops.FP8_CACHE_DTYPES[self.kv_cache_dtype]
            if kv_cache.dtype == torch.uint8:
                kv_cache = kv_cache.view(fp8)
            elif kv_cache.dtype != fp8:
                raise TypeError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs a {fp8} (or uint8) "
                                f"cache, got {kv_cache.dtype}")
        return kv_cache.unbind(0)

    def forward(
        self,
        layer: AttentionLayer | None,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend every query row.

        Args:
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: ``[num_tokens, num_kv_heads, head_size]`` (``None``: nothing to
                cache, e.g. a layer sharing another layer's cache).
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
            attn_metadata: the step's plan; ``None`` in a profiling run (output untouched).
            output: ``[num_tokens, num_heads, head_size]``, written in place.
        """
        self._check_output_args(
            output, output_scale, output_block_scale,
            "TRITON_ATTN writes into a caller-provided output tensor; got output=None",
            "TritonAttentionImpl")
        if attn_metadata is None:  # profiling run
            return output
        key_cache, value_cache = self._cache_views(kv_cache)
        device = query.device
        k_scale = layer_scale(layer, "_k_scale", device)
        v_scale = layer_scale(layer, "_v_scale", device)
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            triton_ops.reshape_and_cache_flash(
                key, value, key_cache, value_cache, attn_metadata.slot_mapping,
                self.kv_cache_dtype, k_scale, v_scale)

        n = attn_metadata.num_actual_tokens
        descale_shape = (attn_metadata.num_reqs, self.num_kv_heads)
        quantized = self.kv_cache_dtype != "auto"
        unified_step(
            self, attn_metadata, query[:n], key_cache, value_cache, output[:n],
            causal=attn_metadata.causal,
            alibi_slopes=self._on(device, "alibi_slopes"),
            k_descale=k_scale.view(1, 1).expand(descale_shape) if quantized else None,
            v_descale=v_scale.view(1, 1).expand(descale_shape) if quantized else None,
            sinks=self._on(device, "sinks"),
            kv_split_plan=attn_metadata.kv_split_plan,
        )
        return output

    def _on(self, device: torch.device, name: str) -> torch.Tensor | None:
        """Attribute ``name`` (a per-head tensor or None), moved to ``device`` once."""
        value = getattr(self, name)
        if value is not None and value.device != device:
            value = value.to(device)
            setattr(self, name, value)
        return value
