"""The packed linear kernel (``ops.packed_linear``) against the float64 reference, its weight
layout, its validation, its fake (torch.compile) implementation, and the model layer on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedattn import ops
from pagedattn.models.layers import PackedLinear, pack_linear_layers
from pagedattn.ops import reference

needs_native = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")

# (out_features, in_features, rows): widths on and off the 16-column panel, depths on and
# off every vector width, row counts covering the tile (AVX2 6, AVX-512 8), its tails and
# more than one 48-row block.
SHAPES = [(16, 8, 1), (37, 20, 7), (960, 576, 1), (192, 64, 13), (50, 33, 49),
          (100, 1, 3), (1, 40, 2), (576, 1536, 4), (48, 72, 100)]


def summation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst-case error of an fp32 dot product of length k, accumulated in any order:
    k * u * sum_k |x w| (u = 2^-24, the unit roundoff; Higham, Accuracy and Stability of
    Numerical Algorithms, eq. 3.5), plus one rounding of the bias add."""
    k = x.shape[1]
    mags = x.double().abs() @ w.double().abs().T
    return (k + 1) * 2.0 ** -24 * mags + 1e-30


@needs_native
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}k{}m{}".format(*s))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_packed_linear_matches_reference(isa, weight_dtype, shape, with_bias):
    n, k, m = shape
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = ops.pack_linear_weight(w, weight_dtype)
    out = ops.packed_linear(x, packed, bias, n)
    expected = reference.packed_linear(x, packed, bias, n)
    assert out.shape == (m, n) and out.dtype == torch.float32
    bound = summation_bound(x, w.to(weight_dtype).float()) + (bias.abs().double() * 2.0 ** -24
                                                              if bias is not None else 0)
    err = (out.double() - expected.double()).abs()
    assert (err <= bound + 1e-6 * expected.double().abs()).all(), float((err - bound).max())


@needs_native
def test_packed_linear_strided_and_empty_inputs(isa):
    w = torch.randn(40, 24)
    packed = ops.pack_linear_weight(w)
    wide = torch.randn(5, 30)
    rows_strided = wide[:, 3:27]                 # row stride 30, last dim contiguous
    transposed = torch.randn(24, 5).T            # last dim strided: copied first
    for x in (rows_strided, transposed):
        torch.testing.assert_close(ops.packed_linear(x, packed, None, 40), x @ w.T,
                                   rtol=1e-5, atol=1e-5)
    assert ops.packed_linear(torch.empty(0, 24), packed, None, 40).shape == (0, 40)


def test_pack_layout():
    w = torch.arange(37 * 5, dtype=torch.float32).view(37, 5)
    packed = ops.pack_linear_weight(w)
    assert packed.shape == (3, 5, 16) and packed.is_contiguous()
    for col in range(48):
        expected = w[col] if col < 37 else torch.zeros(5)
        assert torch.equal(packed[col // 16, :, col % 16], expected), col
    assert torch.equal(reference.unpack_linear_weight(packed, 37), w)
    half = ops.pack_linear_weight(w, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), packed.to(torch.bfloat16).float())


@pytest.mark.parametrize("weight, dtype, exc, match", [
    (torch.zeros(4), None, ValueError, "2-D"),
    (torch.zeros(4, 4), torch.int32, TypeError, "packed weight dtype"),
    ("w", None, ValueError, "2-D"),
])
def test_pack_rejects(weight, dtype, exc, match):
    with pytest.raises(exc, match=match):
        ops.pack_linear_weight(weight, dtype)


@needs_native
@pytest.mark.parametrize("change, exc, match", [
    (dict(x=lambda a: a["x"].bfloat16()), TypeError, "x must be float32"),
    (dict(x=lambda a: a["x"].view(3, 2, 4)), ValueError, r"x must be 2-D"),
    (dict(x=lambda a: torch.randn(3, 9)), ValueError, "x has 9 features but packed_weight has 8"),
    (dict(n=lambda a: 40), ValueError, "out_features 40 does not match packed_weight's 2 panels"),
    (dict(n=lambda a: 0), ValueError, "out_features 0 does not match"),
    (dict(bias=lambda a: torch.randn(21)), ValueError, r"bias must be \[20\]"),
    (dict(bias=lambda a: torch.randn(20, dtype=torch.float64)), TypeError, "bias must be float32"),
    (dict(packed=lambda a: a["packed"].view(2, 128)), ValueError, "packed_weight must be 3-D"),
    (dict(packed=lambda a: torch.zeros(2, 16, 8).transpose(1, 2)), ValueError,
     "packed_weight must be contiguous"),
    (dict(packed=lambda a: a["packed"].to(torch.int16)), TypeError,
     "packed_weight must be float32, bfloat16 or float16"),
    (dict(n=lambda a: 2 ** 64), ValueError, "out_features must be an int in int64 range"),
], ids=["x_bf16", "x_3d", "k_mismatch", "n_mismatch", "n_zero", "bias_shape", "bias_dtype",
        "packed_2d", "packed_strided", "packed_int", "out_features_big"])
def test_packed_linear_rejects(change, exc, match):
    args = dict(x=torch.randn(3, 8), packed=ops.pack_linear_weight(torch.randn(20, 8)),
                bias=None, n=20)
    args.update({name: make(args) for name, make in change.items()})
    with pytest.raises(exc, match=match):
        ops.packed_linear(args["x"], args["packed"], args["bias"], args["n"])


# (d, in_features, rows): one and several panels per half, depths on and off the vector
# widths, row counts on and off the tile and past one 48-row block.
GATED_SHAPES = [(16, 8, 1), (32, 20, 7), (48, 64, 13), (64, 33, 100), (1536, 64, 3)]


@needs_native
@pytest.mark.parametrize("activation", ops.GATED_ACTIVATIONS)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GATED_SHAPES, ids=lambda s: "d{}k{}m{}".format(*s))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_packed_gated_linear(isa, activation, weight_dtype, shape, with_bias):
    d, k, m = shape
    gen = torch.Generator().manual_seed(d * 1000 + k + m)
    w = torch.randn(2 * d, k, generator=gen) / k ** 0.5
    x = torch.randn(m, k, generator=gen) * 2
    bias = torch.randn(2 * d, generator=gen) if with_bias else None
    packed = ops.pack_linear_weight(w, weight_dtype)
    out = ops.packed_gated_linear(x, packed, bias, 2 * d, activation)
    assert out.shape == (m, d) and out.dtype == torch.float32
    # The same tiles and the same activation as the two ops it fuses: bit-equal to them.
    two_ops = getattr(ops, f"{activation}_and_mul")(ops.packed_linear(x, packed, bias, 2 * d))
    assert torch.equal(out, two_ops)
    expected = reference.packed_gated_linear(x, packed, bias, 2 * d, activation)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@needs_native
def test_packed_gated_linear_empty_and_strided(isa):
    w, x = torch.randn(64, 24), torch.randn(5, 30)[:, 3:27]
    packed = ops.pack_linear_weight(w)
    expected = reference.packed_gated_linear(x, packed, None, 64, "silu")
    torch.testing.assert_close(ops.packed_gated_linear(x, packed, None, 64, "silu"), expected,
                               rtol=1e-4, atol=1e-5)
    assert ops.packed_gated_linear(torch.empty(0, 24), packed, None, 64, "silu").shape == (0, 32)


@needs_native
@pytest.mark.parametrize("weight_rows, out_features, activation, match", [
    (64, 64, "relu", r"activation must be one of \('silu', 'gelu_tanh'\), got 'relu'"),
    (48, 48, "silu", r"out_features \(gate and up, 48\) must be a multiple of 32"),
    (48, 64, "silu", "out_features 64 does not match packed_weight's 3 panels"),
])
def test_packed_gated_linear_rejects(weight_rows, out_features, activation, match):
    packed = ops.pack_linear_weight(torch.randn(weight_rows, 8))
    with pytest.raises(ValueError, match=match):
        ops.packed_gated_linear(torch.randn(3, 8), packed, None, out_features, activation)
    if activation == "relu":  # the op itself names the allowed values too
        with pytest.raises(ValueError, match="activation must be 'silu' or 'gelu_tanh', got 'relu'"):
            torch.ops.pagedattn.packed_gated_linear(torch.randn(3, 8), packed, None, 64, "relu")


@needs_native
def test_packed_linear_opcheck():
    x, w = torch.randn(5, 24), torch.randn(40, 24)
    for bias in (None, torch.randn(40)):
        torch.library.opcheck(torch.ops.pagedattn.packed_linear,
                              (x, ops.pack_linear_weight(w, torch.bfloat16), bias, 40))
        torch.library.opcheck(torch.ops.pagedattn.packed_gated_linear,
                              (x, ops.pack_linear_weight(torch.randn(64, 24)), None, 64,
                               "gelu_tanh"))


@needs_native
def test_packed_linear_module_and_model_packing():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, 40), nn.Sequential(nn.ReLU(), nn.Linear(40, 8, bias=False)))
    x = torch.randn(2, 3, 24)  # 3-D input: flattened to rows and back
    expected = net(x)
    pack_linear_layers(net, torch.float32)
    assert isinstance(net[0], PackedLinear) and isinstance(net[1][1], PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in net.modules())
    torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
    assert "weight_dtype=torch.float32" in repr(net[0])
