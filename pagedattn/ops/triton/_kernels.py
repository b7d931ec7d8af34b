"""Triton kernels behind :mod:`pagedattn.ops.triton` (imported on first use).

Whether they run compiled (CUDA) or in Triton's interpreter (``TRITON_INTERPRET=1``,
CPU tensors) is decided by Triton when this module is imported, so the environment
variable must be set before the first op call of the process.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""True when these kernels were created under Triton's interpreter."""


@triton.jit
def _round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even on the grid of an fp8 format, so the cast that
    follows is exact. The hardware cast rounds the same way; the interpreter's does
    not (it rounds ties up and drops the carry into the exponent), and this keeps both
    identical. Rounding adds and removes ``1.5 * 2**23 * ulp``: the sum then has a
    spacing of exactly ``ulp``."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_NORMAL_EXP)
    ulp = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0
    rounded = (x + magic) - magic
    return tl.where(rounded == 0.0, x * 0.0, rounded)  # keep the sign of zero


@triton.jit
def reshape_and_cache_flash_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d,
    num_kv_heads, head_size, block_size,
    HEADS_P: tl.constexpr, HEAD_P: tl.constexpr,
    QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_NORMAL_EXP: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_size]`` key and value
    into their slot; a negative slot (PAD_SLOT_ID) writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_P)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_size)

    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims * stride_key_d,
                  mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h
                    + dims * stride_value_d, mask=mask)
    if QUANTIZE:
        # Saturate explicitly: a plain cast overflows (compiled: to NaN/inf; the
        # interpreter wraps around).
        key = key.to(tl.float32) / tl.load(k_scale_ptr).to(tl.float32)
        key = _round_to_fp8_grid(key, FP8_MANTISSA_BITS, FP8_MIN_NORMAL_EXP)
        key = tl.minimum(tl.maximum(key, -FP8_MAX), FP8_MAX)
        value = value.to(tl.float32) / tl.load(v_scale_ptr).to(tl.float32)
        value = _round_to_fp8_grid(value, FP8_MANTISSA_BITS, FP8_MIN_NORMAL_EXP)
        value = tl.minimum(tl.maximum(value, -FP8_MAX), FP8_MAX)
    tl.store(key_cache_ptr + block * stride_kc_b + offset * stride_kc_o + heads * stride_kc_h
             + dims * stride_kc_d, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + block * stride_vc_b + offset * stride_vc_o
             + heads * stride_vc_h + dims * stride_vc_d,
             value.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tanh(x):
    # tanh through exp (portable to the interpreter); saturates cleanly at +-1 since
    # exp overflows to inf (-> 1) or underflows to 0 (-> -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# Scores are kept in base 2 (exp2 is the hardware's instruction; exp is exp2 plus a
# multiply per element). Everything that meets them is scaled by log2(e) too: the
# softmax scale on the host, ALiBi slopes and sinks here, and the split-KV merge works
# in the same units. The normalised output does not depend on the base.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_keys(
    acc, m_i, l_i, q, start_key, stop_key, key_first, key_hi, position, row_ok, slope,
    table_row, stride_bt_c, k_head, v_head, dims, dim_ok,
    stride_k_b, stride_k_o, stride_k_d, stride_v_b, stride_v_o, stride_v_d,
    qk_scale, softcap, window_left, window_right, k_descale, v_descale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_LEFT: tl.constexpr, USE_RIGHT: tl.constexpr, DEQUANTIZE: tl.constexpr,
    FP32_DOT: tl.constexpr, PAD_HEAD: tl.constexpr, FOLD_SCALE: tl.constexpr,
):
    """Online softmax (base 2) over the key tiles ``[start_key, stop_key)``: the
    running ``(acc, m_i, l_i)`` of the tile's rows, updated. ``MASKED`` tiles check
    each key against the request's range and each row's causal/window limits; the
    others lie wholly inside ``[key_first, key_hi)`` and are visible to every row, so
    their loads and scores carry no mask at all (what lets Triton pipeline the loads
    cleanly)."""
    for start in range(start_key, stop_key, BLOCK_N):
        key_index = start + tl.arange(0, BLOCK_N)
        if MASKED:
            key_ok = (key_index >= key_first) & (key_index < key_hi)
            block = tl.load(table_row + (key_index // BLOCK_SIZE) * stride_bt_c,
                            mask=key_ok, other=0)
        else:
            block = tl.load(table_row + (key_index // BLOCK_SIZE) * stride_bt_c)
        block = block.to(tl.int64)
        offset = key_index % BLOCK_SIZE
        # [BLOCK_N, HEAD_P], contiguous along the head: the layout tl.dot wants for K^T.
        # V is fetched next to K so that both are in flight before the first dot.
        k_ptrs = (k_head + (block * stride_k_b + offset * stride_k_o)[:, None]
                  + dims[None, :] * stride_k_d)
        v_ptrs = (v_head + (block * stride_v_b + offset * stride_v_o)[:, None]
                  + dims[None, :] * stride_v_d)
        if MASKED:
            k = tl.load(k_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        elif PAD_HEAD:
            k = tl.load(k_ptrs, mask=dim_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if DEQUANTIZE:
            k = (k.to(tl.float32) * k_descale).to(q.dtype)
            v = (v.to(tl.float32) * v_descale).to(q.dtype)

        if FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if USE_SOFTCAP:
            # Host passes qk_scale = scale / softcap and softcap * log2(e).
            s = softcap * _tanh(s * qk_scale)
        elif not FOLD_SCALE:
            s = s * qk_scale
        if USE_ALIBI:
            s += slope[:, None] * (key_index[None, :] - position[:, None]).to(tl.float32)
        if MASKED:
            visible = key_ok[None, :] & row_ok[:, None]
            if CAUSAL:
                visible = visible & (key_index[None, :] <= position[:, None])
            if USE_LEFT:
                visible = visible & (key_index[None, :] >= position[:, None] - window_left)
            if USE_RIGHT:
                visible = visible & (key_index[None, :] <= position[:, None] + window_right)
            s = tl.where(visible, s, float("-inf"))

        if FOLD_SCALE:
            # A positive scale commutes with the row max, so it is applied once per row
            # there and fused into the subtraction below (one FMA per score).
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps max -inf; shift it by 0 instead (no NaN).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        if FOLD_SCALE:
            p = tl.exp2(s * qk_scale - m_shift[:, None])
        else:
            p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if FP32_DOT:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def unified_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    cu_seqlens_q_ptr, seqused_k_ptr, block_table_ptr,
    alibi_ptr, sinks_ptr, k_descale_ptr, v_descale_ptr,
    num_reqs, qk_scale, softcap, window_left, window_right,
    stride_q_t, stride_q_h, stride_q_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_k_b, stride_k_o, stride_k_h, stride_k_d,
    stride_v_b, stride_v_o, stride_v_h, stride_v_d,
    stride_bt_r, stride_bt_c,
    stride_kds_r, stride_kds_h, stride_vds_r, stride_vds_h,
    head_size, num_kv_heads, queries_per_kv,
    part_acc_ptr, part_ml_ptr, num_tokens, num_heads, num_splits,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP_P: tl.constexpr, HEAD_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_LEFT: tl.constexpr, USE_RIGHT: tl.constexpr,
    DEQUANTIZE: tl.constexpr, FP32_DOT: tl.constexpr, SPLIT: tl.constexpr,
    PAD_HEAD: tl.constexpr, FOLD_SCALE: tl.constexpr,
):
    """One program = one tile of ``BLOCK_Q`` query tokens of one request times the
    ``queries_per_kv`` query heads that share one kv head.

    Rows of the tile: row ``m`` is token ``m // GROUP_P`` of the tile and head
    ``m % GROUP_P`` of the group (``GROUP_P`` = group size rounded up to a power of
    two; the extra rows are masked). Tiles are numbered request by request: request
    ``r`` owns tiles ``cu_seqlens_q[r] // BLOCK_Q + r`` onwards, one per ``BLOCK_Q``
    of its tokens, so the grid size follows from the token count alone (no host
    sync) and a binary search finds a tile's request. ``program_id(0)`` enumerates
    (tile, kv head) pairs, kv head fastest, from the last tile down: under a causal
    mask a request's last tiles see the most keys, and starting them first leaves the
    short ones to fill the GPU at the end instead of a long tail.

    With ``SPLIT`` (split-KV, for batches too small to fill the GPU), ``program_id(2)``
    takes one of ``num_splits`` equal slices of the tile's key range and stores its
    unnormalised partial state (``acc``, running max in base 2, denominator) for
    :func:`merge_kv_splits_kernel`, which also adds the sinks.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    flat = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = flat % num_kv_heads
    pid = flat // num_kv_heads
    split = tl.program_id(2)

    # Largest r with first_tile(r) <= pid.
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid - 1)
    req = lo
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + req)
    if tile * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(seqused_k_ptr + req)
    context_len = kv_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_index = tile * BLOCK_Q + rows // GROUP_P
    group_index = rows % GROUP_P
    row_ok = (q_index < q_len) & (group_index < queries_per_kv)
    head = kv_head * queries_per_kv + group_index
    position = context_len + q_index
    dims = tl.arange(0, HEAD_P)
    dim_ok = dims < head_size

    token = (q_start + q_index).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h
                + dims[None, :] * stride_q_d,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys any row of the tile can see: [key_lo, key_hi).
    first_position = context_len + tile * BLOCK_Q
    last_position = context_len + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    key_hi = kv_len
    if CAUSAL:
        key_hi = tl.minimum(key_hi, last_position + 1)
    if USE_RIGHT:
        key_hi = tl.minimum(key_hi, last_position + window_right + 1)
    key_lo = 0
    if USE_LEFT:
        key_lo = tl.maximum(first_position - window_left, 0)
    # Keys before key_lo are never loaded, not just masked out of the softmax: a window's
    # old blocks may already be back in the pool (garbage, even NaN, and 0 * NaN = NaN).
    key_first = key_lo
    key_lo = (key_lo // BLOCK_N) * BLOCK_N
    if SPLIT:
        span = tl.cdiv(tl.cdiv(key_hi - key_lo, BLOCK_N), num_splits) * BLOCK_N
        key_lo = key_lo + split * span
        key_hi = tl.minimum(key_hi, key_lo + span)

    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    if USE_SINKS and not SPLIT:
        # The sink is a logit that joins the softmax denominator only: start the
        # running max at it with a denominator of exp(sink - sink) = 1.
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], dtype=tl.float32)
    k_descale = 1.0
    v_descale = 1.0
    if DEQUANTIZE:
        k_descale = tl.load(k_descale_ptr + req * stride_kds_r + kv_head * stride_kds_h)
        v_descale = tl.load(v_descale_ptr + req * stride_vds_r + kv_head * stride_vds_h)

    # Interior tiles [full_lo, full_hi): every key visible to every row of the tile, so
    # no mask is computed there; the edge tiles around them are masked. The interior
    # never reaches past key_hi (need_hi <= key_hi, and a split's end is tile-aligned),
    # which is what lets it load without a mask.
    need_lo = key_first
    if USE_LEFT:
        need_lo = tl.maximum(need_lo, last_position - window_left)
    need_hi = kv_len
    if CAUSAL:
        need_hi = tl.minimum(need_hi, first_position + 1)
    if USE_RIGHT:
        need_hi = tl.minimum(need_hi, first_position + window_right + 1)
    full_lo = key_lo + tl.cdiv(tl.maximum(need_lo - key_lo, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(full_lo, key_hi)
    full_hi = full_lo + tl.maximum(need_hi - full_lo, 0) // BLOCK_N * BLOCK_N
    full_hi = tl.minimum(full_hi, key_hi)
    full_hi = tl.maximum(full_hi, full_lo)

    table_row = block_table_ptr + req.to(tl.int64) * stride_bt_r
    k_head = k_ptr + kv_head * stride_k_h
    v_head = v_ptr + kv_head * stride_v_h
    # Three passes, unrolled at compile time: masked edge, interior, masked edge.
    for phase in tl.static_range(3):
        if phase == 0:
            lo = key_lo
            hi = full_lo
        elif phase == 1:
            lo = full_lo
            hi = full_hi
        else:
            lo = full_hi
            hi = key_hi
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, lo, hi, key_first, key_hi, position, row_ok, slope,
            table_row, stride_bt_c, k_head, v_head, dims, dim_ok,
            stride_k_b, stride_k_o, stride_k_d, stride_v_b, stride_v_o, stride_v_d,
            qk_scale, softcap, window_left, window_right, k_descale, v_descale,
            BLOCK_SIZE, BLOCK_N, phase != 1, CAUSAL, USE_ALIBI, USE_SOFTCAP, USE_LEFT,
            USE_RIGHT, DEQUANTIZE, FP32_DOT, PAD_HEAD, FOLD_SCALE)

    if SPLIT:
        part = ((token * num_heads + head) * num_splits + split)
        tl.store(part_acc_ptr + part[:, None] * HEAD_P + dims[None, :], acc,
                 mask=row_ok[:, None] & (dims[None, :] < HEAD_P))
        tl.store(part_ml_ptr + part, m_i, mask=row_ok)
        tl.store(part_ml_ptr + num_tokens * num_heads * num_splits + part, l_i, mask=row_ok)
    else:
        # Rows that saw no key (and no sink) output zeros.
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h
                 + dims[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def merge_kv_splits_kernel(
    part_acc_ptr, part_ml_ptr, sinks_ptr, out_ptr, cu_seqlens_q_ptr,
    num_reqs, num_tokens, num_heads, num_splits, head_size,
    stride_o_t, stride_o_h, stride_o_d,
    SPLITS_P: tl.constexpr, HEAD_P: tl.constexpr, USE_SINKS: tl.constexpr,
):
    """One program per (token, query head): the softmax over all splits' keys (and the
    sink) from the splits' partial states (running maxima in base 2), normalised into
    ``out``. Tokens past
    ``cu_seqlens_q[num_reqs]`` have no partial state and their rows stay untouched."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(cu_seqlens_q_ptr + num_reqs):
        return
    splits = tl.arange(0, SPLITS_P)
    split_ok = splits < num_splits
    part = (token * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part, mask=split_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + num_tokens * num_heads * num_splits + part, mask=split_ok,
                other=0.0)
    m_max = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_shift)  # a split that saw no key has m = -inf: weight 0
    denominator = tl.sum(weight * l, 0)
    if USE_SINKS:
        denominator += tl.exp2(sink - m_shift)
    dims = tl.arange(0, HEAD_P)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_P + dims[None, :],
                  mask=split_ok[:, None], other=0.0)
    merged = tl.sum(acc * weight[:, None], 0)
    out = tl.where(denominator > 0, merged / tl.where(denominator > 0, denominator, 1.0), 0.0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dims * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_size)
