"""Tests of the backend utilities: the v0 port in compat/ (at vLLM's import path
pagedattn.backends.utils) and the v1 decode/prefill split helpers."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedattn.compat import backend_utils as U
from pagedattn.compat.backend_utils import (
    PAD_SLOT_ID,
    CommonAttentionState,
    CommonMetadataBuilder,
    MetadataInputBuilder,
    MLADims,
    ModelRunnerInfo,
    PrefillDecodeMetadata,
    ReorderableBatch,
    ScheduledTokens,
    SeqGroupInput,
    compute_slot_mapping,
    compute_slot_mapping_start_idx,
    get_mla_dims,
    get_num_prefill_decode_query_kv_tokens,
    get_seq_len_block_table_args,
    is_all_cross_attn_metadata_set,
    is_all_encoder_attn_metadata_set,
    is_block_tables_empty,
    num_blocks_needed,
    reorder_batch_to_split_decodes_and_prefills,
    slot_for_position,
    split_decodes_and_prefills,
)
from pagedattn.compat import vllm_v0
from pagedattn.config import ModelConfig


def flat_slots(block_table, block_size):
    """Oracle: the slot of every position the block table covers, by expansion."""
    return [b * block_size + o for b in block_table for o in range(block_size)]


# --------------------------------------------------------------------------------------
# constants and pure index translation
# --------------------------------------------------------------------------------------


def test_constants():
    assert PAD_SLOT_ID == -1


@pytest.mark.parametrize("block_table, pos, bs, expected", [
    ([7, 2], 0, 4, 28),
    ([7, 2], 3, 4, 31),
    ([7, 2], 5, 4, 9),
    ([3], 0, 1, 3),
    ([0, 5, 1], 40, 16, 16 + 8),
])
def test_slot_for_position(block_table, pos, bs, expected):
    assert slot_for_position(block_table, pos, bs) == expected


@pytest.mark.parametrize("n, bs, expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2),
                                               (17, 16, 2), (3, 1, 3)])
def test_num_blocks_needed(n, bs, expected):
    assert num_blocks_needed(n, bs) == expected


def test_python_and_numpy_paths_agree_on_random_cases():
    rng = random.Random(0)
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 8, 16, 32])
        n_blocks = rng.randint(1, 60)
        table = [rng.randrange(1000) for _ in range(n_blocks)]
        end = rng.randint(0, n_blocks * bs)
        start = rng.randint(0, end)
        py, npy = [99], [99]
        U._compute_slot_mapping_python(py, table, start, end, bs)
        U._compute_slot_mapping_numpy(npy, table, start, end, bs)
        assert py == npy == [99] + flat_slots(table, bs)[start:end]
        assert all(type(s) is int for s in npy)


# --------------------------------------------------------------------------------------
# compute_slot_mapping_start_idx / compute_slot_mapping
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_prompt, q, c, window, expected", [
    (True, 10, 0, 8, 2),      # the docstring example
    (True, 5, 0, 8, 0),       # prompt shorter than the window
    (True, 10, 0, None, 0),   # full attention
    (False, 1, 20, 8, 0),     # decode
    (True, 300, 100, 256, 44),
])
def test_start_idx(is_prompt, q, c, window, expected):
    assert compute_slot_mapping_start_idx(is_prompt, q, c, window) == expected


def test_start_idx_rejects_bad_window():
    with pytest.raises(ValueError, match="sliding_window.*0"):
        compute_slot_mapping_start_idx(True, 10, 0, 0)


def test_docstring_sliding_window_example():
    start = compute_slot_mapping_start_idx(True, 10, 0, 8)
    out: list[int] = []
    compute_slot_mapping(False, out, 0, 10, 0, start, 4, {0: [0, 1, 0]})
    assert out == [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_decode_slot():
    out = [5]
    compute_slot_mapping(False, out, 3, 10, 9, 0, 4, {3: [7, 2, 11]})
    assert out == [5, 11 * 4 + 1]  # position 9 -> third block, offset 1; appended


def test_profile_run_pads_every_token():
    out: list[int] = []
    compute_slot_mapping(True, out, 0, 7, 0, 0, 16, None)
    assert out == [PAD_SLOT_ID] * 7


def _spy_paths(monkeypatch):
    calls = {"python": 0, "numpy": 0}
    py, npy = U._compute_slot_mapping_python, U._compute_slot_mapping_numpy

    def spy_py(*a):
        calls["python"] += 1
        py(*a)

    def spy_np(*a):
        calls["numpy"] += 1
        npy(*a)

    monkeypatch.setattr(vllm_v0, "_compute_slot_mapping_python", spy_py)
    monkeypatch.setattr(vllm_v0, "_compute_slot_mapping_numpy", spy_np)
    return calls


@pytest.mark.parametrize("offset, path", [(-1, "python"), (0, "numpy"), (1, "numpy"),
                                          (None, "python")])
def test_path_switch_at_threshold(monkeypatch, offset, path):
    """Both paths yield the same slots on either side of the switch (wherever the tuning
    constant puts it)."""
    threshold = vllm_v0._COMPUTE_SLOT_MAPPING_NUMPY_NUMEL
    numel = 1 if offset is None else threshold + offset
    calls = _spy_paths(monkeypatch)
    table = list(range(100, 100 + num_blocks_needed(numel + 3, 16)))
    out: list[int] = []
    compute_slot_mapping(False, out, 0, numel + 3, 3, 0, 16, {0: table})
    assert calls == {"python": int(path == "python"), "numpy": int(path == "numpy")}
    assert out == flat_slots(table, 16)[3:numel + 3]


def test_compute_slot_mapping_random_cases_match_oracle(monkeypatch):
    calls = _spy_paths(monkeypatch)
    rng = random.Random(1)
    for _ in range(400):
        bs = rng.choice([1, 4, 8, 16, 32])
        seq_len = rng.randint(0, 700)
        context_len = rng.randint(0, seq_len)
        is_prompt = rng.random() < 0.7
        window = rng.choice([None, rng.randint(1, 400)])
        query_len = seq_len - context_len
        table = [rng.randrange(5000) for _ in range(num_blocks_needed(seq_len, bs) + 1)]
        start = compute_slot_mapping_start_idx(is_prompt, query_len, context_len, window)
        assert start == (max(0, query_len - window) if is_prompt and window else 0)
        out: list[int] = []
        compute_slot_mapping(False, out, 42, seq_len, context_len, start, bs, {42: table})
        slots = flat_slots(table, bs)
        expected = [PAD_SLOT_ID if pos < start else slots[pos]
                    for pos in range(context_len, seq_len)]
        assert out == expected
    assert calls["python"] > 0 and calls["numpy"] > 0


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "16"])
def test_rejects_bad_block_size(bad):
    with pytest.raises(ValueError, match=f"block_size.*{bad!r}"):
        compute_slot_mapping(False, [], 0, 4, 0, 0, bad, {0: [1]})


def test_rejects_inconsistent_lengths_and_tables():
    with pytest.raises(ValueError, match="context_len=5, seq_len=4"):
        compute_slot_mapping(False, [], 0, 4, 5, 0, 4, {0: [1]})
    with pytest.raises(ValueError, match="seq_len.*-1"):
        compute_slot_mapping(False, [], 0, -1, 0, 0, 4, {0: [1]})
    with pytest.raises(ValueError, match=r"seq_id 3 .*\[0, 1\]"):
        compute_slot_mapping(False, [], 3, 4, 0, 0, 4, {0: [1], 1: [2]})
    with pytest.raises(ValueError, match="has 1 blocks.*>= 2.*seq_len=5"):
        compute_slot_mapping(False, [], 0, 5, 0, 0, 4, {0: [1]})
    with pytest.raises(ValueError, match="negative block id"):
        compute_slot_mapping(False, [], 0, 5, 0, 0, 4, {0: [1, -1]})
    out: list[int] = []
    with pytest.raises(ValueError):
        compute_slot_mapping(False, out, 0, 5, 0, 2, 4, {0: [1]})
    assert out == []  # nothing appended on error


def test_is_block_tables_empty():
    assert is_block_tables_empty(None)
    assert is_block_tables_empty({})
    assert is_block_tables_empty({0: None, 1: None})
    assert not is_block_tables_empty({0: None, 1: [3]})
    assert not is_block_tables_empty({0: []})


# --------------------------------------------------------------------------------------
# CommonMetadataBuilder
# --------------------------------------------------------------------------------------


class _Backend:
    """A prefill/decode backend as CommonAttentionState sees it."""

    def __init__(self, name="XFORMERS"):
        self.name = name

    def get_name(self):
        return self.name

    def make_metadata(self, **kwargs):
        return PrefillDecodeMetadata(**kwargs)


def _prompt(seq_ids, lens, tables, ctx=None, **kw):
    ctx = ctx or [0] * len(lens)
    return SeqGroupInput(
        is_prompt=True, seq_ids=seq_ids, input_tokens=[[1] * (n - c) for n, c in zip(lens, ctx)],
        orig_seq_lens=lens, seq_lens=lens, query_lens=[n - c for n, c in zip(lens, ctx)],
        context_lens=ctx, block_tables=tables, **kw)


def _decode(seq_ids, lens, tables, **kw):
    return SeqGroupInput(
        is_prompt=False, seq_ids=seq_ids, input_tokens=[[1]] * len(lens), orig_seq_lens=lens,
        seq_lens=lens, query_lens=[1] * len(lens), context_lens=[n - 1 for n in lens],
        block_tables=tables, **kw)


def _builder(groups, block_size=4, **kw):
    runner = ModelRunnerInfo(device="cpu", attn_backend=_Backend(),
                             graph_block_tables=np.zeros((8, 6), dtype=np.int32))
    return CommonMetadataBuilder(MetadataInputBuilder(runner=runner, block_size=block_size,
                                                      inter_data_list=groups, **kw))


def test_builder_mixed_batch():
    groups = [
        _prompt([0], [6], {0: [3, 9]}),
        _decode([1, 2], [5, 9], {1: [4, 1], 2: [2, 7, 8]}),
    ]
    md = _builder(groups).build(seq_lens=[6, 5, 9], query_lens=[6, 1, 1],
                                cuda_graph_pad_size=-1, batch_size=3)
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (1, 6, 2)
    # prompt: positions 0..5 in blocks 3, 9; decode 1: position 4 -> block 1 offset 0;
    # decode 2: position 8 -> block 8 offset 0.
    assert md.slot_mapping.tolist() == [12, 13, 14, 15, 36, 37, 4, 32]
    assert md.slot_mapping.dtype == torch.int64
    # fresh prompt without chunked prefill attends to itself: empty block table row
    assert md.block_tables.tolist() == [[0, 0, 0], [4, 1, 0], [2, 7, 8]]
    assert md.block_tables.dtype == torch.int32
    assert md.seq_lens_tensor.tolist() == [6, 5, 9]
    assert md.context_lens_tensor.tolist() == [0, 4, 8]
    assert md.query_start_loc.tolist() == [0, 6, 7, 8]
    assert md.seq_start_loc.tolist() == [0, 6, 11, 20]
    assert (md.max_query_len, md.max_prefill_seq_len, md.max_decode_seq_len) == (6, 6, 9)
    assert md.use_cuda_graph is False
    dec = md.decode_metadata
    assert dec.slot_mapping.tolist() == [4, 32]
    assert dec.seq_lens_tensor.tolist() == [5, 9]
    assert dec.block_tables.tolist() == [[4, 1, 0], [2, 7, 8]]
    pre = md.prefill_metadata
    assert pre.slot_mapping.tolist() == [12, 13, 14, 15, 36, 37]
    assert pre.query_start_loc.tolist() == [0, 6]


def test_builder_chunked_prefill_and_sliding_window():
    # second chunk of a prompt: 4 cached tokens, 6 new; window 8 -> start_idx 0 here
    # because start_idx is relative to query_len (6 - 8 < 0).
    groups = [_prompt([5], [10], {5: [1, 2, 3]}, ctx=[4])]
    md = _builder(groups, chunked_prefill_enabled=True, sliding_window=8).build(
        [10], [6], -1, 1)
    assert md.slot_mapping.tolist() == [8, 9, 10, 11, 12, 13]
    assert md.block_tables.tolist() == [[1, 2, 3]]
    # decode with only the last 2 blocks live in the window
    groups = [_decode([0], [9], {0: [5, 6, 7]}, curr_sliding_window_blocks=[2])]
    md = _builder(groups, sliding_window=8).build([9], [1], -1, 1)
    assert md.block_tables.tolist() == [[6, 7]]
    assert md.slot_mapping.tolist() == [7 * 4]


def test_builder_prompt_with_window_masks_prefix_and_prefix_hit_keeps_table():
    groups = [_prompt([0], [10], {0: [0, 1, 0]}, prefix_cache_hit=True)]
    md = _builder(groups, sliding_window=8).build([10], [10], -1, 1)
    assert md.slot_mapping.tolist() == [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert md.block_tables.tolist() == [[0, 1, 0]]


def test_builder_profile_run():
    groups = [_prompt([0, 1], [3, 2], None)]
    md = _builder(groups).build([3, 2], [3, 2], -1, 2)
    assert md.slot_mapping.tolist() == [PAD_SLOT_ID] * 5
    assert md.block_tables.shape == (2, 0)


def test_builder_cuda_graph_padding():
    groups = [_decode([0, 1], [5, 2], {0: [3, 4], 1: [6]})]
    b = _builder(groups)
    before = b.runner.graph_block_tables.copy()
    md = b.build(seq_lens=[5, 2, 1, 1], query_lens=[1, 1], cuda_graph_pad_size=2, batch_size=4)
    assert md.use_cuda_graph
    assert md.num_decode_tokens == 4
    assert md.slot_mapping.tolist() == [4 * 4 + 0, 6 * 4 + 1, -1, -1]
    assert md.block_tables.shape == (4, 6)
    assert md.block_tables[:, :2].tolist() == [[3, 4], [6, 0], [0, 0], [0, 0]]
    assert np.array_equal(b.runner.graph_block_tables, before)  # runner state untouched
    # building again gives the same result (state is reset per build)
    md2 = b.build(seq_lens=[5, 2, 1, 1], query_lens=[1, 1], cuda_graph_pad_size=2, batch_size=4)
    assert md2.slot_mapping.tolist() == md.slot_mapping.tolist()


def test_builder_rejects_bad_input():
    with pytest.raises(ValueError, match="query_len 1.*query_len=2"):
        bad = SeqGroupInput(is_prompt=False, seq_ids=[0], input_tokens=[[1, 2]],
                            orig_seq_lens=[5], seq_lens=[5], query_lens=[2], context_lens=[3],
                            block_tables={0: [1, 2]})
        _builder([bad]).build([5], [2], -1, 1)
    with pytest.raises(ValueError, match="query_lens"):
        _builder([_prompt([0], [3], {0: [1]})]).build([3], [], -1, 1)
    with pytest.raises(ValueError, match="batch_size 1"):
        _builder([_decode([0, 1], [5, 2], {0: [3, 4], 1: [6]})]).build([5, 2], [1, 1], 0, 1)
    with pytest.raises(ValueError, match="block_size.*0"):
        MetadataInputBuilder(runner=ModelRunnerInfo(), block_size=0)


def test_seq_group_input_validation():
    with pytest.raises(ValueError, match="query_lens must have one entry per seq_id.*got 1"):
        SeqGroupInput(is_prompt=True, seq_ids=[0, 1], input_tokens=[[1], [1]],
                      orig_seq_lens=[1, 1], seq_lens=[1, 1], query_lens=[1], context_lens=[0, 0])
    with pytest.raises(ValueError, match="context_len \\+ query_len == orig_seq_len.*2 \\+ 1 != 4"):
        SeqGroupInput(is_prompt=True, seq_ids=[0], input_tokens=[[1]], orig_seq_lens=[4],
                      seq_lens=[4], query_lens=[1], context_lens=[2])
    with pytest.raises(ValueError, match="seq 7 has no entry in block_tables"):
        _prompt([7], [3], {0: [1]})
    with pytest.raises(ValueError, match="len\\(input_tokens\\)"):
        SeqGroupInput(is_prompt=True, seq_ids=[0], input_tokens=[[1, 2]], orig_seq_lens=[1],
                      seq_lens=[1], query_lens=[1], context_lens=[0])


# --------------------------------------------------------------------------------------
# CommonAttentionState
# --------------------------------------------------------------------------------------


def _state(device="cpu", name="XFORMERS", rows=8, width=5):
    table = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    runner = ModelRunnerInfo(device=device, attn_backend=_Backend(name),
                             graph_block_tables=table, max_seq_len_to_capture=64)
    return CommonAttentionState(runner)


def _step_metadata(seq_lens, block_tables, device="cpu"):
    n = len(seq_lens)
    return PrefillDecodeMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=n,
        slot_mapping=torch.arange(n, dtype=torch.long, device=device),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
        max_decode_seq_len=max(seq_lens))


def test_graph_capture_buffers_and_cleanup():
    st = _state()
    with st.graph_capture(6):
        assert st._graph_slot_mapping.tolist() == [PAD_SLOT_ID] * 6
        assert st._graph_slot_mapping.dtype == torch.long
        assert st._graph_seq_lens.tolist() == [1] * 6
        assert st._graph_seq_lens.dtype == torch.int32
        assert st._graph_block_tables.tolist() == np.arange(30).reshape(6, 5).tolist()
        clone = st.graph_clone(4)
        assert isinstance(clone, CommonAttentionState) and clone is not st
        assert clone.runner is st.runner
    assert not st._is_graph_capturing
    assert not hasattr(st, "_graph_seq_lens")
    with pytest.raises(RuntimeError, match="graph_capture"):
        st.graph_clone(4)
    with pytest.raises(RuntimeError, match="graph_capture"):
        st.graph_capture_get_metadata_for_batch(2)


def test_graph_capture_rejects_bad_sizes():
    st = _state(rows=4)
    with pytest.raises(ValueError, match="4 rows.*max_batch_size=5"):
        with st.graph_capture(5):
            pass
    with st.graph_capture(4):
        with pytest.raises(ValueError, match=r"batch_size must be in \[1, 4\], got 5"):
            st.graph_capture_get_metadata_for_batch(5)


def test_graph_metadata_views_and_prepare_copies_into_buffers():
    st = _state()
    with st.graph_capture(8):
        md = st.graph_capture_get_metadata_for_batch(3)
        assert md.use_cuda_graph and md.num_decode_tokens == 3 and md.num_prefills == 0
        assert md.max_decode_seq_len == 64 and md.max_query_len == 1
        bufs = st.get_graph_input_buffers(md)
        assert set(bufs) == {"slot_mapping", "seq_lens_tensor", "block_tables"}
        # the buffers share storage with the state's capture buffers
        assert bufs["seq_lens_tensor"].data_ptr() == st._graph_seq_lens.data_ptr()
        assert bufs["block_tables"].data_ptr() == st._graph_block_tables.data_ptr()
        assert bufs["slot_mapping"].data_ptr() == st._graph_slot_mapping.data_ptr()

        step = _step_metadata([7, 3, 9], [[1, 2, 0, 0, 0], [4, 0, 0, 0, 0], [5, 6, 7, 0, 0]])
        st.prepare_graph_input_buffers(bufs, step)
        assert st._graph_seq_lens.tolist() == [7, 3, 9, 1, 1, 1, 1, 1]
        assert st._graph_block_tables[:3].tolist() == step.block_tables.tolist()
        assert st._graph_block_tables[3].tolist() == [15, 16, 17, 18, 19]  # untouched
        with pytest.raises(ValueError, match=r"block_tables.*\(3, 5\).*\(3, 2\)"):
            st.prepare_graph_input_buffers(bufs, _step_metadata([1, 1, 1], [[1, 2]] * 3))
    assert st.begin_forward(object()) is None


def test_graph_capture_encoder_decoder():
    st = _state(name="XFORMERS")
    with st.graph_capture(4):
        md = st.graph_capture_get_metadata_for_batch(2, is_encoder_decoder_model=True)
        assert md.cross_slot_mapping.numel() == 0
        assert md.cross_block_tables.tolist() == [[1] * 5] * 2
        assert md.encoder_seq_lens_tensor.tolist() == [1, 1]
        assert md.max_encoder_seq_len == 64 and md.num_encoder_tokens == 0
        assert md.is_all_cross_attn_metadata_set
        bufs = st.get_graph_input_buffers(md, is_encoder_decoder_model=True)
        assert {"encoder_seq_lens_tensor", "cross_slot_mapping", "cross_block_tables"} <= set(bufs)
        step = st.graph_capture_get_metadata_for_batch(2, is_encoder_decoder_model=True)
        step.encoder_seq_lens_tensor = torch.tensor([11, 12], dtype=torch.int32)
        step.cross_block_tables = torch.full((2, 5), 3, dtype=torch.int32)
        st.prepare_graph_input_buffers(bufs, step, is_encoder_decoder_model=True)
        assert bufs["encoder_seq_lens_tensor"].tolist() == [11, 12]
        assert bufs["cross_block_tables"].tolist() == [[3] * 5] * 2
    other = _state(name="CPU_ATTN")
    with other.graph_capture(2):
        with pytest.raises(NotImplementedError, match="XFORMERS.*got 'CPU_ATTN'"):
            other.graph_capture_get_metadata_for_batch(2, is_encoder_decoder_model=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for a real graph")
def test_cuda_graph_replay_reads_prepared_buffers():
    st = _state(device="cuda", rows=4, width=3)
    with st.graph_capture(4):
        md = st.graph_capture_get_metadata_for_batch(2)
        bufs = st.get_graph_input_buffers(md)
        dec = md.decode_metadata
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            # stand-in for attention: reads seq lens and the block table
            out = dec.seq_lens_tensor * 1000 + dec.block_tables.sum(dim=1, dtype=torch.int32)
        step = _step_metadata([7, 9], [[1, 2, 3], [4, 5, 6]], device="cuda")
        st.prepare_graph_input_buffers(bufs, step)
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == [7006, 9015]


# --------------------------------------------------------------------------------------
# MLA
# --------------------------------------------------------------------------------------


def test_get_mla_dims():
    hf = SimpleNamespace(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128)
    dims = get_mla_dims(ModelConfig(hf_text_config=hf))
    assert dims == MLADims(1536, 512, 128, 64, 128)
    lite = SimpleNamespace(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                           v_head_dim=128)
    assert get_mla_dims(ModelConfig(hf_text_config=lite)).q_lora_rank is None


def test_get_mla_dims_errors():
    with pytest.raises(ValueError, match="hf_text_config is None"):
        get_mla_dims(ModelConfig())
    with pytest.raises(ValueError, match=r"\['kv_lora_rank', 'v_head_dim'\]"):
        get_mla_dims(SimpleNamespace(hf_text_config=SimpleNamespace(
            qk_nope_head_dim=128, qk_rope_head_dim=64)))
    with pytest.raises(ValueError, match="kv_lora_rank.*0"):
        MLADims(None, 0, 128, 64, 128)
    with pytest.raises(ValueError, match="q_lora_rank.*-1"):
        MLADims(-1, 512, 128, 64, 128)


# --------------------------------------------------------------------------------------
# encoder/decoder helpers
# --------------------------------------------------------------------------------------


def _enc_dec_md(**kw):
    base = dict(num_prefill_tokens=5, num_decode_tokens=3, num_encoder_tokens=7,
                seq_lens_tensor="dec_lens", max_prefill_seq_len=11, max_decode_seq_len=13,
                block_tables="dec_bt", encoder_seq_lens=[7], encoder_seq_lens_tensor="enc_lens",
                max_encoder_seq_len=7, cross_slot_mapping="xslots", cross_block_tables="x_bt")
    base.update(kw)
    md = SimpleNamespace(**base)
    md.is_all_encoder_attn_metadata_set = is_all_encoder_attn_metadata_set(md)
    return md


@pytest.mark.parametrize("attn_type, expected", [
    ("decoder", (5, 5, 3)), ("encoder_only", (5, 5, 3)), ("encoder", (7, 7, 0)),
    ("encoder_decoder", (5, 7, 3)),
])
def test_num_prefill_decode_query_kv_tokens(attn_type, expected):
    from pagedattn.backend import AttentionType

    md = _enc_dec_md()
    assert get_num_prefill_decode_query_kv_tokens(md, attn_type) == expected
    assert get_num_prefill_decode_query_kv_tokens(md, AttentionType(attn_type)) == expected


def test_num_tokens_errors():
    with pytest.raises(ValueError, match="encoder.*num_encoder_tokens"):
        get_num_prefill_decode_query_kv_tokens(_enc_dec_md(num_encoder_tokens=None), "encoder")
    with pytest.raises(ValueError, match="'bogus'.*decoder"):
        get_num_prefill_decode_query_kv_tokens(_enc_dec_md(), "bogus")


def test_seq_len_block_table_args():
    md = _enc_dec_md()
    assert get_seq_len_block_table_args(md, True, "decoder") == ("dec_lens", 11, "dec_bt")
    assert get_seq_len_block_table_args(md, False, "decoder") == ("dec_lens", 13, "dec_bt")
    assert get_seq_len_block_table_args(md, False, "encoder_decoder") == ("enc_lens", 7, "x_bt")
    assert get_seq_len_block_table_args(md, True, "encoder") == ("enc_lens", 7, None)
    with pytest.raises(ValueError, match="'encoder_only'"):
        get_seq_len_block_table_args(md, True, "encoder_only")


def test_all_metadata_set_checks():
    assert is_all_encoder_attn_metadata_set(_enc_dec_md())
    assert is_all_cross_attn_metadata_set(_enc_dec_md())
    for field in ("encoder_seq_lens", "encoder_seq_lens_tensor", "max_encoder_seq_len"):
        md = _enc_dec_md(**{field: None})
        assert not is_all_encoder_attn_metadata_set(md)
        assert not is_all_cross_attn_metadata_set(md)
    for field in ("cross_slot_mapping", "cross_block_tables"):
        md = _enc_dec_md(**{field: None})
        assert is_all_encoder_attn_metadata_set(md)
        assert not is_all_cross_attn_metadata_set(md)


# --------------------------------------------------------------------------------------
# v1 split / reorder
# --------------------------------------------------------------------------------------


def _cam(query_lens, num_actual_tokens=None):
    qsl = torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)
    return SimpleNamespace(
        max_query_len=max(query_lens, default=0), num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]) if num_actual_tokens is None else num_actual_tokens,
        query_start_loc_cpu=qsl)


@pytest.mark.parametrize("query_lens, kw, expected", [
    ([1, 1, 5, 3], {}, (2, 2, 2, 8)),
    ([1, 1, 1], {}, (3, 0, 3, 0)),
    ([4, 2], {}, (0, 2, 0, 6)),
    ([2, 3, 1, 7], {"decode_threshold": 3}, (3, 1, 6, 7)),
    ([2, 2, 2], {"decode_threshold": 2, "require_uniform": True}, (3, 0, 6, 0)),
    ([2, 2, 0, 0], {"decode_threshold": 2, "require_uniform": True}, (4, 0, 4, 0)),
    ([2, 2, 1, 9], {"decode_threshold": 2, "require_uniform": True}, (2, 2, 4, 10)),
    ([1, 2], {"decode_threshold": 2, "require_uniform": True}, (1, 1, 1, 2)),
    ([], {}, (0, 0, 0, 0)),
])
def test_split_decodes_and_prefills(query_lens, kw, expected):
    assert split_decodes_and_prefills(_cam(query_lens), **kw) == expected


def test_split_counts_padding_tokens_as_prefill():
    assert split_decodes_and_prefills(_cam([1, 4], num_actual_tokens=8)) == (1, 1, 1, 7)


def test_split_with_common_attention_metadata():
    from pagedattn.backend import CommonAttentionMetadata

    cam = CommonAttentionMetadata.from_lens([1, 1, 6], [9, 4, 6], block_size=16)
    assert split_decodes_and_prefills(cam, decode_threshold=1) == (2, 1, 2, 6)


def test_split_rejects_bad_input():
    with pytest.raises(ValueError, match="request 2 \\(query_len 1\\).*first prefill at 1"):
        split_decodes_and_prefills(_cam([1, 4, 1]))
    with pytest.raises(ValueError, match="decode_threshold.*0"):
        split_decodes_and_prefills(_cam([1]), decode_threshold=0)
    bad = _cam([1, 4])
    bad.query_start_loc_cpu = bad.query_start_loc_cpu[:2]
    with pytest.raises(ValueError, match="3 entries.*\\(2,\\)"):
        split_decodes_and_prefills(bad)


class _CountingBatch(ReorderableBatch):
    def __post_init__(self):
        super().__post_init__()
        self.swaps = 0

    def swap_states(self, i, j):
        self.swaps += 1
        super().swap_states(i, j)


def test_reorder_example():
    batch = _CountingBatch(req_ids=["a", "b", "c", "d"], num_computed_tokens_cpu=[0, 10, 0, 20])
    sched = ScheduledTokens({"a": 5, "b": 1, "c": 3, "d": 1})
    assert reorder_batch_to_split_decodes_and_prefills(batch, sched) is True
    assert batch.req_ids == ["d", "b", "c", "a"]
    assert batch.num_computed_tokens_cpu.tolist() == [20, 10, 0, 0]
    assert batch.req_id_to_index == {"d": 0, "b": 1, "c": 2, "a": 3}
    assert batch.swaps == 1
    assert reorder_batch_to_split_decodes_and_prefills(batch, sched) is False
    assert batch.swaps == 1


def test_reorder_random_minimal_swaps_then_split():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(0, 12)
        threshold = rng.choice([1, 1, 2, 4])
        ids = [f"r{i}" for i in range(n)]
        sched = {r: rng.choice([1, 1, 2, 3, 4, 9, 30]) for r in ids}
        computed = {r: rng.randint(0, 50) for r in ids}
        batch = _CountingBatch(req_ids=list(ids), num_computed_tokens_cpu=[computed[r] for r in ids])
        n_dec = sum(sched[r] <= threshold for r in ids)
        misplaced = sum(sched[r] > threshold for r in ids[:n_dec])
        changed = reorder_batch_to_split_decodes_and_prefills(
            batch, ScheduledTokens(sched), decode_threshold=threshold)
        assert changed == (misplaced > 0)
        assert batch.swaps == misplaced
        assert sorted(batch.req_ids) == sorted(ids)
        assert all(sched[r] <= threshold for r in batch.req_ids[:n_dec])
        assert all(sched[r] > threshold for r in batch.req_ids[n_dec:])
        assert batch.num_computed_tokens_cpu.tolist() == [computed[r] for r in batch.req_ids]
        if n:
            q = [sched[r] for r in batch.req_ids]
            dec_tok = sum(x for x in q if x <= threshold)
            assert split_decodes_and_prefills(_cam(q), decode_threshold=threshold) == (
                n_dec, n - n_dec, dec_tok, sum(q) - dec_tok)


def test_reorder_and_batch_errors():
    batch = ReorderableBatch(req_ids=["a", "b"])
    with pytest.raises(ValueError, match=r"\['b'\]"):
        reorder_batch_to_split_decodes_and_prefills(batch, ScheduledTokens({"a": 1}))
    with pytest.raises(ValueError, match="decode_threshold.*-1"):
        reorder_batch_to_split_decodes_and_prefills(batch, ScheduledTokens({"a": 1, "b": 1}), -1)
    with pytest.raises(ValueError, match="swap index j.*\\[0, 2\\), got 2"):
        batch.swap_states(0, 2)
    with pytest.raises(ValueError, match="unique"):
        ReorderableBatch(req_ids=["a", "a"])
    with pytest.raises(ValueError, match="num_computed_tokens_cpu.*\\(2,\\).*\\(3,\\)"):
        ReorderableBatch(req_ids=["a", "b"], num_computed_tokens_cpu=[1, 2, 3])
    with pytest.raises(ValueError, match="num_scheduled_tokens\\['x'\\].*-2"):
        ScheduledTokens({"x": -2})
