"""From :class:`EngineArgs` to a ready model: checkpoint, tokenizer, architecture, the
attention stack, the weights, the linear layers' form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from pagedattn.backend import AttentionType
from pagedattn.engine.args import EngineArgs
from pagedattn.engine.attention import AttentionGeometry, AttentionStack, build_attention
from pagedattn.models.bert import BertConfig, BertModel
from pagedattn.models.layers import pack_linear_layers
from pagedattn.models.linear_paths import install_linear_paths
from pagedattn.models.llama import LlamaConfig, LlamaForCausalLM
from pagedattn.models.loader import load_checkpoint, load_tokenizer, resolve_model


@dataclass(frozen=True)
class LoadedModel:
    config: Any  # LlamaConfig or BertConfig
    model: nn.Module
    tokenizer: Any  # a transformers tokenizer, or None (skip_tokenizer_init)
    attention: AttentionStack
    max_model_len: int
    linear_plan: Any = None
    """``linear_impl="auto"``: the measured path of each layer shape and row bucket."""

    @property
    def is_encoder(self) -> bool:
        return isinstance(self.config, BertConfig)


def _max_model_len(args: EngineArgs, limit: int) -> int:
    if args.max_model_len is None:
        return limit
    if args.max_model_len > limit:
        raise ValueError(f"max_model_len must be an int in [1, {limit}] (the model's "
                         f"context), got {args.max_model_len!r}")
    return args.max_model_len


def load_model(args: EngineArgs) -> LoadedModel:
    ckpt = load_checkpoint(resolve_model(args.model), need_tokenizer=not args.skip_tokenizer_init)
    is_encoder = ckpt.config.get("model_type") == "bert"
    if is_encoder:
        cfg = BertConfig.from_hf(ckpt.config)
        geo = AttentionGeometry(cfg.num_layers, cfg.num_heads, cfg.num_heads, cfg.head_dim,
                                None, AttentionType.ENCODER_ONLY)
        model_cls = BertModel
    else:
        cfg = LlamaConfig.from_hf(ckpt.config)
        geo = AttentionGeometry(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                cfg.sliding_window, AttentionType.DECODER)
        model_cls = LlamaForCausalLM
    max_model_len = _max_model_len(args, cfg.max_position_embeddings)
    attention = build_attention(args, geo, max_model_len)
    attn_dtype = args.dtype if args.linear_dtype != args.dtype else None
    net = model_cls(cfg, attention.impls, attn_dtype)
    net.load_weights(ckpt.weights())
    net = net.to(args.linear_dtype).eval()
    plan = None
    if args.linear_impl == "packed":
        pack_linear_layers(net, args.dtype)
    elif args.linear_impl == "auto":
        plan = install_linear_paths(net, args.dtype)
    return LoadedModel(cfg, net, load_tokenizer(ckpt), attention, max_model_len, plan)
