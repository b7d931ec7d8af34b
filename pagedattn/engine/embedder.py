"""``Embedder``: an encoder-only model (BERT) turning texts into unit vectors.

No KV cache and no scheduler: each batch of whole sequences (under the token budget) is
one bidirectional forward pass, mean-pooled and L2-normalised.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedattn.backend import CommonAttentionMetadata
from pagedattn.engine.args import EngineArgs
from pagedattn.engine.inputs import check_text, check_token_ids, longest_token_chars
from pagedattn.engine.loading import LoadedModel
from pagedattn.models.bert import BertModel
from pagedattn.paging import PAD_SLOT_ID, query_start_loc


def encoder_metadata(seq_lens: list[int]) -> CommonAttentionMetadata:
    """A bidirectional batch of whole sequences with no cache (no slot is written)."""
    n = len(seq_lens)
    qsl = query_start_loc(seq_lens)
    total = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=n,
        num_actual_tokens=total, max_query_len=max(seq_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros((n, 1), dtype=torch.int32),
        slot_mapping=torch.full((total,), PAD_SLOT_ID, dtype=torch.int64), causal=False)


class Embedder:
    def __init__(self, loaded: LoadedModel, args: EngineArgs) -> None:
        if not loaded.is_encoder:
            raise ValueError("Embedder serves encoder-only models; this one is a decoder "
                             "(use LLMEngine)")
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.builder = loaded.attention.builder
        self.max_model_len = loaded.max_model_len
        self.max_num_batched_tokens = args.max_num_batched_tokens
        self._max_chars: int | None = None

    def token_ids(self, text: str | Sequence[int]) -> list[int]:
        """Checked token ids of one input: a text (truncated to the context) or a list of
        ids (each in the vocabulary, no more than the context)."""
        if isinstance(text, str):
            if self.tokenizer is None:
                raise ValueError("text inputs need a tokenizer; pass token-id lists")
            check_text(text, "input")
            if self._max_chars is None:
                self._max_chars = 2 * self.max_model_len * longest_token_chars(self.tokenizer)
            # Truncation keeps the first max_model_len tokens, and those come from the
            # text's head: the tail is never tokenized, however long the text.
            ids = self.tokenizer(text[:self._max_chars], truncation=True,
                                 max_length=self.max_model_len).input_ids
        else:
            ids = check_token_ids(text, self.model_config.vocab_size, "input")
            if len(ids) > self.max_model_len:
                raise ValueError(f"input of {len(ids)} tokens exceeds max_model_len={self.max_model_len}")
        if not ids:
            raise ValueError("cannot embed an empty input")
        return ids

    @torch.inference_mode()
    def embed(self, texts: str | Sequence[str] | Sequence[Sequence[int]]) -> torch.Tensor:
        """``[n, hidden]`` float32 unit vectors, one per text (or token-id list)."""
        if isinstance(texts, str):
            texts = [texts]
        seqs = [self.token_ids(t) for t in texts]
        out, batch = [], []
        for ids in seqs + [None]:
            if batch and (ids is None or sum(map(len, batch)) + len(ids) > self.max_num_batched_tokens):
                out.append(self._embed_batch(batch))
                batch = []
            if ids is not None:
                batch.append(ids)
        return torch.cat(out) if out else torch.zeros(0, self.model_config.hidden_size)

    def _embed_batch(self, batch: list[list[int]]) -> torch.Tensor:
        lens = [len(b) for b in batch]
        common = encoder_metadata(lens)
        input_ids = torch.tensor([t for b in batch for t in b], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lens])
        hidden = self.model(input_ids, positions, self.builder.build(0, common))
        return BertModel.mean_pool(hidden, common.query_start_loc_cpu.tolist())
