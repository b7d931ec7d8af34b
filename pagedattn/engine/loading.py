"""From :class:`EngineArgs` to a ready model: checkpoint, tokenizer, architecture, the
attention stack, the weights, the linear layers' form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedattn.backend import AttentionType
from pagedattn.engine import huge_pages
from pagedattn.engine.args import EngineArgs
from pagedattn.engine.attention import AttentionGeometry, AttentionStack, build_attention
from pagedattn.models.bert import BertConfig, BertModel
from pagedattn.models.gemma3 import ALLOWED_DTYPES, GEMMA3_MODEL_TYPES, Gemma3Config, Gemma3ForCausalLM
from pagedattn.models.layers import pack_linear_layers
from pagedattn.models.linear_paths import install_linear_paths
from pagedattn.models.llama import LlamaConfig, LlamaForCausalLM
from pagedattn.models.loader import load_checkpoint, load_tokenizer, resolve_model


@dataclass(frozen=True)
class LoadedModel:
    config: Any  # LlamaConfig, Gemma3Config or BertConfig
    model: nn.Module
    tokenizer: Any  # a transformers tokenizer, or None (skip_tokenizer_init)
    attention: AttentionStack
    max_model_len: int
    linear_plan: Any = None
    """``linear_impl="auto"``: the measured path of each layer shape and row bucket."""
    act_dtype: torch.dtype = torch.float32
    """The activations of the linear layers (:attr:`EngineArgs.linear_dtype`, or fp32 for
    a model without the bf16-activation form)."""
    weights_on_huge_pages: bool = False
    """The weights were moved to memory advised for huge pages (:mod:`huge_pages`)."""

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


def _refuse_fp16(args: EngineArgs) -> None:
    """Gemma's activations (its residual stream above all) leave float16's range."""
    if torch.float16 in (args.dtype, args.linear_dtype):
        raise ValueError(f"Gemma 3 does not run in float16 (its activations overflow "
                         f"fp16's range); dtype must be one of {', '.join(ALLOWED_DTYPES)}, "
                         f"got dtype={args.dtype}, linear_dtype={args.linear_dtype}")


def load_model(args: EngineArgs) -> LoadedModel:
    ckpt = load_checkpoint(resolve_model(args.model), need_tokenizer=not args.skip_tokenizer_init)
    model_type = ckpt.config.get("model_type")
    is_encoder = model_type == "bert"
    model_kwargs: dict[str, Any] = {}
    if is_encoder:
        cfg = BertConfig.from_hf(ckpt.config)
        geo = AttentionGeometry(cfg.num_layers, cfg.num_heads, cfg.num_heads, cfg.head_dim,
                                None, AttentionType.ENCODER_ONLY)
        model_cls = BertModel
    elif model_type in GEMMA3_MODEL_TYPES:
        cfg = Gemma3Config.from_hf(ckpt.config)
        _refuse_fp16(args)
        geo = AttentionGeometry(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                None, AttentionType.DECODER, layer_windows=cfg.layer_windows,
                                scale=cfg.attn_scale, logits_soft_cap=cfg.attn_logit_softcapping)
        model_cls = Gemma3ForCausalLM
        model_kwargs["dtype"] = args.dtype
    else:
        cfg = LlamaConfig.from_hf(ckpt.config)
        geo = AttentionGeometry(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                cfg.sliding_window, AttentionType.DECODER)
        model_cls = LlamaForCausalLM
    max_model_len = _max_model_len(args, cfg.max_position_embeddings)
    attention = build_attention(args, geo, max_model_len)
    act_dtype = _activation_dtype(args, model_cls)
    attn_dtype = args.dtype if act_dtype != args.dtype else None
    if model_cls is not BertModel and args.linear_impl != "torch":
        # the native paths' mixed form; linear_impl="torch" keeps Hugging Face's roundings
        model_kwargs["act_dtype"] = act_dtype
    net = model_cls(cfg, attention.impls, attn_dtype, **model_kwargs)
    net.load_weights(ckpt.weights())
    # the torch path runs every parameter in linear_dtype; the native paths keep fp32
    # parameters (norms, embeddings) and hold the linear weights in their own form
    net = net.to(args.linear_dtype if args.linear_impl == "torch" else torch.float32).eval()
    plan = None
    if args.linear_impl == "packed":
        pack_linear_layers(net, args.dtype)
    elif args.linear_impl == "auto":
        # batch-invariant: every row count on the packed kernel (its rows are independent
        # of the row count; the other paths' GEMMs block by it)
        plan = install_linear_paths(net, args.dtype, act_dtype=act_dtype,
                                    force="packed" if args.batch_invariant else None)
    if hasattr(net, "native_stack"):
        net.native_stack = args.native_step
    # last: the weights are in their final form (unchosen linear paths' copies freed)
    _, on_huge_pages = huge_pages.move_module(net, args.huge_pages)
    return LoadedModel(cfg, net, load_tokenizer(ckpt), attention, max_model_len, plan, act_dtype,
                       on_huge_pages)


def _activation_dtype(args: EngineArgs, model_cls) -> torch.dtype:
    """The activations' dtype: ``linear_dtype``, except that the encoder (BERT) has no
    bf16-activation form of the native paths and keeps fp32 there."""
    if args.linear_impl != "torch" and model_cls is BertModel:
        return torch.float32
    return args.linear_dtype
