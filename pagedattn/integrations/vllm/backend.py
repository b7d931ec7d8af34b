"""vLLM 0.32's ``CPU_ATTN`` backend with pagedattn's kernels underneath.

The classes subclass vLLM's own CPU backend (``vllm/v1/attention/backends/cpu_attn.py``),
so everything vLLM asks of a backend (supported dtypes, head sizes, block sizes, attention
types, the cross-attention wrapper vLLM builds around the builder and impl) keeps its
answer, and whatever pagedattn cannot serve is handed back to the parent classes.

What changes is the kernel path of the layers pagedattn serves:

* cache writes (``do_kv_cache_update``, and the encoder scratch) go through
  :func:`pagedattn.backends.cpu_runtime.write_cache`;
* the builder plans each step with :func:`pagedattn.backends.cpu_runtime.plan_step`;
* ``forward`` runs :func:`pagedattn.backends.cpu_runtime.attend`.

KV cache: vLLM allocates one tensor per layer, ``[num_blocks, num_kv_heads, block_size,
2 * head_size]``. Read as ``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` each
(block, head) holds ``block_size`` key rows, then ``block_size`` value rows, so the key and
value caches are the two halves along dim 2 (:func:`split_kv_cache`): strided views with
token rows of ``head_size`` contiguous elements, which pagedattn's ops take as they are
(they honour the block and head strides). No copy, no second allocation. The bytes inside
are pagedattn's natural layout, not vLLM's (vLLM packs keys for its kernels), so a cache
is written and read by one side only: the choice is made per KV-cache group, once, when
the group's builder is created (:meth:`PagedAttnCPUMetadataBuilder.unserved_reasons`).

fp8 KV caches (``kv_cache_dtype`` "fp8", "fp8_e4m3", "fp8_e5m2": vLLM allocates them as
uint8) are viewed as ``float8_e4m3fn`` / ``float8_e5m2`` and run on pagedattn's fp8 path
with the layer's per-tensor ``_k_scale_float`` / ``_v_scale_float``.

Handed back to vLLM (one warning naming the layers and the reason): other quantized KV
caches (int8, per-token-head scales, ...), head sizes or block sizes pagedattn's kernels
do not take, groups whose layers differ in head
count, speculative decoding (its drafters may send per-request causal flags), a missing
native extension. Attention types: decoder, encoder-only, encoder (non-causal, over a
per-step scratch cache) and encoder-decoder cross attention (vLLM's cross-attention
wrapper subclasses these classes). Sliding window, logits softcap, ALiBi and sinks are
passed through to the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, CrossAttentionSpec, EncoderOnlyAttentionSpec

from pagedattn import paging
from pagedattn.backends import cpu_runtime
from pagedattn.backends.cpu_attn import CPUAttentionBackend as _PagedAttnCPU
from pagedattn.integrations.vllm import logger
from pagedattn.ops.isa import IsaHint
from pagedattn.ops.reference import FP8_CACHE_DTYPES

_ENCODER_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


# vLLM's fp8 cache dtype names are pagedattn's (its "fp8" is e4m3 too).
FP8_KV_CACHE_DTYPES = FP8_CACHE_DTYPES


_SERVED_CALLS = [0]


def served_attention_calls() -> int:
    """How many layer calls the plugin has run on pagedattn's kernels in this process
    (calls handed back to vLLM's own implementation are not counted): the proof, for a
    test or a benchmark, that pagedattn served a run."""
    return _SERVED_CALLS[0]


def split_kv_cache(kv_cache: torch.Tensor, kv_cache_dtype: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` as
    pagedattn's ``(key_cache, value_cache)``, each ``[num_blocks, num_kv_heads, block_size,
    head_size]``: views (no copy) whose token rows are contiguous (``stride(2) ==
    head_size``) and whose block and head strides are twice a dense cache's. An fp8
    ``kv_cache_dtype`` reinterprets vLLM's uint8 bytes as that fp8 format."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(
            "expected vLLM's CPU KV cache [num_blocks, num_kv_heads, block_size, "
            f"2 * head_size], got shape {tuple(kv_cache.shape)}"
        )
    fp8 = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
    if fp8 is not None and kv_cache.dtype != fp8:
        if kv_cache.element_size() != 1:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a 1-byte cache tensor, "
                             f"got {kv_cache.dtype}")
        kv_cache = kv_cache.view(fp8)
    num_blocks, num_kv_heads, block_size, two_head_size = kv_cache.shape
    rows = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, two_head_size // 2)
    return rows[:, :, :block_size], rows[:, :, block_size:]


def window_pair(sliding_window: int | None, attn_type: str) -> tuple[int, int]:
    """vLLM's window int (``left + 1`` keys, ``-1`` = none) as the kernels' ``(left,
    right)``: :func:`pagedattn.backends.cpu_runtime.window_pair` (vLLM's attention types
    are the same strings)."""
    return cpu_runtime.window_pair(sliding_window, getattr(attn_type, "value", attn_type))


def unserved_kv_cache_dtype(kv_cache_dtype: str) -> str | None:
    """Why pagedattn cannot hold a cache of ``kv_cache_dtype`` (None: it can)."""
    if kv_cache_dtype == "auto" or kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return None
    return (f"kv_cache_dtype={kv_cache_dtype!r} (pagedattn's CPU kernels take the model "
            f"dtype or per-tensor fp8: {', '.join(FP8_KV_CACHE_DTYPES)})")


def kernel_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(_PagedAttnCPU.supported_dtypes)


@dataclass
class PagedAttnCPUMetadata:
    """One step's plan for the layers of a KV-cache group that pagedattn serves.

    CPU tensors. Mutable on purpose: vLLM's cross-attention builder replaces
    ``slot_mapping`` after :meth:`PagedAttnCPUMetadataBuilder.build`.
    """

    isa: str
    """pagedattn kernel-variant hint (``vec``, ``vec16``, ``amx``, ``neon``)."""
    num_actual_tokens: int
    """Query rows of the step (rows past it are padding and left untouched)."""
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    """int32 ``[num_reqs + 1]``."""
    seq_lens: torch.Tensor
    """int32 ``[num_reqs]``: keys each request sees (context + new; encoder length for
    cross attention)."""
    block_table: torch.Tensor
    """int32 ``[>= num_reqs, max_blocks]``."""
    slot_mapping: torch.Tensor
    """int64 ``[num_tokens]``: where this step's keys/values go (``-1`` = skip)."""
    scheduler_metadata: torch.Tensor
    """Opaque work partition from :func:`pagedattn.backends.cpu_runtime.plan_step`."""
    causal: bool = True
    encoder_cache: torch.Tensor | None = None
    """Encoder / encoder-only layers: a scratch cache ``[2, num_blocks, num_kv_heads,
    block_size, head_size]`` (pagedattn's layout) that each layer fills with the step's
    own keys/values before attending; ``block_table``/``slot_mapping`` index it."""


class PagedAttnCPUBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` (same name, same capabilities) on pagedattn's kernels."""

    @staticmethod
    def get_impl_cls() -> type[PagedAttnCPUImpl]:
        return PagedAttnCPUImpl

    @staticmethod
    def get_builder_cls() -> type[PagedAttnCPUMetadataBuilder]:
        return PagedAttnCPUMetadataBuilder


class PagedAttnCPUImpl(CPUAttentionBackendImpl):
    """One attention layer. Runs pagedattn's kernels when its group is served by
    pagedattn (the builder tells it with :meth:`bind`), else vLLM's parent impl."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pagedattn_window = window_pair(self.sliding_window, self.attn_type)
        self.served_by_pagedattn: bool | None = None  # None: no builder has bound it yet
        self.pagedattn_isa: str | None = None
        self._model_dtype = get_current_vllm_config().model_config.dtype

    def unserved_reasons(self) -> list[str]:
        """Why pagedattn's kernels cannot run this layer (empty: they can)."""
        reasons = []
        if cache_reason := unserved_kv_cache_dtype(self.kv_cache_dtype):
            reasons.append(cache_reason)
        if self.head_size not in _PagedAttnCPU.get_supported_head_sizes():
            reasons.append(
                f"head_size {self.head_size} (pagedattn's kernels take "
                f"{_PagedAttnCPU.get_supported_head_sizes()})"
            )
        if self._model_dtype not in kernel_dtypes():
            reasons.append(f"dtype {self._model_dtype} (pagedattn's kernels take {kernel_dtypes()})")
        return reasons

    def bind(self, served_by_pagedattn: bool, isa: str | None) -> None:
        """Called by the group's builder: which kernels own this layer's cache."""
        self.served_by_pagedattn = served_by_pagedattn
        self.pagedattn_isa = isa

    def _serves(self, block_size: int) -> bool:
        if self.served_by_pagedattn is None:
            # Not in any builder's group (e.g. a layer reading another layer's cache):
            # decide as its group would, from the layer and its cache alone.
            served = (not self.unserved_reasons() and cpu_runtime.native_available()
                      and cpu_runtime.block_size_problem(block_size) is None)
            if served:
                self.pagedattn_isa = cpu_runtime.kernel_variant()
            self.served_by_pagedattn = served
        return self.served_by_pagedattn

    def _kernel_sinks(self) -> torch.Tensor | None:
        # The kernels take fp32 or bf16 sink logits; other dtypes are widened once, after
        # the weights are loaded (they are not yet at __init__).
        if self.sinks is not None and self.sinks.dtype not in (torch.float32, torch.bfloat16):
            self.sinks = self.sinks.to(torch.float32)
        return self.sinks

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer for one step, written into ``output`` (``[num_tokens,
        num_heads, head_size]``). ``attn_metadata`` is ``None`` on warm-up runs and vLLM's
        own metadata when the group was handed back: both go to vLLM's impl."""
        if not isinstance(attn_metadata, PagedAttnCPUMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization (output_scale/output_block_scale) is not supported "
                "by pagedattn's CPU attention"
            )
        num_tokens = attn_metadata.num_actual_tokens
        if self.attn_type in _ENCODER_TYPES:
            if key is None or value is None:
                raise ValueError(f"{self.attn_type} attention needs this step's key and value")
            if attn_metadata.encoder_cache is None:
                raise RuntimeError(
                    f"{self.attn_type} layer got metadata without an encoder scratch cache: its "
                    "KV-cache group is not an EncoderOnlyAttentionSpec group"
                )
            key_cache, value_cache = attn_metadata.encoder_cache.unbind(0)
            cpu_runtime.write_cache(key, value, key_cache, value_cache,
                                    attn_metadata.slot_mapping)
        else:
            key_cache, value_cache = split_kv_cache(kv_cache, self.kv_cache_dtype)
        _SERVED_CALLS[0] += 1
        cpu_runtime.attend(
            query[:num_tokens], key_cache, value_cache, output[:num_tokens],
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table,
            scheduler_metadata=attn_metadata.scheduler_metadata, scale=float(self.scale),
            causal=attn_metadata.causal, window=self.pagedattn_window,
            alibi_slopes=self.alibi_slopes, softcap=float(self.logits_soft_cap or 0.0),
            sinks=self._kernel_sinks(), k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float)
        return output

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys/values into the layer's cache (decoder and cross
        attention; encoder layers write their scratch cache in ``forward``)."""
        if not self._serves(kv_cache.shape[2]):
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            return
        if self.attn_type in _ENCODER_TYPES:
            return
        key_cache, value_cache = split_kv_cache(kv_cache, self.kv_cache_dtype)
        cpu_runtime.write_cache(key, value, key_cache, value_cache, slot_mapping,
                                layer._k_scale_float, layer._v_scale_float)


class PagedAttnCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """Plans a step for one KV-cache group: pagedattn's metadata when pagedattn serves
    the group, else vLLM's (the parent's ``build``)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        self._vllm_refusal: NotImplementedError | None = None
        try:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        except NotImplementedError as exc:
            # vLLM's kernels take fp8 caches only with AVX-512/AMX and head sizes that
            # are multiples of 32; its __init__ raises while picking its ISA, after the
            # fields below it. pagedattn's fp8 path has neither limit.
            if vllm_config.cache_config.cache_dtype not in FP8_KV_CACHE_DTYPES:
                raise
            self._finish_init_without_vllm_kernels(kv_cache_spec, exc)
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        impls = {name: layer.impl for name, layer in layers.items()}
        reasons = self.unserved_reasons(impls)
        self.served_by_pagedattn = not reasons
        if reasons and self._vllm_refusal is not None:
            raise NotImplementedError(
                f"{self._vllm_refusal}; pagedattn cannot serve this KV-cache group either: "
                f"{'; '.join(reasons)}") from self._vllm_refusal
        self.pagedattn_isa = None
        if self.served_by_pagedattn:
            # The measured prefill kernel (vector or matrix engine) for this geometry.
            geometry = cpu_runtime.PlanGeometry(self.num_heads, self.num_kv_heads,
                                                self.head_dim, self.dtype, self.window_size)
            self.pagedattn_isa = cpu_runtime.prefill_variant(
                geometry, self.block_size,
                cpu_runtime.fp8_cache_dtype(self.kv_cache_dtype) or self.dtype)
        for impl in impls.values():
            if isinstance(impl, PagedAttnCPUImpl):
                impl.bind(self.served_by_pagedattn, self.pagedattn_isa)
        if reasons:
            shown = ", ".join(list(impls)[:3]) + (", ..." if len(impls) > 3 else "")
            logger.warning("a KV-cache group of %d attention layer(s)%s stays on vLLM's own "
                           "CPU attention: %s", len(impls), f" ({shown})" if shown else "",
                           "; ".join(reasons))
        self._encoder_scratch: torch.Tensor | None = None

    def _finish_init_without_vllm_kernels(self, kv_cache_spec: AttentionSpec,
                                          vllm_refusal: NotImplementedError) -> None:
        """The rest of vLLM's ``__init__`` for a group vLLM's own kernels refused: its
        layers get no vLLM ISA, so if pagedattn cannot serve the group either, vLLM's
        refusal is raised (from ``__init__``, via :meth:`unserved_reasons`)."""
        self.isa = None
        self.is_cross_attention = isinstance(kv_cache_spec, CrossAttentionSpec)
        self.is_encoder_only_attention = isinstance(kv_cache_spec, EncoderOnlyAttentionSpec)
        self._vllm_refusal = vllm_refusal

    def unserved_reasons(self, impls: dict) -> list[str]:
        """Why pagedattn cannot serve this group (empty: it can)."""
        reasons: list[str] = []
        if not cpu_runtime.native_available():
            reasons.append("pagedattn's native CPU extension is not built")
        if cache_reason := unserved_kv_cache_dtype(self.kv_cache_dtype):
            reasons.append(cache_reason)
        if self.head_dim not in _PagedAttnCPU.get_supported_head_sizes():
            reasons.append(f"head_size {self.head_dim} (pagedattn's kernels take "
                           f"{_PagedAttnCPU.get_supported_head_sizes()})")
        if self.dtype not in kernel_dtypes():
            reasons.append(f"dtype {self.dtype} (pagedattn's kernels take {kernel_dtypes()})")
        else:
            problem = cpu_runtime.block_size_problem(self.block_size)
            if problem:
                reasons.append(problem)
        layers_by_reason: dict[str, list[str]] = {}
        for name, impl in impls.items():
            layer_reasons = (impl.unserved_reasons() if isinstance(impl, PagedAttnCPUImpl)
                             else [f"impl {type(impl).__name__} is not pagedattn's"])
            for reason in layer_reasons:
                layers_by_reason.setdefault(reason, []).append(name)
        reasons.extend(f"{reason} in {len(names)} layer(s), e.g. {names[0]}"
                       for reason, names in layers_by_reason.items() if reason not in reasons)
        head_counts = {impl.num_heads for impl in impls.values()} | {self.num_heads}
        if len(head_counts) > 1:
            reasons.append(
                f"the group's layers differ in head count {sorted(head_counts)} (one "
                "pagedattn plan serves every layer of a step)"
            )
        if self.vllm_config.speculative_config is not None:
            reasons.append(
                "speculative decoding (its drafters may send per-request causal flags, "
                "which pagedattn's kernels do not take)"
            )
        return reasons

    def use_cascade_attention(self, common_prefix_len: int, query_lens, *args, **kwargs) -> bool:
        """pagedattn's rule where it serves the group (cpu_runtime.shared_prefix_pays),
        vLLM's answer elsewhere."""
        if not self.served_by_pagedattn:
            return super().use_cascade_attention(common_prefix_len, query_lens, *args, **kwargs)
        return cpu_runtime.shared_prefix_pays(common_prefix_len, query_lens, False)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False):
        if not self.served_by_pagedattn:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        if isinstance(cm.causal, torch.Tensor):
            raise NotImplementedError(
                "per-request causal flags (CommonAttentionMetadata.causal as a tensor) are "
                "not supported by pagedattn's CPU attention; run with PAGEDATTN_VLLM=0"
            )
        num_reqs = cm.num_reqs
        query_start_loc = cm.query_start_loc[: num_reqs + 1].to(torch.int32)
        seq_lens = cm.seq_lens[:num_reqs].to(torch.int32)
        block_table = cm.block_table_tensor[:num_reqs]
        slot_mapping = cm.slot_mapping
        causal = bool(cm.causal)
        encoder_cache = None
        if isinstance(self.kv_cache_spec, CrossAttentionSpec):
            # Decoder queries against the cached encoder keys: no causal mask, and a
            # request may have more queries than keys, which the kernel takes in pieces.
            causal = False
            query_start_loc, seq_lens, block_table = cpu_runtime.split_queries_longer_than_keys(
                query_start_loc, seq_lens, block_table)
        elif isinstance(self.kv_cache_spec, EncoderOnlyAttentionSpec):
            block_table, slot_mapping, encoder_cache = self._plan_encoder_scratch(
                query_start_loc, seq_lens)
        geometry = cpu_runtime.PlanGeometry(self.num_heads, self.num_kv_heads, self.head_dim,
                                            self.dtype, self.window_size)
        # Shared prefixes (prefix caching's common blocks) are found in the block table;
        # a cascade common_prefix_len names one for the whole batch.
        scheduler_metadata = cpu_runtime.plan_step(
            geometry, IsaHint(self.pagedattn_isa), query_start_loc, seq_lens, causal,
            block_table=block_table, block_size=self.block_size,
            common_prefix_len=0 if isinstance(self.kv_cache_spec, CrossAttentionSpec)
            else common_prefix_len)
        return PagedAttnCPUMetadata(
            isa=self.pagedattn_isa,
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            scheduler_metadata=scheduler_metadata,
            causal=causal,
            encoder_cache=encoder_cache,
        )

    def _plan_encoder_scratch(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block table, slot mapping and scratch cache for encoder layers: request r's
        tokens in consecutive blocks of one scratch cache that every layer of the step
        overwrites in turn (layers run one after another). The scratch grows on demand
        and is reused across steps; slots past a request's length are never read."""
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        kv_lens = seq_lens.tolist()
        if query_lens != kv_lens:
            raise NotImplementedError(
                "encoder attention over cached context (seq_lens != query lengths: "
                f"{kv_lens} vs {query_lens}) is not supported by pagedattn's CPU attention; "
                "encoder steps must see all their tokens at once"
            )
        tables = paging.contiguous_block_tables(kv_lens, self.block_size)
        block_table = paging.pad_block_tables(tables)
        slot_mapping = paging.slot_mapping_for_new_tokens(block_table, query_lens, kv_lens,
                                                          self.block_size)
        num_blocks = sum(len(t) for t in tables)
        scratch = self._encoder_scratch
        if scratch is None or scratch.shape[1] < num_blocks:
            scratch = torch.zeros(2, num_blocks, self.num_kv_heads, self.block_size,
                                  self.head_dim, dtype=self.dtype)
            self._encoder_scratch = scratch
        return block_table, slot_mapping, scratch
