"""The native CPU ops against the reference, over the feature grid, under every ISA.

Every case builds a random paged batch whose unused cache slots are NaN (a kernel that
reads outside a request's keys poisons its output) and whose block table is a random
permutation with block 0 reserved.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import threading

try:
    import resource
except ImportError:  # not POSIX
    resource = None

import pytest
import torch

from pagedattn import ops
from pagedattn.ops import kernel_shapes
from pagedattn.ops import reference as ref
from pagedattn.backends.cpu_runtime import kernel_variant
from pagedattn.testing import BATCH_SPECS, TOLERANCES, BatchSpec, make_paged_batch

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# `isa` (tests/conftest.py) runs a test under each instruction set of this machine.


FEATURES = {
    "causal": dict(),
    "noncausal": dict(causal=False),
    "window": dict(window=(13, 0)),
    "window_noncausal": dict(causal=False, window=(9, 4)),
    "softcap": dict(softcap=2.0, scale=0.6),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "everything": dict(window=(40, 0), softcap=5.0, alibi=True, sinks=True),
}


@functools.lru_cache(maxsize=None)
def case_inputs(batch_name, dtype_name, head_size, block_size, num_heads, num_kv_heads, seed=0):
    spec = BATCH_SPECS[batch_name] if isinstance(batch_name, str) else batch_name
    return make_paged_batch(
        spec, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, dtype=DTYPES[dtype_name], seed=seed,
    )


def feature_args(feature: str, num_heads: int, head_size: int) -> dict:
    cfg = FEATURES[feature]
    gen = torch.Generator().manual_seed(7)
    return dict(
        scale=cfg.get("scale", head_size ** -0.5),
        causal=cfg.get("causal", True),
        sliding_window=cfg.get("window", (-1, -1)),
        softcap=cfg.get("softcap", 0.0),
        alibi_slopes=torch.rand(num_heads, generator=gen) * 0.2 if cfg.get("alibi") else None,
        s_aux=torch.randn(num_heads, generator=gen) + 1.0 if cfg.get("sinks") else None,
    )


def run_native(batch, args, *, block_size, enable_kv_split=True, hint=None, k_scale=1.0,
               v_scale=1.0):
    num_heads, head_size = batch.query.shape[1:]
    num_kv_heads = batch.key_cache.shape[1]
    hint = hint or kernel_variant()
    window = args["sliding_window"]
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(batch.spec.seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_size, seq_lens=batch.seq_lens, dtype=batch.query.dtype,
        query_start_loc=batch.query_start_loc, causal=args["causal"],
        sliding_window_size=window[0] + 1 if window[0] >= 0 else -1, isa=hint,
        enable_kv_split=enable_kv_split,
    )
    output = torch.full_like(batch.query, math.nan)
    ops.cpu_attention_with_kv_cache(
        query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache,
        output=output, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        scale=args["scale"], causal=args["causal"], alibi_slopes=args["alibi_slopes"],
        sliding_window=window, block_table=batch.block_table, softcap=args["softcap"],
        scheduler_metadata=metadata, s_aux=args["s_aux"], k_scale=k_scale, v_scale=v_scale,
    )
    return output


def run_reference(batch, args, k_scale=1.0, v_scale=1.0):
    """fp32 reference on the same (already rounded or quantised) inputs."""
    key_cache, value_cache = batch.key_cache.float(), batch.value_cache.float()
    if batch.key_cache.dtype in ref.FP8_DTYPES:
        key_cache = ref.dequantize_fp8(batch.key_cache, k_scale)
        value_cache = ref.dequantize_fp8(batch.value_cache, v_scale)
    return ref.paged_attention(
        batch.query.float(), key_cache, value_cache,
        batch.query_start_loc, batch.seq_lens, batch.block_table, scale=args["scale"],
        causal=args["causal"], sliding_window=args["sliding_window"], softcap=args["softcap"],
        alibi_slopes=args["alibi_slopes"], s_aux=args["s_aux"],
    )


def assert_matches_reference(got, want, dtype):
    atol, rtol = TOLERANCES[dtype]
    assert torch.isfinite(got).all(), "kernel output has NaN/inf (read outside the request?)"
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


# KV cache storage: the query dtype ("same") or an fp8 format with per-tensor scales.
CACHES = {"same": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_SCALES = {"k_scale": 0.037, "v_scale": 0.021}  # |randn| / scale spans the fp8 ranges


def with_fp8_cache(batch, cache_name):
    """``batch`` with its caches quantised as ``reshape_and_cache`` would store them (NaN
    poison included), and the scales to read them with."""
    fp8 = CACHES[cache_name]
    if fp8 is None:
        return batch, {}
    caches = {
        "key_cache": ref.quantize_fp8(batch.key_cache, FP8_SCALES["k_scale"], fp8),
        "value_cache": ref.quantize_fp8(batch.value_cache, FP8_SCALES["v_scale"], fp8),
    }
    return type(batch)(**{**batch.__dict__, **caches}), dict(FP8_SCALES)


# Tolerance with an fp8 cache: kernel and reference read the same stored values, and every
# fp8 value is exactly a bf16 and an fp32 value, so the fp8 rounding itself cancels. What
# is left is the query dtype's own path: fp32 accumulation, the output rounded to the dtype
# (bf16 also rounds P to bf16, relative 2^-9 per weight, below the output's 2^-8), plus two
# fp32 roundings (2 * 2^-24 relative) from folding k_scale into the score scale and v_scale
# into the normalisation -- far below every TOLERANCES entry. The dequantised values have
# the originals' magnitude (|err| <= 2^-4 relative), so the same table applies unchanged.
@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("batch_name", list(BATCH_SPECS))
@pytest.mark.parametrize("feature", FEATURES)
def test_features_over_batches(isa, feature, batch_name, dtype_name, cache_name):
    batch, scales = with_fp8_cache(case_inputs(batch_name, dtype_name, 64, 16, 8, 2), cache_name)
    args = feature_args(feature, 8, 64)
    got = run_native(batch, args, block_size=16, **scales)
    assert_matches_reference(got, run_reference(batch, args, **scales), DTYPES[dtype_name])


# Decodes and a 20-token chunk (the prefill kernels), small enough for ~100 size pairs.
SIZES_BATCH = BatchSpec("sizes", (70, 1, 35), (1, 1, 20))


def _size_pairs() -> list[tuple[int, int]]:
    """Every supported head size (with a block size cycling through the supported ones)
    and every supported block size (with a head size cycling likewise): each size runs,
    and the pairs vary, without the full product."""
    heads, blocks = kernel_shapes.SUPPORTED_HEAD_SIZES, kernel_shapes.SUPPORTED_BLOCK_SIZES
    pairs = {(h, blocks[i * 7 % len(blocks)]) for i, h in enumerate(heads)}
    pairs |= {(heads[i * 5 % len(heads)], b) for i, b in enumerate(blocks)}
    return sorted(pairs)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("head_size,block_size", _size_pairs(), ids=lambda v: str(v))
def test_head_and_block_sizes(isa, head_size, block_size, dtype_name):
    batch = case_inputs(SIZES_BATCH, dtype_name, head_size, block_size, 4, 2)
    args = feature_args("window", 4, head_size)
    got = run_native(batch, args, block_size=block_size)
    assert_matches_reference(got, run_reference(batch, args), DTYPES[dtype_name])


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (6, 6), (12, 4), (16, 16)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_gqa_mqa_mha(isa, heads, dtype_name):
    batch = case_inputs("mixed", dtype_name, 128, 32, *heads)
    args = feature_args("sinks", heads[0], 128)
    got = run_native(batch, args, block_size=32)
    assert_matches_reference(got, run_reference(batch, args), DTYPES[dtype_name])


LONG_SPECS = [
    BatchSpec("one_long_decode", (5000,), (1,)),
    BatchSpec("two_long_spec_decodes", (3000, 4100), (3, 1)),
    BatchSpec("long_prefill_with_context", (2600,), (300,)),
]


@pytest.mark.parametrize("feature", ["causal", "window", "everything"])
@pytest.mark.parametrize("spec", LONG_SPECS, ids=lambda s: s.name)
def test_split_kv_long_contexts(isa, spec, feature):
    """Few requests with long contexts: the scheduler splits KV; merge by LSE must match
    the reference, and match the no-split result."""
    batch = case_inputs(spec, "fp32", 128, 32, 8, 2)
    args = feature_args(feature, 8, 128)
    split = run_native(batch, args, block_size=32, enable_kv_split=True)
    assert_matches_reference(split, run_reference(batch, args), torch.float32)
    no_split = run_native(batch, args, block_size=32, enable_kv_split=False)
    torch.testing.assert_close(split, no_split, atol=2e-6, rtol=2e-6)


def test_results_do_not_depend_on_the_window_hint():
    batch = case_inputs("chunked_prefill", "fp32", 64, 16, 8, 2)
    args = feature_args("window", 8, 64)
    base = run_native(batch, args, block_size=16)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=2, num_heads=8, num_kv_heads=2, head_dim=64, seq_lens=batch.seq_lens,
        dtype=torch.float32, query_start_loc=batch.query_start_loc, causal=True,
        sliding_window_size=-1, isa="vec16", enable_kv_split=True,
    )
    out = torch.empty_like(batch.query)
    ops.cpu_attention_with_kv_cache(
        batch.query, batch.key_cache, batch.value_cache, out, batch.query_start_loc,
        batch.seq_lens, args["scale"], True, None, args["sliding_window"], batch.block_table,
        0.0, metadata, None,
    )
    torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ metamorphic checks


def test_page_swap_and_repeat_call_are_invariant(isa):
    batch = case_inputs("mixed", "bf16", 128, 16, 8, 2)
    args = feature_args("everything", 8, 128)
    first = run_native(batch, args, block_size=16)
    again = run_native(batch, args, block_size=16)
    assert torch.equal(first, again), "repeated call is not bit-identical"

    # Swap two physical pages in the cache and patch the block table accordingly.
    a, b = int(batch.block_table[0, 0]), int(batch.block_table[3, 1])
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    key_cache[[a, b]] = key_cache[[b, a]]
    value_cache[[a, b]] = value_cache[[b, a]]
    table = batch.block_table.clone()
    table[batch.block_table == a], table[batch.block_table == b] = b, a
    swapped = type(batch)(**{**batch.__dict__, "key_cache": key_cache,
                             "value_cache": value_cache, "block_table": table})
    assert torch.equal(run_native(swapped, args, block_size=16), first)


def test_output_rows_past_the_batch_are_untouched():
    batch = case_inputs("decode", "fp32", 64, 16, 8, 2)
    args = feature_args("causal", 8, 64)
    padded_query = torch.cat([batch.query, torch.zeros_like(batch.query[:3])])
    padded = type(batch)(**{**batch.__dict__, "query": padded_query})
    out = run_native(padded, args, block_size=16)
    assert torch.isnan(out[-3:]).all()
    assert_matches_reference(out[:-3], run_reference(batch, args), torch.float32)


# ------------------------------------------------------------------ workspace reuse


def test_reused_workspace_never_leaks_between_calls(isa):
    """The op keeps its scratch (item state, split partials) per calling thread across
    calls: big, small and split calls in any order, also from two threads at once, must
    each equal the reference."""
    plan = [("long_split", LONG_SPECS[0], "everything"), ("small", "decode", "causal"),
            ("prefill", LONG_SPECS[2], "window"), ("spec", LONG_SPECS[1], "sinks"),
            ("small_again", "mixed", "alibi")]
    cases = []
    for _, spec, feature in plan:
        batch = case_inputs(spec, "fp32", 128, 32, 8, 2)
        args = feature_args(feature, 8, 128)
        cases.append((batch, args, run_reference(batch, args)))

    def run_plan(order):
        for i in order:
            batch, args, want = cases[i]
            assert_matches_reference(run_native(batch, args, block_size=32), want, torch.float32)

    run_plan([0, 1, 2, 3, 4, 0, 4, 3, 1])
    errors = []

    def worker(order):
        try:
            with ops.use_cpu_isa(isa):
                run_plan(order)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(o,)) for o in ([4, 0, 2, 1, 3], [1, 3, 0, 4, 2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


libc_trim = _malloc_trim()


@pytest.mark.skipif(resource is None, reason="needs the resource module (POSIX)")
def test_repeat_calls_do_not_fault_in_fresh_scratch():
    """A call after other code allocated and freed memory (an engine's other layers) reuses
    the op's scratch: no fresh pages to fault in. Allocated per call, a split decode's
    ~2 MiB of scratch came back as fresh pages here and cost dozens of page faults."""
    batch = case_inputs(LONG_SPECS[0], "bf16", 128, 32, 32, 8)
    args = feature_args("causal", 32, 128)
    run_native(batch, args, block_size=32)  # grows the workspace
    faults = []
    for _ in range(5):
        churn = [torch.ones(n) for n in (1 << 16, 1 << 18, 1 << 20, 3 << 20)]
        del churn
        if libc_trim is not None:  # hand free heap pages back, as glibc does to its top
            libc_trim(0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run_native(batch, args, block_size=32)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # The output tensor run_native allocates is ~32 KiB (up to 8 pages).
    assert min(faults) <= 10, f"page faults per call: {faults}"


# ------------------------------------------------------------------ reshape_and_cache


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_reshape_and_cache_matches_reference(isa, block_size, dtype_name):
    batch = case_inputs("mixed", dtype_name, 96, block_size, 4, 2)
    slots = batch.slot_mapping.clone()
    slots[[0, 5]] = -1  # padding tokens are skipped
    extra = torch.ones_like(batch.new_keys[:4])  # key/value longer than slot_mapping
    key = torch.cat([batch.new_keys, extra])
    value = torch.cat([batch.new_values, extra])
    want_k = torch.zeros_like(batch.key_cache)
    want_v = torch.zeros_like(batch.value_cache)
    got_k, got_v = want_k.clone(), want_v.clone()
    ref.cpu_attn_reshape_and_cache(key, value, want_k, want_v, slots)
    hint = kernel_variant()
    ops.cpu_attn_reshape_and_cache(key, value, got_k, got_v, slots, hint)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_cache_then_attend_equals_reference_end_to_end(isa):
    """Write the new tokens through the op, then attend: the step a decoder layer runs."""
    batch = case_inputs("chunked_prefill", "bf16", 128, 32, 8, 2)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    key_cache.view(-1)[:] = 0  # wipe, then re-fill the context and the new tokens
    value_cache.view(-1)[:] = 0
    all_slots = torch.cat([
        (batch.block_table[r, torch.arange(n) // 32].long() * 32 + torch.arange(n) % 32)
        for r, n in enumerate(batch.spec.seq_lens)
    ])
    hint = kernel_variant()
    ops.cpu_attn_reshape_and_cache(torch.cat(batch.keys), torch.cat(batch.values),
                                   key_cache, value_cache, all_slots, hint)
    rebuilt = type(batch)(**{**batch.__dict__, "key_cache": key_cache, "value_cache": value_cache})
    args = feature_args("causal", 8, 128)
    assert_matches_reference(run_native(rebuilt, args, block_size=32),
                             run_reference(batch, args), torch.bfloat16)


# ------------------------------------------------------------------ bad input


def _good_call_args():
    batch = case_inputs("mixed", "fp32", 64, 16, 8, 2)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=5, num_heads=8, num_kv_heads=2, head_dim=64, seq_lens=batch.seq_lens,
        dtype=torch.float32, query_start_loc=batch.query_start_loc, causal=True,
        sliding_window_size=-1, isa="vec16", enable_kv_split=True,
    )
    return dict(
        query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache,
        output=torch.empty_like(batch.query), query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, scale=0.125, causal=True, alibi_slopes=None,
        sliding_window=(-1, -1), block_table=batch.block_table, softcap=0.0,
        scheduler_metadata=metadata, s_aux=None,
    )


def _bad_attention_cases():
    q = case_inputs("mixed", "fp32", 64, 16, 8, 2).query
    bt = case_inputs("mixed", "fp32", 64, 16, 8, 2).block_table
    return {
        "query_dtype": (dict(query=q.to(torch.float64)), r"Double|float64"),
        "query_int": (dict(query=q.to(torch.int32)), r"Int|int32"),
        "output_dtype_mismatch": (dict(output=torch.empty_like(q, dtype=torch.bfloat16)), r"output"),
        "query_rank": (dict(query=q.reshape(q.shape[0], -1)), r"query"),
        "heads_not_divisible": (dict(query=q[:, :7].contiguous(), output=torch.empty_like(q[:, :7])), r"divisible|num_heads"),
        "head_size_mismatch": (dict(query=q[..., :32].contiguous(), output=torch.empty_like(q[..., :32])), r"head"),
        "noncontiguous_query": (dict(query=q.transpose(0, 1).contiguous().transpose(0, 1)), r"contiguous|stride"),
        "block_id_out_of_range": (dict(block_table=bt.masked_fill(bt > 0, 10_000)), r"block"),
        "negative_block_id": (dict(block_table=bt.masked_fill(bt > 0, -3)), r"block"),
        "seq_len_below_query_len": (dict(seq_lens=torch.tensor([65, 1, 3, 220, 48], dtype=torch.int32)), r"seq_lens\[2\]"),
        "query_start_loc_not_monotone": (dict(query_start_loc=torch.tensor([0, 1, 2, 1, 106, 154], dtype=torch.int32)), r"query_start_loc"),
        "query_start_loc_past_tokens": (dict(query_start_loc=torch.tensor([0, 1, 2, 6, 106, 999], dtype=torch.int32)), r"query_start_loc"),
        "seq_lens_int64": (dict(seq_lens=torch.tensor([65, 1, 130, 220, 48])), r"seq_lens"),
        "alibi_wrong_length": (dict(alibi_slopes=torch.zeros(3)), r"alibi"),
        "s_aux_wrong_dtype": (dict(s_aux=torch.zeros(8, dtype=torch.float64)), r"s_aux"),
        "metadata_for_other_batch": (dict(seq_lens=torch.tensor([65, 1, 130, 220], dtype=torch.int32), query_start_loc=torch.tensor([0, 1, 2, 6, 106], dtype=torch.int32)), r"metadata|num_reqs"),
        "window_tuple": (dict(sliding_window=(3,)), r"sliding_window"),
    }


@pytest.mark.parametrize("case", list(_bad_attention_cases()))
def test_bad_attention_input_raises(case):
    override, pattern = _bad_attention_cases()[case]
    args = {**_good_call_args(), **override}
    with pytest.raises((ValueError, TypeError, RuntimeError), match=pattern):
        ops.cpu_attention_with_kv_cache(**args)


def test_metadata_from_other_thread_count_is_not_silently_used():
    args = _good_call_args()
    want = run_reference(case_inputs("mixed", "fp32", 64, 16, 8, 2), dict(
        scale=0.125, causal=True, sliding_window=(-1, -1), softcap=0.0,
        alibi_slopes=None, s_aux=None))
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        with contextlib.suppress(RuntimeError, ValueError):  # raising is allowed...
            ops.cpu_attention_with_kv_cache(**args)
            # ...and so is rebuilding, as long as the result is right.
            assert_matches_reference(args["output"], want, torch.float32)
    finally:
        torch.set_num_threads(threads)


def _bad_cache_cases():
    batch = case_inputs("mixed", "fp32", 64, 16, 8, 2)
    k, kc, sm = batch.new_keys, batch.key_cache, batch.slot_mapping
    return {
        "slot_out_of_range": (dict(slot_mapping=sm.masked_fill(sm == sm.max(), kc.shape[0] * 16)), r"slot"),
        "slot_mapping_int32": (dict(slot_mapping=sm.to(torch.int32)), r"slot_mapping"),
        "key_too_short": (dict(key=k[:3], value=batch.new_values[:3]), r"key|tokens"),
        "kv_head_mismatch": (dict(key=k[:, :1].contiguous(), value=batch.new_values[:, :1].contiguous()), r"head"),
        "cache_dtype_mismatch": (dict(key=k.to(torch.bfloat16), value=batch.new_values.to(torch.bfloat16)), r"dtype|BFloat16|bfloat16"),
        "cache_shapes_differ": (dict(value_cache=batch.value_cache[:-1].clone()), r"value_cache"),
        "unknown_hint": (dict(isa="sse2"), r"'vec'.*'vec16'"),
        **({} if ops.matrix_engine_available() else
           {"amx_without_matrix_engine": (dict(isa="amx"), r"amx.*brgemm")}),
        "vec_needs_block_32": (dict(isa="vec"), r"vec.*32|block"),
    }


@pytest.mark.parametrize("case", list(_bad_cache_cases()))
def test_bad_cache_input_raises(case):
    batch = case_inputs("mixed", "fp32", 64, 16, 8, 2)
    args = dict(key=batch.new_keys, value=batch.new_values, key_cache=batch.key_cache.clone(),
                value_cache=batch.value_cache.clone(), slot_mapping=batch.slot_mapping, isa="vec16")
    override, pattern = _bad_cache_cases()[case]
    args.update(override)
    with pytest.raises((ValueError, TypeError, RuntimeError, NotImplementedError), match=pattern):
        ops.cpu_attn_reshape_and_cache(**args)


# ------------------------------------------------------------------ long decodes (issue 33)

LONG_DECODES = [
    BatchSpec("b1_32k", (32768,), (1,)),
    BatchSpec("b2_32k_20k", (32768, 20001), (1, 1)),
]


def _kv_splits(metadata: torch.Tensor, num_reqs: int) -> list[int]:
    from pagedattn.ops.isa import METADATA_FIELDS_PER_REQ, METADATA_HEADER
    base, step = len(METADATA_HEADER), len(METADATA_FIELDS_PER_REQ)
    return [int(metadata[base + r * step]) for r in range(num_reqs)]


@pytest.mark.parametrize("cache_name", ["same", "fp8_e4m3"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
@pytest.mark.parametrize("spec", LONG_DECODES, ids=lambda s: s.name)
def test_32k_decodes_match_reference(isa, spec, dtype_name, cache_name):
    """Contexts of 32k tokens (GQA 4, head size 128): the split-KV plan and its merge over
    a long softmax match the reference, bf16/fp32 queries, model-dtype and fp8 caches."""
    batch, scales = with_fp8_cache(case_inputs(spec, dtype_name, 128, 32, 8, 2), cache_name)
    args = feature_args("sinks", 8, 128)
    got = run_native(batch, args, block_size=32, **scales)
    assert_matches_reference(got, run_reference(batch, args, **scales), DTYPES[dtype_name])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_split_kv_at_batch_1_on_one_and_two_threads(isa, threads, dtype_name):
    """A single decode of one kv head (MQA 8/1) is split over its keys: on 2 threads it
    must be (one head cannot keep two threads busy otherwise); the split and unsplit
    results match the reference on 1 and 2 threads."""
    spec = BatchSpec("b1_9000", (9000,), (1,))
    batch = case_inputs(spec, dtype_name, 128, 32, 8, 1)
    args = feature_args("causal", 8, 128)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan = functools.partial(
            ops.cpu_attn_get_scheduler_metadata, num_reqs=1, num_heads=8, num_kv_heads=1,
            head_dim=128, seq_lens=batch.seq_lens, dtype=batch.query.dtype,
            query_start_loc=batch.query_start_loc, causal=True, sliding_window_size=-1,
            isa=kernel_variant(), enable_kv_split=True)
        splits = _kv_splits(plan(), 1)[0]
        invariant_splits = _kv_splits(plan(batch_invariant=True), 1)[0]
        split = run_native(batch, args, block_size=32, enable_kv_split=True)
        whole = run_native(batch, args, block_size=32, enable_kv_split=False)
    finally:
        torch.set_num_threads(before)
    want = run_reference(batch, args)
    assert_matches_reference(split, want, DTYPES[dtype_name])
    assert_matches_reference(whole, want, DTYPES[dtype_name])
    assert splits >= 1
    assert invariant_splits == 1, "batch-invariant plans never split a row's keys"
    if threads == 2:
        assert splits > 1, "a lone one-head 9000-token decode on 2 threads splits its keys"
