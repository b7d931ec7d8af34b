"""pagedattn.ops.triton against the reference ops (pagedattn.ops.reference).

Shapes are small on purpose: under the interpreter every program instance runs in
Python. They still cover several KV tiles per request, GQA with a group of 3 (not a
power of two), MQA, a head size of 40 (padded to 64 inside the kernel), block tables
in random order with NaN in every unused cache slot.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedattn.ops import reference as ref
from pagedattn.ops import triton as tops
from pagedattn.testing import TOLERANCES, BatchSpec, make_paged_batch

from gpu_env import INTERPRETED, ON_GPU

MAX_SPLITS = tops.MAX_KV_SPLITS

# bf16 only compiled: the interpreter's bf16 tl.dot is wrong.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# The split-KV and window cases cost seconds each under the interpreter: there the fast
# tier runs them in fp16 and the slow tier (make test-all) adds fp32 (the same index logic).
SPLIT_DTYPES = [pytest.param(d, marks=pytest.mark.slow) if INTERPRETED and d == torch.float32
                else d for d in DTYPES]
# Decodes, a chunked prefill over context, a whole prefill, an empty request.
MIXED = BatchSpec("mixed", (70, 1, 45, 0, 33), (1, 1, 9, 0, 33))
FEATURES = {
    "plain": dict(),
    "window": dict(window_size=(10, -1)),
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all": dict(window_size=(20, -1), softcap=4.0, alibi=True, sinks=True),
}


def tolerance(dtype):
    atol, rtol = TOLERANCES[dtype]
    return dict(atol=atol, rtol=rtol)


def make_batch(spec, dtype, device, *, num_heads=6, num_kv_heads=2, head_size=40,
               block_size=16, seed=0):
    b = make_paged_batch(spec, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_size=head_size, block_size=block_size, dtype=dtype,
                         layout="flash", seed=seed)
    for name in ("query", "key_cache", "value_cache", "block_table", "query_start_loc",
                 "seq_lens", "slot_mapping", "new_keys", "new_values"):
        setattr(b, name, getattr(b, name).to(device))
    return b


def feature_args(feature, num_heads, device, seed=5):
    gen = torch.Generator().manual_seed(seed)
    f = FEATURES[feature]
    return dict(
        window_size=f.get("window_size", (-1, -1)),
        softcap=f.get("softcap", 0.0),
        alibi_slopes=(torch.rand(num_heads, generator=gen) * 0.3).to(device)
        if f.get("alibi") else None,
        sinks=(torch.randn(num_heads, generator=gen) * 2).to(device) if f.get("sinks") else None,
    )


def run_unified(b, *, scale=0.2, causal=True, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, sinks=None, k=None, v=None, k_descale=None,
                v_descale=None, num_kv_splits=None, tiles=None):
    out = torch.full_like(b.query, math.nan)
    tops.unified_attention(
        q=b.query, k=b.key_cache if k is None else k, v=b.value_cache if v is None else v,
        out=out, cu_seqlens_q=b.query_start_loc, max_seqlen_q=max(b.spec.query_lens),
        seqused_k=b.seq_lens, max_seqlen_k=max(b.spec.seq_lens), softmax_scale=scale,
        causal=causal, alibi_slopes=alibi_slopes, window_size=window_size,
        block_table=b.block_table, softcap=softcap, q_descale=None, k_descale=k_descale,
        v_descale=v_descale, sinks=sinks, num_kv_splits=num_kv_splits, tiles=tiles)
    return out


def expected(b, *, scale=0.2, causal=True, window_size=(-1, -1), softcap=0.0,
             alibi_slopes=None, sinks=None, key_cache=None, value_cache=None):
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return ref.paged_attention(
        b.query.cpu().float(), (b.key_cache if key_cache is None else key_cache).cpu().float(),
        (b.value_cache if value_cache is None else value_cache).cpu().float(),
        b.query_start_loc.cpu(), b.seq_lens.cpu(), b.block_table.cpu(), scale=scale,
        causal=causal, sliding_window=window_size, softcap=softcap,
        alibi_slopes=cpu(alibi_slopes), s_aux=cpu(sinks), layout="flash")


# ----------------------------------------------------------------- unified_attention


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("feature", FEATURES)
def test_unified_attention_matches_reference(feature, dtype, device):
    b = make_batch(MIXED, dtype, device, seed=1)
    args = feature_args(feature, 6, device)
    out = run_unified(b, **args)
    torch.testing.assert_close(out.float().cpu(), expected(b, **args), **tolerance(dtype))


@pytest.mark.parametrize("dtype", SPLIT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("splits, feature", [(2, "all"), (5, "plain"), (5, "window"),
                                             (5, "all")])
def test_split_kv_matches_reference(splits, feature, dtype, device):
    # 5 splits of a 70-key decode leave some splits without a key tile (merged as empty);
    # the window makes some splits see only masked keys; sinks join in the merge.
    b = make_batch(MIXED, dtype, device, seed=1)
    args = feature_args(feature, 6, device)
    out = run_unified(b, num_kv_splits=splits, **args)
    torch.testing.assert_close(out.float().cpu(), expected(b, **args), **tolerance(dtype))


PLANNED_TILES = sorted({shape for t in tops.TILE_TABLE.values() for shape in t.values()})


# The interpreter runs one dtype of these (each costs seconds there).
@pytest.mark.parametrize("dtype", DTYPES if ON_GPU else [torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", PLANNED_TILES, ids=lambda s: "x".join(map(str, s)))
def test_every_planned_tile_shape_matches_reference(shape, dtype, device):
    # The test batches are short, so the plan alone would never pick the tiles of long
    # prefills or of another GPU: force each shape of the table, with every feature, the
    # split path and an fp8 cache. (Head 40 pads to 64; the group of 3 to 4.)
    rows, block_n, num_warps, num_stages = shape
    tiles = tops.Tiles(max(1, rows // 4), 4, 64, block_n, num_warps, num_stages)
    b = make_batch(MIXED, dtype, device, seed=4)
    args = feature_args("all", 6, device)
    for splits in (None, 3):
        out = run_unified(b, tiles=tiles, num_kv_splits=splits, **args)
        torch.testing.assert_close(out.float().cpu(), expected(b, **args), **tolerance(dtype))
    k8 = b.key_cache.float().nan_to_num(0.0).to(torch.float8_e5m2)
    v8 = b.value_cache.float().nan_to_num(0.0).to(torch.float8_e5m2)
    out = run_unified(b, tiles=tiles, k=k8, v=v8, **args)
    want = expected(b, key_cache=k8.float().cpu(), value_cache=v8.float().cpu(), **args)
    atol = max(TOLERANCES[dtype][0], 2e-3)
    torch.testing.assert_close(out.float().cpu(), want, atol=atol, rtol=atol)


def test_split_kv_chosen_for_small_decode_batches_on_a_gpu_only(device):
    decodes = make_batch(BatchSpec("decode", (900, 700), (1, 1)), torch.float16, device)
    prefill = make_batch(BatchSpec("prefill", (900,), (40,)), torch.float16, device)

    def plan(b):
        return tops.plan_unified_attention(
            b.query, b.key_cache, b.value_cache, torch.empty_like(b.query), b.query_start_loc,
            max(b.spec.query_lens), b.seq_lens, 900, 0.2, True, None, (-1, -1), b.block_table,
            0.0, None, None, None)

    assert plan(prefill).then is None
    if ON_GPU:  # 2 requests x 2 kv heads: far fewer programs than multiprocessors
        assert plan(decodes).grid[2] > 1 and plan(decodes).then is not None
    else:
        assert plan(decodes).grid[2] == 1 and plan(decodes).then is None


@pytest.mark.parametrize("bad", [0, MAX_SPLITS + 1, 2.5, True])
def test_num_kv_splits_out_of_range_rejected(bad, device):
    b = make_batch(BatchSpec("decode", (20,), (1,)), torch.float32, device)
    with pytest.raises(ValueError, match="num_kv_splits must be"):
        run_unified(b, num_kv_splits=bad)


WINDOW_BATCHES = {
    "decode": BatchSpec("decode", (70, 93, 51), (1, 1, 1)),
    "prefill": BatchSpec("prefill", (90, 77), (40, 30)),  # chunks over context
    "mixed": BatchSpec("mixed", (70, 1, 95, 60), (1, 1, 40, 60)),
}


def _poison_blocks_behind_window(b, window_left: int) -> int:
    """NaN into every block that lies wholly before what any query of its request can see
    (as vLLM's sliding-window manager may have handed those blocks to someone else);
    returns how many blocks were poisoned."""
    bs = b.key_cache.shape[1]
    poisoned = 0
    for r, (seq_len, q_len) in enumerate(zip(b.spec.seq_lens, b.spec.query_lens)):
        first_visible = max(seq_len - q_len - window_left, 0)
        for j in range(first_visible // bs):  # blocks whose last key < first_visible
            block = int(b.block_table[r, j])
            b.key_cache[block] = math.nan
            b.value_cache[block] = math.nan
            poisoned += 1
    return poisoned


@pytest.mark.parametrize("dtype", SPLIT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("batch", WINDOW_BATCHES)
@pytest.mark.parametrize("splits", [None, 3], ids=["whole", "split3"])
def test_blocks_behind_the_window_are_never_read(splits, batch, dtype, device):
    # Windows chosen so the first visible key falls past a block edge inside a 32-key
    # tile: the tile's leading block lies wholly behind the window.
    window = (21, -1)
    b = make_batch(WINDOW_BATCHES[batch], dtype, device, seed=3)
    want = expected(b, window_size=window)  # from the intact cache
    assert _poison_blocks_behind_window(b, window[0]) > 0
    out = run_unified(b, window_size=window, num_kv_splits=splits)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.float().cpu(), want, **tolerance(dtype))


@pytest.mark.parametrize("layout", [
    dict(num_heads=4, num_kv_heads=1, head_size=32, block_size=16),   # MQA
    dict(num_heads=3, num_kv_heads=3, head_size=24, block_size=32),   # MHA, head < 32
    dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=48),   # block not pow2
], ids=["mqa", "mha_hs24_bs32", "gqa4_bs48"])
def test_unified_attention_head_layouts(layout, device):
    spec = BatchSpec("mixed", (50, 17, 1), (1, 17, 1))
    b = make_batch(spec, torch.float32, device, seed=2, **layout)
    out = run_unified(b, window_size=(30, -1))
    torch.testing.assert_close(out.cpu(), expected(b, window_size=(30, -1)),
                               **tolerance(torch.float32))


def test_non_causal_windows(device):
    # Without causality a right window lets a query see keys after its position.
    spec = BatchSpec("prefill", (20, 37), (12, 37))
    b = make_batch(spec, torch.float32, device, seed=3)
    for window in [(3, 5), (0, 0), (-1, 2), (-1, -1)]:
        out = run_unified(b, causal=False, window_size=window)
        torch.testing.assert_close(out.cpu(), expected(b, causal=False, window_size=window),
                                   **tolerance(torch.float32))


def test_dominant_sink_gives_finite_near_zero_output(device):
    # A sink far above every score takes nearly all the probability mass.
    b = make_batch(BatchSpec("decode", (5, 40), (1, 1)), torch.float32, device, seed=4)
    sinks = torch.full((6,), 60.0, device=device)
    out = run_unified(b, sinks=sinks)
    assert torch.isfinite(out).all() and out.abs().max() < 1e-6
    torch.testing.assert_close(out.cpu(), expected(b, sinks=sinks), **tolerance(torch.float32))


def test_out_rows_past_the_batch_are_untouched(device):
    b = make_batch(BatchSpec("decode", (20, 9), (1, 1)), torch.float32, device)
    padded_q = torch.cat([b.query, torch.randn(3, 6, 40, device=device)])
    out = torch.full_like(padded_q, 7.0)
    tops.unified_attention(padded_q, b.key_cache, b.value_cache, out, b.query_start_loc, 1,
                           b.seq_lens, 20, 0.2, True, None, (-1, -1), b.block_table, 0.0,
                           None, None, None)
    assert torch.equal(out[2:], torch.full_like(out[2:], 7.0))
    torch.testing.assert_close(out[:2].cpu(), expected(b)[:2], **tolerance(torch.float32))


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_unified_attention_dequantizes_fp8_cache_per_request_and_head(cache_dtype, dtype, device):
    fp8 = tops.FP8_CACHE_DTYPES[cache_dtype]
    b = make_batch(MIXED, dtype, device, seed=6)
    num_reqs, num_kv_heads = len(MIXED.seq_lens), 2
    gen = torch.Generator().manual_seed(0)
    k_descale = (torch.rand(num_reqs, num_kv_heads, generator=gen) + 0.5).to(device)
    v_descale = (torch.rand(num_reqs, num_kv_heads, generator=gen) + 0.5).to(device)
    k8 = b.key_cache.float().nan_to_num(0.0).to(fp8)
    v8 = b.value_cache.float().nan_to_num(0.0).to(fp8)
    out = run_unified(b, k=k8, v=v8, k_descale=k_descale, v_descale=v_descale)
    # Reference: each request reads its blocks dequantized with its own descales.
    exp = torch.zeros(b.query.shape)
    for r in range(num_reqs):
        kc, vc = k8.float().cpu(), v8.float().cpu()
        kc = kc * k_descale[r].cpu().view(1, 1, -1, 1)
        vc = vc * v_descale[r].cpu().view(1, 1, -1, 1)
        lo, hi = int(b.query_start_loc[r]), int(b.query_start_loc[r + 1])
        exp[lo:hi] = expected(b, key_cache=kc, value_cache=vc)[lo:hi]
    # fp16/bf16 tolerances: the dequantized keys are rounded to the query dtype.
    atol = max(TOLERANCES[dtype][0], 2e-3)
    torch.testing.assert_close(out.float().cpu(), exp, atol=atol, rtol=atol)


def test_unified_attention_rejects_bad_inputs(device, monkeypatch):
    # Checks of values (lengths, block ids) sync a GPU: there they run on request only.
    monkeypatch.setenv(tops.CHECK_VALUES_ENV, "1")
    b = make_batch(BatchSpec("decode", (20, 9), (1, 1)), torch.float32, device)
    good = dict(q=b.query, k=b.key_cache, v=b.value_cache, out=torch.empty_like(b.query),
                cu_seqlens_q=b.query_start_loc, max_seqlen_q=1, seqused_k=b.seq_lens,
                max_seqlen_k=20, softmax_scale=0.2, causal=True, alibi_slopes=None,
                window_size=(-1, -1), block_table=b.block_table, softcap=0.0,
                q_descale=None, k_descale=None, v_descale=None)
    cases = [
        (dict(q=b.query[..., :32]), ValueError, "head_size"),
        (dict(q=b.query.to(torch.int32)), TypeError, "q must have dtype"),
        (dict(k=b.key_cache.half(), v=b.value_cache.half()), TypeError,
         "k/v must have q's dtype"),
        (dict(v=b.value_cache.half()), ValueError, "v .* must match k"),
        (dict(out=torch.empty(2, 6, 40, dtype=torch.float16, device=device)), ValueError, "out"),
        (dict(cu_seqlens_q=b.query_start_loc.long()), TypeError, "cu_seqlens_q"),
        (dict(seqused_k=torch.tensor([20, 0], dtype=torch.int32, device=device)), ValueError,
         r"seqused_k\[1\] \(0\) must be >= its query length \(1\)"),
        (dict(block_table=b.block_table[:, :1]), ValueError, "needs 2 blocks"),
        (dict(block_table=b.block_table + 1000), ValueError, "outside"),
        (dict(max_seqlen_q=0, cu_seqlens_q=torch.tensor([0, 2, 2], dtype=torch.int32,
                                                        device=device)),
         ValueError, "max_seqlen_q"),
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(alibi_slopes=torch.zeros(5, device=device)), ValueError, "alibi_slopes"),
        (dict(sinks=torch.zeros(6, dtype=torch.float16, device=device)), TypeError, "sinks"),
        (dict(q_descale=torch.ones(1, device=device)), NotImplementedError, "q_descale"),
        (dict(k_descale=torch.ones(3, 3, device=device)), ValueError, "k_descale"),
        (dict(q=b.query.view(2, 3, 80)), ValueError, "head_size"),
    ]
    for change, exc, match in cases:
        with pytest.raises(exc, match=match):
            tops.unified_attention(**{**good, **change})


def test_heads_not_a_multiple_of_kv_heads_rejected(device):
    b = make_batch(BatchSpec("decode", (20,), (1,)), torch.float32, device, num_heads=6,
                   num_kv_heads=2)
    q = torch.zeros(1, 5, 40, device=device)
    with pytest.raises(ValueError, match=r"num_heads \(5\) must be a multiple of num_kv_heads \(2\)"):
        tops.unified_attention(q, b.key_cache, b.value_cache, torch.empty_like(q),
                               b.query_start_loc, 1, b.seq_lens, 20, 0.2, True, None,
                               (-1, -1), b.block_table, 0.0, None, None, None)


# ----------------------------------------------------------- reshape_and_cache_flash


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_reshape_and_cache_flash_writes_slots_and_skips_padding(dtype, device):
    b = make_batch(MIXED, dtype, device, seed=7)
    slots = b.slot_mapping.clone()
    slots[1] = -1  # a padding slot in the middle: must not be written
    # key/value carry 2 padding rows past slot_mapping: they must not be read.
    pad = torch.full((2, 2, 40), math.nan, dtype=dtype, device=device)
    keys, values = torch.cat([b.new_keys, pad]), torch.cat([b.new_values, pad])
    kc = torch.full_like(b.key_cache, 3.0)
    vc = torch.full_like(b.value_cache, 3.0)
    tops.reshape_and_cache_flash(keys, values, kc, vc, slots, "auto", 1.0, 1.0)
    exp_k, exp_v = torch.full_like(kc, 3.0).cpu(), torch.full_like(vc, 3.0).cpu()
    ref.reshape_and_cache(keys.cpu(), values.cpu(), exp_k, exp_v, slots.cpu(), layout="flash")
    assert torch.equal(kc.cpu(), exp_k) and torch.equal(vc.cpu(), exp_v)
    bs = kc.shape[1]
    skipped = int(b.slot_mapping[1])
    assert torch.equal(kc[skipped // bs, skipped % bs].cpu(), torch.full((2, 40), 3.0, dtype=dtype))


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_reshape_and_cache_flash_fp8_stores_scaled_saturated_values(cache_dtype, device):
    fp8 = tops.FP8_CACHE_DTYPES[cache_dtype]
    fmax = torch.finfo(fp8).max
    num_blocks, bs, nkv, hs = 3, 16, 2, 8
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(5, nkv, hs, generator=gen) * 3)
    value = (torch.randn(5, nkv, hs, generator=gen) * 3)
    key[0, 0, :3] = torch.tensor([1e6, -1e6, fmax * 0.7])  # saturate: +-max after / 0.5
    slots = torch.tensor([0, 17, 33, -1, 47])
    kc = torch.zeros(num_blocks, bs, nkv, hs, dtype=fp8)
    vc = torch.zeros(num_blocks, bs, nkv, hs, dtype=fp8)
    kc, vc = kc.to(device), vc.to(device)
    tops.reshape_and_cache_flash(key.to(device), value.to(device), kc, vc, slots.to(device),
                                 cache_dtype, torch.tensor(0.5, device=device), 2.0)
    exp_k = torch.zeros(num_blocks, bs, nkv, hs, dtype=fp8)
    exp_v = torch.zeros(num_blocks, bs, nkv, hs, dtype=fp8)
    ref.reshape_and_cache((key / 0.5).clamp(-fmax, fmax).to(fp8),
                          (value / 2.0).clamp(-fmax, fmax).to(fp8), exp_k, exp_v, slots,
                          layout="flash")
    assert torch.equal(kc.cpu().view(torch.uint8), exp_k.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), exp_v.view(torch.uint8))
    assert kc[0, 0, 0, 0].float().item() == fmax and kc[0, 0, 0, 1].float().item() == -fmax
    # The reference op (which casts without clamping) agrees on every in-range value.
    exp_ref_k = torch.zeros_like(exp_k)
    ref.reshape_and_cache_flash(key, value, exp_ref_k, torch.zeros_like(exp_v), slots,
                                cache_dtype, 0.5, 2.0)
    in_range = (key.abs() / 0.5 <= fmax)
    rows = torch.nonzero(slots >= 0).flatten()
    for t in rows.tolist():
        s = int(slots[t])
        mask = in_range[t]
        assert torch.equal(kc.cpu()[s // bs, s % bs][mask].float(),
                           exp_ref_k[s // bs, s % bs][mask].float())


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_rounds_like_torch_over_every_magnitude(cache_dtype, device):
    # Round-to-nearest-even, ties and carries into the exponent included, subnormals of
    # the fp8 format, signed zeros: bit-identical to torch's cast.
    fp8 = tops.FP8_CACHE_DTYPES[cache_dtype]
    fmax = torch.finfo(fp8).max
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1024, generator=gen) * s for s in (1e-6, 1e-3, 1, 40, 1e3)])
    x = torch.cat([x, torch.arange(-64, 64) / 16.0 + 1 / 32.0]).clamp(-fmax, fmax)  # ties
    x = x[: x.numel() // 512 * 512].view(-1, 1, 512)
    n = x.shape[0]
    kc = torch.zeros(n, 1, 1, 512, dtype=fp8, device=device)
    vc = torch.zeros_like(kc)
    tops.reshape_and_cache_flash(x.to(device), x.to(device), kc, vc,
                                 torch.arange(n, device=device), cache_dtype, 1.0, 1.0)
    assert torch.equal(kc.cpu().view(torch.uint8).flatten(), x.to(fp8).view(torch.uint8).flatten())


def test_reshape_and_cache_flash_rejects_bad_inputs(device, monkeypatch):
    monkeypatch.setenv(tops.CHECK_VALUES_ENV, "1")  # the slot range check reads values
    kc = torch.zeros(2, 16, 2, 8, device=device)
    key = torch.zeros(3, 2, 8, device=device)
    slots = torch.tensor([0, 1, 2], device=device)
    good = dict(key=key, value=key, key_cache=kc, value_cache=kc.clone(), slot_mapping=slots,
                kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
    cases = [
        (dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype must be one of"),
        (dict(kv_cache_dtype="fp8"), TypeError, "needs a torch.float8_e4m3fn cache"),
        (dict(slot_mapping=torch.tensor([0, 1, 32], device=device)), ValueError, "slot 32"),
        (dict(slot_mapping=torch.arange(4, device=device)), ValueError, "4 entries"),
        (dict(key=torch.zeros(3, 2, 4, device=device), value=torch.zeros(3, 2, 4, device=device)),
         ValueError, r"key must be \[T, 2, 8\]"),
        (dict(value_cache=torch.zeros(2, 16, 2, 8, dtype=torch.float16, device=device)),
         ValueError, "value_cache"),
        (dict(slot_mapping=slots.float()), TypeError, "slot_mapping"),
        (dict(k_scale=torch.ones(2)), ValueError, "k_scale must hold one value"),
        (dict(key_cache=kc.half(), value_cache=kc.half()), TypeError, "needs a torch.float32"),
    ]
    for change, exc, match in cases:
        with pytest.raises(exc, match=match):
            tops.reshape_and_cache_flash(**{**good, **change})


def test_launch_problem_reports_where_kernels_run():
    if INTERPRETED:
        assert tops.launch_problem("cpu") is None
        assert "TRITON_INTERPRET" in tops.launch_problem("cuda")
    else:
        assert tops.launch_problem("cuda") is None
        assert "interpreter" in tops.launch_problem("cpu")
    assert "not supported" in tops.launch_problem("meta")
