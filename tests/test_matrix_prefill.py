"""The matrix-engine prefill kernel (hint ``amx``: oneDNN's brgemm through ATen) against the
reference, over the feature grid, under every ISA this CPU executes.

Prefill items of at least 16 rows on one kv head take the matrix kernel; decodes in the
same batches stay on the vector kernels (their bf16 q.k on the AMX tiles where our tile
loop runs), so mixed batches check that both paths write their own rows. The batches are those of ``test_cpu_ops`` (unused cache slots NaN, random
block tables), so a read outside a request's keys poisons the output.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from pagedattn import ops
from pagedattn.ops.isa import IsaHint
from pagedattn.testing import BatchSpec

from test_cpu_ops import (CACHES, DTYPES, FEATURES, LONG_SPECS, assert_matches_reference,
                          case_inputs, feature_args, run_native, run_reference, with_fp8_cache)

pytestmark = pytest.mark.skipif(
    not ops.matrix_engine_available(),
    reason="torch's brgemm microkernels (oneDNN) do not run here, so the 'amx' hint is refused")

MATRIX = IsaHint.AMX
# Batches with prefill items of >= 16 rows (8 query heads over 2 kv heads: 4 rows a token).
PREFILL_BATCHES = ["prefill", "chunked_prefill", "mixed"]


@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("batch_name", PREFILL_BATCHES)
@pytest.mark.parametrize("feature", FEATURES)
def test_features_over_batches(isa, feature, batch_name, dtype_name, cache_name):
    batch, scales = with_fp8_cache(case_inputs(batch_name, dtype_name, 64, 16, 8, 2), cache_name)
    args = feature_args(feature, 8, 64)
    got = run_native(batch, args, block_size=16, hint=MATRIX, **scales)
    assert_matches_reference(got, run_reference(batch, args, **scales), DTYPES[dtype_name])


MICROKERNELS = ["reference", "brgemm", "tiles"]


@contextlib.contextmanager
def bf16_microkernel(kind: str):
    """bf16 items on one bf16 GEMM behind the matrix engine's interface: "reference" (plain
    loops, any CPU: the packing, probability rounding and tiling of the bf16 path),
    "brgemm" (oneDNN's VNNI microkernel: AMX or AVX512-BF16) or "tiles" (our own AMX tile
    loop, where oneDNN's is not taking the shape: matrix_amx.cpp)."""
    pa = torch.ops.pagedattn
    if kind != "reference" and not pa.matrix_engine_bf16():
        pytest.skip("oneDNN has no bf16 microkernel on this CPU (it needs AVX512-BF16 or "
                    "AMX): bf16 items run the fp32 one")
    if kind == "tiles" and pa.matrix_engine_bf16_microkernel() != "tiles":
        pytest.skip("our AMX tile loop needs a CPU with AMX-BF16 tiles the OS grants")
    pa.matrix_engine_use_bf16_reference(kind == "reference")
    pa.matrix_engine_use_own_tiles(kind != "brgemm")
    try:
        yield
    finally:
        pa.matrix_engine_use_bf16_reference(False)
        pa.matrix_engine_use_own_tiles(True)


@pytest.mark.parametrize("kind", MICROKERNELS)
@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("batch_name", PREFILL_BATCHES)
@pytest.mark.parametrize("feature", FEATURES)
def test_bf16_microkernel_over_the_grid(isa, kind, feature, batch_name, cache_name):
    batch, scales = with_fp8_cache(case_inputs(batch_name, "bf16", 64, 16, 8, 2), cache_name)
    args = feature_args(feature, 8, 64)
    with bf16_microkernel(kind):
        got = run_native(batch, args, block_size=16, hint=MATRIX, **scales)
    assert_matches_reference(got, run_reference(batch, args, **scales), torch.bfloat16)


@pytest.mark.parametrize("kind", MICROKERNELS)
@pytest.mark.parametrize("head_size,block_size", [(32, 1), (64, 16), (72, 48), (80, 16), (128, 32)],
                         ids=lambda v: str(v))
def test_bf16_microkernel_sizes(isa, kind, head_size, block_size):
    batch = case_inputs(BatchSpec("matrix_sizes", (70, 24), (40, 24)), "bf16", head_size,
                        block_size, 8, 2)
    args = feature_args("window", 8, head_size)
    with bf16_microkernel(kind):
        got = run_native(batch, args, block_size=block_size, hint=MATRIX)
    assert_matches_reference(got, run_reference(batch, args), torch.bfloat16)


# A 40-token chunk after 30 cached tokens and a 24-token prompt: several key tiles, a
# ragged last tile, and tiles that start inside a block.
SIZES_BATCH = BatchSpec("matrix_sizes", (70, 24), (40, 24))


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("head_size,block_size",
                         [(32, 1), (40, 8), (64, 16), (72, 48), (128, 32), (256, 64),
                          (512, 16), (128, 512)], ids=lambda v: str(v))
def test_head_and_block_sizes(isa, head_size, block_size, dtype_name):
    batch = case_inputs(SIZES_BATCH, dtype_name, head_size, block_size, 8, 2)
    args = feature_args("window", 8, head_size)
    got = run_native(batch, args, block_size=block_size, hint=MATRIX)
    assert_matches_reference(got, run_reference(batch, args), DTYPES[dtype_name])


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (6, 6), (12, 4), (16, 16), (64, 1)],
                         ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_gqa_mqa_mha(isa, heads, dtype_name):
    batch = case_inputs("prefill", dtype_name, 128, 32, *heads)
    args = feature_args("sinks", heads[0], 128)
    got = run_native(batch, args, block_size=32, hint=MATRIX)
    assert_matches_reference(got, run_reference(batch, args), DTYPES[dtype_name])


@pytest.mark.parametrize("feature", ["causal", "window", "everything"])
@pytest.mark.parametrize("spec", LONG_SPECS, ids=lambda s: s.name)
def test_long_contexts_and_split_kv(isa, spec, feature):
    """Spec decodes of 3 tokens x 8 heads (24 rows) are split along the keys and merged."""
    batch = case_inputs(spec, "fp32", 128, 32, 8, 1)
    args = feature_args(feature, 8, 128)
    split = run_native(batch, args, block_size=32, hint=MATRIX, enable_kv_split=True)
    assert_matches_reference(split, run_reference(batch, args), torch.float32)
    whole = run_native(batch, args, block_size=32, hint=MATRIX, enable_kv_split=False)
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)


def test_encoder_and_cross_attention_shapes(isa):
    """Non-causal items whose query is not at the end of the keys (cross attention: 50
    decoder tokens over 20 encoder keys is split by the runtime; here 18 over 70)."""
    batch = case_inputs(BatchSpec("cross", (70, 33), (18, 33)), "fp32", 64, 16, 8, 2)
    args = feature_args("noncausal", 8, 64)
    got = run_native(batch, args, block_size=16, hint=MATRIX)
    assert_matches_reference(got, run_reference(batch, args), torch.float32)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("dtype_name, microkernel", [("fp32", None), ("bf16", "reference"),
                                                       ("bf16", "tiles")])
def test_a_key_a_row_cannot_see_adds_nothing(isa, bad, dtype_name, microkernel):
    """A non-finite value at a key only later rows of a tile see must not reach the rows
    before it (0 * inf is NaN in a GEMM): the kernel sums such tiles row by row, on the
    fp32 and the bf16 microkernel alike."""
    batch = case_inputs("prefill", dtype_name, 64, 16, 8, 2)
    args = feature_args("causal", 8, 64)
    value_cache = batch.value_cache.clone()
    # Request 0's key 5: seen by its queries 5.., hidden from 0..4 (same 8-token tile).
    block, offset = int(batch.block_table[0, 5 // 16]), 5 % 16
    value_cache[block, :, offset, :] = bad
    poisoned = type(batch)(**{**batch.__dict__, "value_cache": value_cache})
    with bf16_microkernel(microkernel) if microkernel else contextlib.nullcontext():
        got = run_native(poisoned, args, block_size=16, hint=MATRIX)
    assert torch.isfinite(got[:5]).all()
    assert_matches_reference(got[:5], run_reference(poisoned, args)[:5], DTYPES[dtype_name])


JUMP_BATCH = BatchSpec("max_jumps", (700,), (700,))


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("dtype_name, microkernel", [("fp32", None), ("fp16", None),
                                                       ("bf16", "reference"), ("bf16", "brgemm"),
                                                       ("bf16", "tiles")])
@pytest.mark.parametrize("feature", ["causal", "window", "noncausal"])
def test_a_max_that_jumps_after_a_rows_first_tile(isa, feature, head_size, dtype_name,
                                                  microkernel):
    """Tiles every row of an item sees whole take one softmax pass against the rows' running
    max; a key whose logits pass it by far more than the lazy-max margin (here two: in the
    second and the third key tile) sends the row block back to its scores and the two
    passes. Rows before such a key, rows after it, and rows that see it in a tile they see
    only in part (the diagonal, a window's edge) must all match the reference."""
    batch = case_inputs(JUMP_BATCH, dtype_name, head_size, 16, 8, 2)
    tile = 256 if head_size < 128 else 128  # matrix_tile_keys
    query = batch.query.float() * 0.25 + 1.0  # every head leans along the ones vector
    key_cache = batch.key_cache.clone()
    for key, height in ((tile + 40, 3.0), (2 * tile + 5, 6.0)):
        block, offset = int(batch.block_table[0, key // 16]), key % 16
        key_cache[block, :, offset, :] = height
    jumped = type(batch)(**{**batch.__dict__, "query": query.to(batch.query.dtype),
                            "key_cache": key_cache})
    args = feature_args(feature, 8, head_size)
    with bf16_microkernel(microkernel) if microkernel else contextlib.nullcontext():
        got = run_native(jumped, args, block_size=16, hint=MATRIX)
    assert_matches_reference(got, run_reference(jumped, args), DTYPES[dtype_name])


def test_the_hint_selects_another_kernel(isa):
    """fp32 sums in another order on the GEMMs: 'amx' and 'vec' agree to rounding but not
    bit for bit, so the hint reached the kernel (and decode rows, which stay on the vector
    kernels, are identical)."""
    batch = case_inputs("mixed", "fp32", 64, 16, 8, 2)
    args = feature_args("causal", 8, 64)
    matrix = run_native(batch, args, block_size=16, hint=MATRIX)
    vector = run_native(batch, args, block_size=16, hint=IsaHint.VEC16)
    torch.testing.assert_close(matrix, vector, atol=2e-5, rtol=2e-5)
    decode_rows = slice(0, 2)  # the batch's first two requests decode one token each
    assert torch.equal(matrix[decode_rows], vector[decode_rows])
    assert not torch.equal(matrix, vector)


def test_repeat_call_and_thread_count_are_bit_identical(isa):
    batch = case_inputs("chunked_prefill", "bf16", 128, 16, 8, 2)
    args = feature_args("everything", 8, 128)
    first = run_native(batch, args, block_size=16, hint=MATRIX)
    assert torch.equal(first, run_native(batch, args, block_size=16, hint=MATRIX))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run_native(batch, args, block_size=16, hint=MATRIX)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, one_thread)


@pytest.mark.parametrize("threads", [2, 6])
def test_items_racing_for_a_tile_read_it_packed_once(isa, threads):
    """Each shared K/V tile is packed by the first item that reads it; items that find it
    claimed pack the tiles after it or wait. Many query tiles of one kv head over a few
    tiles, on up to more threads than cores (waits while the packer is descheduled). Two
    batches alternate, so the call's buffer always holds the other batch's tiles first:
    every call is bit for bit its batch's one-thread result, which matches the reference."""
    spec = BatchSpec("racing", (1024, 600), (1024, 600))
    batches = [case_inputs(spec, "bf16", 64, 16, 8, 2, seed=seed) for seed in (1, 2)]
    args = feature_args("causal", 8, 64)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [run_native(b, args, block_size=16, hint=MATRIX) for b in batches]
        torch.set_num_threads(threads)
        for i in (1, 0, 1, 0):
            assert torch.equal(run_native(batches[i], args, block_size=16, hint=MATRIX), alone[i])
    finally:
        torch.set_num_threads(saved)
    for batch, out in zip(batches, alone):
        assert_matches_reference(out, run_reference(batch, args), DTYPES["bf16"])


# The packing routines of the current ISA (register transposes on AVX-512, plain loops
# elsewhere) against the layouts written out element by element.
def _rows_and_presence(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    rows = torch.randint(info.min, info.max, shape, dtype=dtype, generator=gen)
    present = torch.rand(shape[0], generator=gen) > 0.2
    return rows, present


# Shapes the tile loop takes (M, N multiples of 16, K of 32; one or two tiles a side) and
# ones it hands to brgemm (a ragged M, N or K).
GEMM_SHAPES = [(64, 128, 128, False), (64, 128, 128, True), (48, 80, 96, True), (16, 16, 32, False),
               (32, 48, 64, True), (64, 256, 64, True), (17, 16, 32, False), (64, 128, 80, True),
               (64, 72, 64, False)]


@pytest.mark.parametrize("kind", MICROKERNELS)
@pytest.mark.parametrize("m,n,k,add", GEMM_SHAPES, ids=lambda v: str(v))
def test_bf16_gemm_is_the_fp32_sum_of_exact_products(kind, m, n, k, add):
    gen = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(k, n, generator=gen).bfloat16()
    c0 = torch.randn(m, n, generator=gen)
    expected = a.double() @ b.double() + (c0.double() if add else 0)
    c = c0.clone()
    with bf16_microkernel(kind):
        torch.ops.pagedattn.matrix_engine_gemm_bf16(a, b, c, add)
    torch.testing.assert_close(c.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("a,b,c,error,match", [
    (torch.zeros(16, 32), torch.zeros(32, 16, dtype=torch.bfloat16), torch.zeros(16, 16),
     TypeError, "a and b must be bfloat16 and c float32, got Float"),
    (torch.zeros(16, 31, dtype=torch.bfloat16), torch.zeros(31, 16, dtype=torch.bfloat16),
     torch.zeros(16, 16), ValueError, r"K even, got \[16, 31\]"),
    (torch.zeros(16, 32, dtype=torch.bfloat16), torch.zeros(32, 16, dtype=torch.bfloat16),
     torch.zeros(16, 8), ValueError, r"c \[M, N\].*\[16, 8\]"),
], ids=["dtype", "odd-k", "c-shape"])
def test_bf16_gemm_rejects_bad_operands(a, b, c, error, match):
    with bf16_microkernel("reference"), pytest.raises(error, match=match):
        torch.ops.pagedattn.matrix_engine_gemm_bf16(a, b, c, False)


@pytest.mark.parametrize("nrows,ncols", [(16, 1), (16, 16), (32, 5), (64, 64), (128, 100),
                                         (256, 17)], ids=str)
def test_transpose32_is_kt_word_by_word(isa, nrows, ncols):
    """K^T: word c of key row n lands at [c][n] (bf16 dimension pairs, or fp32 values);
    absent rows (keys a request cannot see) are zeros."""
    rows, present = _rows_and_presence((nrows, ncols), torch.int32, nrows * 7 + ncols)
    got = torch.ops.pagedattn.matrix_pack_rows(rows, present, 0)
    want = torch.zeros(ncols, nrows, dtype=torch.int32)
    for n in range(nrows):
        if present[n]:
            want[:, n] = rows[n]
    assert torch.equal(got, want)


@pytest.mark.parametrize("nrows,ncols", [(16, 8), (16, 40), (32, 64), (128, 128), (64, 200)],
                         ids=str)
def test_interleave16_is_v_in_key_pairs(isa, nrows, ncols):
    """V: word c of output row j holds rows 2j (low half) and 2j + 1 (high half) at
    column c, the VNNI pair layout of the bf16 microkernel's B operand."""
    rows, present = _rows_and_presence((nrows, ncols), torch.int16, nrows * 5 + ncols)
    got = torch.ops.pagedattn.matrix_pack_rows(rows, present, 1)
    bits = [[(int(rows[n, c]) & 0xFFFF) if present[n] else 0 for c in range(ncols)]
            for n in range(nrows)]
    want = torch.tensor([[bits[2 * j][c] | bits[2 * j + 1][c] << 16 for c in range(ncols)]
                         for j in range(nrows // 2)], dtype=torch.int64)
    want = ((want + 2**31) % 2**32 - 2**31).to(torch.int32)  # the words as int32
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows,present,kind,match", [
    (torch.zeros(15, 4, dtype=torch.int32), torch.ones(15, dtype=torch.bool), 0, "multiple of 16"),
    (torch.zeros(16, 4, dtype=torch.int16), torch.ones(16, dtype=torch.bool), 0, "int32"),
    (torch.zeros(16, 4, dtype=torch.int16), torch.ones(8, dtype=torch.bool), 1, "16 entries"),
    (torch.zeros(16, 4, dtype=torch.int16), torch.ones(16, dtype=torch.bool), 2, "kind"),
])
def test_pack_rows_rejects_bad_input(rows, present, kind, match):
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.pagedattn.matrix_pack_rows(rows, present, kind)


@contextlib.contextmanager
def pack_limit(nbytes: int):
    """The call's packed-tile budget: 0 makes every item pack the tiles it reads."""
    previous = torch.ops.pagedattn.set_matrix_pack_limit(nbytes)
    try:
        yield
    finally:
        torch.ops.pagedattn.set_matrix_pack_limit(previous)


@pytest.mark.parametrize("limit", [0, 100_000], ids=["none-packed", "some-packed"])
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("feature", FEATURES)
def test_tiles_packed_per_item_equal_tiles_packed_per_call(isa, feature, dtype_name, limit):
    """Requests past the call's packing budget pack each tile in the item that reads it,
    with the same routine: the results are bit for bit those of the packed call."""
    batch = case_inputs("chunked_prefill", dtype_name, 64, 16, 8, 2)
    args = feature_args(feature, 8, 64)
    packed = run_native(batch, args, block_size=16, hint=MATRIX)
    with pack_limit(limit):
        per_item = run_native(batch, args, block_size=16, hint=MATRIX)
    assert torch.equal(per_item, packed)
    assert_matches_reference(per_item, run_reference(batch, args), DTYPES[dtype_name])


def test_pack_limit_rejects_a_negative_budget():
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        torch.ops.pagedattn.set_matrix_pack_limit(-1)


@pytest.mark.parametrize("limit", [None, 0], ids=["call-packs", "items-pack"])
@pytest.mark.parametrize("batch_name", ["chunked_prefill", "mixed"])
def test_cost_probe_splits_busy_time_into_gemm_and_the_rest(isa, batch_name, limit):
    """The probe's native timers (benchmarks/profile_prefill.py): while on, the GEMM calls
    are counted and timed, and their time is part of the workers' busy time, as are the
    items' phases outside the GEMMs, their packing included. Decode rows
    (the mixed batch) keep their kernel: decode scores stay on the tiles where they run."""
    batch = case_inputs(batch_name, "bf16", 64, 16, 8, 2)
    args = feature_args("causal", 8, 64)
    run_native(batch, args, block_size=16, hint=MATRIX)
    torch.ops.pagedattn.matrix_engine_profile(True)
    try:
        with pack_limit(limit) if limit is not None else contextlib.nullcontext():
            profiled = run_native(batch, args, block_size=16, hint=MATRIX)
        busy_ns, gemm_ns, calls, pack_ns, *phase_ns = \
            torch.ops.pagedattn.matrix_engine_profile_totals()
    finally:
        torch.ops.pagedattn.matrix_engine_profile(False)
    assert calls > 0 and 0 < gemm_ns <= busy_ns
    # The items' phases (shared tiles packed, queries, softmax, own tile packs, finish)
    # are parts of the busy time outside the GEMMs; every item takes its queries, runs a
    # softmax per tile and finishes. Tiles go to the call's shared buffer, each packed by
    # the first item that reads it, or (no budget) every item packs its own.
    queries_ns, softmax_ns, tile_pack_ns, finish_ns = phase_ns
    assert queries_ns > 0 and softmax_ns > 0 and finish_ns > 0
    if limit is None:
        assert pack_ns > 0 and tile_pack_ns == 0
    else:
        assert pack_ns == 0 and tile_pack_ns > 0
    assert pack_ns + sum(phase_ns) <= busy_ns - gemm_ns
    assert torch.ops.pagedattn.matrix_engine_profile_totals() == [0] * 8
    # The timing wrappers change no result.
    assert torch.equal(profiled, run_native(batch, args, block_size=16, hint=MATRIX))


def test_profile_prefill_script_reports_the_split(tmp_path):
    import importlib.util
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_prefill.py"
    spec = importlib.util.spec_from_file_location("profile_prefill", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("profile_prefill", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    out = tmp_path / "probe.json"
    threads = torch.get_num_threads()
    try:
        assert module.main(["--rows", "4x512", "--heads", "4/2", "--head-size", "64",
                            "--repeat", "1", "--no-peers", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    (row,) = json.loads(out.read_text())
    assert row["row"] == "4x512" and row["pairs"] == 4 * 4 * (512 * 513 // 2)
    assert row["gemm_calls_per_call"] > 0 and row["gemm_ns_per_pair"] > 0
    assert row["outside_ns_per_pair"] == pytest.approx(
        row["core_ns_per_pair"] - row["gemm_ns_per_pair"])
    split = row["outside_split_ns_per_pair"]
    assert set(split) == {"pack", "queries", "softmax", "tile_pack", "finish", "rest"}
    assert sum(split.values()) == pytest.approx(row["outside_ns_per_pair"])
    assert split["softmax"] > 0 and split["rest"] >= 0
    assert row["rows_floor_ns_per_pair"] > 0
    assert row["outside_ns_per_query_row"] == pytest.approx(
        row["outside_ns_per_pair"] * row["pairs"] / (4 * 512 * 4))
    own_tiles = torch.ops.pagedattn.matrix_engine_bf16_microkernel() == "tiles"
    assert set(row["ms"]) == {"pagedattn", "vector"} | ({"brgemm"} if own_tiles else set())


# Decode rows on our AMX tiles (MatrixEngine::decode_scores_bf16): under the 'amx' hint, bf16
# q.k of items with few rows runs as S^T = K . Q^T, the cache's key rows read as A tiles in
# place. Decodes, 3-token spec decodes (more than 8 rows a kv head at 8 query heads a kv
# head: two tile calls), the vector path's fallbacks (head size 80, block size 8).
DECODE_TILE_BATCH = BatchSpec("decode_tiles", (37, 300, 129), (1, 3, 1))


@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 128), (256, 32), (80, 16),
                                                  (64, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("heads", [(9, 3), (16, 2), (4, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decodes_over_the_grid(isa, heads, head_size, block_size, feature, cache_name):
    batch, scales = with_fp8_cache(
        case_inputs(DECODE_TILE_BATCH, "bf16", head_size, block_size, *heads), cache_name)
    args = feature_args(feature, heads[0], head_size)
    got = run_native(batch, args, block_size=block_size, hint=MATRIX, **scales)
    assert_matches_reference(got, run_reference(batch, args, **scales), torch.bfloat16)


def _decode_tiles_run_here():
    if torch.ops.pagedattn.matrix_engine_bf16_microkernel() != "tiles":
        pytest.skip("decode scores run on our AMX tiles, which need a CPU with AMX-BF16 tiles "
                    "the OS grants")


@pytest.mark.parametrize("keys", [16, 48, 128])
@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])
def test_decode_scores_are_fp32_sums_of_exact_products(rows, head_size, keys):
    """Every (row, key) of the transposed product lands at S[row, key], for the 4- and
    8-column tiles, odd and even group counts, and key rows further apart than D."""
    _decode_tiles_run_here()
    gen = torch.Generator().manual_seed(rows * 1000 + head_size + keys)
    q = torch.randn(rows, head_size, generator=gen).bfloat16()
    rows_of_keys = torch.randn(keys, head_size + 32, generator=gen).bfloat16()
    k = rows_of_keys[:, :head_size]
    got = torch.ops.pagedattn.matrix_engine_decode_scores(q, k)
    torch.testing.assert_close(got.double(), q.double() @ k.double().T, rtol=1e-5, atol=1e-4)


def test_decode_scores_follow_the_tile_switch():
    """The tiles switched off (matrix_engine_use_own_tiles) take decode scores with them."""
    _decode_tiles_run_here()
    q = torch.ones(1, 32, dtype=torch.bfloat16)
    k = torch.ones(16, 32, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.pagedattn.matrix_engine_decode_scores(q, k),
                       torch.full((1, 16), 32.0))
    with bf16_microkernel("brgemm"), pytest.raises(NotImplementedError, match="AMX tiles"):
        torch.ops.pagedattn.matrix_engine_decode_scores(q, k)


@pytest.mark.parametrize("q,k,error,match", [
    (torch.zeros(9, 32), torch.zeros(16, 32), TypeError, "must be bfloat16"),
    (torch.zeros(9, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16),
     ValueError, r"R \(9\) must be in \[1, 8\]"),
    (torch.zeros(2, 48, dtype=torch.bfloat16), torch.zeros(16, 48, dtype=torch.bfloat16),
     ValueError, r"D \(48\) must be a positive multiple of 32"),
    (torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(24, 32, dtype=torch.bfloat16),
     ValueError, r"key count \(24\) must be a positive multiple of 16"),
], ids=["dtype", "rows", "head-size", "keys"])
def test_decode_scores_reject_bad_operands(q, k, error, match):
    _decode_tiles_run_here()
    with pytest.raises(error, match=match):
        torch.ops.pagedattn.matrix_engine_decode_scores(q, k)
