"""The fused layer ops (rms_norm, fused_add_rms_norm, silu_and_mul, gelu_tanh_and_mul,
rotary_embedding)
against their references, under every ISA; their validation and fake implementations."""

from __future__ import annotations

import pytest
import torch

from pagedattn import ops
from pagedattn.ops import reference

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")

# Widths on and off every vector width (AVX-512 16, AVX2 8, NEON/portable 4) and its pairs.
WIDTHS = [576, 64, 40, 7, 1]
# 240 rows of 576 split over the threads (a chunk is at least 64k elements); fewer stay on
# the calling thread, as a decode step's rows do.
ROWS = [1, 3, 37, 240]


def rows_tensor(rows: int, d: int, seed: int, row_stride: int | None = None) -> torch.Tensor:
    """``[rows, d]`` normal values, optionally a column slice of a wider tensor."""
    gen = torch.Generator().manual_seed(seed)
    if row_stride is None:
        return torch.randn(rows, d, generator=gen)
    return torch.randn(rows, row_stride, generator=gen)[:, 1:1 + d]


# Norms: the kernel's sum of squares runs in another order than torch's mean, each of the
# d terms rounding once (relative error <= d * 2^-24 on the mean, half that on rsqrt);
# 1e-5 relative covers d = 576 with margin, and an error of one term's size would not pass.
NORM_RTOL = 1e-5


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True], ids=["contig", "strided"])
def test_rms_norm(isa, d, rows, strided):
    x = rows_tensor(rows, d, d + rows, row_stride=d + 5 if strided else None)
    w = rows_tensor(1, d, 7)[0]
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5),
                               rtol=NORM_RTOL, atol=1e-6)


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_fused_add_rms_norm(isa, d, rows):
    x, res, w = rows_tensor(rows, d, 1), rows_tensor(rows, d, 2), rows_tensor(1, d, 3)[0]
    res_ref = res.clone()
    out = ops.fused_add_rms_norm(x, res, w, 1e-6)
    expected = reference.fused_add_rms_norm(x, res_ref, w, 1e-6)
    assert torch.equal(res, res_ref)  # the residual add is one rounding either way
    torch.testing.assert_close(out, expected, rtol=NORM_RTOL, atol=1e-6)


GATED_ACTIVATIONS = ["silu_and_mul", "gelu_tanh_and_mul"]
GELU_TANH_SCALE = 2 * (2 / 3.141592653589793) ** 0.5


@pytest.mark.parametrize("act", GATED_ACTIVATIONS)
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_act_and_mul(isa, act, d, rows):
    x = rows_tensor(rows, 2 * d, d) * 8  # +-30: exp's clamped range and its tails
    x[0, 0], x[-1, d - 1] = 100.0, -100.0
    # Against the fp64 reference: the vector exp is ~1 ulp and the division rounds once, a
    # few ulps of relative error. GELU's exponent z is a polynomial rounded in fp32, and
    # exp(z) turns its ulp into |z| ulps. (torch's fp32 gelu_tanh loses more digits, to
    # 1 + tanh(u) ~ 0 for negative gates.)
    exact = getattr(reference, act)(x.double())
    gate = x[:, :d].double()
    z = gate.abs() if act == "silu_and_mul" else GELU_TANH_SCALE * (gate + 0.044715 * gate**3).abs()
    # 1e-35: past exp's clamp at 88.4 the kernel returns gate * 4e-39 for ~0
    bound = 4 * 2.0**-24 * (4 + z.clamp(max=89)) * exact.abs() + 1e-35
    err = (getattr(ops, act)(x).double() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("act", GATED_ACTIVATIONS)
def test_act_and_mul_keeps_nan_and_inf(isa, act):
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = float("nan"), float("inf"), -1000.0
    x[0, 16:] = 1.0
    out = getattr(ops, act)(x)
    # act(-1000) underflows to -0 in torch; the clamped exp leaves a value of -4e-36
    assert torch.isnan(out[0, 0]) and out[0, 1] == float("inf") and abs(out[0, 2]) < 1e-30


def test_gelu_tanh_and_mul_is_torchs_gelu_tanh():
    """The logistic form is GELU's tanh approximation, not the erf GELU: the two differ
    by ~1e-3 near |a| = 2, far outside the tolerance here."""
    gate = torch.linspace(-6, 6, 97, dtype=torch.float64)
    x = torch.cat([gate, torch.ones_like(gate)]).unsqueeze(0).float()
    expected = torch.nn.functional.gelu(gate, approximate="tanh").float().unsqueeze(0)
    torch.testing.assert_close(ops.gelu_tanh_and_mul(x), expected, rtol=2e-6, atol=2e-7)
    assert not torch.allclose(ops.gelu_tanh_and_mul(x),
                              torch.nn.functional.gelu(gate).float().unsqueeze(0), atol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128, 40, 8])
@pytest.mark.parametrize("tokens", [1, 5, 33, 600])
def test_rotary_embedding_on_fused_qkv_views(isa, head_dim, tokens):
    heads, kv_heads, max_pos = 3, 1, 100
    gen = torch.Generator().manual_seed(head_dim + tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(max_pos, head_dim // 2, generator=gen) * 50
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    expected = qkv.clone()
    q_ref = expected[:, :heads * head_dim].view(tokens, heads, head_dim)
    k_ref = expected[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    reference.rotary_embedding(positions, q_ref, k_ref, cos_sin)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    ops.rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(qkv, expected)  # same products and sums, no fused multiply-add


# ------------------------------------------------------------------ bf16 activations
# A bf16 model's layers keep an fp32 residual stream and pass bf16 between the ops: each op
# widens, computes in fp32 and rounds once. Bound against float64: the fp32 bound above plus
# one rounding to bf16 (8 significant bits: unit roundoff 2^-8 relative).
BF16_RTOL = 2.0 ** -8 + 1e-5


def assert_rounded_once(out: torch.Tensor, exact: torch.Tensor, atol: float = 1e-30) -> None:
    """``out`` (bf16) is ``exact`` (float64) rounded once, up to the fp32 arithmetic."""
    assert out.dtype == torch.bfloat16
    err = (out.double() - exact).abs()
    bound = BF16_RTOL * exact.abs() + atol
    assert (err <= bound).all(), float((err - bound).max())


def f64_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)],
                         ids=["bf16-bf16", "f32-bf16", "bf16-f32"])
def test_rms_norm_bf16(isa, d, rows, x_dtype, out_dtype):
    x = rows_tensor(rows, d, d + rows).to(x_dtype)
    w = rows_tensor(1, d, 7)[0]
    out = ops.rms_norm(x, w, 1e-5, out_dtype)
    exact = f64_rms_norm(x, w, 1e-5)
    if out_dtype == torch.bfloat16:
        assert_rounded_once(out, exact, atol=1e-6)
    else:
        torch.testing.assert_close(out, exact.float(), rtol=NORM_RTOL, atol=1e-6)


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_fused_add_rms_norm_bf16_into_fp32_residual(isa, d, rows):
    x = rows_tensor(rows, d, 1).bfloat16()
    res, w = rows_tensor(rows, d, 2), rows_tensor(1, d, 3)[0]
    expected_res = res + x.float()  # one fp32 rounding, as in the kernel
    out = ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, expected_res)
    assert_rounded_once(out, f64_rms_norm(expected_res, w, 1e-6), atol=1e-6)


@pytest.mark.parametrize("act", GATED_ACTIVATIONS)
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_act_and_mul_bf16(isa, act, d, rows):
    x = (rows_tensor(rows, 2 * d, d) * 8).bfloat16()
    exact = getattr(reference, act)(x.double())
    # the vector exp's few fp32 ulps are far inside the bf16 rounding's margin
    assert_rounded_once(getattr(ops, act)(x), exact, atol=1e-30)


@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("tokens", [1, 33])
def test_rotary_embedding_bf16_is_the_fp32_rotation_rounded(isa, head_dim, tokens):
    gen = torch.Generator().manual_seed(head_dim + tokens)
    q = torch.randn(tokens, 3, head_dim, generator=gen).bfloat16()
    k = torch.randn(tokens, 1, head_dim, generator=gen).bfloat16()
    angles = torch.rand(50, head_dim // 2, generator=gen) * 50
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    q_ref, k_ref = q.float(), k.float()
    reference.rotary_embedding(positions, q_ref, k_ref, cos_sin)
    ops.rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(q, q_ref.bfloat16()) and torch.equal(k, k_ref.bfloat16())


def test_layer_ops_bf16_trace_with_their_fakes():
    x, res, w = torch.randn(3, 8).bfloat16(), torch.randn(3, 8), torch.randn(8)
    torch.library.opcheck(torch.ops.pagedattn.rms_norm, (x, w, 1e-5, torch.float32))
    torch.library.opcheck(torch.ops.pagedattn.fused_add_rms_norm, (x, res, w, 1e-5))
    torch.library.opcheck(torch.ops.pagedattn.silu_and_mul, (x,))
    torch.library.opcheck(torch.ops.pagedattn.gelu_tanh_and_mul, (x,))


@pytest.mark.parametrize("op, args, exc, match", [
    ("rms_norm", lambda: (torch.zeros(2, 4, dtype=torch.float16), torch.ones(4), 1e-5),
     TypeError, "x must be float32 or bfloat16, got Half"),
    ("rms_norm", lambda: (torch.zeros(2, 4), torch.ones(4), 1e-5, torch.float16),
     TypeError, "out_dtype must be float32 or bfloat16, got Half"),
    ("fused_add_rms_norm", lambda: (torch.zeros(2, 4, dtype=torch.bfloat16),
                                    torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-5),
     TypeError, "residual must be float32, got BFloat16"),
    ("rotary_embedding", lambda: (torch.tensor([0]), torch.zeros(1, 1, 8, dtype=torch.bfloat16),
                                  torch.zeros(1, 1, 8), torch.zeros(9, 8)),
     TypeError, "key dtype Float must equal query dtype BFloat16"),
    ("rms_norm", lambda: (torch.zeros(2, 4), torch.ones(5), 1e-5), ValueError, r"weight must be \[4\]"),
    ("rms_norm", lambda: (torch.zeros(2, 4), torch.ones(4), -1.0), ValueError, "eps must be"),
    ("rms_norm", lambda: (torch.zeros(4, 2).T, torch.ones(4), 1e-5), ValueError,
     "x last dim must be contiguous"),
    ("rms_norm", lambda: (torch.zeros(2, 2, 4), torch.ones(4), 1e-5), ValueError, "x must be 2-D"),
    ("fused_add_rms_norm", lambda: (torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(4), 1e-5),
     ValueError, "residual shape"),
    ("fused_add_rms_norm", lambda: (torch.zeros(2, 4), torch.zeros(1, 4).expand(2, 4),
                                    torch.ones(4), 1e-5), ValueError, "residual must not overlap"),
    ("silu_and_mul", lambda: (torch.zeros(2, 5),), ValueError, "even last dim"),
    ("silu_and_mul", lambda: (torch.zeros(2, 4, dtype=torch.float64),), TypeError, "x must be float32"),
    ("gelu_tanh_and_mul", lambda: (torch.zeros(2, 5),), ValueError, "even last dim"),
    ("gelu_tanh_and_mul", lambda: (torch.zeros(2, 4, dtype=torch.float16),), TypeError,
     "x must be float32 or bfloat16, got Half"),
    ("gelu_tanh_and_mul", lambda: (torch.zeros(2, 3, 4),), ValueError, "x must be 2-D"),
    ("rotary_embedding", lambda: (torch.tensor([0, 9]), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8),
                                  torch.zeros(9, 8)), ValueError,
     r"positions\[1\] \(9\) is outside the cos_sin_cache's \[0, 9\)"),
    ("rotary_embedding", lambda: (torch.tensor([0, -1]), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8),
                                  torch.zeros(9, 8)), ValueError, r"positions\[1\] \(-1\)"),
    ("rotary_embedding", lambda: (torch.tensor([0, 1]), torch.zeros(2, 1, 6), torch.zeros(2, 1, 8),
                                  torch.zeros(9, 8)), ValueError, r"query must be \[2, num_heads, 8\]"),
    ("rotary_embedding", lambda: (torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, 1, 8),
                                  torch.zeros(2, 1, 8), torch.zeros(9, 8)), TypeError,
     "positions must have dtype"),
    ("rotary_embedding", lambda: (torch.tensor([0, 1]), torch.zeros(2, 1, 8),
                                  torch.zeros(1, 1, 8).expand(2, 1, 8), torch.zeros(9, 8)),
     ValueError, "key must not overlap itself"),
    ("rotary_embedding", lambda: (torch.tensor([0]), torch.zeros(1, 1, 7), torch.zeros(1, 1, 7),
                                  torch.zeros(9, 7)), ValueError, "cos_sin_cache must be contiguous"),
])
def test_layer_ops_reject(op, args, exc, match):
    with pytest.raises(exc, match=match):
        getattr(ops, op)(*args())


def test_layer_ops_opcheck():
    x, res, w = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16)
    torch.library.opcheck(torch.ops.pagedattn.rms_norm, (x, w, 1e-5))
    torch.library.opcheck(torch.ops.pagedattn.fused_add_rms_norm, (x, res, w, 1e-5))
    torch.library.opcheck(torch.ops.pagedattn.silu_and_mul, (x,))
    torch.library.opcheck(torch.ops.pagedattn.gelu_tanh_and_mul, (x,))
    torch.library.opcheck(torch.ops.pagedattn.rotary_embedding,
                          (torch.tensor([0, 2, 1]), torch.randn(3, 2, 16), torch.randn(3, 1, 16),
                           torch.randn(4, 16)))
