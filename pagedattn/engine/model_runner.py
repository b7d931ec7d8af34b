"""The model runner: turns a scheduler step into one forward pass and sampled tokens.

Per step: copy the KV blocks the scheduler asks for (a forked sequence's copy on write,
``SchedulerOutput.block_copies``), sync the persistent input batch with the scheduled
requests, let the attention builder's threshold put decodes first, derive positions,
block table and slot mapping through ``pagedattn.paging``, build
``CommonAttentionMetadata`` and from it the backend metadata (once), run the model (every
layer's impl reads that same metadata), sample the requests whose last known token was
computed.
"""

from __future__ import annotations

import hashlib

import torch

from pagedattn.backend import CommonAttentionMetadata
from pagedattn.engine import huge_pages
from pagedattn.engine.attention import AttentionStack
from pagedattn.engine.input_batch import InputBatch
from pagedattn.engine.request import Request
from pagedattn.engine.sampler import SamplerOutput, sample
from pagedattn.engine.scheduler import SchedulerOutput
from pagedattn.paging import (
    cdiv,
    new_token_positions,
    query_start_loc,
    reorder_batch_decodes_first,
    slot_mapping_for_new_tokens,
)
from pagedattn.thread_policy import StepThreads


def request_seed(engine_seed: int, req_id: str) -> int:
    """The sampling seed of a request that brings none: the same in every process (a
    digest, not Python's per-process salted ``hash``)."""
    digest = hashlib.sha256(f"{engine_seed}:{req_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sequence_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request seeded with ``seed``: ``seed`` itself
    for sequence 0 (a request with ``n == 1`` samples as before), a digest of
    ``(seed, index)`` for the others, so no two sequences share a stream and requests
    with neighbouring seeds do not share sequences either (``seed + index`` would)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"sequence:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class ModelRunner:
    def __init__(self, model, attention: AttentionStack, *, num_blocks: int,
                 max_model_len: int, max_num_seqs: int, seed: int = 0,
                 huge: bool = True, threads: StepThreads | None = None) -> None:
        self.model = model
        self.threads = threads if threads is not None else StepThreads(adaptive=False)
        self.builder = attention.builder
        self.block_size = attention.spec.block_size
        shape = attention.kv_cache_shape(num_blocks)
        self.kv_caches, self.kv_on_huge_pages = huge_pages.zeros(
            shape, attention.spec.dtype, model.config.num_layers, huge)
        self.input_batch = InputBatch(max_num_seqs, cdiv(max_model_len, self.block_size))
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}

    def _generator(self, req: Request) -> torch.Generator | None:
        sp = req.sampling_params
        if sp.greedy:
            return None
        gen = self.generators.get(req.req_id)
        if gen is None:
            gen = torch.Generator()
            # without a seed: the engine's, mixed with the sequence's own id
            gen.manual_seed(sequence_seed(sp.seed, req.index) if sp.seed is not None
                            else request_seed(self.seed, req.req_id))
            self.generators[req.req_id] = gen
        return gen

    def forget(self, req_id: str) -> None:
        self.generators.pop(req_id, None)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of block ``src`` into block ``dst`` for each ``(src, dst)`` in
        ``pairs``, K and V of every layer (dim 1 of every backend's cache shape is the
        block). No destination is a source: destinations are fresh blocks."""
        for cache in self.kv_caches:
            for src, dst in pairs:
                cache[:, dst].copy_(cache[:, src])

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata, list[int]]:
        """``(input_ids, positions, common metadata, query lens)`` of the step, in the
        input batch's (reordered) row order."""
        batch = self.input_batch
        batch.update(out.requests)
        threshold = self.builder.reorder_batch_threshold
        if threshold is not None:
            reorder_batch_decodes_first(batch, out.num_scheduled_tokens, threshold)
        reqs = batch.requests
        query_lens = [out.num_scheduled_tokens[r.req_id] for r in reqs]
        seq_lens = [r.num_computed_tokens + q for r, q in zip(reqs, query_lens)]
        ids: list[int] = []
        for r, q in zip(reqs, query_lens):
            ids.extend(r.token_ids(r.num_computed_tokens, r.num_computed_tokens + q))
        new_tokens = new_token_positions(query_lens, seq_lens)
        n = len(reqs)
        cols = max(1, int(batch.num_blocks[:n].max()))
        table = batch.block_table[:n, :cols]
        block_table = torch.from_numpy(table)
        slot_mapping = slot_mapping_for_new_tokens(table, query_lens, seq_lens, self.block_size,
                                                   new_tokens)
        positions = new_tokens[1]
        qsl = query_start_loc(query_lens)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=n, num_actual_tokens=len(ids), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), block_table_tensor=block_table,
            slot_mapping=slot_mapping, causal=True)
        return torch.tensor(ids, dtype=torch.long), positions, common, query_lens

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict]:
        """Run one step on the thread count ``self.threads`` chooses for it (the attention
        plan records that count); returns the token sampled for each request that got one,
        and the logprobs (``sampler.TokenLogprobs``) of those that asked for them."""
        with self.threads.step():
            return self._execute(out)

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict]:
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        input_ids, positions, common, query_lens = self.prepare(out)
        attn_metadata = self.builder.build(0, common)
        reqs = self.input_batch.requests
        qsl = common.query_start_loc_cpu.tolist()
        rows, sampled_reqs = [], []
        for i, (r, q) in enumerate(zip(reqs, query_lens)):
            if r.num_computed_tokens + q == r.num_tokens:
                rows.append(qsl[i + 1] - 1)
                sampled_reqs.append(r)
        # Only the sampled rows leave the last layer's attention (a partial prefill's none).
        hidden = self.model.forward(input_ids, positions, self.kv_caches, attn_metadata,
                                 torch.tensor(rows, dtype=torch.long))
        if not rows:
            return {}, {}
        logits = self.model.compute_logits(hidden).float()
        result: SamplerOutput = sample(logits, sampled_reqs,
                                       [self._generator(r) for r in sampled_reqs])
        tokens = {r.req_id: t for r, t in zip(sampled_reqs, result.tokens)}
        logprobs = {r.req_id: lp for r, lp in zip(sampled_reqs, result.logprobs) if lp is not None}
        return tokens, logprobs
