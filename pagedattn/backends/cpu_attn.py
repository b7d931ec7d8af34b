"""CPU_ATTN: the native CPU paged-attention backend (vLLM ``cpu_attn.py`` shape).

Plan/run split: :class:`CPUAttentionMetadataBuilder` turns a step's
``CommonAttentionMetadata`` into an immutable :class:`CPUAttentionMetadata` (kernel ISA
hint, scheduler work partition); every layer's
:class:`CPUAttentionBackendImpl.forward` only consumes it.

Paths in ``forward``:

* ENCODER / ENCODER_ONLY: no cache; per-sequence SDPA over the step's own K/V.
* DECODER / ENCODER_DECODER: write K/V into the paged cache (unless the layer shares
  another layer's cache, or key/value are ``None`` as in cross attention after the
  encoder step), then the native kernel, for every request of the step: decodes,
  prefills of any length, chunks over cached context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedattn.backend import (
    ModelAttention,
    ModelPreparation,
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
    check_request_tensors,
    is_quantized_kv_cache,
)
from pagedattn.backends import cpu_runtime
from pagedattn.config import BuilderConfig, CacheDType
from pagedattn.kv_cache_spec import AttentionSpec, CrossAttentionSpec
from pagedattn.ops import kernel_shapes
from pagedattn.ops.isa import IsaHint
from pagedattn.ops.reference import FP8_CACHE_DTYPES, visibility_mask


class CPUAttentionBackend(AttentionBackend):
    """Head sizes and block sizes: exactly the kernels' (:mod:`pagedattn.ops.kernel_shapes`).
    KV cache: the model dtype (``auto``) or fp8 (``fp8`` = ``fp8_e4m3``, ``fp8_e5m2``) with
    the layer's per-tensor ``k_scale`` / ``v_scale``."""

    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        CacheDType.AUTO, CacheDType.FP8, CacheDType.FP8_E4M3, CacheDType.FP8_E5M2]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return list(kernel_shapes.SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(kernel_shapes.SUPPORTED_HEAD_SIZES)

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @classmethod
    def prepare_for_model(cls, model: ModelAttention) -> ModelPreparation:
        """Batch-invariant engines get batch-invariant plans (the builder's
        ``batch_invariant``, which share no prefix); an engine that switched
        ``shared_prefix_attention`` off gets plans that read every request's keys
        itself (``share_prefixes``); other models need nothing prepared."""
        if model.batch_invariant:
            return ModelPreparation(
                {"batch_invariant": True},
                ("attention batch-invariant: vector kernels, no key splits, no shared "
                 "prefixes",))
        if not model.shared_prefix_attention:
            return ModelPreparation(
                {"share_prefixes": False},
                ("attention: shared prefixes off (each request reads its own keys)",))
        return ModelPreparation()

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        """Decoder, encoder, encoder-only and encoder-decoder (cross) attention."""
        return attn_type in (
            AttentionType.DECODER,
            AttentionType.ENCODER,
            AttentionType.ENCODER_ONLY,
            AttentionType.ENCODER_DECODER,
        )

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``[2, num_blocks, num_kv_heads, block_size, head_size]`` (K then V)."""
        return 2, num_blocks, num_kv_heads, block_size, head_size


@dataclass(frozen=True, eq=False)
class CPUAttentionMetadata:
    """One step's plan for CPU_ATTN, shared (read-only) by every layer of the step.

    Tensors are on the CPU.
    """

    isa: IsaHint
    """Kernel variant passed to the native ops, chosen once by
    :func:`cpu_runtime.kernel_variant`."""
    num_actual_tokens: int
    """Real query tokens of the step (rows past it are padding)."""
    query_start_loc: torch.Tensor
    """int32 ``[num_reqs + 1]``: query rows of each request."""
    seq_lens: torch.Tensor
    """int32 ``[num_reqs]``: keys visible to each request (context + new)."""
    block_table: torch.Tensor
    """int32 ``[num_reqs, max_blocks]``."""
    slot_mapping: torch.Tensor
    """int64 ``[num_tokens]``: cache slot of each new token, ``-1`` = padding."""
    scheduler_metadata: torch.Tensor | None
    """Opaque work partition from ``cpu_attn_get_scheduler_metadata``."""
    causal: bool = True
    sdpa_biases: dict = field(default_factory=dict, repr=False)
    """Dense SDPA biases of encoder steps, built on first use and shared by the layers
    that need the same one (a cache of derived values; the plan itself never changes)."""

    def __post_init__(self) -> None:
        check_request_tensors(self.query_start_loc, self.seq_lens, self.block_table)


class CPUAttentionMetadataBuilder(AttentionMetadataBuilder[CPUAttentionMetadata]):
    """Builds :class:`CPUAttentionMetadata`: the step's kernel plan, once per step.

    ``batch_invariant=True`` plans so that a row's result does not depend on the rest of
    the step (vector kernels, no key splits, no shared prefixes). ``share_prefixes``
    (default ``True``): requests whose block tables begin with the same blocks have those
    keys read once for all of them; ``False`` plans every request alone.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: BuilderConfig,
        device: torch.device,
        batch_invariant: bool = False,
        share_prefixes: bool = True,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        for name, value in (("batch_invariant", batch_invariant),
                            ("share_prefixes", share_prefixes)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        self.batch_invariant = batch_invariant
        self.share_prefixes = share_prefixes and not batch_invariant
        # Decodes first: the runner moves requests with query_len <= 1 to the front.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        parallel_config = vllm_config.parallel_config
        model_config = vllm_config.model_config
        self.num_heads = model_config.get_num_attention_heads(parallel_config)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        self.dtype = model_config.dtype
        self.block_size = kv_cache_spec.block_size
        window = kv_cache_spec.sliding_window
        self.window_size = -1 if window is None else window
        self.is_cross_attention = isinstance(kv_cache_spec, CrossAttentionSpec)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by the cache's "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        self.plan_geometry = cpu_runtime.PlanGeometry(self.num_heads, self.num_kv_heads,
                                                      self.head_dim, self.dtype, self.window_size)
        # A batch-invariant plan needs the vector kernels: the matrix-engine kernel's
        # arithmetic for a row depends on its query tile.
        self.isa = (cpu_runtime.kernel_variant() if batch_invariant
                    else cpu_runtime.prefill_variant(self.plan_geometry, self.block_size,
                                                     kv_cache_spec.dtype))

    def use_cascade_attention(self, common_prefix_len: int, query_lens, *args, **kwargs) -> bool:
        """Whether the step should pass ``common_prefix_len`` to :meth:`build`: where the
        planner's rule says reading that prefix once pays (:func:`cpu_runtime.
        shared_prefix_pays`). Without it, :meth:`build` still finds shared prefixes in the
        block table."""
        return self.share_prefixes and cpu_runtime.shared_prefix_pays(
            common_prefix_len, query_lens, self.batch_invariant)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CPUAttentionMetadata:
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        query_start_loc = cm.query_start_loc_cpu[: num_reqs + 1].to(torch.int32)
        seq_lens = cm.seq_lens[:num_reqs].cpu().to(torch.int32)
        block_table = cm.block_table_tensor[:num_reqs]
        causal = cm.causal
        if self.is_cross_attention:
            if cm.encoder_seq_lens is None:
                raise ValueError("cross attention needs common_attn_metadata.encoder_seq_lens")
            seq_lens = cm.encoder_seq_lens[:num_reqs].cpu().to(torch.int32)
            causal = False
            query_start_loc, seq_lens, block_table = cpu_runtime.split_queries_longer_than_keys(
                query_start_loc, seq_lens, block_table)

        # Requests whose block tables begin with the same blocks share those keys' reads
        # (found in the table; a common_prefix_len from the cascade interface is taken as
        # a prefix of the whole batch).
        sharing = self.share_prefixes
        scheduler_metadata = cpu_runtime.plan_step(
            self.plan_geometry, self.isa, query_start_loc, seq_lens, causal,
            self.batch_invariant, block_table=block_table if sharing else None,
            block_size=self.block_size,
            common_prefix_len=common_prefix_len if sharing and not self.is_cross_attention
            else 0)
        return CPUAttentionMetadata(
            isa=self.isa,
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=cm.slot_mapping,
            scheduler_metadata=scheduler_metadata,
            causal=causal,
        )


@dataclass(frozen=True)
class DirectCall:
    """One layer's scalars for a native loop that calls the cache write and the kernel
    itself (:meth:`CPUAttentionBackendImpl.direct_call`); the tensors are the step's
    metadata's."""

    scale: float
    softcap: float
    k_scale: float
    v_scale: float
    window_left: int
    window_right: int


class CPUAttentionBackendImpl(AttentionImpl[CPUAttentionMetadata]):
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
        if is_quantized_kv_cache(kv_cache_dtype) and str(kv_cache_dtype) not in FP8_CACHE_DTYPES:
            valid = ", ".join(repr(d) for d in CPUAttentionBackend.supported_kv_cache_dtypes)
            raise NotImplementedError(
                f"kv_cache_dtype {kv_cache_dtype!r} is unsupported in CPU_ATTN; expected one of "
                f"{valid}"
            )
        self._check_sliding_window(sliding_window)
        self.attn_type = AttentionType.parse(attn_type)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_cache_dtype = cpu_runtime.fp8_cache_dtype(kv_cache_dtype)
        """``torch.float8_e4m3fn`` / ``float8_e5m2`` for an fp8 cache, else ``None``."""
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self._alibi_key = None if alibi_slopes is None else tuple(float(a) for a in alibi_slopes)
        self.sliding_window = cpu_runtime.window_pair(sliding_window, self.attn_type)
        self._set_alibi_and_sinks(alibi_slopes, sinks)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for one layer of the step.

        Args:
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: ``[num_tokens, num_kv_heads, head_size]``, or ``None`` for cross
                attention once the encoder's K/V are cached.
            kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``.
            attn_metadata: the step's plan; ``None`` during warm-up (output untouched).
            output: ``[num_tokens, num_heads, head_size]``, written in place.
        Returns:
            ``output``.
        """
        self._check_output_args(
            output, output_scale, output_block_scale,
            "CPU_ATTN writes into a caller-provided output tensor; got output=None",
            "CPUAttentionBackendImpl")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        num_tokens = attn_metadata.num_actual_tokens

        if self.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            if key is None or value is None:
                raise ValueError(f"{self.attn_type.value} attention needs key and value tensors")
            self._sdpa_forward(
                query[:num_tokens], key[:num_tokens], value[:num_tokens],
                output[:num_tokens], attn_metadata, causal=False,
            )
            return output

        key_cache, value_cache = kv_cache.unbind(0)
        k_scale, v_scale = self._kv_scales(layer, kv_cache)
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            self._write_cache(key, value, key_cache, value_cache, attn_metadata, k_scale, v_scale)

        self._attend(query[:num_tokens], key_cache, value_cache, output[:num_tokens],
                     attn_metadata, k_scale, v_scale)
        return output

    def direct_call(self, layer: AttentionLayer, kv_cache: torch.Tensor,
                    attn_metadata: CPUAttentionMetadata | None) -> DirectCall | None:
        """The scalars with which a native layer loop runs this layer's step itself: the
        cache write, then the kernel over ``attn_metadata``'s plan, exactly what
        :meth:`forward` does for such a step. ``None`` where the step needs
        :meth:`forward`: encoder attention, a shared cache, ALiBi, sinks, or no metadata
        (warm-up)."""
        if (attn_metadata is None or attn_metadata.scheduler_metadata is None
                or self.attn_type != AttentionType.DECODER
                or self.kv_sharing_target_layer_name is not None
                or self.alibi_slopes is not None or self.sinks is not None):
            return None
        k_scale, v_scale = self._kv_scales(layer, kv_cache)
        left, right = self.sliding_window
        return DirectCall(self.scale, self.logits_soft_cap, k_scale, v_scale, left, right)

    # The impl's own arguments were validated at construction and the metadata's by its
    # builder: per layer, the runtime calls the native ops without re-checking them.

    def _write_cache(self, key, value, key_cache, value_cache, md: CPUAttentionMetadata,
                     k_scale: float, v_scale: float) -> None:
        cpu_runtime.write_cache(key, value, key_cache, value_cache, md.slot_mapping,
                                k_scale, v_scale)

    def _attend(self, query, key_cache, value_cache, output, md: CPUAttentionMetadata,
                k_scale: float, v_scale: float) -> None:
        cpu_runtime.attend(
            query, key_cache, value_cache, output, query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens, block_table=md.block_table,
            scheduler_metadata=md.scheduler_metadata, scale=self.scale, causal=md.causal,
            window=self.sliding_window, alibi_slopes=self.alibi_slopes,
            softcap=self.logits_soft_cap, sinks=self.sinks,
            k_scale=k_scale, v_scale=v_scale)

    def _kv_scales(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> tuple[float, float]:
        """The layer's per-tensor fp8 scales (1.0 for a model-dtype cache); checks that the
        cache tensor holds the configured fp8 format."""
        if self.fp8_cache_dtype is None:
            return 1.0, 1.0
        if kv_cache.dtype != self.fp8_cache_dtype:
            raise TypeError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} needs a {self.fp8_cache_dtype} kv_cache, "
                f"got {kv_cache.dtype}"
            )
        return float(layer._k_scale_float), float(layer._v_scale_float)

    # ------------------------------------------------------------------ SDPA path

    def _sdpa_bias(self, seq_len: int, causal: bool, attn_metadata: CPUAttentionMetadata,
                   dtype: torch.dtype) -> torch.Tensor | None:
        """Additive ``[H, L, L]`` bias (or ``None`` when SDPA's own causal flag suffices)."""
        has_window = self.sliding_window != (-1, -1)
        if self.alibi_slopes is None and not has_window:
            return None
        key = (self.num_heads, seq_len, causal, self.sliding_window, self._alibi_key, dtype)
        biases = attn_metadata.sdpa_biases
        bias = biases.get(key)
        if bias is None:
            bias = self._score_bias(seq_len, causal).to(dtype)
            biases[key] = bias
        return bias

    def _score_bias(self, seq_len: int, causal: bool) -> torch.Tensor:
        """fp32 ``[H, L, L]`` added to the scores: ALiBi ``slope[h] * (j - i)`` where key j
        is visible to query i, ``-inf`` elsewhere."""
        bias = torch.zeros(self.num_heads, seq_len, seq_len, dtype=torch.float32)
        if self.alibi_slopes is not None:
            pos = torch.arange(seq_len, dtype=torch.float32)
            bias += self.alibi_slopes.view(-1, 1, 1) * (pos.view(1, 1, -1) - pos.view(1, -1, 1))
        visible = visibility_mask(seq_len, seq_len, causal, self.sliding_window)
        return bias.masked_fill(~visible, float("-inf"))

    def _sdpa_forward(self, query, key, value, output, attn_metadata, *, causal: bool) -> None:
        """Per-sequence attention over the step's own K/V (no cache), into ``output``."""
        starts = attn_metadata.query_start_loc.tolist()
        for lo, hi in zip(starts[:-1], starts[1:]):
            if hi == lo:
                continue
            q = query[lo:hi].transpose(0, 1)  # [H, L, D]
            k = key[lo:hi].transpose(0, 1)
            v = value[lo:hi].transpose(0, 1)
            if self.logits_soft_cap > 0 or self.sinks is not None:
                out = self._math_attention(q, k, v, causal)
            else:
                bias = self._sdpa_bias(hi - lo, causal, attn_metadata, query.dtype)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, is_causal=causal and bias is None,
                    scale=self.scale, enable_gqa=self.num_heads > self.num_kv_heads,
                )
            output[lo:hi] = out.transpose(0, 1)

    def _math_attention(self, q, k, v, causal: bool) -> torch.Tensor:
        """fp32 attention with softcap and sinks, which SDPA cannot express."""
        seq_len = q.shape[1]
        k = k.float().repeat_interleave(self.num_queries_per_kv, dim=0)
        v = v.float().repeat_interleave(self.num_queries_per_kv, dim=0)
        scores = torch.matmul(q.float(), k.transpose(1, 2)) * self.scale
        if self.logits_soft_cap > 0:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        scores = scores + self._score_bias(seq_len, causal)
        if self.sinks is not None:
            sink_col = self.sinks.float().view(-1, 1, 1).expand(-1, seq_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v).to(q.dtype)
