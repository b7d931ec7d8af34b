"""Helpers to build paged batches for tests and benchmarks.

A :class:`BatchSpec` names a batch shape (``decode``, ``prefill``, ``mixed``...); :func:
`make_paged_batch` fills it with random data and scatters the KV into a paged cache
through a *random* block table (block 0 reserved, blocks permuted), so a kernel that
ignores the block table or reads past a request's blocks gets caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedattn import paging

# Absolute/relative tolerances per storage dtype for kernels vs the fp32 reference.
# bf16/fp16 follow vLLM's CPU attention tests (inputs are exact; the kernel may round
# probabilities to the storage dtype before the PV product).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass(frozen=True)
class BatchSpec:
    """A varlen batch: request ``r`` has ``query_lens[r]`` new tokens and
    ``seq_lens[r]`` total tokens (prior context + new)."""

    name: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.query_lens):
            raise ValueError(
                f"{self.name}: {len(self.seq_lens)} seq_lens vs {len(self.query_lens)} query_lens"
            )
        for r, (s, q) in enumerate(zip(self.seq_lens, self.query_lens)):
            if q < 0 or s < q:
                raise ValueError(f"{self.name}: request {r} has seq_len {s} < query_len {q}")

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


BATCH_SPECS: dict[str, BatchSpec] = {
    spec.name: spec
    for spec in (
        BatchSpec("decode", (37, 64, 129, 300), (1, 1, 1, 1)),
        BatchSpec("spec_decode", (40, 97, 200), (3, 4, 2)),
        BatchSpec("prefill", (70, 33), (70, 33)),
        BatchSpec("chunked_prefill", (150, 90), (40, 90)),
        BatchSpec("mixed", (65, 1, 130, 220, 48), (1, 1, 4, 100, 48)),
        BatchSpec("long_decode", (1100,), (1,)),
    )
}


@dataclass
class PagedBatch:
    """A random batch with its KV both contiguous (per request) and paged.

    query: ``[num_tokens, num_heads, head_size]``; keys/values: per request
    ``[seq_len, num_kv_heads, head_size]``; key_cache/value_cache in ``layout``;
    block_table int32 ``[num_reqs, max_blocks]`` (unused columns hold 0);
    query_start_loc / seq_lens int32; slot_mapping int64 ``[num_tokens]`` (slots of the
    new tokens); new_keys/new_values ``[num_tokens, num_kv_heads, head_size]``.
    """

    spec: BatchSpec
    layout: str
    query: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    new_keys: torch.Tensor = field(repr=False)
    new_values: torch.Tensor = field(repr=False)


def make_paged_batch(
    spec: BatchSpec,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    layout: str = "cpu",
    seed: int = 0,
    extra_blocks: int = 3,
    fill: float = float("nan"),
    shared_prefixes: tuple[tuple[tuple[int, ...], int], ...] = (),
) -> PagedBatch:
    """Build a random :class:`PagedBatch`; unused cache slots hold ``fill`` (NaN by
    default, so a kernel that reads them poisons its output).

    ``shared_prefixes``: groups ``(requests, blocks)`` whose requests share their first
    ``blocks`` blocks, as prefix caching shares them: the same physical blocks in their
    block tables (the first request's), holding the same keys and values."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    # Request r's first shared_with[r][1] blocks are those of request shared_with[r][0].
    shared_with: dict[int, tuple[int, int]] = {}
    for members, blocks in shared_prefixes:
        for r in members[1:]:
            if r in shared_with or r == members[0] or members[0] in shared_with:
                raise ValueError(f"shared_prefixes: request {r} is in more than one group")
            if min(spec.seq_lens[r], spec.seq_lens[members[0]]) < blocks * block_size:
                raise ValueError(f"shared_prefixes: requests {members[0]} and {r} have fewer "
                                 f"than {blocks} blocks of {block_size} keys")
            shared_with[r] = (members[0], blocks)
    blocks_per_req = [paging.cdiv(s, block_size) for s in spec.seq_lens]
    own_blocks = [n - shared_with.get(r, (0, 0))[1] for r, n in enumerate(blocks_per_req)]
    num_blocks = 1 + sum(own_blocks) + extra_blocks  # block 0 reserved
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    if layout == "cpu":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
    elif layout == "flash":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
    else:
        raise ValueError(f"layout must be 'cpu' or 'flash', got {layout!r}")
    key_cache = torch.full(shape, fill, dtype=dtype)
    value_cache = torch.full(shape, fill, dtype=dtype)

    keys, values, tables = [], [], []
    for r, (seq_len, n_blocks) in enumerate(zip(spec.seq_lens, blocks_per_req)):
        k, v = randn(seq_len, num_kv_heads, head_size), randn(seq_len, num_kv_heads, head_size)
        own = [physical.pop() for _ in range(own_blocks[r])]
        if r in shared_with:
            first, blocks = shared_with[r]
            n = blocks * block_size
            k[:n], v[:n] = keys[first][:n], values[first][:n]
            own = tables[first][:blocks] + own
        tables.append(own)
        keys.append(k)
        values.append(v)
        blk, off = paging.blocks_and_offsets(torch.tensor(own, dtype=torch.int64),
                                             torch.arange(seq_len), block_size)
        if layout == "cpu":
            key_cache[blk, :, off], value_cache[blk, :, off] = k, v
        else:
            key_cache[blk, off], value_cache[blk, off] = k, v
    # One spare column: kernels must stop at a request's own blocks.
    block_table = paging.pad_block_tables(tables, min_cols=max(blocks_per_req, default=0) + 1)
    slots = paging.slot_mapping_for_new_tokens(block_table, spec.query_lens, spec.seq_lens,
                                               block_size)

    query_start_loc = paging.query_start_loc(spec.query_lens)
    new_keys = torch.cat([k[len(k) - q:] for k, q in zip(keys, spec.query_lens)])
    new_values = torch.cat([v[len(v) - q:] for v, q in zip(values, spec.query_lens)])
    return PagedBatch(
        spec=spec,
        layout=layout,
        query=randn(spec.num_tokens, num_heads, head_size),
        keys=keys,
        values=values,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(spec.seq_lens, dtype=torch.int32),
        slot_mapping=slots,
        new_keys=new_keys.reshape(-1, num_kv_heads, head_size),
        new_values=new_values.reshape(-1, num_kv_heads, head_size),
    )
