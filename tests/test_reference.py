"""The reference ops against an independent dense computation.

The oracle here is torch's ``scaled_dot_product_attention`` on the *contiguous* per-request
K/V (never the paged cache), in float64, with an explicit additive mask built from
per-query key ranges; sinks become an extra all-zero key whose bias is the sink logit.
Softcap cannot be expressed as a mask, so it is checked against a hand-written float64
softmax.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedattn.ops import reference as ref
from pagedattn.testing import BATCH_SPECS, BatchSpec, make_paged_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 16


def allowed_key_range(p: int, kv_len: int, causal: bool, left: int, right: int) -> range:
    lo = max(0, p - left) if left >= 0 else 0
    hi = kv_len - 1
    if causal:
        hi = min(hi, p)
    if right >= 0:
        hi = min(hi, p + right)
    return range(lo, hi + 1)


def dense_bias(q_len, kv_len, causal, window, slopes) -> torch.Tensor:
    """Additive float64 bias ``[H, q_len, kv_len]``: -inf outside the key range, ALiBi inside."""
    bias = torch.full((NUM_HEADS, q_len, kv_len), -math.inf, dtype=torch.float64)
    for i in range(q_len):
        p = kv_len - q_len + i
        for j in allowed_key_range(p, kv_len, causal, *window):
            bias[:, i, j] = 0.0 if slopes is None else slopes.double() * (j - p)
    return bias


def sdpa_oracle(batch, *, scale, causal, window, slopes=None, sinks=None) -> torch.Tensor:
    outs = []
    for r, (kv_len, q_len) in enumerate(zip(batch.spec.seq_lens, batch.spec.query_lens)):
        lo = int(batch.query_start_loc[r])
        q = batch.query[lo:lo + q_len].double().transpose(0, 1)  # [H, q, D]
        k = batch.keys[r].double().transpose(0, 1)
        v = batch.values[r].double().transpose(0, 1)
        bias = dense_bias(q_len, kv_len, causal, window, slopes)
        if sinks is not None:
            k = torch.cat([k, torch.zeros_like(k[:, :1])], dim=1)
            v = torch.cat([v, torch.zeros_like(v[:, :1])], dim=1)
            sink_col = sinks.double().view(-1, 1, 1).expand(NUM_HEADS, q_len, 1)
            bias = torch.cat([bias, sink_col], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, scale=scale, enable_gqa=True
        )
        # SDPA gives NaN for a row that sees nothing; the contract says zeros.
        out = torch.nan_to_num(out, nan=0.0)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


FEATURES = {
    "causal": dict(causal=True, window=(-1, -1)),
    "noncausal": dict(causal=False, window=(-1, -1)),
    "window_left": dict(causal=True, window=(7, -1)),
    "window_both_noncausal": dict(causal=False, window=(5, 3)),
    "window_right_only": dict(causal=False, window=(-1, 2)),
    "alibi": dict(causal=True, window=(-1, -1), alibi=True),
    "sinks": dict(causal=True, window=(-1, -1), sinks=True),
    "alibi_window_sinks": dict(causal=True, window=(9, -1), alibi=True, sinks=True),
}


@pytest.mark.parametrize("layout", ["cpu", "flash"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("batch_name", ["decode", "spec_decode", "chunked_prefill", "mixed"])
def test_paged_attention_matches_dense_sdpa(layout, feature, batch_name):
    cfg = FEATURES[feature]
    batch = make_paged_batch(
        BATCH_SPECS[batch_name], num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE, block_size=16, dtype=torch.float32, layout=layout, seed=3,
    )
    gen = torch.Generator().manual_seed(1)
    slopes = torch.rand(NUM_HEADS, generator=gen) * 0.3 if cfg.get("alibi") else None
    sinks = torch.randn(NUM_HEADS, generator=gen) * 2 if cfg.get("sinks") else None
    scale = HEAD_SIZE ** -0.5
    got = ref.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, scale=scale, causal=cfg["causal"],
        sliding_window=cfg["window"], alibi_slopes=slopes, s_aux=sinks, layout=layout,
    )
    want = sdpa_oracle(batch, scale=scale, causal=cfg["causal"], window=cfg["window"],
                       slopes=slopes, sinks=sinks)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


def manual_softcap_attention(q, k, v, scale, cap, causal):
    """float64 softmax(cap*tanh(scale*q.k/cap)) v over one request, GQA by index."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.zeros(q_len, NUM_HEADS, HEAD_SIZE, dtype=torch.float64)
    for h in range(NUM_HEADS):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(q_len):
            p = kv_len - q_len + i
            keys = list(allowed_key_range(p, kv_len, causal, -1, -1))
            s = cap * torch.tanh(scale * (kh[keys] @ q[i, h].double()) / cap)
            out[i, h] = torch.softmax(s, 0) @ vh[keys]
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_softcap_matches_manual_softmax(causal):
    batch = make_paged_batch(
        BATCH_SPECS["mixed"], num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE, block_size=16, dtype=torch.float32, seed=5,
    )
    scale, cap = 0.9, 3.0  # a large scale so the cap actually bends the scores
    got = ref.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, scale=scale, causal=causal, softcap=cap,
    )
    want = torch.cat([
        manual_softcap_attention(
            batch.query[int(batch.query_start_loc[r]):int(batch.query_start_loc[r + 1])],
            batch.keys[r], batch.values[r], scale, cap, causal,
        )
        for r in range(len(batch.keys))
    ])
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
    uncapped = ref.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, scale=scale, causal=causal,
    )
    assert (uncapped - got).abs().max() > 1e-3, "softcap had no effect: test is vacuous"


def test_gqa_and_mqa_read_the_right_kv_head():
    # MQA: every query head reads kv head 0; poison kv head 1 of a 2-kv-head cache
    # by giving it huge values, then check a GQA call uses it exactly for heads 2, 3.
    batch = make_paged_batch(
        BATCH_SPECS["decode"], num_heads=4, num_kv_heads=2, head_size=HEAD_SIZE,
        block_size=16, dtype=torch.float32, seed=11,
    )
    out = ref.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, scale=0.25,
    )
    value_cache = batch.value_cache.clone()
    value_cache[:, 1] += 100.0
    shifted = ref.paged_attention(
        batch.query, batch.key_cache, value_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, scale=0.25,
    )
    torch.testing.assert_close(shifted[:, :2], out[:, :2])
    torch.testing.assert_close(shifted[:, 2:], out[:, 2:] + 100.0)


def test_fully_masked_rows_are_zero_and_lse_is_minus_inf():
    # With valid inputs key p is always visible (p < kv_len, and any window contains
    # p), so the rows that see nothing are the padding rows past query_start_loc[-1].
    spec = BatchSpec("pad", (20,), (3,))
    batch = make_paged_batch(spec, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, block_size=16, dtype=torch.float32)
    padded_query = torch.cat([batch.query, torch.full_like(batch.query[:2], math.nan)])
    out, lse = ref.paged_attention(
        padded_query, batch.key_cache, batch.value_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, scale=0.25, return_lse=True,
    )
    assert torch.all(out[3:] == 0) and torch.isneginf(lse[3:]).all()
    assert torch.isfinite(out[:3]).all() and torch.isfinite(lse[:3]).all()


def test_lse_matches_logsumexp_of_dense_scores():
    batch = make_paged_batch(
        BATCH_SPECS["chunked_prefill"], num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE, block_size=16, dtype=torch.float32, seed=2,
    )
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    _, lse = ref.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, scale=0.3, s_aux=sinks, return_lse=True,
    )
    group = NUM_HEADS // NUM_KV_HEADS
    for r, (kv_len, q_len) in enumerate(zip(batch.spec.seq_lens, batch.spec.query_lens)):
        lo = int(batch.query_start_loc[r])
        for i in range(q_len):
            p = kv_len - q_len + i
            for h in range(NUM_HEADS):
                s = 0.3 * (batch.keys[r][: p + 1, h // group].double()
                           @ batch.query[lo + i, h].double())
                want = torch.logsumexp(torch.cat([s, sinks[h:h + 1].double()]), 0)
                assert abs(float(lse[lo + i, h]) - float(want)) < 1e-5


def test_merge_attn_states_equals_attention_over_union():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(12, 3, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(12, 3, 8, generator=gen, dtype=torch.float64)
    scores = torch.einsum("qhd,khd->qhk", q, k)

    def part(keys):
        s = scores[:, :, keys]
        lse = torch.logsumexp(s, -1)
        return torch.einsum("qhk,khd->qhd", torch.softmax(s, -1), v[keys]), lse

    whole, whole_lse = part(list(range(12)))
    (a, la), (b, lb) = part(list(range(5))), part(list(range(5, 12)))
    merged, merged_lse = ref.merge_attn_states(a, la.float(), b, lb.float())
    torch.testing.assert_close(merged, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merged_lse.double(), whole_lse, atol=1e-6, rtol=1e-6)

    # A part that saw nothing (-inf) leaves the other unchanged; both empty -> zeros.
    empty_lse = torch.full_like(la, -math.inf).float()
    kept, kept_lse = ref.merge_attn_states(a, la.float(), torch.zeros_like(a), empty_lse)
    torch.testing.assert_close(kept, a)
    torch.testing.assert_close(kept_lse, la.float())
    none, none_lse = ref.merge_attn_states(a, empty_lse, b, empty_lse)
    assert torch.all(none == 0) and torch.isneginf(none_lse).all()


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_reshape_and_cache_writes_slots_and_skips_padding(layout):
    spec = BATCH_SPECS["mixed"]
    batch = make_paged_batch(spec, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, block_size=16, dtype=torch.float32,
                             layout=layout)
    key_cache = torch.full_like(batch.key_cache, math.nan)
    value_cache = torch.full_like(batch.value_cache, math.nan)
    slots = batch.slot_mapping.clone()
    slots[1] = -1  # padding token: skipped
    # key/value longer than slot_mapping: the tail must not be written anywhere.
    tail = torch.full_like(batch.new_keys[:2], 7.0)
    ref.reshape_and_cache(torch.cat([batch.new_keys, tail]), torch.cat([batch.new_values, tail]),
                          key_cache, value_cache, slots, layout=layout)
    bs = 16
    for t, slot in enumerate(slots.tolist()):
        blk, off = divmod(int(batch.slot_mapping[t]), bs)
        got_k = key_cache[blk, :, off] if layout == "cpu" else key_cache[blk, off]
        got_v = value_cache[blk, :, off] if layout == "cpu" else value_cache[blk, off]
        if slot < 0:
            assert torch.isnan(got_k).all() and torch.isnan(got_v).all()
        else:
            torch.testing.assert_close(got_k, batch.new_keys[t])
            torch.testing.assert_close(got_v, batch.new_values[t])
    written = (~torch.isnan(key_cache)).sum().item()
    assert written == (len(slots) - 1) * NUM_KV_HEADS * HEAD_SIZE
    assert not (key_cache == 7.0).any()


def test_reshape_and_cache_flash_fp8_roundtrip():
    key = torch.randn(4, 2, 16)
    value = torch.randn(4, 2, 16)
    kc = torch.zeros(2, 16, 2, 16, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    ref.reshape_and_cache_flash(key, value, kc, vc, torch.tensor([0, 5, 17, 31]), "fp8", 0.5, 0.25)
    torch.testing.assert_close(kc[0, 5].float() * 0.5, key[1], atol=0.1, rtol=0.07)
    torch.testing.assert_close(vc[1, 15].float() * 0.25, value[3], atol=0.05, rtol=0.07)
    with pytest.raises(ValueError, match="fp16"):
        ref.reshape_and_cache_flash(key, value, kc, vc, torch.tensor([0]), "fp16")


BAD_CASES = {
    "seq_len_below_query_len": (dict(seq_lens=torch.tensor([2], dtype=torch.int32)), "seq_lens"),
    "block_id_out_of_range": (dict(block_table=torch.tensor([[99, 1]], dtype=torch.int32)), "outside"),
    "heads_not_divisible": (dict(query=torch.zeros(3, 3, 16)), "divisible"),
    "head_size_mismatch": (dict(query=torch.zeros(3, 4, 8)), "query must have shape"),
    "query_start_loc_length": (dict(query_start_loc=torch.tensor([0], dtype=torch.int32)), "num_reqs"),
    "alibi_wrong_length": (dict(alibi_slopes=torch.zeros(3)), "alibi_slopes"),
    "too_few_block_columns": (dict(block_table=torch.tensor([[1]], dtype=torch.int32)), "needs 2 blocks"),
}


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_attention_input_raises_value_error(case):
    override, message = BAD_CASES[case]
    args = dict(
        query=torch.zeros(3, 4, 16), key_cache=torch.zeros(4, 2, 16, 16),
        value_cache=torch.zeros(4, 2, 16, 16),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([20], dtype=torch.int32),
        block_table=torch.tensor([[1, 2]], dtype=torch.int32), alibi_slopes=None,
    )
    args.update(override)
    with pytest.raises(ValueError, match=message):
        ref.paged_attention(
            args["query"], args["key_cache"], args["value_cache"], args["query_start_loc"],
            args["seq_lens"], args["block_table"], scale=1.0, alibi_slopes=args["alibi_slopes"],
        )


def test_bad_slot_and_layout_raise():
    key = torch.zeros(2, 2, 16)
    cache = torch.zeros(2, 2, 16, 16)
    with pytest.raises(ValueError, match="slot 32"):
        ref.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 32]))
    with pytest.raises(ValueError, match="layout"):
        ref.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1]), layout="nhd")
    with pytest.raises(ValueError, match="3 entries"):
        ref.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 2]))
