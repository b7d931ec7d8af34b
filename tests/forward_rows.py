"""A decoder's forward with ``output_rows`` (the engine's sampled rows only) against the
same forward over every row, on an idle engine's cache."""

from __future__ import annotations

import torch

from pagedattn import LLM
from pagedattn.backend import CommonAttentionMetadata


def assert_output_rows_match_all_rows(llm: LLM, lens: list[int], seed: int = 0) -> None:
    """Prefill sequences of ``lens`` tokens in one batch, twice: the hidden states of each
    sequence's last row, and of no row, must equal those rows of the full forward. The
    linear layers must run per row (``linear_impl="packed"``), so equal means bit-equal."""
    engine = llm.engine
    common = CommonAttentionMetadata.from_lens(lens, lens,
                                               block_size=engine.attention.spec.block_size)
    metadata = engine.attention.builder.build(0, common)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, llm.model.config.vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    caches = engine.runner.kv_caches
    last_rows = torch.tensor(lens).cumsum(0) - 1
    with torch.inference_mode():
        full = llm.model(ids, positions, caches, metadata)
        last = llm.model(ids, positions, caches, metadata, last_rows)
        none = llm.model(ids, positions, caches, metadata, torch.tensor([], dtype=torch.long))
    assert full.shape[0] == sum(lens)
    assert torch.equal(last, full[last_rows])
    assert none.shape == (0, full.shape[1])
