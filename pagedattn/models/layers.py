"""Building blocks shared by the models: norms, rotary embedding, packed linear layers, and
the paged attention layer that hands one layer's Q/K/V to the selected backend's impl."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn import ops


def native_fp32(x: torch.Tensor) -> bool:
    """Whether the fused native layer ops serve ``x`` (fp32 activations, extension loaded);
    other dtypes take the torch code, which casts like Hugging Face's modules."""
    return x.dtype == torch.float32 and ops.native_available()


def native_dtypes(act_dtype: torch.dtype | None) -> frozenset[torch.dtype]:
    """The activation dtypes a layer sends to the native ops: fp32, and ``act_dtype`` when
    the model runs its linear layers on bf16 activations (an fp32 residual stream, every
    other tensor bf16). A whole-model bf16 run (``linear_impl="torch"``) keeps the torch
    code and its Hugging Face roundings."""
    return frozenset({torch.float32} | ({act_dtype} if act_dtype == torch.bfloat16 else set()))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, scale in the model dtype. Called with a residual,
    it first adds ``x`` into it (vLLM's fused form) and returns ``(normed, residual)``.

    ``act_dtype`` bf16 (bf16 activations around fp32 residuals): the native op takes fp32 or
    bf16 ``x`` and writes the normed rows in bf16, the input of the next linear layer."""

    identity_weight = 1.0
    """The weight that leaves normalised rows as they are (the checkpoint's convention)."""

    def __init__(self, dim: int, eps: float, act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), self.identity_weight))
        self.eps = eps
        self.native_dtypes = native_dtypes(act_dtype)
        self.out_dtype = act_dtype if act_dtype == torch.bfloat16 else None

    def _native(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (x.dtype in self.native_dtypes and ops.native_available()
                and self.weight.dtype == torch.float32
                and (residual is None or residual.dtype == torch.float32))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self._native(x, residual):
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps, self.out_dtype)
            return (ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.out_dtype),
                    residual)
        if residual is None:
            return self._torch_norm(x)
        residual = residual + x
        return self._torch_norm(residual), residual

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def keep_rows(rows: torch.Tensor | None, attn: torch.Tensor,
              residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn`` and ``residual`` cut to ``rows`` (``None``: all of them), in the last layer
    of a step: every row's keys and values are in the cache by then, and only the rows the
    engine samples need the rest of the model (a long prefill samples one row in
    thousands, so this skips most of the last layer's linear work)."""
    if rows is None:
        return attn, residual
    return attn.index_select(0, rows), residual.index_select(0, rows)


def silu_and_mul(x: torch.Tensor,
                 native: frozenset[torch.dtype] = frozenset({torch.float32})) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up projection ``[T, 2 d]``; on the native op
    for the dtypes in ``native`` (see :func:`native_dtypes`)."""
    if x.dtype in native and ops.native_available():
        return ops.silu_and_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]  # Hugging Face's order and roundings


class PackedLinear(nn.Module):
    """A linear layer on the native kernel (``pagedattn.ops.packed_linear``): fp32
    activations, the weight packed once in ``weight_dtype`` and widened in registers.

    A decode step streams every weight once per token; bf16 weights halve those bytes,
    and torch's own bf16 linear is several times slower than fp32 on CPUs without a
    native bf16 GEMM."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight",
                             ops.pack_linear_weight(linear.weight.detach(), weight_dtype))
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return ops.packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def gated(self, x: torch.Tensor, activation: str,
              act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act(gate) * up`` of this gate/up projection, in one kernel where it can."""
        if not fusable(x, self.out_features):
            return act_and_mul(self(x))
        return ops.packed_gated_linear(x, self.packed_weight, self.bias, self.out_features,
                                       activation)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.packed_weight.dtype}, bias={self.bias is not None}")


def fusable(x: torch.Tensor, out_features: int) -> bool:
    """Whether ``ops.packed_gated_linear`` serves a gate/up projection of ``x``: the native
    op, 2-D fp32 or bf16 rows, and halves of whole 16-column panels."""
    return (ops.native_available() and x.dim() == 2 and out_features % (2 * ops.LINEAR_PANEL) == 0
            and x.dtype in (torch.float32, torch.bfloat16))


def gate_up_linear(in_features: int, out_features: int, activation: str) -> nn.Linear:
    """A gated MLP's fused gate/up projection (no bias), tagged with its activation
    (``gated_activation``), so that the linear paths' measurement times what runs:
    ``act(gate) * up``, fused into the GEMM on the paths that can
    (:func:`pagedattn.models.linear_paths.install_linear_paths`)."""
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.gated_activation = activation
    return linear


def gated_projection(gate_up: nn.Module, x: torch.Tensor, activation: str,
                     act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A gated MLP's ``act(gate) * up`` from its fused gate/up projection ``gate_up``.
    Packed layers compute it in one kernel (the ``[T, 2 d]`` projection is never written,
    and the activation costs no pass over memory of its own); any other layer runs, then
    ``act_and_mul`` (``activation``'s op)."""
    gated = getattr(gate_up, "gated", None)
    if gated is None:
        return act_and_mul(gate_up(x))
    return gated(x, activation, act_and_mul)


def replace_linear_layers(model: nn.Module, make) -> list[nn.Module]:
    """Replace every ``nn.Linear`` of ``model`` (in place) by ``make(linear)``; returns the
    new modules in model order (a tied ``lm_head`` gets its own copy; the embedding keeps
    its table)."""
    made = []
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            made.append(make(child))
            setattr(model, name, made[-1])
        else:
            made += replace_linear_layers(child, make)
    return made


def pack_linear_layers(model: nn.Module, weight_dtype: torch.dtype) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`PackedLinear` with
    ``weight_dtype`` weights. Call after loading the weights and casting the model to fp32."""
    replace_linear_layers(model, lambda linear: PackedLinear(linear, weight_dtype))
    return model


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (GPT-NeoX layout, as Hugging Face Llama checkpoints use), with the
    cosines and sines of every position up to ``max_positions`` computed once in fp32:
    ``cos_sin[pos] = [cos(pos * f) | sin(pos * f)]`` over the ``head_dim / 2`` frequencies."""

    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.native_dtypes = native_dtypes(act_dtype)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                    / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``(q, k)`` (``[T, heads, head_dim]``); fp32 ones are rotated in place."""
        if q.dtype in self.native_dtypes and ops.native_available() \
                and self.cos_sin.dtype == torch.float32:
            ops.rotary_embedding(positions, q, k, self.cos_sin)
            return q, k
        half = self.cos_sin.shape[1] // 2
        cos, sin = self.cos_sin[positions, :half], self.cos_sin[positions, half:]
        cos = torch.cat([cos, cos], dim=-1).to(q.dtype).unsqueeze(1)
        sin = torch.cat([sin, sin], dim=-1).to(q.dtype).unsqueeze(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class PagedAttention(nn.Module):
    """One layer's attention through a backend impl. It owns no cache: the runner passes
    the layer's KV cache and the step's metadata on every call (no global context).

    ``attn_dtype``: the dtype of the attention op when it differs from the activations'
    (bf16 attention under fp32 linear layers): Q/K/V are cast to it, the output back.

    The ``_*_scale`` attributes are what the ``AttentionLayer`` protocol promises impls:
    1.0 unless an fp8 cache's scales are calibrated (:meth:`calibrate_kv_scales`)."""

    def __init__(self, impl, attn_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.impl = impl
        self.attn_dtype = attn_dtype
        one = torch.tensor(1.0, dtype=torch.float32)
        self._q_scale = self._prob_scale = one
        self._k_scale, self._v_scale = one.clone(), one.clone()
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
        self._calibrate_for: torch.dtype | None = None

    def calibrate_kv_scales(self, fp8_dtype: torch.dtype) -> None:
        """Set ``k_scale`` / ``v_scale`` from the next call that brings keys: the
        per-tensor ``amax / finfo(fp8_dtype).max``, so that call's K and V use the whole
        fp8 range; later calls keep them (values beyond saturate)."""
        self._calibrate_for = fp8_dtype

    def _set_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        fp8_max = torch.finfo(self._calibrate_for).max
        for name, x in (("k", k), ("v", v)):
            amax = float(x.detach().abs().float().nan_to_num(0.0, 0.0, 0.0).max())
            scale = amax / fp8_max if amax > 0 else 1.0
            setattr(self, f"_{name}_scale", torch.tensor(scale, dtype=torch.float32))
            setattr(self, f"_{name}_scale_float", scale)
        self._calibrate_for = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata) -> torch.Tensor:
        act_dtype = q.dtype
        if self.attn_dtype is not None and act_dtype != self.attn_dtype:
            q, k, v = q.to(self.attn_dtype), k.to(self.attn_dtype), v.to(self.attn_dtype)
        if self._calibrate_for is not None and k.numel():
            self._set_kv_scales(k, v)
        out = torch.empty_like(q)
        out = self.impl.forward(self, q, k, v, kv_cache, attn_metadata, output=out)
        return out.to(act_dtype)
