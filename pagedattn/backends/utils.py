"""Attention backend utilities: slot mapping, prefill/decode metadata building,
graph-capture buffers, MLA dims, encoder/decoder helpers and the v1 decode/prefill
batch split.

Paging vocabulary used throughout. A request's token at absolute position ``pos`` lives
in physical block ``block_table[pos // block_size]`` at offset ``pos % block_size``; its
flat *slot* is ``block * block_size + offset``. A slot of :data:`PAD_SLOT_ID` (-1) means
"do not write this token" (profiling runs, tokens outside a sliding window, graph
padding); cache-writing ops skip it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from pagedattn.backends._batch import (
    InputBatch,
    MetadataInputBuilder,
    PrefillDecodeMetadata,
    SchedulerOutput,
    SeqGroupInput,
)

logger = logging.getLogger(__name__)

PAD_SLOT_ID = -1
"""Slot sentinel: the token is not written to the KV cache."""

STR_NOT_IMPL_ENC_DEC_ROCM_HIP = (
    "ROCm/HIP is not currently supported with encoder/decoder models."
)

TAttentionMetadata = TypeVar("TAttentionMetadata")

# Below this many slots the per-element python loop beats numpy's array setup cost.
_COMPUTE_SLOT_MAPPING_NUMPY_NUMEL = 256

# Backends whose metadata carries the encoder/cross-attention fields graph capture fills.
_ENC_DEC_GRAPH_BACKENDS = ("XFORMERS", "FLASH_ATTN", "ROCM_FLASH")

# AttentionType values (pagedattn.backend.AttentionType is a str-enum with these values;
# comparing by value keeps this module importable on its own).
_DECODER = "decoder"
_ENCODER = "encoder"
_ENCODER_ONLY = "encoder_only"
_ENCODER_DECODER = "encoder_decoder"
_ATTN_TYPES = (_DECODER, _ENCODER, _ENCODER_ONLY, _ENCODER_DECODER)


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _require_int(name: str, value: Any, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _attn_type_value(attn_type: Any) -> str:
    value = str(getattr(attn_type, "value", attn_type))
    if value not in _ATTN_TYPES:
        raise ValueError(f"invalid attention type {attn_type!r}; expected one of {_ATTN_TYPES}")
    return value


# --------------------------------------------------------------------------------------
# Paging: pure index translation
# --------------------------------------------------------------------------------------


def slot_for_position(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Flat cache slot of absolute token ``position``.

    ``block_table[position // block_size] * block_size + position % block_size``; e.g.
    ``block_table=[7, 2]``, ``block_size=4``: position 5 -> block 2, offset 1 -> slot 9.
    """
    return block_table[position // block_size] * block_size + position % block_size


def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold positions ``[0, num_tokens)``: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


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
    blocks = np.asarray(block_table, dtype=np.int64)[positions // block_size]
    slot_mapping.extend((blocks * block_size + positions % block_size).tolist())


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
    width = max((len(b) for b in block_tables), default=0)
    host = np.full((len(block_tables), width), pad, dtype=np.int32)
    for i, row in enumerate(block_tables):
        host[i, :len(row)] = row
    return _to_device(torch.from_numpy(host), device, pin_memory)


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
            # A fresh copy, not a view of the runner's array: rows of an earlier step
            # must not leak into this one.
            host = np.zeros((batch_size, template.shape[1]), dtype=np.int32)
            for i, row in enumerate(self.block_tables):
                if len(row) > template.shape[1]:
                    raise ValueError(
                        f"block table of request {i} has {len(row)} blocks, more than the "
                        f"captured width {template.shape[1]}"
                    )
                host[i, :len(row)] = row
            block_tables = _to_device(torch.from_numpy(host), device, pin)
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
# Graph-capture state
# --------------------------------------------------------------------------------------


class AttentionState(ABC):
    """Per-backend state that owns the static input buffers of captured graphs."""

    @abstractmethod
    def graph_capture(self, max_batch_size: int): ...

    @abstractmethod
    def graph_clone(self, batch_size: int) -> "AttentionState": ...

    @abstractmethod
    def graph_capture_get_metadata_for_batch(self, batch_size: int,
                                             is_encoder_decoder_model: bool = False): ...

    @abstractmethod
    def get_graph_input_buffers(self, attn_metadata,
                                is_encoder_decoder_model: bool = False) -> dict[str, Any]: ...

    @abstractmethod
    def prepare_graph_input_buffers(self, input_buffers, attn_metadata,
                                    is_encoder_decoder_model: bool = False) -> None: ...

    @abstractmethod
    def begin_forward(self, model_input) -> None: ...


class CommonAttentionState(AttentionState):
    """Static decode buffers for graph capture and replay.

    Inside ``with state.graph_capture(max_batch_size):`` the state owns

    * ``_graph_slot_mapping``  ``int64 [max_batch_size]`` filled with PAD_SLOT_ID,
    * ``_graph_seq_lens``      ``int32 [max_batch_size]`` filled with 1,
    * ``_graph_block_tables``  ``int32 [max_batch_size, max_blocks]`` from
      ``runner.graph_block_tables``,

    all on ``runner.device``. Metadata for a captured batch of ``b`` decodes holds views
    ``[:b]`` of them, so a graph captured over that metadata (e.g.
    ``torch.cuda.graph``) reads those addresses; before each replay
    ``prepare_graph_input_buffers`` copies the step's values into the same storage.
    The slot mapping is the runner's to copy (it lives beside input ids/positions).
    """

    def __init__(self, runner: Any):
        self.runner = runner
        self._is_graph_capturing = False

    def _require_capturing(self, what: str) -> None:
        if not self._is_graph_capturing:
            raise RuntimeError(f"{what} is only valid inside `with state.graph_capture(...)`")

    def _require_enc_dec_backend(self) -> None:
        name = self.runner.attn_backend.get_name()
        if name not in _ENC_DEC_GRAPH_BACKENDS:
            raise NotImplementedError(
                f"graph capture of encoder/decoder models needs one of the backends "
                f"{_ENC_DEC_GRAPH_BACKENDS}, got {name!r}"
            )

    @contextmanager
    def graph_capture(self, max_batch_size: int) -> Iterator[None]:
        _require_int("max_batch_size", max_batch_size, 1)
        template = self.runner.graph_block_tables
        if template.shape[0] < max_batch_size:
            raise ValueError(
                f"runner.graph_block_tables has {template.shape[0]} rows, fewer than "
                f"max_batch_size={max_batch_size}"
            )
        device = self.runner.device
        self._is_graph_capturing = True
        self._graph_slot_mapping = torch.full((max_batch_size,), PAD_SLOT_ID,
                                              dtype=torch.long, device=device)
        self._graph_seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        self._graph_block_tables = torch.from_numpy(
            np.ascontiguousarray(template[:max_batch_size], dtype=np.int32)).to(device)
        try:
            yield
        finally:
            self._is_graph_capturing = False
            del self._graph_slot_mapping
            del self._graph_seq_lens
            del self._graph_block_tables

    def graph_clone(self, batch_size: int) -> "CommonAttentionState":
        self._require_capturing("graph_clone")
        return self.__class__(self.runner)

    def graph_capture_get_metadata_for_batch(self, batch_size: int,
                                             is_encoder_decoder_model: bool = False):
        """Decode-only metadata over the first ``batch_size`` rows of the buffers."""
        self._require_capturing("graph_capture_get_metadata_for_batch")
        capacity = self._graph_seq_lens.shape[0]
        if not _is_int(batch_size) or not 1 <= batch_size <= capacity:
            raise ValueError(f"batch_size must be in [1, {capacity}], got {batch_size!r}")
        attn_metadata = self.runner.attn_backend.make_metadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=batch_size,
            slot_mapping=self._graph_slot_mapping[:batch_size],
            multi_modal_placeholder_index_maps=None,
            enable_kv_scales_calculation=True,
            seq_lens=None,
            seq_lens_tensor=self._graph_seq_lens[:batch_size],
            max_query_len=1,
            max_decode_query_len=1,
            max_prefill_seq_len=0,
            max_decode_seq_len=self.runner.max_seq_len_to_capture,
            query_start_loc=None,
            seq_start_loc=None,
            context_lens_tensor=None,
            block_tables=self._graph_block_tables[:batch_size],
            use_cuda_graph=True,
        )
        if is_encoder_decoder_model:
            self._require_enc_dec_backend()
            self._update_captured_metadata_for_enc_dec_model(batch_size, attn_metadata)
        return attn_metadata

    def get_graph_input_buffers(self, attn_metadata,
                                is_encoder_decoder_model: bool = False) -> dict[str, Any]:
        decode = attn_metadata.decode_metadata
        input_buffers = {
            "slot_mapping": attn_metadata.slot_mapping,
            "seq_lens_tensor": decode.seq_lens_tensor,
            "block_tables": decode.block_tables,
        }
        if is_encoder_decoder_model:
            self._require_enc_dec_backend()
            self._add_additional_input_buffers_for_enc_dec_model(attn_metadata, input_buffers)
        return input_buffers

    def prepare_graph_input_buffers(self, input_buffers, attn_metadata,
                                    is_encoder_decoder_model: bool = False) -> None:
        """Copy this step's decode seq lens and block tables into the captured buffers
        (shapes must match the captured batch exactly)."""
        decode = attn_metadata.decode_metadata
        _copy_into(input_buffers, "seq_lens_tensor", decode.seq_lens_tensor)
        _copy_into(input_buffers, "block_tables", decode.block_tables)
        if is_encoder_decoder_model:
            self._require_enc_dec_backend()
            self._prepare_input_buffers_for_enc_dec_model(attn_metadata, input_buffers)

    def begin_forward(self, model_input) -> None:
        return

    def _update_captured_metadata_for_enc_dec_model(self, batch_size: int, attn_metadata) -> None:
        # Decode steps write no cross K/V, so the captured cross slot mapping is empty;
        # lengths of 1 and block 1 are placeholders replaced before every replay.
        device = self.runner.device
        attn_metadata.cross_slot_mapping = torch.tensor([], dtype=torch.int, device=device)
        attn_metadata.cross_block_tables = torch.full(
            (batch_size, self.runner.get_max_block_per_batch()), 1, dtype=torch.int,
            device=device)
        attn_metadata.encoder_seq_lens = torch.full((batch_size,), 1, dtype=torch.int,
                                                    device=device)
        attn_metadata.encoder_seq_lens_tensor = torch.full((batch_size,), 1, dtype=torch.int,
                                                           device=device)
        attn_metadata.max_encoder_seq_len = self.runner.max_seq_len_to_capture
        attn_metadata.num_encoder_tokens = 0

    def _add_additional_input_buffers_for_enc_dec_model(self, attn_metadata,
                                                        input_buffers: dict[str, Any]) -> None:
        decode = attn_metadata.decode_metadata
        input_buffers["encoder_seq_lens_tensor"] = decode.encoder_seq_lens_tensor
        input_buffers["cross_slot_mapping"] = decode.cross_slot_mapping
        input_buffers["cross_block_tables"] = decode.cross_block_tables

    def _prepare_input_buffers_for_enc_dec_model(self, attn_metadata,
                                                 input_buffers: dict[str, Any]) -> None:
        decode = attn_metadata.decode_metadata
        for name in ("encoder_seq_lens_tensor", "cross_slot_mapping", "cross_block_tables"):
            _copy_into(input_buffers, name, getattr(decode, name))


def _copy_into(input_buffers: dict[str, Any], name: str, src: torch.Tensor | None) -> None:
    dst = input_buffers[name]
    if src is None or tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"{name}: expected a tensor of the captured shape {tuple(dst.shape)}, got "
            f"{None if src is None else tuple(src.shape)}"
        )
    dst.copy_(src, non_blocking=True)


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
    kind = _attn_type_value(attn_type)
    if kind in (_ENCODER, _ENCODER_DECODER) and attn_metadata.num_encoder_tokens is None:
        raise ValueError(f"{kind} attention needs attn_metadata.num_encoder_tokens, got None")
    if kind == _ENCODER:
        return attn_metadata.num_encoder_tokens, attn_metadata.num_encoder_tokens, 0
    if kind == _ENCODER_DECODER:
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
    kind = _attn_type_value(attn_type)
    if kind == _DECODER:
        max_seq_len = (attn_metadata.max_prefill_seq_len if is_prompt
                       else attn_metadata.max_decode_seq_len)
        return attn_metadata.seq_lens_tensor, max_seq_len, attn_metadata.block_tables
    if kind == _ENCODER_DECODER:
        return (attn_metadata.encoder_seq_lens_tensor, attn_metadata.max_encoder_seq_len,
                attn_metadata.cross_block_tables)
    if kind == _ENCODER:
        return attn_metadata.encoder_seq_lens_tensor, attn_metadata.max_encoder_seq_len, None
    raise ValueError(
        f"invalid attention type {attn_type!r} for get_seq_len_block_table_args; expected "
        f"one of {(_DECODER, _ENCODER, _ENCODER_DECODER)}"
    )


def is_all_encoder_attn_metadata_set(attn_metadata) -> bool:
    """All metadata encoder attention needs is set."""
    return (attn_metadata.encoder_seq_lens is not None
            and attn_metadata.encoder_seq_lens_tensor is not None
            and attn_metadata.max_encoder_seq_len is not None)


def is_all_cross_attn_metadata_set(attn_metadata) -> bool:
    """All metadata cross attention needs is set (a superset of the encoder's)."""
    return (attn_metadata.is_all_encoder_attn_metadata_set
            and attn_metadata.cross_slot_mapping is not None
            and attn_metadata.cross_block_tables is not None)


# --------------------------------------------------------------------------------------
# v1: decodes-first batch split
# --------------------------------------------------------------------------------------


def split_decodes_and_prefills(common_attn_metadata, decode_threshold: int = 1,
                               require_uniform: bool = False) -> tuple[int, int, int, int]:
    """``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` of a batch
    already ordered decodes first (see :func:`reorder_batch_to_split_decodes_and_prefills`).

    Reads only ``max_query_len``, ``num_reqs``, ``num_actual_tokens`` and
    ``query_start_loc_cpu`` (``int32 [num_reqs + 1]``) of the metadata. A decode is a
    request with ``query_len <= decode_threshold``; the boundary is the first request
    above it. With ``require_uniform`` the decodes must also share the first request's
    query length (a batch where every length equals it, or is 0 = graph padding, is all
    decodes). Tokens beyond ``query_start_loc_cpu[-1]`` (padding up to
    ``num_actual_tokens``) count as prefill tokens.

    Example (threshold 1): query lens ``[1, 1, 5, 3]`` -> ``(2, 2, 2, 8)``.

    Raises:
        ValueError: ``decode_threshold < 1``, a ``query_start_loc_cpu`` that does not
            have ``num_reqs + 1`` entries, or (non-uniform) a decode after the first
            prefill, i.e. a batch that was not reordered.
    """
    _require_int("decode_threshold", decode_threshold, 1)
    max_query_len = common_attn_metadata.max_query_len
    num_reqs = common_attn_metadata.num_reqs
    num_tokens = common_attn_metadata.num_actual_tokens
    qsl = common_attn_metadata.query_start_loc_cpu
    if qsl.dim() != 1 or qsl.numel() != num_reqs + 1:
        raise ValueError(
            f"query_start_loc_cpu must have num_reqs + 1 = {num_reqs + 1} entries, got "
            f"shape {tuple(qsl.shape)}"
        )

    if max_query_len <= decode_threshold and (not require_uniform or decode_threshold <= 1):
        return num_reqs, 0, num_tokens, 0
    query_lens = qsl[1:] - qsl[:-1]
    if int(query_lens[0]) > decode_threshold:
        return 0, num_reqs, 0, num_tokens

    if require_uniform:
        first = query_lens[0]
        if bool(torch.all((query_lens == first) | (query_lens == 0))):
            return num_reqs, 0, num_tokens, 0
        is_prefill = query_lens != first
    else:
        is_prefill = query_lens > decode_threshold
    if not bool(torch.any(is_prefill)):
        return num_reqs, 0, num_tokens, 0

    first_prefill = int(torch.nonzero(is_prefill)[0])
    if not require_uniform:
        tail = query_lens[first_prefill:]
        stray = torch.nonzero((tail > 0) & (tail <= decode_threshold))
        if stray.numel():
            idx = first_prefill + int(stray[0])
            raise ValueError(
                f"request {idx} (query_len {int(query_lens[idx])}) is a decode after the "
                f"first prefill at {first_prefill}; reorder the batch with "
                "reorder_batch_to_split_decodes_and_prefills first"
            )
    num_decode_tokens = int(qsl[first_prefill])
    return (first_prefill, num_reqs - first_prefill, num_decode_tokens,
            num_tokens - num_decode_tokens)


def reorder_batch_to_split_decodes_and_prefills(input_batch: InputBatch,
                                                scheduler_output: SchedulerOutput,
                                                decode_threshold: int = 1) -> bool:
    """Move the decodes (``num_scheduled_tokens <= decode_threshold``) to the front of
    ``input_batch`` with the fewest ``swap_states`` calls; return whether it changed.

    With ``k`` decodes, every prefill in rows ``[0, k)`` is swapped with a decode in rows
    ``[k, n)`` (earliest misplaced prefill with latest misplaced decode), one swap per
    misplaced pair, which is minimal. A 1-token fresh prompt counts as a decode: for
    attention it is one query over its own key, and keeping the rule purely on query
    length keeps it consistent with :func:`split_decodes_and_prefills`.

    Example (threshold 1): scheduled ``[5, 1, 3, 1]`` -> one swap (rows 0 and 3) ->
    ``[1, 1, 3, 5]``.

    Raises:
        ValueError: ``decode_threshold < 1`` or a request of the batch missing from
            ``scheduler_output.num_scheduled_tokens``.
    """
    _require_int("decode_threshold", decode_threshold, 1)
    scheduled = scheduler_output.num_scheduled_tokens
    missing = [r for r in input_batch.req_ids if r not in scheduled]
    if missing:
        raise ValueError(f"requests {missing} of the input batch have no entry in "
                         "scheduler_output.num_scheduled_tokens")
    is_decode = [scheduled[r] <= decode_threshold for r in input_batch.req_ids]
    num_decodes = sum(is_decode)
    misplaced_prefills = [i for i in range(num_decodes) if not is_decode[i]]
    misplaced_decodes = [i for i in range(num_decodes, len(is_decode)) if is_decode[i]]
    for prefill_row, decode_row in zip(misplaced_prefills, reversed(misplaced_decodes)):
        input_batch.swap_states(prefill_row, decode_row)
    return bool(misplaced_prefills)
