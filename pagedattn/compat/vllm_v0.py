"""vLLM's v0 attention helpers, kept for code written against that interface.

This is a compatibility layer, not the core: the engine and the v1 backends build their
metadata from :class:`pagedattn.common_metadata.CommonAttentionMetadata` and translate
indices with :mod:`pagedattn.paging`. What lives here serves callers written against
vLLM's v0 model runner: the prefill-first :class:`CommonMetadataBuilder`, the
graph-capture buffers of :class:`~pagedattn.compat.graph_state.CommonAttentionState`,
the per-sequence slot mapping,
MLA dimensions and the encoder/decoder argument helpers. Their inputs are the stand-in
runner types of :mod:`pagedattn.compat.runner_types`.

``pagedattn.backends.utils`` re-exports every name, so the seed's import path works.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from pagedattn import paging
from pagedattn.backend import AttentionType
from pagedattn.compat.runner_types import (
    MetadataInputBuilder,
    PrefillDecodeMetadata,
    SeqGroupInput,
)
from pagedattn.compat.runner_types import _check_int as _require_int

logger = logging.getLogger(__name__)

PAD_SLOT_ID = paging.PAD_SLOT_ID

STR_NOT_IMPL_ENC_DEC_ROCM_HIP = (
    "ROCm/HIP is not currently supported with encoder/decoder models."
)

TAttentionMetadata = TypeVar("TAttentionMetadata")

# Below this many slots the per-element python loop beats numpy's array setup cost.
_COMPUTE_SLOT_MAPPING_NUMPY_NUMEL = 256


# --------------------------------------------------------------------------------------
# Paging: pure index translation
# --------------------------------------------------------------------------------------


def slot_for_position(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Flat cache slot of absolute token ``position``.

    ``block_table[position // block_size] * block_size + position % block_size``; e.g.
    ``block_table=[7, 2]``, ``block_size=4``: position 5 -> block 2, offset 1 -> slot 9.
    """
    return paging.slots_for_positions(block_table, position, block_size)


def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold positions ``[0, num_tokens)``: ``ceil(num_tokens / block_size)``."""
    return paging.cdiv(num_tokens, block_size)


def _compute_slot_mapping_python(slot_mapping: list[int], block_table: Sequence[int],
                                 range_start: int, range_end: int, block_size: int) -> None:
    """Append the slots of positions ``[range_start, range_end)`` one by one."""
    for pos in range(range_start, range_end):
        slot_mapping.append(slot_for_position(block_table, pos, block_size))


def _compute_slot_mapping_numpy(slot_mapping: list[int], block_table: Sequence[int],
                                range_start: int, range_end: int, block_size: int) -> None:
    """Vectorised twin of :func:`_compute_slot_mapping_python` (same values, python
    ints)."""
    positions = np.arange(range_start, range_end, dtype=np.int64)
    slots = paging.slots_for_positions(np.asarray(block_table, dtype=np.int64), positions,
                                       block_size)
    slot_mapping.extend(slots.tolist())


def compute_slot_mapping_start_idx(is_prompt: bool, query_len: int, context_len: int,
                                   sliding_window: int | None) -> int:
    """First prompt position whose K/V must be cached.

    With a sliding window only the last ``sliding_window`` prompt tokens can ever be
    attended to again, so a prompt skips its first ``max(0, query_len - sliding_window)``
    tokens; decodes and full-attention layers start at 0. ``context_len`` is accepted
    for interface parity and not used.
    """
    _require_int("query_len", query_len, 0)
    _require_int("context_len", context_len, 0)
    if sliding_window is not None:
        _require_int("sliding_window", sliding_window, 1)
    if is_prompt and sliding_window is not None:
        return max(0, query_len - sliding_window)
    return 0


def compute_slot_mapping(is_profile_run: bool, slot_mapping: list[int], seq_id: int,
                         seq_len: int, context_len: int, start_idx: int, block_size: int,
                         block_tables: dict[int, Sequence[int] | None] | None) -> None:
    """Append the cache slots of sequence ``seq_id``'s new tokens to ``slot_mapping``.

    The new tokens are positions ``[context_len, seq_len)``; positions below
    ``start_idx`` (sliding-window prefix, see :func:`compute_slot_mapping_start_idx`)
    get :data:`PAD_SLOT_ID`. In a profiling run (no block tables yet) all ``seq_len``
    entries are :data:`PAD_SLOT_ID`.

    Example (prompt of 10 tokens, sliding window 8, block size 4, ring-reused block
    table ``[0, 1, 0]``; ``start_idx = 10 - 8 = 2``)::

        position   0   1   2 3 4 5 6 7 8 9
        block      -   -   0 0 1 1 1 1 0 0
        slot      -1  -1   2 3 4 5 6 7 0 1

    Appends ``seq_len - context_len`` entries (``seq_len`` in a profiling run). Runs
    above :data:`_COMPUTE_SLOT_MAPPING_NUMPY_NUMEL` slots take the numpy path, which
    yields the same values as the python loop.

    Raises:
        ValueError: bad ``block_size``, lengths out of order (``context_len > seq_len``,
            negatives), ``seq_id`` missing from ``block_tables``, or a block table too
            short for ``seq_len`` / holding negative block ids.
    """
    _require_int("block_size", block_size, 1)
    _require_int("seq_len", seq_len, 0)
    _require_int("context_len", context_len, 0)
    _require_int("start_idx", start_idx, 0)
    if context_len > seq_len:
        raise ValueError(
            f"context_len must be <= seq_len, got context_len={context_len}, seq_len={seq_len}"
        )
    if is_profile_run:
        slot_mapping.extend([PAD_SLOT_ID] * seq_len)
        return

    padding_mask_len = max(0, start_idx - context_len)
    range_start = max(start_idx, context_len)
    range_end = seq_len
    numel = range_end - range_start

    if block_tables is None or seq_id not in block_tables or block_tables[seq_id] is None:
        keys = None if block_tables is None else sorted(block_tables)
        raise ValueError(
            f"seq_id {seq_id!r} has no block table (block_tables keys: {keys}); pass "
            "is_profile_run=True when block tables are not allocated yet"
        )
    block_table = block_tables[seq_id]
    if numel > 0:
        needed = num_blocks_needed(range_end, block_size)
        if len(block_table) < needed:
            raise ValueError(
                f"block table of seq {seq_id} has {len(block_table)} blocks, expected "
                f">= {needed} for seq_len={seq_len} with block_size={block_size}"
            )
        used = block_table[range_start // block_size:needed]
        if min(used) < 0:
            raise ValueError(
                f"block table of seq {seq_id} holds a negative block id: {list(used)}"
            )

    slot_mapping.extend([PAD_SLOT_ID] * padding_mask_len)
    if numel < _COMPUTE_SLOT_MAPPING_NUMPY_NUMEL:
        _compute_slot_mapping_python(slot_mapping, block_table, range_start, range_end,
                                     block_size)
    else:
        _compute_slot_mapping_numpy(slot_mapping, block_table, range_start, range_end,
                                    block_size)


def is_block_tables_empty(block_tables: dict | None) -> bool:
    """``True`` if ``block_tables`` is ``None`` or a dict whose values are all ``None``
    (the marker of a memory-profiling run)."""
    if block_tables is None:
        return True
    return isinstance(block_tables, dict) and all(v is None for v in block_tables.values())


def make_padded_block_tables(block_tables: Sequence[Sequence[int]], device: torch.device,
                             pad: int = 0, pin_memory: bool = False) -> torch.Tensor:
    """``int32 [len(block_tables), max_len]`` right-padded with ``pad`` (block 0 by
    default: padding is never read because ``seq_lens`` bounds every read)."""
    host = paging.pad_block_tables(block_tables, min_cols=0, pad=pad)
    return _to_device(host, device, pin_memory)


def _to_device(host: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
    if device.type == "cpu":
        return host
    if pin_memory:
        host = host.pin_memory()
    return host.to(device, non_blocking=pin_memory)


def _host_to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device,
                    pin_memory: bool) -> torch.Tensor:
    return _to_device(torch.tensor(list(values), dtype=dtype), device, pin_memory)


# --------------------------------------------------------------------------------------
# Prefill/decode metadata builder
# --------------------------------------------------------------------------------------


class CommonMetadataBuilder(Generic[TAttentionMetadata]):
    """Builds prefill/decode attention metadata from the step's sequence groups.

    Driven by a :class:`~pagedattn.backends._batch.MetadataInputBuilder`: ``build``
    walks ``inter_data_list`` (prompt groups first, as the engine orders them), computes
    each sequence's block table and slot mapping, and returns ``_metadata_cls(**fields)``
    (by default :class:`~pagedattn.backends._batch.PrefillDecodeMetadata`).
    """

    _metadata_cls: type = PrefillDecodeMetadata

    def __init__(self, input_builder: MetadataInputBuilder):
        self.input_builder = input_builder
        self.runner = input_builder.runner
        self.sliding_window = input_builder.sliding_window
        self.block_size = input_builder.block_size
        self.prepare()

    def prepare(self) -> None:
        """Reset the per-step accumulators."""
        self.slot_mapping: list[int] = []
        self.prefill_seq_lens: list[int] = []
        self.context_lens: list[int] = []
        self.block_tables: list[list[int]] = []
        self.curr_seq_lens: list[int] = []
        self.multimodal_placeholder_maps: dict[str, list[int]] = {}
        self.num_prefills = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    def _add_seq_group(self, inter_data: SeqGroupInput, chunked_prefill_enabled: bool) -> None:
        is_prompt = inter_data.is_prompt
        block_tables = inter_data.block_tables
        is_profile_run = is_block_tables_empty(block_tables)
        per_seq = zip(inter_data.seq_ids, inter_data.input_tokens, inter_data.orig_seq_lens,
                      inter_data.seq_lens, inter_data.query_lens, inter_data.context_lens,
                      inter_data.curr_sliding_window_blocks)
        for seq_id, tokens, seq_len, curr_seq_len, query_len, context_len, window_blocks in per_seq:
            self.context_lens.append(context_len)
            if is_prompt:
                for modality, placeholders in (inter_data.multi_modal_placeholder_maps or {}).items():
                    self.multimodal_placeholder_maps.setdefault(modality, []).extend(placeholders)
                self.num_prefills += 1
                self.num_prefill_tokens += len(tokens)
                self.prefill_seq_lens.append(seq_len)
            else:
                if query_len != 1:
                    raise ValueError(
                        f"a decode sequence must have query_len 1, got seq {seq_id}: "
                        f"seq_len={seq_len}, context_len={context_len}, query_len={query_len}"
                    )
                self.num_decode_tokens += query_len
                self.curr_seq_lens.append(curr_seq_len)

            # Attention reads cached blocks only when the step has a cached prefix
            # (prefix hit, chunked prefill, decode); a fresh prompt attends to itself.
            block_table: list[int] = []
            if not is_profile_run:
                full = list(block_tables[seq_id] or [])
                if inter_data.prefix_cache_hit:
                    block_table = full
                elif chunked_prefill_enabled or not is_prompt:
                    block_table = full[-window_blocks:] if window_blocks else full
            self.block_tables.append(block_table)

            start_idx = compute_slot_mapping_start_idx(is_prompt, query_len, context_len,
                                                       self.sliding_window)
            compute_slot_mapping(is_profile_run, self.slot_mapping, seq_id, seq_len,
                                 context_len, start_idx, self.block_size, block_tables)

    def build(self, seq_lens: list[int], query_lens: list[int], cuda_graph_pad_size: int,
              batch_size: int) -> TAttentionMetadata:
        """Build the step's metadata with tensors on ``runner.device``.

        Args:
            seq_lens: per-request KV lengths, possibly padded to ``batch_size`` for a
                captured graph.
            query_lens: per-request query lengths (at least one, max > 0).
            cuda_graph_pad_size: extra decode slots to pad for a captured graph, ``-1``
                when no graph is used. Padded slots are :data:`PAD_SLOT_ID`.
            batch_size: the (possibly padded) batch size; with a graph, the number of
                rows of ``runner.graph_block_tables`` the block table takes.
        """
        self.prepare()
        for inter_data in self.input_builder.inter_data_list:
            self._add_seq_group(inter_data, self.input_builder.chunked_prefill_enabled)

        if not query_lens or max(query_lens) <= 0:
            raise ValueError(f"query_lens must hold at least one positive length, got {query_lens}")
        _require_int("cuda_graph_pad_size", cuda_graph_pad_size, -1)
        _require_int("batch_size", batch_size, 0)
        device = self.runner.device
        pin = self.runner.pin_memory
        use_captured_graph = cuda_graph_pad_size != -1

        max_query_len = max(query_lens)
        max_prefill_seq_len = max(self.prefill_seq_lens, default=0)
        max_decode_seq_len = max(self.curr_seq_lens, default=0)
        num_decode_tokens = self.num_decode_tokens
        query_start_loc = list(accumulate(query_lens, initial=0))
        seq_start_loc = list(accumulate(seq_lens, initial=0))

        if use_captured_graph:
            self.slot_mapping.extend([PAD_SLOT_ID] * cuda_graph_pad_size)
            num_decode_tokens = batch_size
            template = self.runner.graph_block_tables
            if batch_size > template.shape[0] or len(self.block_tables) > batch_size:
                raise ValueError(
                    f"captured batch_size {batch_size} must cover the {len(self.block_tables)} "
                    f"requests and fit graph_block_tables rows {template.shape[0]}"
                )
            width = template.shape[1]
            for i, row in enumerate(self.block_tables):
                if len(row) > width:
                    raise ValueError(
                        f"block table of request {i} has {len(row)} blocks, more than the "
                        f"captured width {width}"
                    )
            # A fresh table, not a view of the runner's array: rows of an earlier step
            # must not leak into this one.
            host = torch.zeros((batch_size, width), dtype=torch.int32)
            host[:len(self.block_tables)] = paging.pad_block_tables(self.block_tables,
                                                                    min_cols=width)
            block_tables = _to_device(host, device, pin)
        else:
            block_tables = make_padded_block_tables(self.block_tables, device, pin_memory=pin)

        return self._metadata_cls(
            num_prefills=self.num_prefills,
            slot_mapping=_host_to_device(self.slot_mapping, torch.long, device, pin),
            multi_modal_placeholder_index_maps=dict(self.multimodal_placeholder_maps),
            enable_kv_scales_calculation=True,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            seq_lens=list(seq_lens),
            seq_lens_tensor=_host_to_device(seq_lens, torch.int32, device, pin),
            max_query_len=max_query_len,
            max_prefill_seq_len=max_prefill_seq_len,
            max_decode_seq_len=max_decode_seq_len,
            query_start_loc=_host_to_device(query_start_loc, torch.int32, device, pin),
            seq_start_loc=_host_to_device(seq_start_loc, torch.int32, device, pin),
            context_lens_tensor=_host_to_device(self.context_lens, torch.int32, device, pin),
            block_tables=block_tables,
            use_cuda_graph=use_captured_graph,
        )


# --------------------------------------------------------------------------------------
# MLA
# --------------------------------------------------------------------------------------


@dataclass
class MLADims:
    """Multi-head latent attention dimensions (DeepSeek-V2/V3 style).

    ``q_lora_rank`` is ``None`` when queries are not low-rank compressed.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        if self.q_lora_rank is not None:
            _require_int("q_lora_rank", self.q_lora_rank, 1)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _require_int(name, getattr(self, name), 1)


def get_mla_dims(model_config: Any) -> MLADims:
    """Read :class:`MLADims` from ``model_config.hf_text_config`` (any attribute bag;
    ``q_lora_rank`` may be absent)."""
    cfg = getattr(model_config, "hf_text_config", None)
    if cfg is None:
        raise ValueError("model_config.hf_text_config is None; MLA dims need an HF-style "
                         "text config with kv_lora_rank, qk_nope_head_dim, "
                         "qk_rope_head_dim and v_head_dim")
    required = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [name for name in required if not hasattr(cfg, name)]
    if missing:
        raise ValueError(f"hf_text_config lacks the MLA attributes {missing}")
    return MLADims(q_lora_rank=getattr(cfg, "q_lora_rank", None),
                   **{name: getattr(cfg, name) for name in required})


# --------------------------------------------------------------------------------------
# Encoder/decoder helpers
# --------------------------------------------------------------------------------------


def get_num_prefill_decode_query_kv_tokens(attn_metadata, attn_type: Any) -> tuple[int, int, int]:
    """``(prefill query tokens, prefill key/value tokens, decode query tokens)``.

    Encoder attention runs in the prefill phase only, with the encoder tokens as both
    query and key; cross attention reads encoder keys for decoder queries; decoder and
    encoder-only self-attention use the decoder token counts for both.

    Raises:
        ValueError: unknown ``attn_type``, or ``num_encoder_tokens`` is ``None`` for
            encoder / encoder-decoder attention.
    """
    kind = AttentionType.parse(attn_type)
    if kind in (AttentionType.ENCODER, AttentionType.ENCODER_DECODER) \
            and attn_metadata.num_encoder_tokens is None:
        raise ValueError(f"{kind} attention needs attn_metadata.num_encoder_tokens, got None")
    if kind == AttentionType.ENCODER:
        return attn_metadata.num_encoder_tokens, attn_metadata.num_encoder_tokens, 0
    if kind == AttentionType.ENCODER_DECODER:
        return (attn_metadata.num_prefill_tokens, attn_metadata.num_encoder_tokens,
                attn_metadata.num_decode_tokens)
    return (attn_metadata.num_prefill_tokens, attn_metadata.num_prefill_tokens,
            attn_metadata.num_decode_tokens)


def get_seq_len_block_table_args(attn_metadata, is_prompt: bool, attn_type: Any) -> tuple:
    """``(seq_lens tensor, max seq len, block tables or None)`` for an attention call.

    decoder         -> decoder ``seq_lens_tensor``, ``max_prefill_seq_len`` (prompt) or
                       ``max_decode_seq_len``, ``block_tables``
    encoder_decoder -> ``encoder_seq_lens_tensor``, ``max_encoder_seq_len``,
                       ``cross_block_tables``
    encoder         -> ``encoder_seq_lens_tensor``, ``max_encoder_seq_len``, ``None``

    Raises:
        ValueError: ``attn_type`` is unknown or ``encoder_only`` (which keeps no paged
            KV and so has no block table).
    """
    kind = AttentionType.parse(attn_type)
    if kind == AttentionType.DECODER:
        max_seq_len = (attn_metadata.max_prefill_seq_len if is_prompt
                       else attn_metadata.max_decode_seq_len)
        return attn_metadata.seq_lens_tensor, max_seq_len, attn_metadata.block_tables
    if kind == AttentionType.ENCODER_DECODER:
        return (attn_metadata.encoder_seq_lens_tensor, attn_metadata.max_encoder_seq_len,
                attn_metadata.cross_block_tables)
    if kind == AttentionType.ENCODER:
        return attn_metadata.encoder_seq_lens_tensor, attn_metadata.max_encoder_seq_len, None
    supported = ", ".join(repr(t.value) for t in
                          (AttentionType.DECODER, AttentionType.ENCODER,
                           AttentionType.ENCODER_DECODER))
    raise ValueError(
        f"invalid attention type {kind.value!r} for get_seq_len_block_table_args; expected "
        f"one of {supported}"
    )
