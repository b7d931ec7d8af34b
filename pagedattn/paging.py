"""Index translation for a paged KV cache, and nothing else.

Vocabulary. The KV cache is a pool of fixed-size *blocks* of ``block_size`` tokens. A
request's *block table* lists the physical blocks that hold its tokens in order: its token
at absolute position ``pos`` lives in block ``block_table[pos // block_size]`` at offset
``pos % block_size``. The flat *slot* of that token is ``block * block_size + offset``.
A slot of :data:`PAD_SLOT_ID` (-1) means "do not write this token" (padding, profiling
runs, tokens a sliding window will never read again); cache writers skip it.

Worked example (``block_size = 4``, block table ``[7, 2]``)::

    position   0  1  2  3 | 4  5  6  7
    block      7  7  7  7 | 2  2  2  2
    slot      28 29 30 31 | 8  9 10 11

Batches are ordered *decodes first*: requests whose query length is at most a threshold
(1 for plain decoding) come before the others, so kernels can treat the two groups as
contiguous ranges. :func:`decodes_first_swaps` computes the minimal row swaps that put a
batch in that order; :func:`split_decodes_and_prefills` reads the boundary back.

Everything here is a pure function of its arguments (python ints, numpy arrays or torch
tensors); nothing allocates cache memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedattn.checks import require_int

PAD_SLOT_ID = -1
"""Slot sentinel: the token is not written to the KV cache."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, e.g. the blocks that hold ``a`` tokens."""
    return -(-a // b)


def query_start_loc(query_lens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """int32 ``[num_reqs + 1]``: request r's tokens are rows ``[qsl[r], qsl[r + 1])``.

    Example: ``query_lens=[1, 3]`` -> ``[0, 1, 4]``.
    """
    lens = torch.as_tensor(query_lens, dtype=torch.int32)
    qsl = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=qsl[1:])
    return qsl


def blocks_and_offsets(block_table: Any, positions: Any, block_size: int,
                       req_indices: Any = None) -> tuple[Any, Any]:
    """``(block, offset)`` of each absolute position: ``block_table[pos // bs]`` and
    ``pos % bs``, the lookup every slot comes from (see :func:`slots_for_positions`).

    Works elementwise on python ints (with a list block table), numpy arrays and torch
    tensors. With ``req_indices`` the block table is 2-D ``[num_reqs, max_blocks]`` and
    position ``t`` reads row ``req_indices[t]``; otherwise it is one request's 1-D table.
    Tensor and array blocks are widened to int64 (so ``block * bs`` cannot overflow int32).
    """
    block_index = positions // block_size
    if req_indices is None:
        blocks = block_table[block_index]
    else:
        blocks = block_table[req_indices, block_index]
    if isinstance(blocks, torch.Tensor):
        blocks = blocks.to(torch.int64)
    elif isinstance(blocks, np.ndarray):
        blocks = blocks.astype(np.int64)
    return blocks, positions % block_size


def slots_for_positions(block_table: Any, positions: Any, block_size: int,
                        req_indices: Any = None) -> Any:
    """The slot formula, the only copy of it: ``block_table[pos // bs] * bs + pos % bs``.

    Same argument forms as :func:`blocks_and_offsets`; tensor results are int64.
    """
    blocks, offsets = blocks_and_offsets(block_table, positions, block_size, req_indices)
    return blocks * block_size + offsets


def split_slots(slots: Any, block_size: int) -> tuple[Any, Any]:
    """The inverse of the slot formula: ``(slot // bs, slot % bs)``, i.e. the block and the
    offset in it where a cache writer or reader finds the token of each slot."""
    return slots // block_size, slots % block_size


def new_token_positions(query_lens: Sequence[int], seq_lens: Sequence[int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(req_indices, positions)``, int64, one entry per new token of the batch: request
    r's ``query_lens[r]`` new tokens sit at positions ``seq_lens[r] - query_lens[r] ..
    seq_lens[r] - 1``.

    Example: ``query_lens=[1, 3]``, ``seq_lens=[5, 3]`` -> ``([0, 1, 1, 1], [4, 0, 1, 2])``.
    """
    # numpy, not torch: a step's few dozen requests cost ~1 us per numpy op against
    # ~10 us per torch op, and the engine pays this every step.
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if q.size != s.size:
        raise ValueError(f"query_lens and seq_lens must have one entry per request, got "
                         f"{q.size} and {s.size}")
    short = s < q
    if short.any():
        r = int(np.flatnonzero(short)[0])
        raise ValueError(f"request {r}: seq_len ({int(s[r])}) must be >= query_len "
                         f"({int(q[r])})")
    req_indices = np.repeat(np.arange(q.size, dtype=np.int64), q)
    starts = np.cumsum(q) - q  # first token row of each request
    offsets = np.arange(req_indices.size, dtype=np.int64) - starts[req_indices]
    positions = (s - q)[req_indices] + offsets
    return torch.from_numpy(req_indices), torch.from_numpy(positions)


def slot_mapping_for_new_tokens(block_table: torch.Tensor, query_lens: Sequence[int],
                                seq_lens: Sequence[int], block_size: int,
                                new_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
                                ) -> torch.Tensor:
    """``[sum(query_lens)]`` int64 slots of the batch's new tokens (see
    :func:`new_token_positions`, whose result ``new_tokens`` may pass in), read through the
    2-D ``block_table``."""
    req_indices, positions = new_tokens or new_token_positions(query_lens, seq_lens)
    if positions.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    if isinstance(block_table, np.ndarray):
        return torch.from_numpy(slots_for_positions(block_table, positions.numpy(), block_size,
                                                    req_indices.numpy()))
    return slots_for_positions(torch.as_tensor(block_table), positions, block_size,
                               req_indices)


def pad_block_tables(block_tables: Sequence[Sequence[int]], *, min_cols: int = 1,
                     pad: int = 0) -> torch.Tensor:
    """``[num_reqs, max(len) or min_cols]`` int32 block table from ragged per-request
    lists; columns past a request's own blocks hold ``pad`` and are never read."""
    cols = max([min_cols, *(len(t) for t in block_tables)])
    table = torch.full((len(block_tables), cols), pad, dtype=torch.int32)
    for r, blocks in enumerate(block_tables):
        if len(blocks):
            table[r, : len(blocks)] = torch.as_tensor(list(blocks), dtype=torch.int32)
    return table


def contiguous_block_tables(seq_lens: Sequence[int], block_size: int,
                            first_block: int = 0) -> list[list[int]]:
    """Per-request block lists when request r gets ``cdiv(seq_lens[r], block_size)``
    consecutive blocks numbered on from request r-1's (starting at ``first_block``)."""
    tables, nxt = [], first_block
    for sl in seq_lens:
        n = cdiv(sl, block_size)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    return tables


def decodes_first_swaps(is_decode: Sequence[bool]) -> list[tuple[int, int]]:
    """The fewest row swaps that move every decode in front of every prefill.

    With ``k`` decodes, each prefill in rows ``[0, k)`` is swapped with a decode in rows
    ``[k, n)`` (earliest misplaced prefill with latest misplaced decode): one swap per
    misplaced pair, which is minimal. Example: ``[F, T, F, T]`` -> ``[(0, 3)]``.
    """
    flags = [bool(d) for d in is_decode]
    k = sum(flags)
    misplaced_prefills = [i for i in range(k) if not flags[i]]
    misplaced_decodes = [i for i in range(k, len(flags)) if flags[i]]
    return list(zip(misplaced_prefills, reversed(misplaced_decodes)))


def num_leading_decodes(query_lens: Sequence[int], decode_threshold: int = 1) -> int:
    """Requests at the front of a batch with ``query_len <= decode_threshold``."""
    n = 0
    while n < len(query_lens) and query_lens[n] <= decode_threshold:
        n += 1
    return n


def split_decodes_and_prefills(query_start_loc: torch.Tensor, num_actual_tokens: int,
                               decode_threshold: int = 1, require_uniform: bool = False
                               ) -> tuple[int, int, int, int]:
    """``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` of a batch
    already ordered decodes first (see :func:`decodes_first_swaps`).

    ``query_start_loc``: host ``int32 [num_reqs + 1]``; ``num_actual_tokens``: the batch's
    token rows (rows past ``query_start_loc[-1]``, padding, count as prefill tokens). A
    decode is a request with ``query_len <= decode_threshold``; the boundary is the first
    request above it. With ``require_uniform`` the decodes must also share the first
    request's query length (a batch where every length equals it, or is 0 = graph
    padding, is all decodes).

    Example (threshold 1): query lens ``[1, 1, 5, 3]`` -> ``(2, 2, 2, 8)``.

    Raises:
        ValueError: ``decode_threshold < 1``, or (non-uniform) a decode after the first
            prefill, i.e. a batch that was not reordered.
    """
    require_int("decode_threshold", decode_threshold, 1)
    qsl = query_start_loc
    num_reqs = qsl.numel() - 1
    num_tokens = num_actual_tokens
    query_lens = qsl[1:] - qsl[:-1]
    max_query_len = int(query_lens.max()) if num_reqs > 0 else 0

    if max_query_len <= decode_threshold and (not require_uniform or decode_threshold <= 1):
        return num_reqs, 0, num_tokens, 0
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
                f"first prefill at {first_prefill}; reorder the batch decodes first "
                "(reorder_batch_to_split_decodes_and_prefills)"
            )
    num_decode_tokens = int(qsl[first_prefill])
    return (first_prefill, num_reqs - first_prefill, num_decode_tokens,
            num_tokens - num_decode_tokens)


def reorder_batch_decodes_first(input_batch: Any, num_scheduled_tokens: dict[str, int],
                                decode_threshold: int = 1) -> bool:
    """Reorder a persistent batch (anything with ``req_ids`` and ``swap_states(i, j)``)
    so its decodes (``num_scheduled_tokens[req] <= decode_threshold``) come first, with
    the fewest swaps; return whether anything moved.

    A 1-token fresh prompt counts as a decode: for attention it is one query over its
    own key, and keeping the rule purely on query length keeps it consistent with
    :func:`split_decodes_and_prefills`.

    Raises:
        ValueError: ``decode_threshold < 1`` or a request of the batch missing from
            ``num_scheduled_tokens``.
    """
    require_int("decode_threshold", decode_threshold, 1)
    missing = [r for r in input_batch.req_ids if r not in num_scheduled_tokens]
    if missing:
        raise ValueError(f"requests {missing} of the input batch have no entry in "
                         "num_scheduled_tokens")
    swaps = decodes_first_swaps(
        [num_scheduled_tokens[r] <= decode_threshold for r in input_batch.req_ids])
    for i, j in swaps:
        input_batch.swap_states(i, j)
    return bool(swaps)
