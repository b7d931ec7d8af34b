"""Shared prefixes: requests whose block tables begin with the same physical blocks (a
system prompt, the n samples of one prompt) have those keys read once for all of them.

The plan finds the groups in the block table (or takes vLLM's cascade
``common_prefix_len``); a shared plan must give what the reference gives, and what the
plan without sharing gives, over the feature grid, under every ISA; a block table other
than the one the plan saw or a bad argument must raise by name (a corrupt shared plan:
test_scheduler_plan.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedattn import ops
from pagedattn.backends import cpu_runtime
from pagedattn.backends.cpu_runtime import kernel_variant
from pagedattn.ops.isa import (METADATA_FIELDS_PER_REQ, METADATA_HEADER,
                               SHARED_PREFIX_LONG_KEYS, SHARED_PREFIX_MIN_KEYS,
                               SHARED_PREFIX_MIN_SAVED_KEYS, IsaHint)
from pagedattn.testing import TOLERANCES, BatchSpec, make_paged_batch

from test_cpu_ops import (CACHES, FP8_SCALES, assert_matches_reference, feature_args,
                          run_reference, with_fp8_cache)

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Group (0, 1, 2, 4): decodes, a short spec decode and a chunked prefill whose context holds
# the prefix; group (3, 5): two decodes; request 6 shares nothing; request 7 shares its
# first block only with 6, too little to pay.
SPEC = BatchSpec("shared", (600, 590, 700, 560, 630, 540, 150, 140), (1, 1, 3, 1, 40, 1, 1, 2))


def shared_batch(dtype, head_size, block_size, num_heads, num_kv_heads, seed=0):
    """SPEC with groups (0, 1, 2, 4) and (3, 5) sharing 512 keys each (a prefix long
    enough to pay for two requests), in whole blocks, and requests 6 and 7 sharing one
    block of at most 32 keys."""
    per = lambda keys: max(1, keys // block_size)  # noqa: E731
    groups = (((0, 1, 2, 4), per(512)), ((3, 5), per(512)))
    if block_size * 1 < SHARED_PREFIX_MIN_KEYS:
        groups += (((6, 7), 1),)
    return make_paged_batch(SPEC, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_size=head_size, block_size=block_size, dtype=dtype, seed=seed,
                            shared_prefixes=groups)


@functools.lru_cache(maxsize=None)
def cached_batch(dtype_name, head_size, block_size, num_heads, num_kv_heads):
    return shared_batch(DTYPES[dtype_name], head_size, block_size, num_heads, num_kv_heads)


def plan(batch, *, share=True, hint=None, causal=True, common_prefix_len=0,
         batch_invariant=False, block_table=None):
    num_heads, head_size = batch.query.shape[1:]
    table = batch.block_table if block_table is None else block_table
    return ops.cpu_attn_get_scheduler_metadata(
        len(batch.spec.seq_lens), num_heads, batch.key_cache.shape[1], head_size,
        batch.seq_lens, batch.query.dtype, batch.query_start_loc, causal, -1,
        hint or kernel_variant(), True, batch_invariant,
        block_table=table if share else None,
        block_size=batch.key_cache.shape[2] if share else None,
        common_prefix_len=common_prefix_len)


def attend(batch, meta, args, scales=None, block_table=None):
    out = torch.full_like(batch.query, float("nan"))
    ops.cpu_attention_with_kv_cache(
        batch.query, batch.key_cache, batch.value_cache, out, batch.query_start_loc,
        batch.seq_lens, args["scale"], args["causal"], args["alibi_slopes"],
        args["sliding_window"], batch.block_table if block_table is None else block_table,
        args["softcap"], meta, args["s_aux"], **(scales or {}))
    return out


def header(meta) -> dict:
    return dict(zip(METADATA_HEADER, meta[: len(METADATA_HEADER)].tolist()))


def prefix_keys(meta, num_reqs) -> list[int]:
    """Per request, the keys its shared-prefix group covers (0: in no group)."""
    base, step = len(METADATA_HEADER), len(METADATA_FIELDS_PER_REQ)
    at = METADATA_FIELDS_PER_REQ.index("prefix_keys")
    return [int(meta[base + r * step + at]) for r in range(num_reqs)]


# (num_heads, num_kv_heads, head_size, block_size): GQA, MHA, MQA with an 8-lane head size,
# the smallest head and block sizes, and a large head in blocks of 1.
GEOMETRIES = [(8, 2, 128, 32), (4, 4, 64, 16), (8, 1, 80, 16), (4, 2, 32, 8), (4, 2, 256, 1)]
FEATURES = ["causal", "noncausal", "window", "softcap", "alibi", "sinks", "everything"]


def check_shared(batch, args, hint, scales=None):
    """The shared plan against the reference and against the plan without sharing."""
    meta = plan(batch, hint=hint, causal=args["causal"])
    assert header(meta)["num_groups"] >= 1, "the batch's shared prefixes were not found"
    got = attend(batch, meta, args, scales)
    unshared = attend(batch, plan(batch, share=False, hint=hint, causal=args["causal"]), args,
                      scales)
    return got, unshared


@pytest.mark.parametrize("hint", ["vector", "amx"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "h{}kv{}d{}b{}".format(*g))
def test_shared_plan_matches_reference(isa, geometry, feature, hint):
    if hint == "amx" and not ops.matrix_engine_available():
        pytest.skip("the matrix engine (oneDNN brgemm) does not run here")
    num_heads, num_kv_heads, head_size, block_size = geometry
    for dtype in ("fp32", "bf16") if feature in ("causal", "everything") else ("bf16",):
        batch = cached_batch(dtype, head_size, block_size, num_heads, num_kv_heads)
        args = feature_args(feature, num_heads, head_size)
        got, unshared = check_shared(batch, args, IsaHint.AMX if hint == "amx" else None)
        want = run_reference(batch, args)
        assert_matches_reference(got, want, DTYPES[dtype])
        atol, rtol = TOLERANCES[DTYPES[dtype]]
        torch.testing.assert_close(got.float(), unshared.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("cache", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_shared_plan_over_fp8_and_fp16(isa, dtype, cache):
    batch, scales = with_fp8_cache(cached_batch(dtype, 128, 16, 8, 2), cache)
    args = feature_args("everything", 8, 128)
    for hint in (None, IsaHint.AMX) if ops.matrix_engine_available() else (None,):
        got, unshared = check_shared(batch, args, hint, scales)
        want = run_reference(batch, args, **FP8_SCALES)
        # fp8 caches: kernel and reference read the same stored values (test_cpu_ops)
        atol, rtol = TOLERANCES[DTYPES[dtype]]
        torch.testing.assert_close(got.float(), want, atol=max(atol, 2e-3), rtol=max(rtol, 2e-3))
        torch.testing.assert_close(got.float(), unshared.float(), atol=max(atol, 2e-3),
                                   rtol=max(rtol, 2e-3))


def test_overlapping_groups_a_loner_and_a_window_that_cuts_the_prefix():
    """Two groups whose prefixes overlap in part (4 requests share 16 blocks, two of them
    24), one request in none, and a window that keeps members' rows off part of the prefix
    or all of it: every row as the reference, sinks counted once."""
    spec = BatchSpec("overlap", (1400, 1350, 1300, 1340, 500, 300), (1, 1, 1, 1, 1, 1))
    batch = make_paged_batch(spec, num_heads=8, num_kv_heads=2, head_size=64, block_size=32,
                             dtype=torch.float32, shared_prefixes=(((0, 1, 2, 3), 16),))
    # 0 and 1 share 24 blocks: their first 24 ids the same (the reference reads the
    # cache through the table, as the kernels do).
    table = batch.block_table.clone()
    table[1, :24] = table[0, :24]
    batch.block_table.copy_(table)
    meta = plan(batch)
    # One group of four saves 3 x 512 key reads; {0, 1} and {2, 3} would save 768 + 512.
    assert header(meta)["num_groups"] == 1 and header(meta)["num_members"] == 4
    assert prefix_keys(meta, 6) == [512, 512, 512, 512, 0, 0]
    for window in ((-1, -1), (1000, 0), (100, 0)):
        # 1000: request 2 (position 1299) sees keys 299 on, request 0 (1399) keys 399 on;
        # 100: no member's row sees any of the prefix.
        args = dict(feature_args("sinks", 8, 64), sliding_window=window)
        got = attend(batch, meta, args)
        assert_matches_reference(got, run_reference(batch, args), torch.float32)


def padded(tables, cols):
    return torch.tensor([t + [0] * (cols - len(t)) for t in tables], dtype=torch.int32)


def groups_of(tables, seq_lens, query_lens=None, block_size=16):
    """prefix_keys of the plan over these block tables (no attention run)."""
    n = len(tables)
    query_lens = query_lens or [1] * n
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        n, 8, 2, 64, torch.tensor(seq_lens, dtype=torch.int32), torch.float32, qsl, True, -1,
        kernel_variant(), True, block_table=padded(tables, max(map(len, tables)) + 1),
        block_size=block_size)
    return prefix_keys(meta, n), header(meta)


def test_the_planner_keeps_one_group_behind_a_system_prompt():
    """32 requests behind an 8-block prompt, pairs of which share 2 blocks more (n = 2
    samples): one group of 32 sharing 8 blocks saves more reads than 16 pairs sharing 10."""
    prompt = list(range(1, 9))
    tables = [prompt + [100 + r // 2, 200 + r // 2, 300 + r] for r in range(32)]
    keys, hdr = groups_of(tables, [11 * 16] * 32)
    assert keys == [128] * 32 and hdr["num_groups"] == 1


def test_the_planner_splits_where_subgroups_share_much_more():
    """Two prompts behind one common first block: two groups, each its own prompt."""
    a = [7] + list(range(10, 50))
    b = [7] + list(range(60, 100))
    tables = [a + [1000 + r] for r in range(3)] + [b + [2000 + r] for r in range(3)]
    keys, hdr = groups_of(tables, [42 * 16] * 6)
    assert keys == [41 * 16] * 6 and hdr["num_groups"] == 2


def test_the_planner_leaves_short_prefixes_and_lone_requests_alone():
    short = SHARED_PREFIX_MIN_KEYS // 16 - 1
    tables = [list(range(1, 1 + short)) + [50 + r, 60 + r, 70 + r, 80 + r, 90 + r]
              for r in range(3)]
    tables.append([300, 301, 302, 303, 304, 305])  # shares nothing
    keys, hdr = groups_of(tables, [96, 96, 96, 96])
    assert keys == [0, 0, 0, 0] and hdr["num_groups"] == 0


@pytest.mark.parametrize("members, blocks, pays", [
    (2, SHARED_PREFIX_LONG_KEYS // 16, True),             # a long prefix pays for two
    (2, SHARED_PREFIX_LONG_KEYS // 16 - 1, False),        # a shorter one does not
    (17, SHARED_PREFIX_MIN_SAVED_KEYS // 16 // 16, True),  # 16 x 128 key reads saved
    (16, SHARED_PREFIX_MIN_SAVED_KEYS // 16 // 16, False),  # 15 x 128 are too few
])
def test_the_planner_groups_where_the_measured_rule_says_it_pays(members, blocks, pays):
    tables = [list(range(1, 1 + blocks)) + [500 + r] for r in range(members)]
    keys, _ = groups_of(tables, [(blocks + 1) * 16] * members)
    assert keys == ([blocks * 16] if pays else [0]) * members
    assert cpu_runtime.shared_prefix_pays(blocks * 16, [1] * members, False) == pays


def test_the_planner_stops_at_the_shortest_member():
    """A member with fewer keys than its group's common blocks caps the shared keys (its
    rows must not see keys past its own length through another's blocks)."""
    tables = [list(range(1, 41)), list(range(1, 41)), list(range(1, 41))]
    keys, _ = groups_of(tables, [640, 640, 600])
    assert keys == [592, 592, 592]


def test_requests_with_identical_tables_share_everything():
    """Two requests on the very same blocks and lengths (nothing of their own): the group
    covers every key; each result is the reference's."""
    spec = BatchSpec("twins", (512, 512), (1, 1))
    batch = make_paged_batch(spec, num_heads=8, num_kv_heads=2, head_size=64, block_size=32,
                             dtype=torch.float32, shared_prefixes=(((0, 1), 16),))
    meta = plan(batch)
    assert prefix_keys(meta, 2) == [512, 512]
    for feature in ("causal", "everything"):
        args = feature_args(feature, 8, 64)
        assert_matches_reference(attend(batch, meta, args), run_reference(batch, args),
                                 torch.float32)


def test_a_block_table_other_than_the_planned_one_is_refused():
    batch = cached_batch("fp32", 64, 16, 4, 4)
    meta = plan(batch)
    other = batch.block_table.clone()
    other[1, 2] = other[3, 0]  # a member's shared block moved
    with pytest.raises(ValueError, match=r"block_table\[1, 2\].*differs from block_table"):
        attend(batch, meta, feature_args("causal", 4, 64), block_table=other)


def test_common_prefix_len_is_a_whole_batch_prefix():
    spec = BatchSpec("cascade", (300, 290, 330), (1, 1, 40))
    batch = make_paged_batch(spec, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                             dtype=torch.float32, shared_prefixes=(((0, 1, 2), 12),))
    for length in (192, 100):  # whole blocks, or ending inside one
        meta = plan(batch, common_prefix_len=length)
        assert prefix_keys(meta, 3) == [length] * 3
        args = feature_args("everything", 8, 64)
        assert_matches_reference(attend(batch, meta, args), run_reference(batch, args),
                                 torch.float32)
    with pytest.raises(ValueError, match=r"common_prefix_len \(208\) spans block 12"):
        plan(batch, common_prefix_len=208)
    with pytest.raises(ValueError, match=r"common_prefix_len \(299\) exceeds seq_lens\[1\]"):
        plan(batch, common_prefix_len=299)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(common_prefix_len=-1), "common_prefix_len"),
    (dict(common_prefix_len=1.5), "common_prefix_len"),
    (dict(common_prefix_len=64, block_table=None), "common_prefix_len"),
    (dict(block_size=None), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=True), "block_size"),
    (dict(block_table="0,1"), "block_table"),
    (dict(block_table=torch.zeros(8, 4, dtype=torch.int64)), "block_table"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)), "block_table has 2 rows"),
    (dict(batch_invariant=True, common_prefix_len=64), "batch_invariant"),
])
def test_bad_sharing_arguments_are_refused_by_name(kwargs, pattern):
    batch = cached_batch("fp32", 64, 16, 4, 4)
    base = dict(block_table=batch.block_table, block_size=16)
    with pytest.raises((ValueError, TypeError), match=pattern):
        ops.cpu_attn_get_scheduler_metadata(
            len(batch.spec.seq_lens), 4, 4, 64, batch.seq_lens, torch.float32,
            batch.query_start_loc, True, -1, kernel_variant(), True,
            kwargs.pop("batch_invariant", False), **{**base, **kwargs})


def test_batch_invariant_plans_do_not_share():
    """A shared row's arithmetic would depend on its batch-mates (the group's GEMM tile),
    so batch-invariant plans ignore the block table's shared blocks."""
    batch = cached_batch("fp32", 64, 16, 4, 4)
    meta = plan(batch, batch_invariant=True)
    assert header(meta)["num_groups"] == 0
    assert prefix_keys(meta, len(SPEC.seq_lens)) == [0] * len(SPEC.seq_lens)


def test_cpu_attn_builder_shares_and_answers_the_cascade_question():
    """CPU_ATTN's builder plans with the step's block table, so shared blocks are read once
    without any caller naming them; use_cascade_attention applies the planner's rule."""
    from pagedattn import registry
    from pagedattn.backend import CommonAttentionMetadata
    from pagedattn.config import BuilderConfig, CacheConfig, ModelConfig
    from pagedattn.kv_cache_spec import AttentionSpec

    backend = registry.get_backend_cls("CPU_ATTN")
    batch = cached_batch("fp32", 64, 16, 4, 4)
    config = BuilderConfig(model_config=ModelConfig(dtype=torch.float32, num_attention_heads=4,
                                                    num_kv_heads=4, head_size=64),
                           cache_config=CacheConfig(block_size=16))
    spec = AttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float32)
    builder = backend.get_builder_cls()(spec, ["layers.0.attn"], config, torch.device("cpu"))
    common = CommonAttentionMetadata.from_lens(
        query_lens=list(SPEC.query_lens), seq_lens=list(SPEC.seq_lens),
        block_table=batch.block_table, block_size=16)
    md = builder.build(common_prefix_len=0, common_attn_metadata=common)
    assert header(md.scheduler_metadata)["num_groups"] == 2
    rule = SHARED_PREFIX_LONG_KEYS
    assert builder.use_cascade_attention(rule, [1, 1], 8, 8, False, False, False, 0, 1)
    assert not builder.use_cascade_attention(rule - 1, [1, 1], 8, 8, False, False, False, 0, 1)
    assert not builder.use_cascade_attention(rule, [1, 0], 8, 8, False, False, False, 0, 1)
    invariant = backend.get_builder_cls()(spec, ["layers.0.attn"], config, torch.device("cpu"),
                                          batch_invariant=True)
    assert not invariant.use_cascade_attention(4096, [1, 1], 8, 8, False, False, False, 0, 1)
    assert header(invariant.build(0, common).scheduler_metadata)["num_groups"] == 0
    assert cpu_runtime.shared_prefix_pays(rule, [3, 1], False)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("feature", ["causal", "everything"])
def test_a_long_prefix_is_split_over_the_threads(isa, threads, feature):
    """One kv head, four decodes behind a 2,048-key prefix: fewer shared-prefix jobs than
    threads, so the group's keys run as several chunks, whose partials the merges fold."""
    spec = BatchSpec("long", (2100, 2090, 2080, 2200), (1, 1, 1, 2))
    batch = make_paged_batch(spec, num_heads=4, num_kv_heads=1, head_size=64, block_size=16,
                             dtype=torch.float32, shared_prefixes=(((0, 1, 2, 3), 128),))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        meta = plan(batch)
        args = feature_args(feature, 4, 64)
        got = attend(batch, meta, args)
    finally:
        torch.set_num_threads(before)
    assert prefix_keys(meta, 4) == [2048] * 4
    assert_matches_reference(got, run_reference(batch, args), torch.float32)
