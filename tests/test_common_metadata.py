"""Tests of CommonAttentionMetadata (pagedattn.common_metadata, re-exported by backend)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from pagedattn import common_metadata
from pagedattn.backend import CommonAttentionMetadata


def test_from_lens_worked_example():
    # Module docstring example: block_size 4, blocks handed out consecutively.
    m = CommonAttentionMetadata.from_lens([1, 3, 2], [5, 3, 9], block_size=4)
    assert m.num_reqs == 3 and m.num_actual_tokens == 6
    assert m.max_query_len == 3 and m.max_seq_len == 9
    assert m.query_start_loc.tolist() == [0, 1, 4, 6]
    assert m.query_start_loc_cpu.tolist() == [0, 1, 4, 6]
    assert m.seq_lens.tolist() == [5, 3, 9]
    assert m.block_table_tensor.tolist() == [[0, 1, 0], [2, 0, 0], [3, 4, 5]]
    # positions: req0 -> 4; req1 -> 0,1,2; req2 -> 7,8
    assert m.slot_mapping.tolist() == [1 * 4 + 0, 8, 9, 10, 4 * 4 + 3, 5 * 4 + 0]
    assert m._seq_lens_cpu.tolist() == [5, 3, 9]
    assert m._num_computed_tokens_cpu.tolist() == [4, 0, 7]
    assert m.causal is True
    for t in (m.query_start_loc, m.query_start_loc_cpu, m.seq_lens, m.block_table_tensor):
        assert t.dtype == torch.int32
    assert m.slot_mapping.dtype == torch.int64


def test_from_lens_with_explicit_tables():
    bt = [[7, 3], [5, 0]]
    m = CommonAttentionMetadata.from_lens([2, 1], [6, 1], bt, [12, 13, 40, -1], causal=False)
    assert m.block_table_tensor.tolist() == bt
    assert m.slot_mapping.tolist() == [12, 13, 40, -1]
    assert m.num_actual_tokens == 3 and m.causal is False
    # slots derived from a given table
    m = CommonAttentionMetadata.from_lens([2, 1], [6, 1], torch.tensor(bt), block_size=4)
    assert m.slot_mapping.tolist() == [3 * 4 + 0, 3 * 4 + 1, 5 * 4 + 0]


def test_from_lens_accepts_tensors_and_arrays_and_empty_batch():
    m = CommonAttentionMetadata.from_lens(torch.tensor([2]), np.array([3]), block_size=8)
    assert m.slot_mapping.tolist() == [1, 2]
    m = CommonAttentionMetadata.from_lens([], [], block_size=16)
    assert m.num_reqs == 0 and m.max_query_len == 0 and m.max_seq_len == 0
    assert m.query_start_loc.tolist() == [0]


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(query_lens=[1, 2], seq_lens=[3]), ValueError, "got 2 and 1"),
    (dict(query_lens=[1, 5], seq_lens=[3, 4]), ValueError,
     r"request 1: seq_len \(4\) must be >= query_len \(5\)"),
    (dict(query_lens=[1, -1], seq_lens=[3, 4]), ValueError, r"query_lens\[1\] must be >= 0"),
    (dict(query_lens=[1.0], seq_lens=[3]), TypeError, r"query_lens\[0\] must be an int"),
    (dict(query_lens="1", seq_lens=[3]), TypeError, "query_lens must be a sequence"),
    (dict(query_lens=[1], seq_lens=[3], block_size=None), ValueError, "block_size is required"),
    (dict(query_lens=[1], seq_lens=[3], block_size=0), ValueError, "block_size must be an int"),
    (dict(query_lens=[1, 1], seq_lens=[3, 9], block_table=[[0], [1]]), ValueError,
     r"request 1: seq_len 9 needs 3 blocks of 4, block_table has 1 columns"),
    (dict(query_lens=[1, 1], seq_lens=[3, 9], block_table=[[0, 1, 2]]), ValueError,
     r"block_table must have shape \[num_reqs=2"),
    (dict(query_lens=[1, 2], seq_lens=[3, 9], slot_mapping=[0, 1]), ValueError,
     r"at least sum\(query_lens\)=3"),
    (dict(query_lens=[1], seq_lens=[3], slot_mapping=[0.5]), TypeError, "must hold integers"),
])
def test_from_lens_errors(kwargs, exc, msg):
    kwargs.setdefault("block_size", 4)
    with pytest.raises(exc, match=msg):
        CommonAttentionMetadata.from_lens(**kwargs)


def _padded_metadata() -> CommonAttentionMetadata:
    # 3 real requests padded to 4 (query_len 0), 6 real tokens padded to 8.
    m = CommonAttentionMetadata.from_lens(
        [2, 1, 3, 0], [5, 1, 4, 0], slot_mapping=[0, 1, 2, 3, 4, 5, -1, -1], block_size=4
    )
    m.encoder_seq_lens = torch.tensor([10, 11, 12, 0], dtype=torch.int32)
    m.encoder_seq_lens_cpu = np.array([10, 11, 12, 0], dtype=np.int32)
    m.dcp_local_seq_lens = torch.tensor([3, 1, 2, 0], dtype=torch.int32)
    m.dcp_local_seq_lens_cpu = m.dcp_local_seq_lens.clone()
    m.logits_indices_padded = torch.tensor([1, 2, 5, 0])
    m.num_logits_indices = 3
    m.num_actual_tokens = 8
    return m


def test_unpadded_slices_every_request_and_token_field():
    m = _padded_metadata()
    m.compute_num_computed_tokens()
    u = m.unpadded(num_actual_tokens=6, num_actual_reqs=3)
    assert u.num_reqs == 3 and u.num_actual_tokens == 6
    assert u.query_start_loc.tolist() == [0, 2, 3, 6]
    assert u.query_start_loc_cpu.tolist() == [0, 2, 3, 6]
    assert u.seq_lens.tolist() == [5, 1, 4]
    assert u._seq_lens_cpu.tolist() == [5, 1, 4]
    assert u._num_computed_tokens_cpu.tolist() == [3, 0, 1]
    assert u.block_table_tensor.shape == (3, m.block_table_tensor.shape[1])
    assert u.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5]
    assert u.encoder_seq_lens.tolist() == [10, 11, 12]
    assert u.encoder_seq_lens_cpu.tolist() == [10, 11, 12]
    assert u.dcp_local_seq_lens.tolist() == [3, 1, 2]
    assert u.dcp_local_seq_lens_cpu.tolist() == [3, 1, 2]
    assert u.logits_indices_padded is m.logits_indices_padded and u.num_logits_indices == 3
    assert (u.max_query_len, u.max_seq_len, u.causal) == (m.max_query_len, m.max_seq_len, True)
    assert u._num_computed_tokens_cache is None
    # views, not copies
    assert u.seq_lens.data_ptr() == m.seq_lens.data_ptr()
    assert u.slot_mapping.data_ptr() == m.slot_mapping.data_ptr()


def test_unpadded_keeps_absent_optionals_absent():
    m = CommonAttentionMetadata.from_lens([1, 1], [2, 2], block_size=4)
    m._seq_lens_cpu = m._num_computed_tokens_cpu = None
    u = m.unpadded(1, 1)
    assert u._seq_lens_cpu is None and u._num_computed_tokens_cpu is None
    assert u.encoder_seq_lens is None and u.dcp_local_seq_lens_cpu is None


def test_unpadded_rejects_growing():
    m = _padded_metadata()
    with pytest.raises(ValueError, match=r"num_actual_reqs \(5\) exceeds num_reqs \(4\)"):
        m.unpadded(6, 5)
    with pytest.raises(ValueError, match=r"num_actual_tokens \(9\) exceeds the 8 tokens"):
        m.unpadded(9, 3)
    with pytest.raises(ValueError, match="num_actual_tokens must be an int >= 0"):
        m.unpadded(-1, 3)


def test_compute_num_computed_tokens_is_cached():
    m = CommonAttentionMetadata.from_lens([2, 1, 3], [5, 1, 4], block_size=4)
    first = m.compute_num_computed_tokens()
    assert first.tolist() == [3, 0, 1]
    assert m.compute_num_computed_tokens() is first


@pytest.fixture
def fresh_deprecations(monkeypatch):
    monkeypatch.setattr(common_metadata, "_warned_once", set())


def _direct_metadata() -> CommonAttentionMetadata:
    # Built without from_lens so the host copies must be derived lazily.
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([7, 4], dtype=torch.int32),
        num_reqs=2, num_actual_tokens=3, max_query_len=2, max_seq_len=7,
        block_table_tensor=torch.zeros(2, 2, dtype=torch.int32),
        slot_mapping=torch.arange(3),
    )


def test_seq_lens_cpu_warns_once_per_process(fresh_deprecations):
    m = _direct_metadata()
    with pytest.warns(DeprecationWarning, match="seq_lens_cpu is deprecated"):
        assert m.seq_lens_cpu.tolist() == [7, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert m.seq_lens_cpu.tolist() == [7, 4]
        assert _direct_metadata().seq_lens_cpu.device.type == "cpu"


def test_num_computed_tokens_cpu_warns_once_and_alone(fresh_deprecations):
    m = _direct_metadata()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert m.num_computed_tokens_cpu.tolist() == [5, 3]
        assert m.num_computed_tokens_cpu.tolist() == [5, 3]
    assert [str(w.message).split(" is ")[0] for w in caught] == [
        "CommonAttentionMetadata.num_computed_tokens_cpu"
    ]
    assert caught[0].category is DeprecationWarning
    # seq_lens_cpu has its own once-per-process warning, still pending
    with pytest.warns(DeprecationWarning, match="seq_lens_cpu"):
        m.seq_lens_cpu


@pytest.mark.parametrize("change, msg", [
    (dict(num_reqs=-1), "num_reqs must be an int >= 0"),
    (dict(num_reqs=3), r"query_start_loc must be 1-D with at least 4 entries"),
    (dict(query_start_loc_cpu=torch.tensor([0, 2, 3, 3], dtype=torch.int32)),
     "same length"),
    (dict(seq_lens=torch.tensor([7])), "seq_lens must be 1-D with at least 2"),
    (dict(block_table_tensor=torch.zeros(2)), "block_table_tensor must be a 2-D tensor"),
    (dict(slot_mapping=torch.zeros(3, 1)), "slot_mapping must be 1-D"),
    (dict(max_seq_len=None), "max_seq_len must be an int >= 0"),
])
def test_common_metadata_validates_structure(change, msg):
    base = _direct_metadata()
    fields = {f: getattr(base, f) for f in (
        "query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
        "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping")}
    with pytest.raises(ValueError, match=msg):
        CommonAttentionMetadata(**{**fields, **change})
