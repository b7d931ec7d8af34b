"""pagedattn.paging: the index translation, checked against hand-worked values."""

import numpy as np
import pytest
import torch

from pagedattn import paging


def test_slot_formula_on_ints_numpy_and_tensors():
    table = [7, 2]
    # position 5 -> block 2, offset 1 -> slot 9 (block_size 4)
    assert paging.slots_for_positions(table, 5, 4) == 9
    pos = np.arange(8)
    assert paging.slots_for_positions(np.array(table), pos, 4).tolist() == \
        [28, 29, 30, 31, 8, 9, 10, 11]
    out = paging.slots_for_positions(torch.tensor(table, dtype=torch.int32), torch.arange(8), 4)
    assert out.dtype == torch.int64 and out.tolist() == [28, 29, 30, 31, 8, 9, 10, 11]


def test_slot_formula_does_not_overflow_int32_block_ids():
    table = torch.tensor([2**30], dtype=torch.int32)
    assert int(paging.slots_for_positions(table, torch.tensor([3]), 16)[0]) == 2**30 * 16 + 3


def test_new_token_positions_and_slots():
    req, pos = paging.new_token_positions([1, 3], [5, 3])
    assert req.tolist() == [0, 1, 1, 1] and pos.tolist() == [4, 0, 1, 2]
    table = paging.pad_block_tables([[3, 9], [4]])
    assert table.tolist() == [[3, 9], [4, 0]] and table.dtype == torch.int32
    slots = paging.slot_mapping_for_new_tokens(table, [1, 3], [5, 3], block_size=4)
    assert slots.tolist() == [9 * 4 + 0, 16, 17, 18]


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [5, 1, 9]),        # a decode step
    ([1, 4, 1, 2], [3, 4, 17, 2]),  # mixed
    ([3], [3]),
    ([], []),
])
def test_new_token_positions_agree_with_their_definition(query_lens, seq_lens):
    req, pos = paging.new_token_positions(query_lens, seq_lens)
    want = [(r, s - q + i) for r, (q, s) in enumerate(zip(query_lens, seq_lens))
            for i in range(q)]
    assert req.dtype == pos.dtype == torch.int64
    assert list(zip(req.tolist(), pos.tolist())) == want
    # the slots, from a torch or a numpy block table, with or without the positions given
    table = torch.arange(4 * max(len(query_lens), 1), dtype=torch.int32).view(-1, 4) * 3 + 1
    want_slots = [int(table[r, p // 8]) * 8 + p % 8 for r, p in want]
    for bt in (table, table.numpy()):
        for given in (None, (req, pos)):
            slots = paging.slot_mapping_for_new_tokens(bt, query_lens, seq_lens, 8, given)
            assert slots.dtype == torch.int64 and slots.tolist() == want_slots


def test_new_token_positions_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per request, got 2 and 1"):
        paging.new_token_positions([1, 1], [4])


def test_new_token_positions_rejects_short_seq():
    with pytest.raises(ValueError, match=r"request 1: seq_len \(2\) must be >= query_len \(3\)"):
        paging.new_token_positions([1, 3], [5, 2])


def test_contiguous_block_tables_and_cdiv():
    assert paging.cdiv(9, 4) == 3 and paging.cdiv(8, 4) == 2 and paging.cdiv(0, 4) == 0
    assert paging.contiguous_block_tables([5, 4, 0], 4, first_block=1) == [[1, 2], [3], []]


@pytest.mark.parametrize("flags,swaps", [
    ([False, True, False, True], [(0, 3)]),
    ([True, True, False], []),
    ([False, False, True, True], [(0, 3), (1, 2)]),
    ([], []),
])
def test_decodes_first_swaps_are_minimal(flags, swaps):
    assert paging.decodes_first_swaps(flags) == swaps
    order = list(flags)
    for i, j in swaps:
        order[i], order[j] = order[j], order[i]
    assert order == sorted(flags, reverse=True)


def test_num_leading_decodes():
    assert paging.num_leading_decodes([1, 1, 5, 1], 1) == 2
    assert paging.num_leading_decodes([2, 1], 2) == 2


def test_blocks_and_offsets_and_split_slots_invert_the_slot_formula():
    table = torch.tensor([[7, 2], [5, 9]], dtype=torch.int32)
    req = torch.tensor([0, 0, 1, 1])
    pos = torch.tensor([1, 5, 3, 4])
    blocks, offsets = paging.blocks_and_offsets(table, pos, 4, req)
    assert blocks.dtype == torch.int64
    assert blocks.tolist() == [7, 2, 5, 9] and offsets.tolist() == [1, 1, 3, 0]
    slots = paging.slots_for_positions(table, pos, 4, req)
    assert slots.tolist() == [29, 9, 23, 36]
    back_blocks, back_offsets = paging.split_slots(slots, 4)
    assert back_blocks.tolist() == blocks.tolist() and back_offsets.tolist() == offsets.tolist()
