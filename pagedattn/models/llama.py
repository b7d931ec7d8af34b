"""The Llama family on paged attention: Llama (SmolLM2 included), Mistral (sliding
window) and Qwen2 (bias on the QKV projection). One class: the differences are config.

The forward takes the step's flattened tokens (``[T]`` ids and positions of all
requests together), the per-layer KV caches and the backend metadata built once for
the step; it returns ``[T, hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.models.loader import CheckpointNames, decoder_names, load_weights
from pagedattn.models.native_stack import NativeStep
from pagedattn.models.layers import (PagedAttention, RMSNorm, RotaryEmbedding, gate_up_linear,
                                     gated_projection, keep_rows, native_dtypes, silu_and_mul)

DECODER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        model_type = cfg.get("model_type")
        if model_type not in DECODER_ARCHITECTURES:
            raise NotImplementedError(
                f"model_type {model_type!r} is not supported; decoders: "
                f"{', '.join(DECODER_ARCHITECTURES)} (and 'bert' for embeddings)")
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise NotImplementedError(f"rope_scaling {rope_scaling!r} is not supported")
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        window = None
        if model_type == "mistral":
            window = cfg.get("sliding_window")
        elif model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise NotImplementedError("Qwen2 with use_sliding_window=True is not supported")
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, attn_impl, attn_dtype: torch.dtype | None = None,
                 act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.native_dtypes = native_dtypes(act_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, act_dtype)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.attn = PagedAttention(attn_impl, attn_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, act_dtype)
        self.gate_up_proj = gate_up_linear(cfg.hidden_size, 2 * cfg.intermediate_size, "silu")
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, attn_metadata,
                output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` after the layer; the next layer (or the final norm) adds them.
        ``output_rows``: only those rows go on past attention (see :func:`keep_rows`)."""
        t = x.shape[0]
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotary(positions, q.view(t, self.num_heads, self.head_dim),
                      k.view(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        attn = self.attn(q, k, v, kv_cache, attn_metadata).view(t, self.q_size)
        attn, residual = keep_rows(output_rows, attn, residual)
        h, residual = self.post_attention_layernorm(self.o_proj(attn), residual)
        act = gated_projection(self.gate_up_proj, h, "silu",
                               lambda gate_up: silu_and_mul(gate_up, self.native_dtypes))
        return self.down_proj(act), residual


class LlamaForCausalLM(NativeStep, nn.Module):
    """``act_dtype``: bf16 runs the linear layers, RoPE and attention on bf16 activations
    around an fp32 residual stream (the norms widen, add and round once); None keeps every
    activation in the parameters' dtype. Steps run on one native op where it serves them
    (:class:`NativeStep`)."""

    def __init__(self, cfg: LlamaConfig, attn_impls: list, attn_dtype: torch.dtype | None = None,
                 act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.act_dtype = act_dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                                      act_dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, impl, attn_dtype, act_dtype)
                                    for impl in attn_impls)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, act_dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states ``[T, hidden]``, or of ``output_rows`` only (the rows
        the caller samples): the last layer then skips the rest's MLP (see
        :func:`keep_rows`)."""
        x, residual = self.embed_tokens(input_ids), None
        hidden = self.native_forward(x, positions, kv_caches, attn_metadata, output_rows)
        if hidden is not None:
            return hidden
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(positions, x, residual, self.rotary, kv_cache, attn_metadata,
                                output_rows if i == last else None)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_names(self) -> CheckpointNames:
        """The Hugging Face names, q/k/v and gate/up packed into the fused projections."""
        cfg = self.config
        return decoder_names(cfg.model_type, cfg.num_heads * cfg.head_dim,
                             cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size,
                             cfg.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (:func:`pagedattn.models.loader.load_weights`);
        every parameter must be set exactly once (a missing one raises naming it)."""
        load_weights(self, weights, self.checkpoint_names())
