"""XFORMERS_VLLM_V1: vLLM's xformers V1 backend, on pagedattn's Triton ops.

Paths in ``forward`` (the batch is ordered decodes first, see ``reorder_batch``):

* cache write: :func:`pagedattn.ops.triton.reshape_and_cache_flash`;
* prefill requests (query length > 1): :func:`pagedattn.ops.triton.unified_attention`;
* decode requests (one query each): xformers' ``memory_efficient_attention_forward``
  over the whole paged cache, with a ``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask``
  that the builder makes from the block table. That mask has no sliding window and no
  soft-cap, so layers with either run their decodes through ``unified_attention`` too
  (vLLM's seed ignores both on decodes, which changes the results silently).

Importing this module needs neither xformers nor CUDA: xformers is imported on first
use, and :meth:`XFormersAttentionBackend.validate_configuration` (hence the registry and
``pagedattn info``) reports why the backend cannot run here.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch

from pagedattn import paging
from pagedattn.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
    flash_kv_cache_shape,
    is_quantized_kv_cache,
)
from pagedattn.config import DeviceCapability, BuilderConfig
from pagedattn.backends.triton_attn import TritonAttentionBackend, layer_scale, unified_step
from pagedattn.kv_cache_spec import AttentionSpec
from pagedattn.ops import triton as triton_ops

if TYPE_CHECKING:
    from xformers.ops.fmha.attn_bias import AttentionBias

XFORMERS_AVAILABLE = importlib.util.find_spec("xformers") is not None
"""Whether the xformers package is installed (its kernels may still be unusable: see
:func:`xformers_problems`)."""

_SUPPORTED_HEAD_SIZES = list(range(32, 257, 8))


@functools.lru_cache(maxsize=1)
def _xformers_import_problem() -> str | None:
    if not XFORMERS_AVAILABLE:
        return "xformers is not installed (pip install --no-deps xformers)"
    # xformers logs a multi-line warning when its C++/CUDA library does not match this
    # torch; xformers_problems() reports that as a one-line reason instead.
    xformers_logger = logging.getLogger("xformers")
    previous_level = xformers_logger.level
    xformers_logger.setLevel(logging.ERROR)
    try:
        import xformers  # noqa: F401
        import xformers.ops  # noqa: F401
        from xformers.ops.fmha.attn_bias import (  # noqa: F401
            PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
        )
    except Exception as exc:  # a broken install is a reason, not a crash
        return f"xformers is not importable: {type(exc).__name__}: {exc}"
    finally:
        xformers_logger.setLevel(previous_level)
    return None


def xformers_problems(device_capability: DeviceCapability | None = None) -> list[str]:
    """Why xformers' decode kernel cannot run here (empty = it can). A capability of
    ``(0, 0)`` means the CPU, where xformers has no paged attention kernel."""
    problem = _xformers_import_problem()
    if problem is not None:
        return [problem]
    cpu = device_capability is not None and tuple(device_capability) == (0, 0)
    if not cpu and torch.cuda.is_available():
        problem = _paged_decode_trial(torch.cuda.current_device())
        return [] if problem is None else [problem]
    reasons = []
    import xformers

    if not getattr(xformers, "_has_cpp_library", False):
        reasons.append(_CPP_LIBRARY_MISSING)
    reasons.append("xformers' paged decode kernel needs a CUDA GPU")
    return reasons


_CPP_LIBRARY_MISSING = ("xformers' C++/CUDA kernels did not load (the wheel was built for "
                        "another torch/CUDA; XFORMERS_MORE_DETAILS=1 python -c 'import "
                        "xformers.ops' says more)")


@functools.lru_cache(maxsize=None)
def _paged_decode_trial(device_index: int) -> str | None:
    """Run xformers' forward once on a tiny paged decode on GPU ``device_index``: which
    of its kernels can take the decode depends on the wheel, torch and the GPU (a wheel
    built for another torch may still serve it from its Triton kernels), so ask it."""
    import xformers
    import xformers.ops as xops

    device = torch.device("cuda", device_index)
    head_size, block_size = 64, 16
    q = torch.zeros(1, 1, 1, 1, head_size, dtype=torch.float16, device=device)
    cache = torch.zeros(1, block_size, 1, 1, head_size, dtype=torch.float16, device=device)
    bias = _paged_decode_mask_cls().from_seqlens(
        q_seqlen=[1], kv_seqlen=[block_size], page_size=block_size,
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device), device=device)
    try:
        xops.memory_efficient_attention_forward(q, cache, cache, attn_bias=bias, p=0.0)
        torch.cuda.synchronize(device)
    except (NotImplementedError, RuntimeError, ValueError) as exc:
        detail = " ".join(str(exc).split())[:600] or type(exc).__name__
        missing = "" if getattr(xformers, "_has_cpp_library", False) else _CPP_LIBRARY_MISSING + "; "
        return f"{missing}xformers has no kernel for the paged decode here: {detail}"
    return None


def _paged_decode_mask_cls():
    problem = _xformers_import_problem()
    if problem is not None:
        raise RuntimeError(f"XFORMERS_VLLM_V1 needs xformers: {problem}")
    from xformers.ops.fmha.attn_bias import PagedBlockDiagonalCausalWithOffsetPaddedKeysMask

    return PagedBlockDiagonalCausalWithOffsetPaddedKeysMask


class XFormersAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(_SUPPORTED_HEAD_SIZES)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def validate_head_size(cls, head_size: int) -> None:
        supported_head_sizes = cls.get_supported_head_sizes()
        if head_size not in supported_head_sizes:
            attn_type = cls.__name__.removesuffix("Backend")
            raise ValueError(
                f"Head size {head_size} is not supported by {attn_type}. "
                f"Supported head sizes are: {supported_head_sizes}. "
                "Set PAGEDATTN_BACKEND=TRITON_ATTN to use the Triton backend, which "
                "supports all head sizes.")

    @staticmethod
    def get_name() -> str:
        return "XFORMERS_VLLM_V1"

    @staticmethod
    def get_impl_cls() -> type[XFormersAttentionImpl]:
        return XFormersAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[XFormersAttentionMetadata]:
        return XFormersAttentionMetadata

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if block_size % 16 != 0:
            raise ValueError("Block size must be a multiple of 16.")
        return flash_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_builder_cls() -> type[XFormersAttentionMetadataBuilder]:
        return XFormersAttentionMetadataBuilder

    @classmethod
    def device_problems(cls, device_capability: DeviceCapability) -> list[str]:
        reasons = xformers_problems(device_capability)
        # Prefills run on Triton's kernels; on the CPU xformers_problems already rules the
        # backend out, so the interpreter's absence would only add noise.
        triton_problem = TritonAttentionBackend.launch_problem(device_capability)
        if triton_problem is not None and tuple(device_capability) != (0, 0):
            reasons.append(f"prefill kernel: {triton_problem}")
        return reasons


@dataclass(frozen=True, eq=False)
class XFormersAttentionMetadata:
    """One step's batch (decodes first), with decode-only / prefill-only views derived on
    first use (read-only like every field; derived once, shared by the step's layers)."""

    num_actual_tokens: int  # Number of tokens excluding padding.
    max_query_len: int
    query_start_loc: torch.Tensor
    """int32 ``[num_reqs + 1]``."""
    max_seq_len: int
    seq_lens: torch.Tensor
    """int32 ``[num_reqs]``: keys per request (context + new)."""
    block_table: torch.Tensor
    """int32 ``[num_reqs, max_blocks]``."""
    slot_mapping: torch.Tensor
    """int64 ``[num_actual_tokens]``, ``-1`` = do not cache."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0

    attn_bias: Optional[AttentionBias] = None
    """The decodes' paged mask (xformers ``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask``)."""

    @cached_property
    def prefill_metadata(self) -> Optional[XFormersAttentionMetadata]:
        """The prefill requests alone (query rows rebased to 0), or ``None``."""
        if self.num_prefills == 0:
            return None
        q_start_loc = self.query_start_loc[self.num_decodes:]
        q_seqlens = torch.diff(q_start_loc)
        kv_seqlens = self.seq_lens[self.num_decodes:]
        return XFormersAttentionMetadata(
            num_actual_tokens=self.num_prefill_tokens,
            max_query_len=int(q_seqlens.max().item()),
            query_start_loc=q_start_loc - q_start_loc[0],
            max_seq_len=int(kv_seqlens.max().item()),
            seq_lens=kv_seqlens,
            block_table=self.block_table[self.num_decodes:],
            slot_mapping=self.slot_mapping[self.num_decode_tokens:],
        )

    @cached_property
    def decode_metadata(self) -> Optional[XFormersAttentionMetadata]:
        """The decode requests alone (with the paged bias), or ``None``."""
        if self.num_decode_tokens == 0:
            return None
        q_start_loc = self.query_start_loc
        q_seqlens = torch.diff(q_start_loc)
        decode_kv_seqlens = self.seq_lens[:self.num_decodes]
        return XFormersAttentionMetadata(
            num_actual_tokens=self.num_decode_tokens,
            max_query_len=int(q_seqlens[:self.num_decodes].max().item()),
            query_start_loc=q_start_loc[:self.num_decodes + 1],
            max_seq_len=int(decode_kv_seqlens.max().item()),
            seq_lens=decode_kv_seqlens,
            block_table=self.block_table[:self.num_decodes],
            slot_mapping=self.slot_mapping[:self.num_decode_tokens],
            attn_bias=self.attn_bias,
        )


class XFormersAttentionMetadataBuilder(AttentionMetadataBuilder[XFormersAttentionMetadata]):
    """Splits the (decodes-first) batch and builds the decodes' paged xformers bias."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: BuilderConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._mask_cls = _paged_decode_mask_cls()  # fails early, with the reason
        self.block_size = kv_cache_spec.block_size
        if self.block_size % 16 != 0:
            raise ValueError(f"XFORMERS_VLLM_V1 needs a block size that is a multiple of 16, "
                             f"got {self.block_size}")
        self._init_reorder_batch_threshold(1)

    def reorder_batch(self, input_batch: Any, scheduler_output: Any) -> bool:
        """Move the decodes (one scheduled token) in front of the prefills, in place;
        return whether anything moved."""
        return paging.reorder_batch_decodes_first(
            input_batch, scheduler_output.num_scheduled_tokens, decode_threshold=1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> XFormersAttentionMetadata:
        cm = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            paging.split_decodes_and_prefills(cm.query_start_loc_cpu[: cm.num_reqs + 1],
                                              cm.num_actual_tokens, decode_threshold=1))
        num_reqs = cm.num_reqs
        q_start_loc = cm.query_start_loc[: num_reqs + 1]
        kv_seqlens = cm.seq_lens[:num_reqs]
        block_table = cm.block_table_tensor[:num_reqs]

        bias = None
        if num_decodes > 0:
            qsl_cpu = cm.query_start_loc_cpu[: num_decodes + 1]
            bias = self._mask_cls.from_seqlens(
                q_seqlen=torch.diff(qsl_cpu).tolist(),
                kv_seqlen=kv_seqlens[:num_decodes].tolist(),
                page_size=self.block_size,
                block_tables=block_table[:num_decodes],
                device=block_table.device,
            )
        return XFormersAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_decodes=num_decodes,
            max_query_len=cm.max_query_len,
            query_start_loc=q_start_loc,
            max_seq_len=cm.max_seq_len,
            seq_lens=kv_seqlens,
            block_table=block_table,
            slot_mapping=cm.slot_mapping,
            attn_bias=bias,
        )


class XFormersAttentionImpl(AttentionImpl[XFormersAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: Optional[list[float]],
        sliding_window: Optional[int],
        kv_cache_dtype: str,
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: Optional[str] = None,
    ) -> None:
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("KV sharing is not supported in V0.")
        if alibi_slopes is not None:
            raise NotImplementedError("XFormers does not support alibi slopes yet.")
        self._set_heads(num_heads, head_size, scale, num_kv_heads)
        if is_quantized_kv_cache(kv_cache_dtype):
            # xformers' decode kernel reads the cache as is: it cannot dequantize fp8.
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported by XFORMERS_VLLM_V1 "
                "(its decode kernel cannot read an fp8 cache); use 'auto' or TRITON_ATTN")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.alibi_slopes = None
        if sliding_window is None:
            self.sliding_window = (-1, -1)
        else:
            self.sliding_window = (sliding_window - 1, 0)
        if logits_soft_cap is None:
            # Setting logits_soft_cap to 0 means no soft cap.
            logits_soft_cap = 0
        self.logits_soft_cap = logits_soft_cap
        # xformers' paged decode mask knows neither windows nor soft-capping (the seed
        # ignores both there, silently); such layers decode through unified_attention.
        self.decode_with_xformers = sliding_window is None and not logits_soft_cap

        XFormersAttentionBackend.validate_head_size(head_size)

        if AttentionType.parse(attn_type) != AttentionType.DECODER:
            raise NotImplementedError("Encoder self-attention and "
                                      "encoder/decoder cross-attention "
                                      "are not implemented for "
                                      "XFormersAttentionImpl.")

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: XFormersAttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward pass with XFormers: decodes through its paged kernel, prefills (and
        every row of a windowed or soft-capped layer) through Triton's
        ``unified_attention``. ``output`` is required and returned; ``attn_metadata`` is
        ``None`` in a profiling run, which leaves it untouched."""
        if output is None:
            raise ValueError("Output tensor must be provided.")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization is not yet supported for XFormersAttentionImpl")
        if attn_metadata is None:
            return output  # profiling run

        key_cache, value_cache = kv_cache.unbind(0)
        k_scale = layer_scale(layer, "_k_scale", query.device)
        v_scale = layer_scale(layer, "_v_scale", query.device)
        # key/value may be longer than slot_mapping (padding): the op writes only
        # slot_mapping.numel() tokens.
        triton_ops.reshape_and_cache_flash(
            key, value, key_cache, value_cache, attn_metadata.slot_mapping,
            self.kv_cache_dtype, k_scale, v_scale)

        num_actual_tokens = attn_metadata.num_actual_tokens
        num_decode_tokens = attn_metadata.num_decode_tokens
        # Triton's launches need no alibi (rejected in __init__) and no descales (the
        # cache is never fp8 here).
        if not self.decode_with_xformers:
            # One unified launch over decodes and prefills alike.
            unified_step(self, attn_metadata, query[:num_actual_tokens], key_cache,
                         value_cache, output[:num_actual_tokens])
            return output
        if prefill_meta := attn_metadata.prefill_metadata:
            unified_step(self, prefill_meta, query[num_decode_tokens:num_actual_tokens],
                         key_cache, value_cache, output[num_decode_tokens:num_actual_tokens])
        if decode_meta := attn_metadata.decode_metadata:
            self._decode(query[:num_decode_tokens], key_cache, value_cache, decode_meta,
                         output[:num_decode_tokens])
        return output

    def _decode(self, decode_query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, decode_meta: XFormersAttentionMetadata,
                output: torch.Tensor) -> None:
        """xformers over the whole paged cache as one flat key sequence, the paged bias
        selecting each decode's own keys."""
        problems = xformers_problems(DeviceCapability(0, 0) if decode_query.device.type == "cpu"
                                     else None)
        if problems:
            raise RuntimeError(f"XFORMERS_VLLM_V1 cannot run its decode path here: "
                               f"{'; '.join(problems)}")
        import xformers.ops as xops

        # [1, tokens, kv heads, queries per kv head, head size]: xformers' GQA layout.
        q = decode_query.view(1, -1, self.num_kv_heads, self.num_queries_per_kv,
                              self.head_size)
        grouped = (1, -1, self.num_kv_heads, self.num_queries_per_kv, self.head_size)
        cache_k = key_cache.view(1, -1, self.num_kv_heads, 1, self.head_size).expand(grouped)
        cache_v = value_cache.view(1, -1, self.num_kv_heads, 1, self.head_size).expand(grouped)
        output.copy_(xops.memory_efficient_attention_forward(
            q, cache_k, cache_v, attn_bias=decode_meta.attn_bias, p=0.0, scale=self.scale,
        ).view(decode_query.shape))
