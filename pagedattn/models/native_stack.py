"""A decoder's step in one native op (``ops.decoder_stack``): every layer, then the final
norm, with no Python between the ops. It runs the Llama family and Gemma 3.

The Python layer loop (:class:`pagedattn.models.llama.LlamaDecoderLayer`,
:class:`pagedattn.models.gemma3.Gemma3DecoderLayer`) spends much of a
decode step between kernels: per op an interpreter frame, a dispatcher call and an
allocation, a dozen ops per layer, while the other threads spin waiting for the next
parallel region. The native op runs the same kernels, with the same arguments, in the same
order, so its result is the Python loop's bit for bit (tests/test_native_stack.py).

This module decides, once per model and once per step, whether the op serves the step,
and resolves the step's arguments: each linear layer's path for the step's row count
(:class:`MeasuredLinear`'s measured choice) and each layer's attention scalars (the
backend's :meth:`direct_call`). Anything else runs the Python loop: other linear or
attention backends, ALiBi or sinks, uncalibrated fp8
scales, or models loaded without the native extension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedattn import ops
from pagedattn.models.layers import PackedLinear, fusable
from pagedattn.models.linear_paths import (LinearPath, MeasuredLinear, choices_generation,
                                           row_bucket)

PATH_CODES = {LinearPath.PACKED: 0, LinearPath.DPBF16: 1, LinearPath.TORCH: 2,
              LinearPath.ONEDNN: 3, LinearPath.AMX: 5}
PACKED_GATED = 4
"""The packed path's fused gate/up projection and activation (``ops.packed_gated_linear``)."""
AMX_GATED = 6
"""The amx path's (``ops.packed_gated_linear_amx``)."""


@dataclass(frozen=True)
class StackLayout:
    """What the native op reads of a model that it can run, found once."""

    style: str
    """``"llama"`` or ``"gemma3"`` (``ops.DECODER_STACK_STYLES``)."""
    act_dtype: torch.dtype
    attn_dtype: torch.dtype
    """Attention's dtype: ``act_dtype``, or bf16 under fp32 activations."""
    linears: tuple[tuple[MeasuredLinear | PackedLinear, ...], ...]
    """Per layer: qkv, o, gate_up, down."""
    norm_weights: tuple[torch.Tensor, ...]
    """Per layer (Llama: input, post-attention; Gemma 3, its ``1 + w`` scales: input, q, k,
    post-attention, pre- and post-feedforward), then the final norm's."""
    cos_sin: tuple[torch.Tensor, ...]
    """Per layer: its rotary table."""
    out_features: tuple[int, ...]
    eps: float
    gate_fusable: bool
    """Whether the gate/up projection's packed path fuses its activation (:func:`fusable`)."""
    linear_args: dict = field(default_factory=dict, compare=False, repr=False)
    """The op's (weights, biases, path codes) resolved per (rows' bucket, output rows'
    bucket, :func:`choices_generation`): a decode step's 120 paths and weights are looked
    up once, not per step."""

    def resolved_linears(self, rows: int, last_rows: int) -> tuple[list, list, list[int]]:
        """Each linear layer's weight, bias and path code for a step of ``rows`` rows whose
        last layer's o, gate/up and down projections run ``last_rows`` rows."""
        key = (row_bucket(rows), row_bucket(last_rows), choices_generation())
        found = self.linear_args.get(key)
        if found is None:
            found = self.linear_args[key] = self._resolve_linears(rows, last_rows)
            for stale in [k for k in self.linear_args if k[2] != key[2]]:
                del self.linear_args[stale]
        return found

    def _resolve_linears(self, rows: int, last_rows: int) -> tuple[list, list, list[int]]:
        weights, biases, paths = [], [], []
        fused = {LinearPath.PACKED: PACKED_GATED, LinearPath.AMX: AMX_GATED}
        for i, four in enumerate(self.linears):
            for which, lin in enumerate(four):
                n = last_rows if i == len(self.linears) - 1 and which > 0 else rows
                path, weight = _path_and_weight(lin, n)
                weights.append(weight)
                biases.append(lin.bias)
                paths.append(fused[path] if which == 2 and path in fused and self.gate_fusable
                             else PATH_CODES[path])
        return weights, biases, paths


def _norms(model, layer) -> tuple[str, list] | str:
    """The layer's style and its norms' weights as the op takes them, or why it has none."""
    if hasattr(layer, "q_norm"):  # Gemma 3: (1 + w), computed once here
        names = ("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm",
                 "pre_feedforward_layernorm", "post_feedforward_layernorm")
        return "gemma3", [getattr(layer, n).scale() for n in names]
    if hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm"):
        return "llama", [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return f"no native step op for {type(layer).__name__}"


def layout(model) -> StackLayout | str:
    """The model's :class:`StackLayout`, or why the native op cannot run it."""
    if not ops.native_available():
        return "the native extension is not loaded"
    act = getattr(model, "act_dtype", None) or torch.float32
    if act not in (torch.float32, torch.bfloat16):
        return f"activations are {act}"
    linears, norms, tables, styles = [], [], [], set()
    for i, layer in enumerate(model.layers):
        found = _norms(model, layer)
        if isinstance(found, str):
            return found
        styles.add(found[0])
        norms += found[1]
        four = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        for lin in four:
            if not _runs(lin, act):
                return (f"layer {i}: {type(lin).__name__} is neither a MeasuredLinear with "
                        f"{act} activations nor a PackedLinear under float32 ones")
        impl = layer.attn.impl
        if not hasattr(impl, "direct_call"):
            return f"layer {i}: attention runs {type(impl).__name__}, not the native kernel"
        linears.append(four)
        rotary = model.rotary[layer.layer_type] if hasattr(layer, "layer_type") else model.rotary
        tables.append(rotary.cos_sin)
    style = styles.pop()
    norms.append(model.norm.scale() if style == "gemma3" else model.norm.weight)
    if any(w.dtype != torch.float32 for w in norms + tables):
        return "norm weights or rotary tables are not float32"
    if model.embed_tokens.weight.dtype != torch.float32:
        return "the embedding is not float32"
    out_features = tuple(lin.out_features for lin in linears[0])
    attn_dtypes = {layer.attn.attn_dtype or act for layer in model.layers}
    if len(attn_dtypes) != 1:
        return f"layers differ in their attention dtypes: {attn_dtypes}"
    return StackLayout(style, act, attn_dtypes.pop(), tuple(linears), tuple(norms),
                       tuple(tables), out_features, model.config.rms_norm_eps,
                       fusable(torch.empty(0, 0, dtype=act), out_features[2]))


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
    # the last layer's o, gate/up and down projections run on the output rows only
    last_rows = rows if output_rows is None else output_rows.shape[0]
    weights, biases, paths = stack.resolved_linears(rows, last_rows)
    md = attn_metadata
    cfg = model.config
    return ops.decoder_stack(
        stack.style, x, positions, list(stack.cos_sin), list(stack.norm_weights), weights,
        biases, paths,
        list(stack.out_features), kv_caches, md.slot_mapping, md.query_start_loc, md.seq_lens,
        md.block_table, md.scheduler_metadata, md.causal, scalars, windows, output_rows,
        cfg.num_heads, cfg.num_kv_heads, stack.eps, stack.act_dtype, stack.attn_dtype)


class NativeStep:
    """Mixin of the decoder models the op runs: a switch, and their layout, found on first
    use (the linear layers and weights are final by then)."""

    native_stack: bool = True
    """Run steps on ``ops.decoder_stack`` where it serves them; False: always the Python
    layer loop."""
    _stack_layout: StackLayout | str | None = None

    def stack_layout(self) -> StackLayout | str:
        """What the op reads of this model, or why it cannot run it."""
        if self._stack_layout is None:
            self._stack_layout = layout(self)
        return self._stack_layout

    def native_forward(self, x: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], attn_metadata,
                       output_rows: torch.Tensor | None) -> torch.Tensor | None:
        """The step's final hidden states from the op, or None: run the Python loop."""
        if not self.native_stack:
            return None
        return forward(self, self.stack_layout(), x, positions, kv_caches, attn_metadata,
                       output_rows)


def describe(model) -> str:
    """Which loop runs the model's layers, for ``--verbose`` and ``info``."""
    stack_layout = getattr(model, "stack_layout", None)
    if stack_layout is None:
        return f"layers in Python (no native step op for {type(model).__name__})"
    if not model.native_stack:
        return "layers in Python (native step off)"
    found = stack_layout()
    if isinstance(found, str):
        return f"layers in Python ({found})"
    return "layers in one native op per step (Python where a step needs it)"
