"""Stand-in model-runner and scheduler types that the v0 helpers of
:mod:`pagedattn.compat.vllm_v0` (re-exported by :mod:`pagedattn.backends.utils`) read.

vLLM drives those helpers with objects from its model runner and scheduler
(``ModelInputForGPUBuilder.InterDataForSeqGroup``, ``ModelRunnerBase``, the v1
``ReorderableBatch`` and ``ScheduledTokens``). Those objects carry far more than attention
needs, so this module defines small validated dataclasses that carry exactly the fields
the helpers read; an engine fills them (or duck-types them) and the helpers stay pure.

Two families live here:

* the prefill/decode ("v0") path used by ``CommonMetadataBuilder`` and
  ``CommonAttentionState``: :class:`SeqGroupInput`, :class:`MetadataInputBuilder`,
  :class:`ModelRunnerInfo`, :class:`GraphCaptureBackend` and the metadata they produce,
  :class:`PrefillDecodeMetadata` (prefills first, then decodes);
* the v1 batch-reorder path: :class:`ReorderableBatch` and :class:`ScheduledTokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from pagedattn.checks import is_int, require_int


# vLLM's runner hands these types numpy integers as often as ints: both are accepted here.
def _is_int(value: Any) -> bool:
    return is_int(value, numpy=True)


def _check_int(name: str, value: Any, minimum: int) -> None:
    require_int(name, value, minimum, numpy=True)


def _check_int_list(name: str, values: Any, minimum: int) -> None:
    for i, v in enumerate(values):
        _check_int(f"{name}[{i}]", v, minimum)


_ENCODER_FIELDS = ("encoder_seq_lens", "encoder_seq_lens_tensor", "max_encoder_seq_len",
                   "num_encoder_tokens", "cross_slot_mapping", "cross_block_tables")


def is_all_encoder_attn_metadata_set(attn_metadata: Any) -> bool:
    """All metadata encoder attention needs is set."""
    return (attn_metadata.encoder_seq_lens is not None
            and attn_metadata.encoder_seq_lens_tensor is not None
            and attn_metadata.max_encoder_seq_len is not None)


def is_all_cross_attn_metadata_set(attn_metadata: Any) -> bool:
    """All metadata cross attention needs is set: the encoder's (read through the
    metadata's own ``is_all_encoder_attn_metadata_set``) plus the cross cache map."""
    return (attn_metadata.is_all_encoder_attn_metadata_set
            and attn_metadata.cross_slot_mapping is not None
            and attn_metadata.cross_block_tables is not None)


# --------------------------------------------------------------------------------------
# prefill/decode path
# --------------------------------------------------------------------------------------


@dataclass
class SeqGroupInput:
    """What ``CommonMetadataBuilder`` reads from one sequence group of a step
    (vLLM's ``InterDataForSeqGroup``). Every per-sequence list has one entry per
    ``seq_ids`` entry, in the same order.

    Attributes:
        is_prompt: the group is in its prompt (prefill) phase; otherwise every sequence
            decodes exactly one token this step.
        seq_ids: sequence ids, keys of ``block_tables``.
        input_tokens: token ids scheduled this step, one list per sequence; its length
            is the sequence's query length.
        orig_seq_lens: true total length of each sequence after this step
            (``context_len + query_len``).
        seq_lens: the length attention sees (may be clipped to the sliding window for
            decodes, so ``seq_lens[i] <= orig_seq_lens[i]``).
        query_lens: tokens computed this step.
        context_lens: tokens already in the KV cache before this step.
        curr_sliding_window_blocks: ``0`` = use the whole block table, ``n > 0`` = only
            the last ``n`` blocks are live (sliding window).
        block_tables: ``{seq_id: [physical block id, ...]}`` covering positions
            ``[0, orig_seq_len)``; ``None`` (or all values ``None``) marks a memory
            profiling run, whose slots are all ``PAD_SLOT_ID``.
        prefix_cache_hit: the prompt reuses cached blocks, so the full block table is
            passed to attention even without chunked prefill.
        multi_modal_placeholder_maps: optional ``{modality: [placeholder index, ...]}``;
            concatenated over the prompt groups of the batch.
    """

    is_prompt: bool
    seq_ids: list[int]
    input_tokens: list[list[int]]
    orig_seq_lens: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    context_lens: list[int]
    curr_sliding_window_blocks: list[int] | None = None
    block_tables: dict[int, list[int] | None] | None = None
    prefix_cache_hit: bool = False
    multi_modal_placeholder_maps: dict[str, list[int]] | None = None

    def __post_init__(self) -> None:
        n = len(self.seq_ids)
        if self.curr_sliding_window_blocks is None:
            self.curr_sliding_window_blocks = [0] * n
        for name in ("input_tokens", "orig_seq_lens", "seq_lens", "query_lens",
                     "context_lens", "curr_sliding_window_blocks"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(
                    f"{name} must have one entry per seq_id ({n} seq_ids {self.seq_ids}), "
                    f"got {got}"
                )
        for name in ("orig_seq_lens", "seq_lens", "query_lens", "context_lens",
                     "curr_sliding_window_blocks"):
            _check_int_list(name, getattr(self, name), 0)
        for i, seq_id in enumerate(self.seq_ids):
            q, c, s = self.query_lens[i], self.context_lens[i], self.orig_seq_lens[i]
            if len(self.input_tokens[i]) != q:
                raise ValueError(
                    f"seq {seq_id}: len(input_tokens) must equal query_len {q}, "
                    f"got {len(self.input_tokens[i])}"
                )
            if c + q != s:
                raise ValueError(
                    f"seq {seq_id}: expected context_len + query_len == orig_seq_len, got "
                    f"{c} + {q} != {s}"
                )
            if self.seq_lens[i] > s:
                raise ValueError(
                    f"seq {seq_id}: seq_len {self.seq_lens[i]} exceeds orig_seq_len {s}"
                )
            if self.block_tables is not None and seq_id not in self.block_tables:
                raise ValueError(
                    f"seq {seq_id} has no entry in block_tables "
                    f"(keys: {sorted(self.block_tables)})"
                )


@runtime_checkable
class GraphCaptureBackend(Protocol):
    """The two backend hooks the prefill/decode helpers call."""

    def get_name(self) -> str: ...

    def make_metadata(self, **kwargs: Any) -> Any: ...


@dataclass
class ModelRunnerInfo:
    """What the builder and the graph-capture state read from the model runner.

    Attributes:
        device: where metadata tensors and graph buffers live.
        attn_backend: provides ``get_name()`` and ``make_metadata(**fields)``.
        graph_block_tables: ``int32 [max_graph_batch_size, max_blocks_per_seq]`` host
            array, the template of the block table a captured graph reads.
        max_seq_len_to_capture: the decode seq-len bound graphs are captured for.
        pin_memory: stage host tensors in pinned memory before the device copy (only
            meaningful for CUDA devices).
    """

    device: torch.device | str = "cpu"
    attn_backend: Any = None
    graph_block_tables: np.ndarray = field(
        default_factory=lambda: np.zeros((0, 0), dtype=np.int32))
    max_seq_len_to_capture: int = 8192
    pin_memory: bool = False

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if not isinstance(self.graph_block_tables, np.ndarray) or self.graph_block_tables.ndim != 2:
            raise ValueError(
                "graph_block_tables must be a 2-D numpy array [max_batch, max_blocks], got "
                f"{type(self.graph_block_tables).__name__} with shape "
                f"{getattr(self.graph_block_tables, 'shape', None)}"
            )
        if not np.issubdtype(self.graph_block_tables.dtype, np.integer):
            raise ValueError(
                f"graph_block_tables must hold integers, got dtype {self.graph_block_tables.dtype}"
            )
        _check_int("max_seq_len_to_capture", self.max_seq_len_to_capture, 1)
        if self.attn_backend is not None and not isinstance(self.attn_backend, GraphCaptureBackend):
            raise TypeError(
                "attn_backend must provide get_name() and make_metadata(**kwargs), got "
                f"{type(self.attn_backend).__name__}"
            )

    def get_max_block_per_batch(self) -> int:
        """Width of the captured block table (blocks per sequence)."""
        return int(self.graph_block_tables.shape[1])


@dataclass
class MetadataInputBuilder:
    """What ``CommonMetadataBuilder`` reads from vLLM's ``ModelInputForGPUBuilder``.

    ``sliding_window``: window in tokens, ``None`` = full attention.
    """

    runner: ModelRunnerInfo
    block_size: int
    inter_data_list: list[SeqGroupInput] = field(default_factory=list)
    sliding_window: int | None = None
    chunked_prefill_enabled: bool = False

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, 1)


@dataclass
class PrefillDecodeMetadata:
    """Attention metadata of a batch laid out prefills first, then decodes.

    Token-level tensors cover ``num_prefill_tokens + num_decode_tokens`` tokens,
    request-level tensors ``num_prefills + num_decodes`` requests. Sentinels: a slot of
    ``PAD_SLOT_ID`` (-1) is not written; block-table padding is block 0 (never read,
    since ``seq_lens`` bounds every read).

    Attributes:
        slot_mapping: ``int64 [num_tokens]`` flat cache slot per token.
        seq_lens: host list of per-request lengths (``None`` in captured graphs).
        seq_lens_tensor: ``int32 [num_reqs]`` per-request KV length.
        query_start_loc: ``int32 [num_reqs + 1]`` or ``None``.
        seq_start_loc: ``int32 [num_reqs + 1]`` or ``None``.
        context_lens_tensor: ``int32 [num_reqs]`` tokens cached before this step, or
            ``None``.
        block_tables: ``int32 [num_reqs, max_blocks]``.
        encoder_* / cross_*: encoder lengths and the cross-attention cache map, ``None``
            for decoder-only models.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    seq_lens_tensor: torch.Tensor | None
    block_tables: torch.Tensor | None
    max_query_len: int | None = None
    max_prefill_seq_len: int = 0
    max_decode_seq_len: int = 0
    seq_lens: list[int] | None = None
    query_start_loc: torch.Tensor | None = None
    seq_start_loc: torch.Tensor | None = None
    context_lens_tensor: torch.Tensor | None = None
    use_cuda_graph: bool = False
    max_decode_query_len: int | None = None
    multi_modal_placeholder_index_maps: dict[str, Any] | None = None
    enable_kv_scales_calculation: bool = True
    encoder_seq_lens: list[int] | torch.Tensor | None = None
    encoder_seq_lens_tensor: torch.Tensor | None = None
    max_encoder_seq_len: int | None = None
    num_encoder_tokens: int | None = None
    cross_slot_mapping: torch.Tensor | None = None
    cross_block_tables: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_int("num_prefills", self.num_prefills, 0)
        _check_int("num_prefill_tokens", self.num_prefill_tokens, 0)
        _check_int("num_decode_tokens", self.num_decode_tokens, 0)
        n_tok = self.num_prefill_tokens + self.num_decode_tokens
        if self.slot_mapping.dim() != 1 or self.slot_mapping.numel() != n_tok:
            raise ValueError(
                f"slot_mapping must be 1-D with num_prefill_tokens + num_decode_tokens = "
                f"{n_tok} entries, got shape {tuple(self.slot_mapping.shape)}"
            )

    @property
    def is_all_encoder_attn_metadata_set(self) -> bool:
        return is_all_encoder_attn_metadata_set(self)

    @property
    def is_all_cross_attn_metadata_set(self) -> bool:
        return is_all_cross_attn_metadata_set(self)

    def _encoder_fields(self) -> dict[str, Any]:
        """The encoder and cross-attention fields, which the prefill and decode views keep
        whole: they describe the encoder's tokens, which the split does not divide."""
        return {name: getattr(self, name) for name in _ENCODER_FIELDS}

    @property
    def prefill_metadata(self) -> "PrefillDecodeMetadata | None":
        """The prefill part (views of this object's tensors), ``None`` if no prefill."""
        if self.num_prefills == 0:
            return None
        p, pt = self.num_prefills, self.num_prefill_tokens

        def head(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
            return None if t is None else t[:n]

        return PrefillDecodeMetadata(
            num_prefills=p,
            num_prefill_tokens=pt,
            num_decode_tokens=0,
            slot_mapping=self.slot_mapping[:pt],
            seq_lens=None if self.seq_lens is None else list(self.seq_lens[:p]),
            seq_lens_tensor=head(self.seq_lens_tensor, p),
            max_query_len=self.max_query_len,
            max_prefill_seq_len=self.max_prefill_seq_len,
            max_decode_seq_len=0,
            query_start_loc=head(self.query_start_loc, p + 1),
            seq_start_loc=head(self.seq_start_loc, p + 1),
            context_lens_tensor=head(self.context_lens_tensor, p),
            block_tables=head(self.block_tables, p),
            use_cuda_graph=False,
            multi_modal_placeholder_index_maps=self.multi_modal_placeholder_index_maps,
            enable_kv_scales_calculation=self.enable_kv_scales_calculation,
            **self._encoder_fields(),
        )

    @property
    def decode_metadata(self) -> "PrefillDecodeMetadata | None":
        """The decode part, ``None`` if no decode.

        Its tensors are *views* of this object's tensors, so a graph runner that copies
        new values into them (``prepare_graph_input_buffers``) writes into the very
        buffers a captured graph reads.
        """
        if self.num_decode_tokens == 0:
            return None
        p, pt = self.num_prefills, self.num_prefill_tokens

        def tail(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[p:]

        qsl = None
        if self.query_start_loc is not None:
            qsl = self.query_start_loc[p:] - self.query_start_loc[p]
        return PrefillDecodeMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=self.num_decode_tokens,
            slot_mapping=self.slot_mapping[pt:],
            seq_lens=None,
            seq_lens_tensor=tail(self.seq_lens_tensor),
            max_query_len=self.max_decode_query_len or 1,
            max_decode_query_len=self.max_decode_query_len,
            max_prefill_seq_len=0,
            max_decode_seq_len=self.max_decode_seq_len,
            query_start_loc=qsl,
            seq_start_loc=None,
            context_lens_tensor=tail(self.context_lens_tensor),
            block_tables=tail(self.block_tables),
            use_cuda_graph=self.use_cuda_graph,
            enable_kv_scales_calculation=self.enable_kv_scales_calculation,
            **self._encoder_fields(),
        )


# --------------------------------------------------------------------------------------
# v1 batch reorder path
# --------------------------------------------------------------------------------------


@dataclass
class ScheduledTokens:
    """``num_scheduled_tokens``: ``{req_id: tokens scheduled this step}`` (>= 0)."""

    num_scheduled_tokens: dict[str, int]

    def __post_init__(self) -> None:
        for req_id, n in self.num_scheduled_tokens.items():
            _check_int(f"num_scheduled_tokens[{req_id!r}]", n, 0)


@dataclass
class ReorderableBatch:
    """The persistent per-request state of the running batch, one row per request.

    Attributes:
        req_ids: request id of each row.
        num_computed_tokens_cpu: ``int32 [num_reqs]`` tokens already in the KV cache.
        num_prompt_tokens: ``int32 [num_reqs]`` prompt length of each request.

    ``swap_states(i, j)`` exchanges every per-row field of rows ``i`` and ``j``, so a
    request's state always travels with its id.
    """

    req_ids: list[str]
    num_computed_tokens_cpu: np.ndarray | None = None
    num_prompt_tokens: np.ndarray | None = None
    req_id_to_index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        if len(set(self.req_ids)) != n:
            raise ValueError(f"req_ids must be unique, got {self.req_ids}")
        for name in ("num_computed_tokens_cpu", "num_prompt_tokens"):
            arr = getattr(self, name)
            arr = np.zeros(n, dtype=np.int32) if arr is None else np.array(arr, dtype=np.int32)
            if arr.shape != (n,):
                raise ValueError(
                    f"{name} must have shape ({n},) (one entry per req_id), got {arr.shape}"
                )
            if (arr < 0).any():
                raise ValueError(f"{name} must be >= 0, got {arr.tolist()}")
            setattr(self, name, arr)
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def swap_states(self, i: int, j: int) -> None:
        n = self.num_reqs
        for name, idx in (("i", i), ("j", j)):
            require_int(f"swap index {name}", idx, 0, maximum=n - 1, numpy=True,
                        expected=f"in [0, {n})")
        if i == j:
            return
        ids = self.req_ids
        ids[i], ids[j] = ids[j], ids[i]
        self.req_id_to_index[ids[i]] = i
        self.req_id_to_index[ids[j]] = j
        for arr in (self.num_computed_tokens_cpu, self.num_prompt_tokens):
            arr[[i, j]] = arr[[j, i]]
