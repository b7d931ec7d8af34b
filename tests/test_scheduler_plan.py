"""The scheduler metadata carries the whole work partition of a step: the attention op of
every layer only checks it against the call and executes it. Stale, corrupt or foreign
metadata must raise, never compute garbage."""

from __future__ import annotations

import pytest
import torch

from pagedattn import ops
from pagedattn.backends.cpu_runtime import kernel_variant
from pagedattn.testing import BatchSpec, make_paged_batch

from test_cpu_ops import (LONG_SPECS, assert_matches_reference, case_inputs, feature_args,  # noqa: F401
                          run_reference)

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")


def metadata_for(batch, *, split=True, window=-1, seq_lens=None, query_start_loc=None):
    num_heads, head_size = batch.query.shape[1:]
    return ops.cpu_attn_get_scheduler_metadata(
        len(batch.spec.seq_lens), num_heads, batch.key_cache.shape[1], head_size,
        batch.seq_lens if seq_lens is None else seq_lens, batch.query.dtype,
        batch.query_start_loc if query_start_loc is None else query_start_loc, True, window,
        kernel_variant(), split)


def attend(batch, meta, args):
    out = torch.full_like(batch.query, float("nan"))
    ops.cpu_attention_with_kv_cache(
        batch.query, batch.key_cache, batch.value_cache, out, batch.query_start_loc,
        batch.seq_lens, args["scale"], args["causal"], args["alibi_slopes"],
        args["sliding_window"], batch.block_table, args["softcap"], meta, args["s_aux"])
    return out


@pytest.mark.parametrize("spec", ["mixed", LONG_SPECS[0], LONG_SPECS[1]],
                         ids=lambda s: s if isinstance(s, str) else s.name)
def test_one_plan_serves_every_layer_of_a_step(isa, spec):
    """Planned once, run for 30 layers (here: 30 calls with different features), each
    equal to the reference; split decodes included."""
    batch = case_inputs(spec, "fp32", 128, 32, 8, 2)
    meta = metadata_for(batch)
    snapshot = meta.clone()
    for layer in range(30):
        feature = ["causal", "window", "everything", "sinks", "alibi"][layer % 5]
        args = feature_args(feature, 8, 128)
        assert_matches_reference(attend(batch, meta, args), run_reference(batch, args),
                                 torch.float32)
    assert torch.equal(meta, snapshot), "the op must not write the metadata"


def test_windowed_call_splits_its_own_visible_keys():
    """The plan ignores the window hint; a split decode under a window cuts its chunks from
    the keys it sees, equal to the unsplit result."""
    batch = case_inputs(LONG_SPECS[0], "fp32", 128, 32, 8, 2)
    args = feature_args("window", 8, 128)
    split = attend(batch, metadata_for(batch, split=True, window=14), args)
    whole = attend(batch, metadata_for(batch, split=False), args)
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)
    assert_matches_reference(split, run_reference(batch, args), torch.float32)


def test_metadata_of_another_step_is_rejected():
    """Same number of requests, other lengths (the next decode step): its partition no
    longer covers the call."""
    batch = make_paged_batch(BatchSpec("s", (300, 40), (1, 40)), num_heads=8, num_kv_heads=2,
                             head_size=64, block_size=16, dtype=torch.float32)
    stale = metadata_for(batch, seq_lens=torch.tensor([299, 39], dtype=torch.int32),
                         query_start_loc=torch.tensor([0, 1, 40], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"does not match this call's query_start_loc/seq_lens"):
        attend(batch, stale, feature_args("causal", 8, 64))
    other_q = metadata_for(batch, query_start_loc=torch.tensor([0, 2, 40], dtype=torch.int32),
                           seq_lens=torch.tensor([300, 40], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"does not match|corrupt"):
        attend(batch, other_q, feature_args("causal", 8, 64))


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-prefix"])
def test_every_corrupted_word_of_the_plan_is_rejected(shared):
    """Flip each word after the fixed header (per-request fields, jobs, merges, and for a
    plan that shares prefixes its groups and members): the checksum or the bounds reject
    every one."""
    if shared:  # two decodes and a spec decode behind 1,024 keys in the same blocks
        spec = BatchSpec("shared", (1100, 1050, 1080), (1, 1, 3))
        batch = make_paged_batch(spec, num_heads=8, num_kv_heads=2, head_size=64,
                                 block_size=16, dtype=torch.float32,
                                 shared_prefixes=(((0, 1, 2), 64),))
        meta = ops.cpu_attn_get_scheduler_metadata(
            3, 8, 2, 64, batch.seq_lens, torch.float32, batch.query_start_loc, True, -1,
            kernel_variant(), True, block_table=batch.block_table, block_size=16)
        assert int(meta[ops.METADATA_HEADER.index("num_groups")]) == 1
    else:
        batch = case_inputs(LONG_SPECS[1], "fp32", 64, 16, 8, 2)
        meta = metadata_for(batch)
    args = feature_args("causal", 8, 64)
    good = attend(batch, meta, args)
    header = len(ops.METADATA_HEADER)
    assert meta.numel() > header + 2 * 2
    for i in range(header, meta.numel()):
        for delta in (1, -(1 << 20)):
            bad = meta.clone()
            bad[i] += delta
            with pytest.raises(ValueError, match=r"scheduler_metadata"):
                attend(batch, bad, args)
    assert torch.equal(attend(batch, meta, args), good)
