"""A Llama-family decoder's step in one native op (``ops.llama_decoder_stack``): every
layer, then the final norm, with no Python between the ops.

The Python layer loop (:class:`pagedattn.models.llama.LlamaDecoderLayer`) spends much of a
decode step between kernels: per op an interpreter frame, a dispatcher call and an
allocation, a dozen ops per layer, while the other threads spin waiting for the next
parallel region. The native op runs the same kernels, with the same arguments, in the same
order, so its result is the Python loop's bit for bit (tests/test_native_stack.py).

This module decides, once per model and once per step, whether the op serves the step,
and resolves the step's arguments: each linear layer's path for the step's row count
(:class:`MeasuredLinear`'s measured choice) and each layer's attention scalars (the
backend's :meth:`direct_call`). Anything else runs the Python loop: other linear or
attention backends, a step with torch flash prefills, ALiBi or sinks, uncalibrated fp8
scales, or models loaded without the native extension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn import ops
from pagedattn.models.layers import PackedLinear, fusable
from pagedattn.models.linear_paths import LinearPath, MeasuredLinear

PATH_CODES = {LinearPath.PACKED: 0, LinearPath.DPBF16: 1, LinearPath.TORCH: 2,
              LinearPath.ONEDNN: 3}
PACKED_GATED_SILU = 4
"""The packed path's fused gate/up projection and SiLU (``ops.packed_gated_linear``)."""


@dataclass(frozen=True)
class StackLayout:
    """What the native op reads of a model that it can run, found once."""

    act_dtype: torch.dtype
    attn_dtype: torch.dtype
    """Attention's dtype: ``act_dtype``, or bf16 under fp32 activations."""
    linears: tuple[tuple[MeasuredLinear | PackedLinear, ...], ...]
    """Per layer: qkv, o, gate_up, down."""
    norm_weights: tuple[torch.Tensor, ...]
    """Per layer: input, post-attention; then the final norm's."""
    out_features: tuple[int, ...]
    eps: float
    gate_fusable: bool
    """Whether the gate/up projection's packed path fuses its SiLU (:func:`fusable`)."""


def layout(model) -> StackLayout | str:
    """The model's :class:`StackLayout`, or why the native op cannot run it."""
    if not ops.native_available():
        return "the native extension is not loaded"
    act = getattr(model, "act_dtype", None) or torch.float32
    if act not in (torch.float32, torch.bfloat16):
        return f"activations are {act}"
    cfg = model.config
    linears, norms = [], []
    for i, layer in enumerate(model.layers):
        four = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        for lin in four:
            if not _runs(lin, act):
                return (f"layer {i}: {type(lin).__name__} is neither a MeasuredLinear with "
                        f"{act} activations nor a PackedLinear under float32 ones")
        impl = layer.attn.impl
        if not hasattr(impl, "direct_call"):
            return f"layer {i}: attention runs {type(impl).__name__}, not the native kernel"
        linears.append(four)
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    norms.append(model.norm.weight)
    if any(w.dtype != torch.float32 for w in norms) or model.rotary.cos_sin.dtype != torch.float32:
        return "norm weights or the rotary table are not float32"
    if model.embed_tokens.weight.dtype != torch.float32:
        return "the embedding is not float32"
    out_features = tuple(lin.out_features for lin in linears[0])
    attn_dtypes = {layer.attn.attn_dtype or act for layer in model.layers}
    if len(attn_dtypes) != 1:
        return f"layers differ in their attention dtypes: {attn_dtypes}"
    return StackLayout(act, attn_dtypes.pop(), tuple(linears), tuple(norms), out_features,
                       cfg.rms_norm_eps, fusable(torch.empty(0, 0, dtype=act), out_features[2]))


def _runs(lin, act: torch.dtype) -> bool:
    """Whether the op runs linear layer ``lin`` as the model does with ``act`` activations."""
    if isinstance(lin, MeasuredLinear):
        return lin.act_dtype == act and lin.out_dtype == act
    return isinstance(lin, PackedLinear) and act == torch.float32


def _path_and_weight(lin, rows: int) -> tuple[LinearPath, torch.Tensor]:
    if isinstance(lin, PackedLinear):
        return LinearPath.PACKED, lin.packed_weight
    path = lin.path_for(rows)
    return path, lin.weight_for(path)


def forward(model, stack: StackLayout | str, x: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[torch.Tensor], attn_metadata,
            output_rows: torch.Tensor | None) -> torch.Tensor | None:
    """The model's final hidden states from the native op, or None when this step needs the
    Python loop (``x``, the embeddings, is then untouched)."""
    if isinstance(stack, str) or attn_metadata is None \
            or attn_metadata.num_actual_tokens != x.shape[0]:
        return None
    rows = x.shape[0]
    scalars, windows = [], []
    for layer, kv_cache in zip(model.layers, kv_caches):
        attn = layer.attn
        call = None if attn._calibrate_for is not None else \
            attn.impl.direct_call(attn, kv_cache, attn_metadata)
        if call is None:
            return None
        scalars += [call.scale, call.softcap, call.k_scale, call.v_scale]
        windows += [call.window_left, call.window_right]
    weights, biases, paths = [], [], []
    # the last layer's o, gate/up and down projections run on the output rows only
    last_rows = rows if output_rows is None else output_rows.shape[0]
    for i, four in enumerate(stack.linears):
        for which, lin in enumerate(four):
            n = last_rows if i == len(stack.linears) - 1 and which > 0 else rows
            path, weight = _path_and_weight(lin, n)
            weights.append(weight)
            biases.append(lin.bias)
            paths.append(PACKED_GATED_SILU if which == 2 and path is LinearPath.PACKED
                         and stack.gate_fusable else PATH_CODES[path])
    md = attn_metadata
    cfg = model.config
    return ops.llama_decoder_stack(
        x, positions, model.rotary.cos_sin, list(stack.norm_weights), weights, biases, paths,
        list(stack.out_features), kv_caches, md.slot_mapping, md.query_start_loc, md.seq_lens,
        md.block_table, md.scheduler_metadata, md.causal, scalars, windows, output_rows,
        cfg.num_heads, cfg.num_kv_heads, stack.eps, stack.act_dtype, stack.attn_dtype)


def describe(model) -> str:
    """Which loop runs the model's layers, for ``--verbose`` and ``info``."""
    stack_layout = getattr(model, "stack_layout", None)
    if stack_layout is None:
        return f"layers in Python (no native step op for {type(model).__name__})"
    if not model.native_stack:
        return "layers in Python (native step op turned off)"
    found = stack_layout()
    if isinstance(found, str):
        return f"layers in Python ({found})"
    return "layers in one native op per step (Python where a step needs it)"
