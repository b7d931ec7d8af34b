"""``CommonAttentionMetadata``: one batch, in the form every backend's builder reads.

Re-exported by ``pagedattn.backend`` (its home in vLLM's interface); it lives in its
own file to keep the interface module short.

Worked example (3 requests, block_size 4)::

    request         0        1           2
    query_lens      1        3           2        (tokens computed this step)
    seq_lens        5        3           9        (context + query)
    computed        4        0           7        (= seq_lens - query_lens)
    query_start_loc [0,      1,          4,    6]
    query i of request r sits at absolute position  seq_lens[r] - query_lens[r] + i,
    so request 2's two queries are positions 7 and 8.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedattn import paging
from pagedattn.checks import require_int

__all__ = ["CommonAttentionMetadata"]

_warned_once: set[str] = set()
"""Names of the deprecated properties that have already warned in this process."""


def _warn_deprecated_once(name: str, advice: str) -> None:
    if name in _warned_once:
        return
    _warned_once.add(name)
    warnings.warn(
        f"CommonAttentionMetadata.{name} is deprecated: {advice}",
        DeprecationWarning,
        stacklevel=3,
    )


def _check_count(name: str, value: object) -> None:
    require_int(name, value, 0)


def _check_1d(name: str, t: object, min_len: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.numel() < min_len:
        raise ValueError(
            f"{name} must be 1-D with at least {min_len} entries, got shape {tuple(t.shape)}"
        )


def _int_list(name: str, values: Any) -> list[int]:
    if isinstance(values, (torch.Tensor, np.ndarray)):
        if values.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool):
            raise TypeError(f"{name}[{i}] must be an int, got {v!r}")
        try:
            v = operator.index(v)
        except TypeError:
            raise TypeError(f"{name}[{i}] must be an int, got {v!r}") from None
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
        out.append(v)
    return out


def _integer_tensor(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.is_floating_point() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    return t.to(dtype)


def _lens_block_table(block_table, seq_lens: list[int], block_size: int | None) -> torch.Tensor:
    """:meth:`CommonAttentionMetadata.from_lens`' block table: checked, or made."""
    num_reqs = len(seq_lens)
    if block_table is None:
        return paging.pad_block_tables(paging.contiguous_block_tables(seq_lens, block_size))
    bt = torch.as_tensor(block_table).to("cpu")
    if bt.dim() != 2 or bt.shape[0] != num_reqs:
        raise ValueError(
            f"block_table must have shape [num_reqs={num_reqs}, max_blocks], "
            f"got {tuple(bt.shape)}"
        )
    bt = _integer_tensor("block_table", bt, torch.int32)
    if block_size is not None:
        for r, sl in enumerate(seq_lens):
            if paging.cdiv(sl, block_size) > bt.shape[1]:
                raise ValueError(
                    f"request {r}: seq_len {sl} needs {paging.cdiv(sl, block_size)} "
                    f"blocks of {block_size}, block_table has {bt.shape[1]} columns"
                )
    return bt


def _lens_slot_mapping(slot_mapping, bt: torch.Tensor, query_lens: list[int],
                       seq_lens: list[int], block_size: int | None) -> torch.Tensor:
    """:meth:`CommonAttentionMetadata.from_lens`' slot mapping: checked, or derived."""
    if slot_mapping is None:
        return paging.slot_mapping_for_new_tokens(bt, query_lens, seq_lens, block_size)
    num_tokens = sum(query_lens)
    sm = torch.as_tensor(slot_mapping)
    if sm.dim() != 1 or sm.numel() < num_tokens:
        raise ValueError(
            f"slot_mapping must be 1-D with at least sum(query_lens)={num_tokens} "
            f"entries, got shape {tuple(sm.shape)}"
        )
    return _integer_tensor("slot_mapping", sm, torch.int64)


@dataclass
class CommonAttentionMetadata:
    """Per-batch attention metadata, shared by every layer and backend of a step.

    Builders read it to produce their per-layer metadata. Device tensors live on the
    model's device; ``*_cpu`` twins are host copies for planning without a device sync.
    Under CUDA-graph padding the request/token dimensions may be longer than
    ``num_reqs`` / the real token count; ``unpadded`` cuts them back.
    """

    query_start_loc: torch.Tensor
    """``(num_reqs + 1,)`` int32, device: exclusive prefix sum of query lengths; request
    r's query tokens are rows ``query_start_loc[r]:query_start_loc[r+1]``."""
    query_start_loc_cpu: torch.Tensor
    """``(num_reqs + 1,)`` int32, CPU copy of ``query_start_loc``."""

    seq_lens: torch.Tensor
    """``(num_reqs,)`` int32, device: each request's total length *including* this
    step's query tokens (context + query), i.e. how many keys its queries may see."""

    num_reqs: int
    """Number of requests."""
    num_actual_tokens: int
    """Total query tokens of the batch (may include CUDA-graph padding)."""
    max_query_len: int
    """Longest query in the batch."""
    max_seq_len: int
    """Longest ``seq_lens`` entry (may be an upper bound)."""

    block_table_tensor: torch.Tensor
    """``(num_reqs, max_blocks_per_req)`` int32, device: physical block ids; entry
    ``[r, i]`` holds request r's tokens ``i*block_size .. (i+1)*block_size - 1``.
    Columns past a request's last block are padding and never read."""
    slot_mapping: torch.Tensor
    """``(num_tokens,)`` int64, device: cache slot of each query token,
    ``paging.slots_for_positions`` of its position; ``-1``
    (PAD_SLOT_ID) marks padding tokens whose K/V are not written."""

    causal: bool = True
    """Causal mask (decoder) or bidirectional (encoder)."""

    logits_indices_padded: torch.Tensor | None = None
    """``(num_logits_padded,)`` int64: token rows whose logits are needed (fast-prefill
    builders), padded; only the first ``num_logits_indices`` are real."""
    num_logits_indices: int | None = None

    encoder_seq_lens: torch.Tensor | None = None
    """``(num_reqs,)`` int32, device: encoder length per request (cross-attention)."""
    encoder_seq_lens_cpu: np.ndarray | None = None
    """``(num_reqs,)`` int32 numpy copy of ``encoder_seq_lens``."""

    dcp_local_seq_lens: torch.Tensor | None = None
    """``(num_reqs,)`` int32, device: the part of each sequence stored on this rank under
    decode context parallelism."""
    dcp_local_seq_lens_cpu: torch.Tensor | None = None
    """``(num_reqs,)`` int32, CPU copy of ``dcp_local_seq_lens``."""

    # Deprecated host copies, filled lazily by the properties below (or by from_lens).
    _seq_lens_cpu: torch.Tensor | None = None
    """``(num_reqs,)`` int32, CPU."""
    _num_computed_tokens_cpu: torch.Tensor | None = None
    """``(num_reqs,)`` int32, CPU: ``seq_lens - query_lens``."""
    _num_computed_tokens_cache: torch.Tensor | None = None
    """``(num_reqs,)`` int32, device: cache of ``compute_num_computed_tokens``."""

    def __post_init__(self) -> None:
        # Structural checks only: reading tensor values here would force a device sync
        # on every step.
        for name in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
            _check_count(name, getattr(self, name))
        n = self.num_reqs
        _check_1d("query_start_loc", self.query_start_loc, n + 1)
        _check_1d("query_start_loc_cpu", self.query_start_loc_cpu, n + 1)
        if self.query_start_loc_cpu.device.type != "cpu":
            raise ValueError(
                f"query_start_loc_cpu must be on the CPU, got {self.query_start_loc_cpu.device}"
            )
        if self.query_start_loc_cpu.numel() != self.query_start_loc.numel():
            raise ValueError(
                "query_start_loc_cpu and query_start_loc must have the same length, got "
                f"{self.query_start_loc_cpu.numel()} and {self.query_start_loc.numel()}"
            )
        _check_1d("seq_lens", self.seq_lens, n)
        bt = self.block_table_tensor
        if not isinstance(bt, torch.Tensor) or bt.dim() != 2 or bt.shape[0] < n:
            raise ValueError(
                f"block_table_tensor must be a 2-D tensor with at least num_reqs={n} rows, "
                f"got {tuple(bt.shape) if isinstance(bt, torch.Tensor) else type(bt).__name__}"
            )
        _check_1d("slot_mapping", self.slot_mapping, 0)

    @classmethod
    def from_lens(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: torch.Tensor | Sequence[Sequence[int]] | None = None,
        slot_mapping: torch.Tensor | Sequence[int] | None = None,
        causal: bool = True,
        device: torch.device | str = "cpu",
        *,
        block_size: int | None = None,
    ) -> CommonAttentionMetadata:
        """Build the metadata of a batch from per-request lengths (tests, examples).

        Args:
            query_lens: ``[num_reqs]`` new tokens per request (>= 0).
            seq_lens: ``[num_reqs]`` total tokens per request, ``>= query_lens[r]``.
            block_table: ``[num_reqs, max_blocks]`` block ids. ``None`` (needs
                ``block_size``): request r gets ``ceil(seq_lens[r] / block_size)``
                consecutive blocks, numbered from 0 after request r-1's, padded with 0.
            slot_mapping: ``[>= sum(query_lens)]`` slots (entries past the real tokens
                are padding, e.g. -1). ``None`` (needs ``block_size``): derived from
                the block table for positions ``seq_len - query_len .. seq_len - 1``.
            causal: causal (decoder) or bidirectional mask.
            device: where the device tensors go; ``*_cpu`` twins stay on the CPU.
            block_size: tokens per block; when given, the block table is checked to
                cover every request's ``seq_len``.

        Fills ``query_start_loc(_cpu)``, ``seq_lens``, the host copies of seq_lens and
        of the computed-token counts, ``num_reqs``, ``num_actual_tokens =
        sum(query_lens)``, ``max_query_len`` and ``max_seq_len`` (0 for no requests).

        Raises:
            ValueError: lengths differ, ``seq_len < query_len`` (naming the request), a
                block table too short for a request, a short slot mapping, or a missing
                ``block_size`` where one is needed.
            TypeError: non-integer lengths.
        """
        q = _int_list("query_lens", query_lens)
        s = _int_list("seq_lens", seq_lens)
        if len(q) != len(s):
            raise ValueError(
                f"query_lens and seq_lens must have one entry per request, got "
                f"{len(q)} and {len(s)}"
            )
        for r, (ql, sl) in enumerate(zip(q, s)):
            if sl < ql:
                raise ValueError(
                    f"request {r}: seq_len ({sl}) must be >= query_len ({ql}); seq_len "
                    "counts the context plus this step's query tokens"
                )
        if block_size is not None:
            require_int("block_size", block_size, 1)
        if block_size is None and (block_table is None or slot_mapping is None):
            raise ValueError(
                "block_size is required to derive a missing block_table or slot_mapping"
            )
        num_reqs, num_tokens = len(q), sum(q)

        bt = _lens_block_table(block_table, s, block_size)
        sm = _lens_slot_mapping(slot_mapping, bt, q, s, block_size)

        qsl_cpu = paging.query_start_loc(q)
        seq_lens_cpu = torch.tensor(s, dtype=torch.int32)
        computed_cpu = seq_lens_cpu - torch.tensor(q, dtype=torch.int32)
        return cls(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens_cpu.to(device),
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max(q, default=0),
            max_seq_len=max(s, default=0),
            block_table_tensor=bt.to(device),
            slot_mapping=sm.to(device),
            causal=causal,
            _seq_lens_cpu=seq_lens_cpu,
            _num_computed_tokens_cpu=computed_cpu,
        )

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        """Deprecated ``(num_reqs,)`` int32 host copy of ``seq_lens``.

        Reading it may force a device-to-host sync; use ``seq_lens`` (or
        ``seq_lens.cpu()`` where a host copy is really needed). Warns once per process.
        """
        _warn_deprecated_once(
            "seq_lens_cpu",
            "use the device seq_lens (or seq_lens.cpu() if a host copy is needed); "
            "the implicit device-to-host copy breaks async scheduling",
        )
        return self._host_seq_lens()

    @property
    def num_computed_tokens_cpu(self) -> torch.Tensor:
        """Deprecated ``(num_reqs,)`` int32 host ``seq_lens - query_lens``.

        Derive it from ``query_start_loc_cpu`` and ``seq_lens`` (or use
        ``compute_num_computed_tokens``) instead. Warns once per process.
        """
        _warn_deprecated_once(
            "num_computed_tokens_cpu",
            "use compute_num_computed_tokens() on device, or derive it from "
            "query_start_loc_cpu and seq_lens",
        )
        if self._num_computed_tokens_cpu is None:
            query_lens = self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]
            # Goes through the helper, not the property, so only one warning fires.
            self._num_computed_tokens_cpu = self._host_seq_lens() - query_lens
        return self._num_computed_tokens_cpu

    def _host_seq_lens(self) -> torch.Tensor:
        if self._seq_lens_cpu is None:
            self._seq_lens_cpu = self.seq_lens.to("cpu")
        return self._seq_lens_cpu

    def compute_num_computed_tokens(self) -> torch.Tensor:
        """``(num_reqs,)`` tokens already in the cache per request
        (``seq_lens - query_lens``), on the device; computed once and cached."""
        if self._num_computed_tokens_cache is None:
            query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            self._num_computed_tokens_cache = self.seq_lens - query_lens
        return self._num_computed_tokens_cache

    def unpadded(self, num_actual_tokens: int, num_actual_reqs: int) -> CommonAttentionMetadata:
        """A view of the first ``num_actual_reqs`` requests and ``num_actual_tokens``
        tokens, dropping CUDA-graph padding. Tensors are slices (no copies);
        ``max_query_len``/``max_seq_len`` stay as (upper-bound) values; the device
        computed-tokens cache is not carried over.

        Raises:
            ValueError: either count is negative or exceeds this metadata's.
        """
        _check_count("num_actual_tokens", num_actual_tokens)
        _check_count("num_actual_reqs", num_actual_reqs)
        if num_actual_reqs > self.num_reqs:
            raise ValueError(
                f"num_actual_reqs ({num_actual_reqs}) exceeds num_reqs ({self.num_reqs})"
            )
        if num_actual_tokens > self.slot_mapping.numel():
            raise ValueError(
                f"num_actual_tokens ({num_actual_tokens}) exceeds the "
                f"{self.slot_mapping.numel()} tokens of slot_mapping"
            )

        def reqs(x: Any) -> Any:
            return x[:num_actual_reqs] if x is not None else None

        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: num_actual_reqs + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: num_actual_reqs + 1],
            seq_lens=self.seq_lens[:num_actual_reqs],
            _seq_lens_cpu=reqs(self._seq_lens_cpu),
            _num_computed_tokens_cpu=reqs(self._num_computed_tokens_cpu),
            num_reqs=num_actual_reqs,
            num_actual_tokens=num_actual_tokens,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            block_table_tensor=self.block_table_tensor[:num_actual_reqs],
            slot_mapping=self.slot_mapping[:num_actual_tokens],
            causal=self.causal,
            logits_indices_padded=self.logits_indices_padded,
            num_logits_indices=self.num_logits_indices,
            encoder_seq_lens=reqs(self.encoder_seq_lens),
            encoder_seq_lens_cpu=reqs(self.encoder_seq_lens_cpu),
            dcp_local_seq_lens=reqs(self.dcp_local_seq_lens),
            dcp_local_seq_lens_cpu=reqs(self.dcp_local_seq_lens_cpu),
        )
