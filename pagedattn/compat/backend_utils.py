"""Attention backend utilities with the names of vLLM's ``attention/backends/utils.py``,
importable at that path as :mod:`pagedattn.backends.utils` (a re-export of this module).

Two kinds of names are reachable here:

* the v1 decodes-first batch split (:func:`split_decodes_and_prefills`,
  :func:`reorder_batch_to_split_decodes_and_prefills`), thin users of
  :mod:`pagedattn.paging`, which holds all index translation (slot formula, block
  tables, the split itself);
* the v0 port -- ``CommonMetadataBuilder``, ``CommonAttentionState``,
  ``compute_slot_mapping``, MLA dims, the encoder/decoder helpers -- which lives in
  :mod:`pagedattn.compat.vllm_v0` with its stand-in runner types in
  :mod:`pagedattn.compat.runner_types`, re-exported so seed code keeps importing it from
  here.
"""

from __future__ import annotations

from pagedattn import paging
from pagedattn.compat.graph_state import (  # noqa: F401  (vLLM v0 names)
    AttentionState,
    CommonAttentionState,
)
from pagedattn.compat.runner_types import (  # noqa: F401  (vLLM v0 names)
    GraphCaptureBackend,
    ReorderableBatch,
    MetadataInputBuilder,
    ModelRunnerInfo,
    PrefillDecodeMetadata,
    ScheduledTokens,
    SeqGroupInput,
    is_all_cross_attn_metadata_set,
    is_all_encoder_attn_metadata_set,
)
from pagedattn.compat.vllm_v0 import (  # noqa: F401  (vLLM v0 names)
    _COMPUTE_SLOT_MAPPING_NUMPY_NUMEL,
    PAD_SLOT_ID,
    STR_NOT_IMPL_ENC_DEC_ROCM_HIP,
    CommonMetadataBuilder,
    MLADims,
    TAttentionMetadata,
    _compute_slot_mapping_numpy,
    _compute_slot_mapping_python,
    compute_slot_mapping,
    compute_slot_mapping_start_idx,
    get_mla_dims,
    get_num_prefill_decode_query_kv_tokens,
    get_seq_len_block_table_args,
    is_block_tables_empty,
    logger,
    make_padded_block_tables,
    num_blocks_needed,
    slot_for_position,
)


__all__ = [
    "AttentionState",
    "CommonAttentionState",
    "CommonMetadataBuilder",
    "GraphCaptureBackend",
    "MLADims",
    "MetadataInputBuilder",
    "ModelRunnerInfo",
    "PAD_SLOT_ID",
    "PrefillDecodeMetadata",
    "ReorderableBatch",
    "STR_NOT_IMPL_ENC_DEC_ROCM_HIP",
    "ScheduledTokens",
    "SeqGroupInput",
    "TAttentionMetadata",
    "_COMPUTE_SLOT_MAPPING_NUMPY_NUMEL",
    "_compute_slot_mapping_numpy",
    "_compute_slot_mapping_python",
    "compute_slot_mapping",
    "compute_slot_mapping_start_idx",
    "get_mla_dims",
    "get_num_prefill_decode_query_kv_tokens",
    "get_seq_len_block_table_args",
    "is_all_cross_attn_metadata_set",
    "is_all_encoder_attn_metadata_set",
    "is_block_tables_empty",
    "logger",
    "make_padded_block_tables",
    "num_blocks_needed",
    "reorder_batch_to_split_decodes_and_prefills",
    "slot_for_position",
    "split_decodes_and_prefills",
]

def split_decodes_and_prefills(common_attn_metadata, decode_threshold: int = 1,
                               require_uniform: bool = False) -> tuple[int, int, int, int]:
    """``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` of a batch
    already ordered decodes first, read from its metadata's ``num_reqs``,
    ``num_actual_tokens`` and ``query_start_loc_cpu``; see
    :func:`pagedattn.paging.split_decodes_and_prefills`."""
    num_reqs = common_attn_metadata.num_reqs
    qsl = common_attn_metadata.query_start_loc_cpu
    if qsl.dim() != 1 or qsl.numel() != num_reqs + 1:
        raise ValueError(
            f"query_start_loc_cpu must have num_reqs + 1 = {num_reqs + 1} entries, got "
            f"shape {tuple(qsl.shape)}")
    return paging.split_decodes_and_prefills(qsl, common_attn_metadata.num_actual_tokens,
                                             decode_threshold, require_uniform)


def reorder_batch_to_split_decodes_and_prefills(input_batch: ReorderableBatch,
                                                scheduler_output: ScheduledTokens,
                                                decode_threshold: int = 1) -> bool:
    """Move the decodes (``num_scheduled_tokens <= decode_threshold``) to the front of
    ``input_batch`` with the fewest ``swap_states`` calls; return whether it changed.
    See :func:`pagedattn.paging.reorder_batch_decodes_first`.

    Example (threshold 1): scheduled ``[5, 1, 3, 1]`` -> one swap (rows 0 and 3) ->
    ``[1, 1, 3, 5]``.
    """
    return paging.reorder_batch_decodes_first(
        input_batch, scheduler_output.num_scheduled_tokens, decode_threshold)
