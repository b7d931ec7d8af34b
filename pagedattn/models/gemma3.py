"""Gemma 3 (text) on paged attention: the built-in ``gemma3`` (Gemma 3 270M).

What differs from the Llama family, all in this file:

* interleaved attention: five sliding-window layers (window ``sliding_window``) then one
  global layer, repeated; each kind has its own RoPE base (local 10,000, global from the
  config). The windows live in the attention impls the engine injects, one per layer;
* Gemma's RMSNorm ``x * (1 + w)`` computed in fp32, on q and k too (per head), and four
  norms per layer: before and after attention, before and after the MLP;
* a GELU-tanh gated MLP, embeddings scaled by ``sqrt(hidden)`` rounded to the model dtype,
  the attention scale ``query_pre_attn_scalar ** -0.5``, optional logit soft caps.

The forward takes the step's flattened tokens and returns ``[T, hidden]``, as
:mod:`pagedattn.models.llama` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn import ops
from pagedattn.models.layers import (PagedAttention, RMSNorm, RotaryEmbedding, gate_up_linear,
                                     gated_projection, keep_rows, native_dtypes)
from pagedattn.models.loader import CheckpointNames, decoder_names, load_weights
from pagedattn.models.native_stack import NativeStep

GEMMA3_MODEL_TYPES = ("gemma3_text",)
SLIDING, FULL = "sliding_attention", "full_attention"

# The Gemma 3 definition's constants, for configs (a GGUF's metadata) that do not carry
# them; the same defaults as transformers' Gemma3TextConfig.
GEMMA3_DEFAULTS: dict[str, Any] = {
    "sliding_window_pattern": 6,  # every sixth layer is global
    "rope_local_base_freq": 10000.0,
    "rope_theta": 1000000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
}
ALLOWED_DTYPES = ("bfloat16", "float32")
"""float16 is refused: Gemma's activations leave fp16's range."""


def _rope_theta(cfg: dict[str, Any], layer_type: str) -> float:
    params = (cfg.get("rope_parameters") or {}).get(layer_type)
    if isinstance(params, dict):  # transformers 5's per-layer-type form
        kind = params.get("rope_type", "default")
        if kind != "default":
            raise NotImplementedError(f"Gemma 3 rope_type {kind!r} for {layer_type} layers is "
                                      "not supported (only 'default' RoPE)")
        return float(params["rope_theta"])
    if layer_type == FULL:
        scaling = cfg.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise NotImplementedError(f"rope_scaling {scaling!r} is not supported")
        return float(cfg.get("rope_theta", GEMMA3_DEFAULTS["rope_theta"]))
    return float(cfg.get("rope_local_base_freq", GEMMA3_DEFAULTS["rope_local_base_freq"]))


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    """RoPE base of the global (full-attention) layers."""
    rope_local_theta: float
    """RoPE base of the sliding-window layers."""
    max_position_embeddings: int
    sliding_window: int
    layer_types: tuple[str, ...]
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = "gemma3_text"

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (``None`` = full attention)."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    @property
    def attn_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma3Config":
        """From a Hugging Face ``gemma3_text`` config dict (transformers 4 or 5 layout), or
        the fields a GGUF holds: what it lacks comes from :data:`GEMMA3_DEFAULTS`."""
        if cfg.get("model_type") not in GEMMA3_MODEL_TYPES:
            raise NotImplementedError(f"model_type {cfg.get('model_type')!r} is not Gemma 3 text "
                                      f"({', '.join(GEMMA3_MODEL_TYPES)})")
        d = {**GEMMA3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or
                                    k.endswith("softcapping")}}
        if d["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"Gemma 3 hidden_activation {d['hidden_activation']!r} is "
                                      "not supported (gelu_pytorch_tanh only)")
        if cfg.get("use_bidirectional_attention"):
            raise NotImplementedError("Gemma 3 with use_bidirectional_attention=True is not supported")
        layers = d["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:
            pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern",
                                                                d["sliding_window_pattern"]))
            types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
        if len(types) != layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {layers} layers as {SLIDING!r} or {FULL!r}, "
                             f"got {types!r}")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d["rms_norm_eps"]),
            rope_theta=_rope_theta(d, FULL),
            rope_local_theta=_rope_theta(d, SLIDING),
            max_position_embeddings=d["max_position_embeddings"],
            sliding_window=int(d["sliding_window"]),
            layer_types=tuple(types),
            query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            attention_bias=bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``normalise(x) * (1 + w)``, all in fp32, then back to ``x``'s dtype
    (Llama's casts before the weight; Gemma's after). The weight is Hugging Face's ``w``
    (zero = identity). Called with a residual, it first adds ``x`` into it and returns
    ``(normed, residual)``, as :class:`pagedattn.models.layers.RMSNorm` does. Any leading
    shape: the norm is over the last dimension.

    ``act_dtype`` bf16 (bf16 activations around an fp32 residual stream): the native op
    takes fp32 or bf16 ``x`` and writes bf16, rounded once."""

    identity_weight = 0.0

    def scale(self) -> torch.Tensor:
        """``1 + w`` in fp32 (a few hundred floats: computed per call, never stale)."""
        return 1.0 + self.weight.detach().float()

    def _native_dtype(self, x: torch.Tensor) -> bool:
        return x.dtype in self.native_dtypes and ops.native_available()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if self._native_dtype(x) and residual.dtype == torch.float32 and x.dim() == 2 \
                    and x.is_contiguous() and residual.is_contiguous():
                return (ops.fused_add_rms_norm(x, residual, self.scale(), self.eps,
                                               self.out_dtype), residual)
            residual = residual + x
            return self.forward(residual), residual
        if self._native_dtype(x):
            flat = x.reshape(-1, x.shape[-1])
            return ops.rms_norm(flat.contiguous(), self.scale(), self.eps,
                                self.out_dtype).view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.scale()).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor,
                      native: frozenset[torch.dtype] = frozenset({torch.float32})) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of a fused gate/up projection ``[T, 2 d]``; on the native op
    for the dtypes in ``native`` (see :func:`pagedattn.models.layers.native_dtypes`)."""
    if x.dim() == 2 and x.dtype in native and ops.native_available():
        return ops.gelu_tanh_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up  # Hugging Face's order and roundings


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_type: str, attn_impl,
                 attn_dtype: torch.dtype | None = None, act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, act_dtype)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, eps, act_dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, eps, act_dtype)
        self.attn = PagedAttention(attn_impl, attn_dtype)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, act_dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, act_dtype)
        self.gate_up_proj = gate_up_linear(cfg.hidden_size, 2 * cfg.intermediate_size, "gelu_tanh")
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, act_dtype)
        self.mlp_native_dtypes = native_dtypes(act_dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, attn_metadata,
                output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` after the layer: ``x`` is the MLP's output after its post-norm,
        not yet added to the residual stream (the next layer's first norm adds it).
        ``output_rows``: only those rows go on past attention (see :func:`keep_rows`)."""
        t = x.shape[0]
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        q, k = rotary(positions, q, k)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        attn = self.attn(q, k, v, kv_cache, attn_metadata).view(t, self.q_size)
        attn, residual = keep_rows(output_rows, attn, residual)
        h = self.post_attention_layernorm(self.o_proj(attn))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h = self.down_proj(gated_projection(
            self.gate_up_proj, h, "gelu_tanh",
            lambda gate_up: gelu_tanh_and_mul(gate_up, self.mlp_native_dtypes)))
        return self.post_feedforward_layernorm(h), residual


class Gemma3ForCausalLM(NativeStep, nn.Module):
    """``attn_impls``: one impl per layer, each built with its layer's window
    (:attr:`Gemma3Config.layer_windows`) and the scale :attr:`Gemma3Config.attn_scale`.
    ``dtype``: the model dtype, which the embedding scale is rounded to (as Gemma's
    reference code and transformers do: ``sqrt(640)`` is 25.25 in bf16). Steps run on one
    native op where it serves them (:class:`NativeStep`)."""

    def __init__(self, cfg: Gemma3Config, attn_impls: list, attn_dtype: torch.dtype | None = None,
                 dtype: torch.dtype = torch.float32, act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if len(attn_impls) != cfg.num_layers:
            raise ValueError(f"got {len(attn_impls)} attention impls for {cfg.num_layers} layers")
        self.config = cfg
        self.act_dtype = act_dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype).float()
        self.register_buffer("embed_scale", scale, persistent=False)
        self.rotary = nn.ModuleDict({
            FULL: RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                                  act_dtype),
            SLIDING: RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta,
                                     cfg.max_position_embeddings, act_dtype)})
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, kind, impl, attn_dtype, act_dtype)
                                    for kind, impl in zip(cfg.layer_types, attn_impls))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, act_dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states ``[T, hidden]``, or of ``output_rows`` only (see
        :func:`keep_rows`)."""
        x, residual = self.embed(input_ids), None
        hidden = self.native_forward(x, positions, kv_caches, attn_metadata, output_rows)
        if hidden is not None:
            return hidden
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(positions, x, residual, self.rotary[layer.layer_type], kv_cache,
                                attn_metadata, output_rows if i == last else None)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def checkpoint_names(self) -> CheckpointNames:
        """The Hugging Face names (``model.layers.N.self_attn.q_proj.weight``, ...): q/k/v
        and gate/up packed into the fused projections, the q/k norms kept per layer."""
        cfg = self.config
        return decoder_names(cfg.model_type, cfg.num_heads * cfg.head_dim,
                             cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size,
                             cfg.tie_word_embeddings,
                             extra_modules=("self_attn.q_norm", "self_attn.k_norm"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (:func:`pagedattn.models.loader.load_weights`);
        every parameter must be set exactly once."""
        load_weights(self, weights, self.checkpoint_names())
