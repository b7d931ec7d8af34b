"""Building blocks shared by the models: norms, rotary embedding, packed linear layers, and
the paged attention layer that hands one layer's Q/K/V to the selected backend's impl."""

from __future__ import annotations

import torch
from torch import nn

from pagedattn import ops


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, scale in the model dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.packed_weight.dtype}, bias={self.bias is not None}")


def pack_linear_layers(model: nn.Module, weight_dtype: torch.dtype) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`PackedLinear` with
    ``weight_dtype`` weights. Call after loading the weights and casting the model to fp32
    (a tied ``lm_head`` gets its own packed copy; the embedding keeps its table)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child, weight_dtype))
        else:
            pack_linear_layers(child, weight_dtype)
    return model


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (GPT-NeoX layout, as Hugging Face Llama checkpoints use), with
    cos/sin tables for every position up to ``max_positions`` computed once in fp32."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                    / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, 1, head_dim]`` in ``dtype``, for the step's tokens."""
        return (self.cos[positions].to(dtype).unsqueeze(1),
                self.sin[positions].to(dtype).unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class PagedAttention(nn.Module):
    """One layer's attention through a backend impl. It owns no cache: the runner passes
    the layer's KV cache and the step's metadata on every call (no global context).

    The ``_*_scale`` attributes are the unquantised defaults the ``AttentionLayer``
    protocol promises to impls."""

    def __init__(self, impl, kv_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.impl = impl
        self.kv_dtype = kv_dtype
        """Dtype of the cache and the attention op, when it differs from the activations'
        (bf16 cache under fp32 linear layers): Q/K/V are cast to it, the output back."""
        one = torch.tensor(1.0, dtype=torch.float32)
        self._q_scale = self._k_scale = self._v_scale = self._prob_scale = one
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata) -> torch.Tensor:
        act_dtype = q.dtype
        if self.kv_dtype is not None and act_dtype != self.kv_dtype:
            q, k, v = q.to(self.kv_dtype), k.to(self.kv_dtype), v.to(self.kv_dtype)
        out = torch.empty_like(q)
        out = self.impl.forward(self, q, k, v, kv_cache, attn_metadata, output=out)
        return out.to(act_dtype)
