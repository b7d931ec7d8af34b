"""A BERT encoder on the backend's encoder-only attention (bidirectional, no KV cache),
with the sentence-transformers pooling of all-MiniLM: mean over tokens, L2-normalised."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.models.loader import CheckpointNames, load_weights
from pagedattn.models.layers import PagedAttention


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "BertConfig":
        if cfg.get("model_type") != "bert":
            raise NotImplementedError(f"model_type {cfg.get('model_type')!r} is not a BERT encoder")
        act = cfg.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "relu"):
            raise NotImplementedError(f"hidden_act {act!r} is not supported; use gelu, gelu_new or relu")
        return cls(cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"],
                   cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["max_position_embeddings"], cfg.get("type_vocab_size", 2),
                   cfg.get("layer_norm_eps", 1e-12), act)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, attn_impl, attn_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(h, 3 * h)
        self.attn = PagedAttention(attn_impl, attn_dtype)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(h, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, h)
        self.output_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = {"gelu": F.gelu, "relu": F.relu,
                    "gelu_new": lambda x: F.gelu(x, approximate="tanh")}[cfg.hidden_act]

    def forward(self, x: torch.Tensor, attn_metadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        attn = self.attn(q.contiguous(), k.contiguous(), v.contiguous(), torch.empty(0),
                         attn_metadata)
        x = self.attn_norm(x + self.attn_out(attn.reshape(t, -1)))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig, attn_impls: list, attn_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg, impl, attn_dtype) for impl in attn_impls)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings.weight[0])
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, attn_metadata)
        return x

    @staticmethod
    def mean_pool(hidden: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        """``[num_seqs, hidden]`` unit vectors: each sequence's mean token state."""
        pooled = torch.stack([hidden[a:b].float().mean(0)
                              for a, b in zip(query_start_loc[:-1], query_start_loc[1:])])
        return F.normalize(pooled, dim=-1)

    def checkpoint_names(self) -> CheckpointNames:
        """The Hugging Face BERT names: query/key/value packed into ``qkv``, the pooler
        and the position-id buffer skipped."""
        h = self.config.hidden_size
        embeddings = ("word_embeddings", "position_embeddings", "token_type_embeddings")
        return CheckpointNames(
            model_name="the BERT encoder", prefix="bert.",
            skip=lambda name: name.startswith("pooler.") or name.endswith("position_ids"),
            layers=("encoder.layer", "layers"),
            modules={"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                     "intermediate.dense": "intermediate", "output.dense": "output",
                     "output.LayerNorm": "output_norm"},
            packed={"attention.self.query": ("qkv", 0), "attention.self.key": ("qkv", 1),
                    "attention.self.value": ("qkv", 2)},
            shards={"qkv": (h, h, h)},
            top={"embeddings.LayerNorm": "embed_norm",
                 **{f"embeddings.{e}": e for e in embeddings}})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (:func:`pagedattn.models.loader.load_weights`)."""
        load_weights(self, weights, self.checkpoint_names())
