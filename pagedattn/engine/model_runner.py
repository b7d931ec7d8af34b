"""The model runner: turns a scheduler step into one forward pass and sampled tokens.

Per step: sync the persistent input batch with the scheduled requests, let the attention
builder's threshold put decodes first, derive positions, block table and slot mapping
through ``pagedattn.paging``, build ``CommonAttentionMetadata`` and from it the backend
metadata (once), run the model (every layer's impl reads that same metadata), sample
the requests whose last known token was computed.
"""

from __future__ import annotations

import torch

from pagedattn.backend import AttentionType, CommonAttentionMetadata
from pagedattn.config import CacheConfig, EngineConfig, ModelConfig
from pagedattn.engine.input_batch import InputBatch
from pagedattn.engine.request import Request
from pagedattn.engine.sampler import sample
from pagedattn.engine.scheduler import SchedulerOutput
from pagedattn.kv_cache_spec import AttentionSpec, EncoderOnlyAttentionSpec
from pagedattn.paging import (
    PAD_SLOT_ID,
    cdiv,
    new_token_positions,
    reorder_batch_decodes_first,
    slot_mapping_for_new_tokens,
)


def make_attention(backend_cls, *, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, block_size: int, max_model_len: int,
                   sliding_window: int | None, attn_type: str):
    """``(builder, impls)``: one metadata builder for all layers, one impl per layer."""
    spec_cls = EncoderOnlyAttentionSpec if attn_type == AttentionType.ENCODER_ONLY else AttentionSpec
    spec = spec_cls(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_dim,
                    dtype=dtype, sliding_window=sliding_window)
    config = EngineConfig(
        model_config=ModelConfig(dtype=dtype, num_attention_heads=num_heads,
                                 num_kv_heads=num_kv_heads, head_size=head_dim,
                                 max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=block_size))
    names = [f"layers.{i}.attn" for i in range(num_layers)]
    builder = backend_cls.get_builder_cls()(spec, names, config, torch.device("cpu"))
    impls = [backend_cls.get_impl_cls()(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                        None, sliding_window, "auto", attn_type=attn_type)
             for _ in range(num_layers)]
    return builder, impls


class ModelRunner:
    def __init__(self, model, builder, backend_cls, *, num_blocks: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, kv_dtype: torch.dtype,
                 seed: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.builder = builder
        self.block_size = block_size
        shape = backend_cls.get_kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(cfg.num_layers)]
        self.input_batch = InputBatch(max_num_seqs, cdiv(max_model_len, block_size))
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}
        self.forward_fn = model.forward

    def _generator(self, req: Request) -> torch.Generator | None:
        sp = req.sampling_params
        if sp.greedy:
            return None
        gen = self.generators.get(req.req_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(sp.seed if sp.seed is not None else hash((self.seed, req.req_id)) & (2**63 - 1))
            self.generators[req.req_id] = gen
        return gen

    def forget(self, req_id: str) -> None:
        self.generators.pop(req_id, None)

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
        _, positions = new_token_positions(query_lens, seq_lens)
        n = len(reqs)
        cols = max(1, int(batch.num_blocks[:n].max()))
        block_table = torch.from_numpy(batch.block_table[:n, :cols])
        slot_mapping = slot_mapping_for_new_tokens(block_table, query_lens, seq_lens, self.block_size)
        qsl = torch.zeros(n + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=n, num_actual_tokens=len(ids), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), block_table_tensor=block_table,
            slot_mapping=slot_mapping, causal=True)
        return torch.tensor(ids, dtype=torch.long), positions, common, query_lens

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns the token sampled for each request that got one."""
        input_ids, positions, common, query_lens = self.prepare(out)
        attn_metadata = self.builder.build(0, common)
        hidden = self.forward_fn(input_ids, positions, self.kv_caches, attn_metadata)
        reqs = self.input_batch.requests
        qsl = common.query_start_loc_cpu.tolist()
        rows, sampled_reqs = [], []
        for i, (r, q) in enumerate(zip(reqs, query_lens)):
            if r.num_computed_tokens + q == r.num_tokens:
                rows.append(qsl[i + 1] - 1)
                sampled_reqs.append(r)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[rows]).float()
        tokens = sample(logits, [r.sampling_params for r in sampled_reqs],
                        [self._generator(r) for r in sampled_reqs])
        return {r.req_id: t for r, t in zip(sampled_reqs, tokens)}


def encoder_metadata(seq_lens: list[int]) -> CommonAttentionMetadata:
    """A bidirectional batch of whole sequences with no cache (no slot is written)."""
    n = len(seq_lens)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    total = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=n,
        num_actual_tokens=total, max_query_len=max(seq_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros((n, 1), dtype=torch.int32),
        slot_mapping=torch.full((total,), PAD_SLOT_ID, dtype=torch.int64), causal=False)
