"""FP8 KV caches: the quantising write (bit-exact against the reference), the decoding
read under every ISA (all 256 codes), NaN and saturation, and the end-to-end error of
attention over an fp8 cache against unquantised keys/values, with a bound derived from the
fp8 rounding. The attention feature grid with fp8 caches runs in test_cpu_ops.py."""

from __future__ import annotations

import math

import pytest
import torch

from pagedattn import ops
from pagedattn.ops import reference as ref
from pagedattn.paging import slots_for_positions
from pagedattn.testing import TOLERANCES
from test_cpu_ops import case_inputs, feature_args, run_native

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def same_bits_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp8 caches equal bit for bit, except that any NaN code matches any NaN code."""
    nan_got, nan_want = torch.isnan(got.float()), torch.isnan(want.float())
    if not torch.equal(nan_got, nan_want):
        return False
    return torch.equal(got.view(torch.uint8)[~nan_got], want.view(torch.uint8)[~nan_want])


def special_values(fp8: torch.dtype, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Values that exercise rounding: ties, subnormals, the largest finite value and
    beyond it, infinities, NaN, signed zeros, then random normals over a wide range."""
    info = torch.finfo(fp8)
    tiny = info.smallest_normal
    sub_step = tiny / (2 ** (3 if fp8 == torch.float8_e4m3fn else 2))
    vals = [0.0, -0.0, info.max, -info.max, info.max * 1.03, -info.max * 1.2, 1e30, math.inf,
            -math.inf, math.nan, tiny, -tiny, sub_step, sub_step / 2, sub_step * 1.5,
            sub_step * 2.5, tiny * 0.75, 1.0 + 1 / 16, 1.0 + 3 / 16, 1.0 + 1 / 32, 3.3, -17.0]
    gen = torch.Generator().manual_seed(3)
    rand = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-14, 12, (n,), generator=gen))
    x = torch.cat([torch.tensor(vals), rand])[:n]
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.5])
def test_write_quantises_exactly_like_the_reference(fmt, dtype_name, scale):
    """Saturation, round-to-nearest-even (subnormals too) and NaN: the same bits."""
    fp8, dtype = FP8[fmt], DTYPES[dtype_name]
    num_tokens, kvh, hs, bs = 24, 2, 64, 16
    key = special_values(fp8, dtype, num_tokens * kvh * hs).view(num_tokens, kvh, hs)
    value = (-key.float() * 1.7).to(dtype)
    slots = torch.randperm(4 * bs, generator=torch.Generator().manual_seed(1))[:num_tokens]
    slots[3] = -1  # padding: skipped
    want_k = torch.zeros(4, kvh, bs, hs, dtype=fp8)
    want_v = torch.zeros_like(want_k)
    got_k, got_v = want_k.clone(), want_v.clone()
    ref.cpu_attn_reshape_and_cache(key, value, want_k, want_v, slots, k_scale=scale,
                                   v_scale=scale * 3)
    ops.cpu_attn_reshape_and_cache(key, value, got_k, got_v, slots, "vec16",
                                   k_scale=torch.tensor([scale]), v_scale=scale * 3)
    assert same_bits_or_both_nan(got_k, want_k)
    assert same_bits_or_both_nan(got_v, want_v)
    # saturation, not overflow to NaN; NaN stays NaN
    stored = got_k.float()
    assert stored[~torch.isnan(stored)].abs().max() == torch.finfo(fp8).max
    assert torch.isnan(stored).sum() == torch.isnan(key.float()).sum()


def test_reference_quantisation_rounds_to_nearest_even():
    """The reference itself, against hand-worked e4m3 values (1 + 1/16 is a tie between
    1 and 1.125 -> 1; 1 + 3/16 -> 1.25; subnormal step 2^-9: 1.5 steps -> 2 steps)."""
    x = torch.tensor([1 + 1 / 16, 1 + 3 / 16, 1.5 * 2 ** -9, 500.0, -math.inf])
    got = ref.quantize_fp8(x, 1.0, torch.float8_e4m3fn).float()
    assert got.tolist() == [1.0, 1.25, 2 * 2 ** -9, 448.0, -448.0]


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16", "fp16"])
def test_read_decodes_every_code_exactly(isa, fmt, dtype_name):
    """One key, one query: the output is the value row times v_scale. The value row holds
    all 256 fp8 codes, so each ISA's vectorised decode is checked code by code (NaN codes
    must give NaN; e5m2 infinities give inf)."""
    fp8, dtype = FP8[fmt], DTYPES[dtype_name]
    hs, bs = 256, 16
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    key_cache = torch.zeros(2, 1, bs, hs, dtype=fp8)
    value_cache = torch.zeros_like(key_cache)
    value_cache[1, 0, 0] = codes
    key_cache[1, 0, 0] = torch.ones(hs).to(fp8)
    query = torch.full((1, 1, hs), 0.01, dtype=dtype)
    qsl, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    block_table = torch.tensor([[1]], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(1, 1, 1, hs, seq_lens, dtype, qsl, True, -1,
                                               "vec16", True)
    out = torch.empty_like(query)
    v_scale = 0.5  # a power of two: the products stay exact
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, qsl, seq_lens, 0.1,
                                    True, None, (-1, -1), block_table, 0.0, meta, None,
                                    k_scale=3.0, v_scale=v_scale)
    want = (codes.float() * v_scale).to(dtype)
    torch.testing.assert_close(out[0, 0], want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", FP8)
def test_nan_value_poisons_only_the_rows_that_read_it(isa, fmt):
    """A NaN stored in a visible value makes the rows that read it NaN (as the reference
    says); the other requests, and the NaN in blocks nobody reads, change nothing."""
    batch = case_inputs("decode", "bf16", 64, 16, 8, 2)
    fp8 = FP8[fmt]
    k = ref.quantize_fp8(batch.key_cache, 0.05, fp8)
    v = ref.quantize_fp8(batch.value_cache, 0.05, fp8)
    first_block = int(batch.block_table[0, 0])
    v[first_block, 0, 3, 5] = float("nan")
    poisoned = type(batch)(**{**batch.__dict__, "key_cache": k, "value_cache": v})
    args = feature_args("causal", 8, 64)
    out = run_native(poisoned, args, block_size=16, k_scale=0.05, v_scale=0.05)
    group = 8 // 2
    assert torch.isnan(out[0, :group, 5].float()).all()  # request 0, kv head 0, dim 5
    assert torch.isfinite(out[0, group:].float()).all()
    assert torch.isfinite(out[1:].float()).all()


def test_bad_scales_raise():
    batch = case_inputs("decode", "bf16", 64, 16, 8, 2)
    k = ref.quantize_fp8(batch.key_cache, 1.0, torch.float8_e4m3fn)
    for bad, kind in ((0.0, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                      (torch.ones(2), ValueError), ("1", TypeError)):
        with pytest.raises(kind, match="k_scale"):
            ops.cpu_attn_reshape_and_cache(batch.new_keys, batch.new_values, k, k.clone(),
                                           batch.slot_mapping, "vec16", k_scale=bad)


def test_fp8_query_is_rejected():
    batch = case_inputs("decode", "bf16", 64, 16, 8, 2)
    fp8 = torch.float8_e4m3fn
    with pytest.raises(TypeError, match="(?i)float8_e4m3fn"):
        run_native(type(batch)(**{**batch.__dict__, "query": batch.query.to(fp8),
                                  "key_cache": batch.key_cache.to(fp8),
                                  "value_cache": batch.value_cache.to(fp8)}),
                   feature_args("causal", 8, 64), block_size=16)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("feature", ["causal", "softcap", "alibi"])
def test_end_to_end_error_is_within_the_fp8_rounding_bound(isa, fmt, feature):
    """Write bf16 K/V through the op into an fp8 cache, attend, compare with attention over
    the unquantised K/V. Bound, from the fp8 rounding:

    * each stored value x' = x + e with |e| <= u|x| + a (u = 2^-(M+1): round to nearest
      with M mantissa bits; a = half the subnormal step, times the scale);
    * a score s_j = scale * q.k_j moves by at most d = scale * sum_i |q_i| (u|k_ji| + a_k);
    * shifting every score by at most d scales each softmax weight by a factor in
      [e^-2d, e^2d], so sum_j |dp_j| <= e^2d - 1;
    * |do| <= sum_j p_j |dv_j| + sum_j |dp_j| |v_j| <= (u + e^2d - 1) max|v| + a_v.
    Softcap (a contraction) and ALiBi (exact) do not widen it. The bf16 output rounding of
    both sides adds TOLERANCES[bf16]."""
    fp8 = FP8[fmt]
    mant = 3 if fp8 == torch.float8_e4m3fn else 2
    u = 2.0 ** -(mant + 1)
    batch = case_inputs("chunked_prefill", "bf16", 64, 16, 8, 2)
    k_scale, v_scale = 0.02, 0.03
    key_cache = torch.zeros(batch.key_cache.shape, dtype=fp8)
    value_cache = torch.zeros_like(key_cache)
    all_slots = torch.cat([
        torch.as_tensor(slots_for_positions(batch.block_table[r], torch.arange(n), 16))
        for r, n in enumerate(batch.spec.seq_lens)]).long()
    ops.cpu_attn_reshape_and_cache(torch.cat(batch.keys), torch.cat(batch.values), key_cache,
                                   value_cache, all_slots, "vec16", k_scale=k_scale,
                                   v_scale=v_scale)
    quantised = type(batch)(**{**batch.__dict__, "key_cache": key_cache,
                               "value_cache": value_cache})
    args = feature_args(feature, 8, 64)
    got = run_native(quantised, args, block_size=16, k_scale=k_scale, v_scale=v_scale).float()

    group = 8 // 2  # query heads per kv head
    sub_half = torch.finfo(fp8).smallest_normal / 2 ** mant / 2
    atol_bf16, rtol_bf16 = TOLERANCES[torch.bfloat16]
    starts = batch.query_start_loc.tolist()
    for r, (keys, values) in enumerate(zip(batch.keys, batch.values)):
        lo, hi = starts[r], starts[r + 1]
        want = _contiguous_reference(batch.query[lo:hi], keys, values, args)
        q = batch.query[lo:hi].float().abs()                        # [q, H, D]
        k_err = u * keys.float().abs() + sub_half * k_scale          # [kv, Hkv, D]
        k_err = k_err.repeat_interleave(group, dim=1)                # [kv, H, D]
        # d per query row: the largest score change over its keys, [q, H]
        d = args["scale"] * (q.unsqueeze(1) * k_err.unsqueeze(0)).sum(-1).amax(1)
        vmax = values.float().abs().amax(0).repeat_interleave(group, dim=0)  # [H, D]
        bound = (u + torch.expm1(2 * d)).unsqueeze(-1) * vmax + sub_half * v_scale
        err = (got[lo:hi] - want).abs()
        allowed = bound + atol_bf16 + rtol_bf16 * want.abs()
        assert (err <= allowed).all(), f"request {r}: max excess {(err - allowed).max():.3g}"
        assert err.max() > 0  # the cache really was quantised


def _contiguous_reference(query, keys, values, args):
    """fp32 attention of one request over its contiguous (unquantised) keys/values."""
    kv_len, kvh, hs = keys.shape
    cache_k = keys.float().transpose(0, 1).unsqueeze(0)  # one block holding everything
    cache_v = values.float().transpose(0, 1).unsqueeze(0)
    return ref.paged_attention(
        query.float(), cache_k, cache_v, torch.tensor([0, query.shape[0]], dtype=torch.int32),
        torch.tensor([kv_len], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
        scale=args["scale"], causal=args["causal"], sliding_window=args["sliding_window"],
        softcap=args["softcap"], alibi_slopes=args["alibi_slopes"], s_aux=args["s_aux"],
    )
