"""Pure-PyTorch reference of every pagedattn op.

This module implements ``docs/semantics.md`` (the attention semantics) for every kernel:
tests compare kernels against it, and ``pagedattn.ops`` falls back to it when the native
extension is missing. It is written for clarity, one request at a time, in float32.

Cache layouts (``layout`` argument):

* ``"cpu"``   -- ``key_cache[block, kv_head, offset, :]``   shape ``[nb, nkv, bs, hs]``
* ``"flash"`` -- ``key_cache[block, offset, kv_head, :]``   shape ``[nb, bs, nkv, hs]``

Token ``j`` of request ``r`` lives in block ``block_table[r, j // bs]`` at offset
``j % bs``. A slot id is ``block * bs + offset``; slot ``-1`` (PAD_SLOT_ID) means "skip".

Visibility (per request, ``q_len`` new queries over ``kv_len`` keys; query ``i`` sits at
absolute position ``p = kv_len - q_len + i``)::

    q_len=3, kv_len=6, causal, window (left=2, right=-1):   key j ->  0 1 2 3 4 5
        query 0 (p=3)                                                . x x x . .
        query 1 (p=4)                                                . . x x x .
        query 2 (p=5)                                                . . . x x x
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from pagedattn.checks import is_number

from pagedattn import paging

Layout = Literal["cpu", "flash"]
_LAYOUTS = ("cpu", "flash")
FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_scale_value(scale: "torch.Tensor | float", name: str) -> float:
    """A per-tensor fp8 scale as a Python float: a number or a 1-element tensor, finite
    and positive (ValueError otherwise)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor, got shape "
                             f"{tuple(scale.shape)}")
        scale = scale.item()
    if not is_number(scale):
        raise TypeError(f"{name} must be a float or a 1-element tensor, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"{name} must be a finite positive number, got {scale!r}")
    return scale


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 cache stores for ``x``: ``x / scale`` in float32, saturated to the
    format's largest finite value (448 for e4m3fn, 57344 for e5m2; infinities too),
    rounded to nearest even; NaN stays NaN. The native ``cpu_attn_reshape_and_cache``
    writes exactly these bits."""
    limit = torch.finfo(dtype).max
    scaled = x.float() / torch.tensor(scale, dtype=torch.float32)
    return scaled.clamp(-limit, limit).to(dtype)


def dequantize_fp8(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values of an fp8 cache: stored value times ``scale`` (the fp8 -> float32
    step is exact)."""
    return cache.float() * scale


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")


def _cache_geometry(key_cache: torch.Tensor, layout: Layout) -> tuple[int, int, int, int]:
    """``(num_blocks, num_kv_heads, block_size, head_size)`` of a cache in ``layout``."""
    _check_layout(layout)
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be 4-D ({layout} layout), got shape {tuple(key_cache.shape)}"
        )
    if layout == "cpu":
        num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
    else:
        num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    return num_blocks, num_kv_heads, block_size, head_size


# --------------------------------------------------------------------------- caching


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: Layout = "cpu",
) -> None:
    """Write token ``t``'s key/value ``[num_kv_heads, head_size]`` into slot
    ``slot_mapping[t]`` of the caches (in place).

    key/value: ``[T, num_kv_heads, head_size]`` with ``T >= slot_mapping.numel()`` (only
    the first ``slot_mapping.numel()`` tokens are written). Negative slots are skipped.
    """
    num_blocks, num_kv_heads, block_size, head_size = _cache_geometry(key_cache, layout)
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    n = slot_mapping.numel()
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_size):
            raise ValueError(
                f"{name} must have shape [T, {num_kv_heads}, {head_size}], got {tuple(t.shape)}"
            )
        if t.shape[0] < n:
            raise ValueError(
                f"{name} has {t.shape[0]} tokens but slot_mapping has {n} entries"
            )
    slots = slot_mapping.reshape(-1).to(torch.int64)
    valid = slots >= 0
    too_big = slots >= num_blocks * block_size
    if bool(too_big.any()):
        bad = int(slots[too_big][0])
        raise ValueError(
            f"slot_mapping holds slot {bad}, out of range for {num_blocks} blocks of "
            f"{block_size} (max slot {num_blocks * block_size - 1})"
        )
    tokens = torch.nonzero(valid).flatten()
    blocks, offsets = paging.split_slots(slots[tokens], block_size)
    for src, cache in ((key, key_cache), (value, value_cache)):
        rows = src[:n][tokens].to(cache.dtype)
        if layout == "cpu":
            cache[blocks, :, offsets, :] = rows
        else:
            cache[blocks, offsets, :, :] = rows


def _gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int, layout: Layout
) -> torch.Tensor:
    """Keys (or values) ``0..kv_len-1`` of one request, ``[kv_len, num_kv_heads, hs]``."""
    _, _, block_size, _ = _cache_geometry(cache, layout)
    blocks, offsets = paging.blocks_and_offsets(block_table_row, torch.arange(kv_len),
                                                block_size)
    if layout == "cpu":
        return cache[blocks, :, offsets, :]
    return cache[blocks, offsets, :, :]


# --------------------------------------------------------------------------- attention


def visibility_mask(
    q_len: int, kv_len: int, causal: bool, sliding_window: tuple[int, int] = (-1, -1)
) -> torch.Tensor:
    """Boolean ``[q_len, kv_len]``: True where query ``i`` may attend to key ``j``."""
    # A window of kv_len or more hides nothing; clamping keeps pos +- window in int64.
    left, right = (min(w, kv_len) for w in sliding_window)
    pos = (kv_len - q_len + torch.arange(q_len)).unsqueeze(1)
    key = torch.arange(kv_len).unsqueeze(0)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        mask &= key <= pos
    if left >= 0:
        mask &= key >= pos - left
    if right >= 0:
        mask &= key <= pos + right
    return mask


def _weighted_values(probs: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``sum_k probs[h, q, k] * v[k, h]`` over the keys row ``q`` sees, ``[q_len, H, D]``.

    A key a row cannot see contributes nothing at all, even a NaN/inf value (a plain
    product would give it weight 0, and 0 * NaN = NaN); a row that sees it gets it.
    """
    bad = ~torch.isfinite(v)
    if not bad.any():
        return torch.einsum("hqk,khd->qhd", probs, v)
    numer = torch.einsum("hqk,khd->qhd", probs, v.masked_fill(bad, 0.0))
    for k in torch.nonzero(bad.flatten(1).any(dim=1)).flatten().tolist():
        rows = visible[:, k]
        bad_part = torch.where(bad[k], v[k], 0.0)  # [H, D]
        numer[rows] += probs[:, rows, k].transpose(0, 1).unsqueeze(-1) * bad_part
    return numer


def _attend_one_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    sliding_window: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    s_aux: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of ``q [q_len, H, D]`` over ``k, v [kv_len, H_kv, D]``.

    Returns ``(out [q_len, H, D], lse [q_len, H])``; ``lse`` is the log of the softmax
    denominator (sink included), ``-inf`` for rows that see nothing.
    """
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)

    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    positions = (kv_len - q_len + torch.arange(q_len)).unsqueeze(1)
    if alibi_slopes is not None:
        distance = (torch.arange(kv_len).unsqueeze(0) - positions).float()  # j - p
        scores = scores + alibi_slopes.float().view(-1, 1, 1) * distance
    visible = visibility_mask(q_len, kv_len, causal, sliding_window)
    scores = scores.masked_fill(~visible, float("-inf"))

    row_max = scores.amax(dim=-1)
    if s_aux is not None:
        row_max = torch.maximum(row_max, s_aux.float().view(-1, 1))
    # A row that sees nothing (and has no sink) keeps max -inf; shift by 0 to avoid NaN.
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(scores - safe_max.unsqueeze(-1))
    denom = probs.sum(dim=-1)
    if s_aux is not None:
        denom = denom + torch.exp(s_aux.float().view(-1, 1) - safe_max)
    numer = _weighted_values(probs, v, visible)
    denom_t = denom.transpose(0, 1)  # [q_len, H]
    out = torch.where(
        denom_t.unsqueeze(-1) > 0, numer / denom_t.clamp_min(1e-38).unsqueeze(-1), 0.0
    )
    lse = torch.where(denom_t > 0, safe_max.transpose(0, 1) + torch.log(denom_t), float("-inf"))
    return out, lse


def _check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    layout: Layout,
    sliding_window: tuple[int, int],
    alibi_slopes: torch.Tensor | None,
    s_aux: torch.Tensor | None,
) -> None:
    num_blocks, num_kv_heads, block_size, head_size = _cache_geometry(key_cache, layout)
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(
            f"query must have shape [num_tokens, num_heads, {head_size}], got {tuple(query.shape)}"
        )
    num_heads = query.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )
    num_reqs = seq_lens.numel()
    if query_start_loc.numel() != num_reqs + 1:
        raise ValueError(
            f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries, "
            f"got {query_start_loc.numel()}"
        )
    if int(query_start_loc[-1]) > query.shape[0]:
        raise ValueError(
            f"query_start_loc[-1] ({int(query_start_loc[-1])}) exceeds num_tokens "
            f"({query.shape[0]})"
        )
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table must be [num_reqs={num_reqs}, max_blocks], got {tuple(block_table.shape)}"
        )
    if len(sliding_window) != 2:
        raise ValueError(f"sliding_window must be a (left, right) pair, got {sliding_window!r}")
    for name, t in (("alibi_slopes", alibi_slopes), ("s_aux", s_aux)):
        if t is not None and t.numel() != num_heads:
            raise ValueError(f"{name} must have num_heads={num_heads} entries, got {t.numel()}")
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    for r in range(num_reqs):
        q_len, kv_len = int(q_lens[r]), int(seq_lens[r])
        if q_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing, request {r} has {q_len}")
        if kv_len < q_len:
            raise ValueError(f"seq_lens[{r}] ({kv_len}) must be >= query length ({q_len})")
        needed = paging.cdiv(kv_len, block_size)
        if needed > block_table.shape[1]:
            raise ValueError(
                f"request {r} needs {needed} blocks for seq_len {kv_len}, block_table has "
                f"{block_table.shape[1]} columns"
            )
        used = block_table[r, :needed]
        if needed and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(
                f"block_table[{r}] holds block ids {used.tolist()} outside [0, {num_blocks})"
            )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    layout: Layout = "cpu",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a varlen batch of queries over a paged KV cache.

    Args:
        query: ``[num_tokens, num_heads, head_size]``; request ``r`` owns rows
            ``query_start_loc[r]:query_start_loc[r+1]``.
        key_cache, value_cache: paged caches in ``layout`` (module docstring).
        query_start_loc: int ``[num_reqs + 1]``, non-decreasing.
        seq_lens: int ``[num_reqs]``, total KV length per request including the new
            tokens; must be ``>= query length``.
        block_table: int ``[num_reqs, max_blocks]``, physical block of each logical block.
        scale: multiplies ``q.k``.
        causal: hide keys after the query's position.
        sliding_window: ``(left, right)``; ``-1`` = unbounded on that side.
        softcap: ``> 0`` applies ``softcap * tanh(s / softcap)`` to the scaled scores.
        alibi_slopes: ``[num_heads]``; adds ``slope[h] * (j - p)`` after softcap.
        s_aux: ``[num_heads]`` sink logits: add ``exp(s_aux[h] - m)`` to the denominator
            only (a raw logit, neither scaled nor capped).
        return_lse: also return the log-sum-exp ``[num_tokens, num_heads]`` float32
            (log of the denominator, sink included; ``-inf`` where nothing is visible).
            To merge partial results with :func:`merge_attn_states`, compute the parts
            without sinks.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype`` (rows past
        ``query_start_loc[-1]`` are zero), and the LSE if asked.
    """
    _check_attention_args(
        query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
        layout, sliding_window, alibi_slopes, s_aux,
    )
    out = torch.zeros(query.shape, dtype=torch.float32)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32)
    starts = query_start_loc.tolist()
    for r, kv_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[r], starts[r + 1]
        if hi == lo:
            continue
        k = _gather_request_kv(key_cache, block_table[r], kv_len, layout)
        v = _gather_request_kv(value_cache, block_table[r], kv_len, layout)
        out[lo:hi], lse[lo:hi] = _attend_one_request(
            query[lo:hi], k, v,
            scale=scale, causal=causal, sliding_window=tuple(sliding_window),
            softcap=softcap, alibi_slopes=alibi_slopes, s_aux=s_aux,
        )
    out = out.to(query.dtype)
    return (out, lse) if return_lse else out


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets.

    ``out_*``: ``[num_tokens, num_heads, head_size]``; ``lse_*``: ``[num_tokens,
    num_heads]`` float32 (``-inf`` = that part saw no key). Returns the attention over
    the union of the key sets and its LSE, computed in float32, output in ``out_a.dtype``.
    """
    if out_a.shape != out_b.shape:
        raise ValueError(f"outputs differ in shape: {tuple(out_a.shape)} vs {tuple(out_b.shape)}")
    if lse_a.shape != out_a.shape[:2] or lse_b.shape != out_a.shape[:2]:
        raise ValueError(
            f"lse must have shape {tuple(out_a.shape[:2])}, got {tuple(lse_a.shape)} and "
            f"{tuple(lse_b.shape)}"
        )
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    safe_m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a = torch.exp(lse_a - safe_m)
    w_b = torch.exp(lse_b - safe_m)
    total = w_a + w_b
    merged = (w_a.unsqueeze(-1) * out_a.float() + w_b.unsqueeze(-1) * out_b.float())
    merged = torch.where(total.unsqueeze(-1) > 0, merged / total.clamp_min(1e-38).unsqueeze(-1), 0.0)
    lse = torch.where(total > 0, safe_m + torch.log(total), float("-inf"))
    return merged.to(out_a.dtype), lse


# --------------------------------------------------------- op-signature fallbacks (CPU)


def cpu_attn_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str | None = None,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    """Reference of ``pagedattn.ops.cpu_attn_reshape_and_cache`` (``isa`` is ignored):
    fp8 caches store :func:`quantize_fp8` of the rows; other caches ignore the scales."""
    if key_cache.dtype in FP8_DTYPES:
        key = quantize_fp8(key, kv_scale_value(k_scale, "k_scale"), key_cache.dtype)
        value = quantize_fp8(value, kv_scale_value(v_scale, "v_scale"), value_cache.dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, layout="cpu")


def cpu_attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: tuple[int, int],
    block_table: torch.Tensor,
    softcap: float,
    scheduler_metadata: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    """Reference of ``pagedattn.ops.cpu_attention_with_kv_cache``: fills
    ``output[:query_start_loc[-1]]`` (``scheduler_metadata`` is ignored). fp8 caches are
    read as :func:`dequantize_fp8` values (float32, as the kernel accumulates)."""
    if output.shape != query.shape:
        raise ValueError(
            f"output shape {tuple(output.shape)} must equal query shape {tuple(query.shape)}"
        )
    if key_cache.dtype in FP8_DTYPES:
        key_cache = dequantize_fp8(key_cache, kv_scale_value(k_scale, "k_scale"))
        value_cache = dequantize_fp8(value_cache, kv_scale_value(v_scale, "v_scale"))
    result = paged_attention(
        query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
        scale=scale, causal=causal, sliding_window=tuple(sliding_window), softcap=softcap,
        alibi_slopes=alibi_slopes, s_aux=s_aux, layout="cpu",
    )
    n = int(query_start_loc[-1])
    output[:n].copy_(result[:n])


# -------------------------------------------------------- op-signature fallbacks (GPU)


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    """Reference of ``reshape_and_cache_flash`` (flash layout ``[nb, bs, nkv, hs]``).

    With an fp8 ``kv_cache_dtype`` the cache stores ``x / scale`` in fp8.
    """
    if kv_cache_dtype == "auto":
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, layout="flash")
        return
    if kv_cache_dtype not in FP8_CACHE_DTYPES:
        valid = ["auto", *FP8_CACHE_DTYPES]
        raise ValueError(f"kv_cache_dtype must be one of {valid}, got {kv_cache_dtype!r}")
    k = quantize_fp8(key, kv_scale_value(k_scale, "k_scale"), key_cache.dtype)
    v = quantize_fp8(value, kv_scale_value(v_scale, "v_scale"), value_cache.dtype)
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, layout="flash")


def unified_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    window_size: tuple[int, int],
    block_table: torch.Tensor,
    softcap: float,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Reference of ``unified_attention`` over flash-layout caches ``k``/``v``
    (``[nb, bs, nkv, hs]``); fp8 caches are dequantized with ``k_descale``/``v_descale``.
    Fills ``out[:cu_seqlens_q[-1]]``."""
    if q_descale is not None:
        raise NotImplementedError("quantized queries (q_descale) are not supported")
    key_cache = k.float() * (float(k_descale) if k_descale is not None else 1.0)
    value_cache = v.float() * (float(v_descale) if v_descale is not None else 1.0)
    result = paged_attention(
        q.float(), key_cache, value_cache, cu_seqlens_q, seqused_k, block_table,
        scale=softmax_scale, causal=causal, sliding_window=tuple(window_size),
        softcap=softcap, alibi_slopes=alibi_slopes, s_aux=sinks, layout="flash",
    )
    n = int(cu_seqlens_q[-1])
    out[:n].copy_(result[:n])


# ------------------------------------------------------------------ linear layers

LINEAR_PANEL = 16
"""Output columns per panel of a packed linear weight (``pack_linear_weight``)."""


def unpack_linear_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The ``[out_features, in_features]`` weight inside a packed one: packed
    ``[p, k, 16]`` holds column ``16 * p + c`` of the layer at ``packed[p, :, c]``."""
    panels, k, width = packed.shape
    if width != LINEAR_PANEL or panels * width < out_features:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not hold {out_features} "
                         f"output columns in panels of {LINEAR_PANEL}")
    return packed.permute(0, 2, 1).reshape(panels * width, k)[:out_features]


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """Reference of ``pagedattn.ops.packed_linear``: ``x @ W.T + bias`` with the packed
    weight widened to float64 (the kernel accumulates in fp32), returned in float32."""
    w = unpack_linear_weight(packed_weight, out_features).double()
    out = x.double() @ w.T
    if bias is not None:
        out = out + bias.double()
    return out.float()


def packed_gated_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                        out_features: int, activation: str) -> torch.Tensor:
    """Reference of ``pagedattn.ops.packed_gated_linear``: the gate/up projection
    ``h = x @ W.T + bias`` (``out_features = 2 d`` columns, gate first), then
    ``act(h[:, :d]) * h[:, d:]``, in float64; returned in float32."""
    acts = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
    w = unpack_linear_weight(packed_weight, out_features).double()
    h = x.double() @ w.T
    if bias is not None:
        h = h + bias.double()
    return acts[activation](h).float()


# ------------------------------------------------------------------ layer steps (fp32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Llama's RMSNorm: ``(x * rsqrt(mean(x^2) + eps)) * weight`` per row, in fp32,
    rounded once to ``out_dtype`` (default ``x.dtype``)."""
    h = x.float()
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)) * weight.float()
    return out.to(out_dtype or x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``residual += x`` in place (in the residual's dtype), then :func:`rms_norm` of the
    sum into ``out_dtype`` (default ``x.dtype``)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps, out_dtype or x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x`` of width ``2 d``, in fp32 for half ``x``
    (rounded once to ``x.dtype``; fp64 ``x`` stays fp64)."""
    d = x.shape[-1] // 2
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    return (torch.nn.functional.silu(h[..., :d]) * h[..., d:]).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[:, :d], approximate="tanh") * x[:, d:]`` for ``x`` of width ``2 d``, in fp32
    for half ``x`` (rounded once to ``x.dtype``; fp64 ``x`` stays fp64).

    GELU-tanh ``0.5 a (1 + tanh(u))``, ``u = sqrt(2/pi) (a + 0.044715 a^3)``, is written as
    ``a * sigmoid(2 u)``, the same function: ``1 + tanh(u)`` cancels to 0 for negative
    gates (below -5 in fp64), while the sigmoid keeps their tiny values."""
    d = x.shape[-1] // 2
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    gate = h[..., :d]
    u = (2 / math.pi) ** 0.5 * (gate + 0.044715 * gate.pow(3))
    return (gate * torch.sigmoid(2 * u) * h[..., d:]).to(x.dtype)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate-half RoPE in place: ``x * cos + rotate_half(x) * sin`` for every head of
    ``query`` ``[T, H, D]`` and ``key`` ``[T, Hk, D]``, with ``cos_sin_cache[pos]`` holding
    the ``D / 2`` cosines then the ``D / 2`` sines of position ``pos``."""
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions, :half].unsqueeze(1)
    sin = cos_sin_cache[positions, half:].unsqueeze(1)
    for t in (query, key):
        x1, x2 = t[..., :half].clone(), t[..., half:].clone()
        t[..., :half] = x1 * cos + (-x2) * sin
        t[..., half:] = x2 * cos + x1 * sin


# ------------------------------------------------------------------ memory streaming


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index (NaN counts as maximal), int64 ``[rows]``."""
    if logits.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"logits must be float32 or bfloat16, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be 2-D [rows, vocab] with vocab >= 1, got shape "
                         f"{tuple(logits.shape)}")
    return logits.argmax(dim=-1)


def stream_read(buf: torch.Tensor) -> int:
    """The sum of ``buf``'s bytes, each read as an unsigned 8-bit integer (whatever
    ``buf``'s dtype): what :func:`pagedattn.ops.stream_read` returns, computed plainly."""
    return int(buf.reshape(-1).view(torch.uint8).sum(dtype=torch.int64))
