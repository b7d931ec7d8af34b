"""Measured linear paths (``pagedattn.models.linear_paths``): every path forced on every ISA
against a float64 reference, the vdpbf16ps op's layout, validation and fake, the per-bucket
dispatch, and the per-machine cache (key fields; stale, corrupt and unwritable files)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedattn import ops
from pagedattn.models import linear_paths as lp
from pagedattn.models.layers import gate_up_linear
from pagedattn.models.linear_paths import LinearPath, MeasuredLinear

needs_native = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")
needs_dpbf16 = pytest.mark.skipif(
    not ops.native_available() or ops.CpuIsa.AVX512BF16 not in ops.supported_cpu_isas(),
    reason="this CPU has no AVX512-BF16 (or the native extension is not built)")

U32 = 2.0 ** -24
# Unit roundoff of the activations each path feeds its GEMM, and of the GEMM's output
# before it is widened back to fp32 (oneDNN's half GEMM returns the weight dtype).
HALF_U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}


def error_bound(path: LinearPath, x, w, weight_dtype, expected, bias):
    """Worst case of ``|out - x @ w.T - bias|`` in float64, ``w`` already in ``weight_dtype``:
    rounding each activation (relative ``u_a`` per operand; the weights are exact), an fp32
    sum of ``k`` products in any order (``(k + 1) u32 sum |x w|``, Higham eq. 3.5), the
    GEMM output's rounding (``u_o``) and one fp32 rounding of the bias add."""
    k = x.shape[1]
    mags = x.double().abs() @ w.double().abs().T
    u_a = 0.0 if path is LinearPath.PACKED else HALF_U[weight_dtype]
    u_o = HALF_U[weight_dtype] if path in (LinearPath.TORCH, LinearPath.ONEDNN) else 0.0
    acc = u_a * mags + (k + 1) * U32 * (1 + u_a) * mags
    bound = acc + u_o * (mags + acc)
    return bound + U32 * (expected.abs() + bound) + 1e-30


def make_layer(n, k, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=gen))
    return layer


def require(path: LinearPath, weight_dtype: torch.dtype) -> None:
    reasons = lp.unavailable_reasons(path, weight_dtype)
    if reasons:
        pytest.skip(f"{path.value} with {weight_dtype}: {'; '.join(reasons)}")


# (out_features, in_features): widths off the 16-column panel and the 4-panel tile, an odd
# depth (a padded k pair), and a SmolLM2-like projection.
SHAPES = [(50, 33), (37, 64), (200, 576)]


def bf16_activation_bound(path: LinearPath, x, w, expected, out_dtype):
    """Worst case of ``|out - x @ w.T - bias|`` for bf16 activations (exact in every path:
    bf16 operands widen exactly): an fp32 sum of ``k`` products, the GEMM output's bf16
    rounding on the oneDNN/torch paths (before the fp32 bias add), and the final rounding
    to ``out_dtype``."""
    k = x.shape[1]
    mags = x.double().abs() @ w.double().abs().T
    acc = (k + 1) * U32 * mags
    if path in (LinearPath.TORCH, LinearPath.ONEDNN):
        acc = acc + HALF_U[torch.bfloat16] * (mags + acc)
    u_out = HALF_U[torch.bfloat16] if out_dtype == torch.bfloat16 else U32
    return acc + u_out * (expected.abs() + acc) + U32 * (expected.abs() + acc) + 1e-30


# (weights, activations, output): fp32 activations under every weight dtype; bf16
# activations (the layers of a bf16 model on a CPU with a native bf16 GEMM), and bf16
# activations with fp32 logits (its lm_head)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = [(F32, F32, F32), (BF16, F32, F32), (F16, F32, F32), (BF16, BF16, BF16),
          (BF16, BF16, F32)]


@needs_native
@pytest.mark.parametrize("path", list(LinearPath), ids=lambda p: p.value)
@pytest.mark.parametrize("dtypes", DTYPES,
                         ids=lambda d: "w{}-act{}-out{}".format(*(str(t)[-4:] for t in d)))
@pytest.mark.parametrize("rows", [1, 7, 32, 257])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}k{}".format(*s))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_forced_path_matches_float64(isa, path, dtypes, rows, shape, with_bias):
    weight_dtype, act_dtype, out_dtype = dtypes
    require(path, weight_dtype)
    n, k = shape
    linear = make_layer(n, k, with_bias, seed=n + k + rows)
    layer = MeasuredLinear(linear, weight_dtype, [path], act_dtype, out_dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(act_dtype)
    out = layer(x)
    assert out.shape == (rows, n) and out.dtype == out_dtype
    w = linear.weight.detach().to(weight_dtype).double()
    expected = x.double() @ w.T
    if with_bias:
        expected += linear.bias.detach().double()
    if act_dtype == torch.float32:
        bound = error_bound(path, x, w, weight_dtype, expected, with_bias)
    else:
        bound = bf16_activation_bound(path, x, w, expected, out_dtype)
    err = (out.double() - expected).abs()
    assert (err <= bound).all(), float((err - bound).max())


@needs_native
def test_measured_linear_casts_other_activations_and_rejects_bad_dtypes():
    linear = make_layer(40, 24, True)
    layer = MeasuredLinear(linear, torch.bfloat16, [LinearPath.PACKED], torch.bfloat16)
    x = torch.randn(3, 24)
    torch.testing.assert_close(layer(x), layer(x.bfloat16()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="act_dtype must be float32, or bfloat16 with bfloat16"):
        MeasuredLinear(linear, torch.float32, [LinearPath.PACKED], torch.bfloat16)
    with pytest.raises(ValueError, match="act_dtype must be"):
        MeasuredLinear(linear, torch.float16, [LinearPath.PACKED], torch.float16)


@needs_native
def test_fp32_weights_never_get_bf16_activations():
    paths = lp.candidate_paths(torch.float32)
    assert LinearPath.DPBF16 not in paths and LinearPath.PACKED in paths
    layer = MeasuredLinear(make_layer(40, 24, True), torch.float32, paths)
    assert layer.dp_weight is None
    assert layer.weight is None or layer.weight.dtype == torch.float32
    assert "bfloat16 weights only" in " ".join(lp.unavailable_reasons(LinearPath.DPBF16,
                                                                      torch.float32))


@needs_native
def test_dispatch_follows_the_bucket_choices():
    paths = lp.candidate_paths(torch.bfloat16)
    if len(paths) < 2:
        pytest.skip("one linear path for bf16 weights here: nothing to alternate")
    layer = MeasuredLinear(make_layer(40, 24, False), torch.bfloat16, paths)
    choices = [paths[i % 2] for i in range(len(lp.ROW_BUCKETS))]
    layer.set_choices(choices)
    for bucket, path in zip(lp.ROW_BUCKETS, choices):
        for rows in {bucket.lo, bucket.probe, bucket.hi or 600}:
            x = torch.randn(rows, 24)
            assert torch.equal(layer(x), layer.runner(path)(x)), (bucket.label, rows, path)
    x3 = torch.randn(2, 3, 24)  # 3-D input: flattened to rows and back
    torch.testing.assert_close(layer(x3), layer(x3.reshape(6, 24)).view(2, 3, 40))
    layer.release_unused()
    assert set(layer.paths) == set(choices)


# ------------------------------------------------------------------ the vdpbf16ps op


def test_pack_dpbf16_layout():
    w = torch.arange(37 * 5, dtype=torch.float32).view(37, 5)  # exact in bf16 (< 256)
    packed = ops.pack_linear_weight_dpbf16(w)
    assert packed.shape == (3, 3, 32) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    for col in range(48):
        for kk in range(6):
            expected = float(w[col, kk]) if col < 37 and kk < 5 else 0.0
            got = float(packed[col // 16, kk // 2, 2 * (col % 16) + kk % 2])
            assert got == expected, (col, kk)


@pytest.mark.parametrize("weight, exc, match", [
    (torch.zeros(4), ValueError, "2-D"),
    (torch.zeros(4, 4, dtype=torch.int32), TypeError, "floating-point"),
    ("w", ValueError, "2-D"),
])
def test_pack_dpbf16_rejects(weight, exc, match):
    with pytest.raises(exc, match=match):
        ops.pack_linear_weight_dpbf16(weight)


# The two ops over pack_linear_weight_dpbf16's layout: vdpbf16ps, and AMX tiles.
BF16_OPS = {"dpbf16": "packed_linear_dpbf16", "amx": "packed_linear_amx"}


def bf16_op(name: str):
    """The op, or a skip naming why it cannot run here."""
    path = LinearPath(name)
    require(path, torch.bfloat16)
    return getattr(ops, BF16_OPS[name]), getattr(torch.ops.pagedattn, BF16_OPS[name])


@pytest.mark.parametrize("op_name", list(BF16_OPS))
@pytest.mark.parametrize("case, exc, match", [
    ("x_fp16", TypeError, "x must be float32 or bfloat16, got Half"),
    ("out_fp16", TypeError, "out_dtype must be float32 or bfloat16, got Half"),
    ("x_3d", ValueError, r"x must be 2-D"),
    ("k_mismatch", ValueError, "x has 10 features but packed_weight has 4 pairs"),
    ("n_mismatch", ValueError, "out_features 40 does not match packed_weight's 2 panels"),
    ("bias_shape", ValueError, r"bias must be \[20\]"),
    ("bias_dtype", TypeError, "bias must be float32"),
    ("packed_fp32", TypeError, "packed_weight must be bfloat16"),
    ("packed_plain_layout", ValueError, r"packed_weight must be 3-D \[ceil\(out_features / 16\), "
                                        r"ceil\(in_features / 2\), 32\]"),
    ("packed_strided", ValueError, "packed_weight must be contiguous"),
    ("out_features_big", ValueError, "out_features must be an int in int64 range"),
    ("isa_without_bf16_dot", NotImplementedError, None),
])
def test_packed_bf16_linear_rejects(op_name, case, exc, match):
    op, _ = bf16_op(op_name)
    if match is None:  # a lower ISA forced
        match = {"dpbf16": "needs the avx512bf16 kernels", "amx": "needs AMX-BF16 tiles"}[op_name]
    x, n, bias, out_dtype = torch.randn(3, 8), 20, None, None
    packed = ops.pack_linear_weight_dpbf16(torch.randn(20, 8))
    if case == "x_fp16":
        x = x.half()
    elif case == "out_fp16":
        out_dtype = torch.float16
    elif case == "x_3d":
        x = x.view(3, 2, 4)
    elif case == "k_mismatch":
        x = torch.randn(3, 10)
    elif case == "n_mismatch":
        n = 40
    elif case == "bias_shape":
        bias = torch.randn(21)
    elif case == "bias_dtype":
        bias = torch.randn(20, dtype=torch.float64)
    elif case == "packed_fp32":
        packed = packed.float()
    elif case == "packed_plain_layout":
        packed = ops.pack_linear_weight(torch.randn(20, 8), torch.bfloat16)
    elif case == "packed_strided":
        packed = torch.zeros(2, 32, 4, dtype=torch.bfloat16).transpose(1, 2)
    elif case == "out_features_big":
        n = 2 ** 64
    with pytest.raises(exc, match=match):
        if case == "isa_without_bf16_dot":
            with ops.use_cpu_isa("avx512"):
                op(x, packed, bias, n)
        else:
            op(x, packed, bias, n, out_dtype)


@pytest.mark.parametrize("op_name", list(BF16_OPS))
def test_packed_bf16_linear_opcheck_and_edges(op_name):
    linear, native = bf16_op(op_name)
    x, w = torch.randn(5, 23), torch.randn(40, 23)
    packed = ops.pack_linear_weight_dpbf16(w)
    for bias in (None, torch.randn(40)):
        torch.library.opcheck(native, (x, packed, bias, 40))
        torch.library.opcheck(native, (x.bfloat16(), packed, bias, 40, torch.bfloat16))
    # bf16 activations are the fp32 path's own rounding of x; a bf16 output is its sums
    # rounded once
    torch.testing.assert_close(linear(x.bfloat16(), packed, None, 40),
                               linear(x, packed, None, 40), rtol=0, atol=0)
    torch.testing.assert_close(
        linear(x, packed, None, 40, torch.bfloat16),
        linear(x, packed, None, 40).bfloat16(), rtol=0, atol=0)
    assert linear(torch.empty(0, 23), packed, None, 40).shape == (0, 40)
    strided = torch.randn(23, 5).T  # last dim strided: copied first
    torch.testing.assert_close(linear(strided, packed, None, 40),
                               linear(strided.contiguous(), packed, None, 40))
    # NaN/inf in the row after the last feature must not leak through the padded pair
    wide = torch.full((5, 24), float("nan"))
    wide[:, :23] = x
    torch.testing.assert_close(linear(wide[:, :23], packed, None, 40),
                               linear(x, packed, None, 40))
    # no features: the output is the bias
    bias = torch.randn(40)
    no_features = ops.pack_linear_weight_dpbf16(torch.randn(40, 0))
    torch.testing.assert_close(linear(torch.empty(3, 0), no_features, bias, 40),
                               bias.expand(3, 40), rtol=0, atol=0)


@pytest.mark.parametrize("op_name", list(BF16_OPS))
def test_packed_bf16_linear_compiles_fullgraph(op_name):
    _, native = bf16_op(op_name)
    x, w, bias = torch.randn(5, 23), torch.randn(40, 23), torch.randn(40)
    packed = ops.pack_linear_weight_dpbf16(w)

    def step(x):
        return native(x, packed, bias, 40).relu()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), step(x), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 65, 130])
@pytest.mark.parametrize("k", [2, 31, 32, 64, 100, 576, 4096])
def test_packed_linear_amx_rows_and_depths(rows, k):
    """The tile loop's edges against float64: 16-row tiles and 32-row blocks with their
    leftover rows, row chunks (64 rows at 4096 features), K steps of 32 features with a
    zero-padded last one (and an odd k's padded pair), an odd panel count (the last pair
    has one panel) and a width off the panel."""
    linear, _ = bf16_op("amx")
    n = 40
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w, bias = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    packed = ops.pack_linear_weight_dpbf16(w)
    expected = x.double() @ w.double().T + bias.double()
    mags = x.double().abs() @ w.double().abs().T
    for out_dtype in (torch.float32, torch.bfloat16):
        out = linear(x, packed, bias, n, out_dtype)
        u_out = HALF_U[torch.bfloat16] if out_dtype == torch.bfloat16 else U32
        acc = (k + 1) * U32 * mags + U32 * (expected.abs() + mags)
        bound = acc + u_out * (expected.abs() + acc) + 1e-30
        err = (out.double() - expected).abs()
        assert (err <= bound).all(), (out_dtype, float((err - bound).max()))


def gated_reference(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a float64 [rows, 2 d] projection (transformers' forms)."""
    g, u = h.chunk(2, dim=1)
    if activation == "silu":
        return g * torch.sigmoid(g) * u
    return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * u


def rounded_as_avx512bf16(t: torch.Tensor) -> torch.Tensor:
    """t to bf16 as the avx512bf16 kernels store it (vcvtneps2bf16): to nearest even, with
    fp32 denormals (magnitudes below 2^-126) flushed to zero of their sign."""
    return torch.where(t.abs() < 2.0**-126, t * 0, t).bfloat16()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 17, 70])
@pytest.mark.parametrize("k", [31, 64, 0])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_packed_gated_linear_amx(activation, rows, k, with_bias):
    """The gated form against float64, and bit for bit against its two steps: the plain
    op's fp32 sums, then the activation op (one rounding to bf16 at the end; GELU's
    negative tails reach fp32 denormals at 31 features, which that rounding flushes)."""
    linear, _ = bf16_op("amx")
    d = 48  # three panels a half: gate panel j runs beside up panel 3 + j
    gen = torch.Generator().manual_seed(rows * 100 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(2 * d, k, generator=gen).bfloat16()
    bias = torch.randn(2 * d, generator=gen) if with_bias else None
    packed = ops.pack_linear_weight_dpbf16(w)
    fused = ops.packed_gated_linear_amx(x, packed, bias, 2 * d, activation)
    assert fused.shape == (rows, d) and fused.dtype == torch.float32
    act_and_mul = ops.silu_and_mul if activation == "silu" else ops.gelu_tanh_and_mul
    two_steps = act_and_mul(linear(x, packed, bias, 2 * d))
    torch.testing.assert_close(fused, two_steps, rtol=0, atol=0)
    torch.testing.assert_close(
        ops.packed_gated_linear_amx(x, packed, bias, 2 * d, activation, torch.bfloat16),
        rounded_as_avx512bf16(two_steps), rtol=0, atol=0)
    h = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    torch.testing.assert_close(fused.double(), gated_reference(h, activation),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case, exc, match", [
    ("odd_half", ValueError, r"out_features \(gate and up, 40\) must be a multiple of 32"),
    ("activation", ValueError, "activation must be 'silu' or 'gelu_tanh', got 'relu'"),
    ("k_mismatch", ValueError, "x has 10 features but packed_weight has 4 pairs"),
])
def test_packed_gated_linear_amx_rejects(case, exc, match):
    bf16_op("amx")
    x, n, activation = torch.randn(3, 8), 64, "silu"
    packed = ops.pack_linear_weight_dpbf16(torch.randn(64, 8))
    if case == "odd_half":
        n, packed = 40, ops.pack_linear_weight_dpbf16(torch.randn(40, 8))
    elif case == "activation":
        activation = "relu"
    elif case == "k_mismatch":
        x = torch.randn(3, 10)
    with pytest.raises(exc, match=match):
        ops.packed_gated_linear_amx(x, packed, None, n, activation)


def test_packed_gated_linear_amx_opcheck_and_layer():
    bf16_op("amx")
    x, w, bias = torch.randn(5, 23), torch.randn(64, 23), torch.randn(64)
    packed = ops.pack_linear_weight_dpbf16(w)
    torch.library.opcheck(torch.ops.pagedattn.packed_gated_linear_amx,
                          (x.bfloat16(), packed, bias, 64, "gelu_tanh", torch.bfloat16))
    # MeasuredLinear.gated takes the fused op on the amx path
    linear = make_layer(64, 23, True)
    layer = MeasuredLinear(linear, torch.bfloat16, [LinearPath.AMX], torch.bfloat16)
    xb = x.bfloat16()
    torch.testing.assert_close(
        layer.gated(xb, "silu", ops.silu_and_mul),
        ops.packed_gated_linear_amx(xb, layer.dp_weight, layer.bias, 64, "silu", torch.bfloat16),
        rtol=0, atol=0)


# ------------------------------------------------------------------ choosing and caching


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(lp.FORCE_ENV, raising=False)
    return tmp_path / "pagedattn"


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 24, bias=False),
                         nn.Linear(24, 40))


@needs_native
def test_install_measures_caches_and_reuses(cache_dir):
    net = small_net()
    x = torch.randn(3, 24)
    expected = net(x)
    plan = lp.install_linear_paths(net, torch.float32, busy=False)
    assert not any(isinstance(m, nn.Linear) for m in net.modules())
    torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
    assert list(plan.shapes) == ["24x40:float32", "40x24:float32"]  # shared by two layers
    assert all(c.source == "measured" and c.times_us for cs in plan.shapes.values() for c in cs)
    data = json.loads((cache_dir / "linear-paths.json").read_text())
    assert set(data["key"]) == {"format", "cpu_model", "cpu_flags", "threads", "torch", "isa",
                                "extension"}
    assert data["key"]["extension"] == ops.native_build() != "none"
    assert data["key"] == lp.machine_key()
    assert data["key"]["threads"] == torch.get_num_threads()
    assert data["key"]["torch"] == torch.__version__
    again = lp.install_linear_paths(small_net(), torch.float32, busy=False)
    assert all(c.source == "cached" for cs in again.shapes.values() for c in cs)
    assert [c.path for c in again.shapes["24x40:float32"]] == [c.path for c in plan.shapes["24x40:float32"]]
    assert any("rows       1:" in line for line in again.lines())


@needs_native
@pytest.mark.parametrize("damage", ["stale_threads", "stale_torch", "stale_flags",
                                    "stale_extension", "garbage", "wrong_json", "bad_entry",
                                    "fewer_candidates"])
def test_stale_or_corrupt_cache_is_remeasured_and_rewritten(cache_dir, damage):
    lp.install_linear_paths(small_net(), torch.float32, busy=False)
    path = cache_dir / "linear-paths.json"
    data = json.loads(path.read_text())
    if damage.startswith("stale_"):
        field = {"stale_threads": "threads", "stale_torch": "torch", "stale_flags": "cpu_flags",
                 "stale_extension": "extension"}[damage]
        data["key"][field] = "something else"
        path.write_text(json.dumps(data))
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff{not json")
    elif damage == "wrong_json":
        path.write_text("[1, 2, 3]")
    elif damage == "bad_entry":
        data["shapes"]["24x40:float32"] = [{"rows": "1", "path": "no-such-path"}]
        path.write_text(json.dumps(data))
    else:  # measured before a path existed: its times lack that path
        for entry in data["shapes"]["24x40:float32"]:
            entry["times_us"].pop(entry["path"] if entry["path"] != "packed" else "torch", None)
        path.write_text(json.dumps(data))
    plan = lp.install_linear_paths(small_net(), torch.float32, busy=False)
    assert plan.shapes["24x40:float32"][0].source == "measured"
    rewritten = json.loads(path.read_text())
    assert rewritten["key"] == lp.machine_key()
    assert [e["path"] for e in rewritten["shapes"]["24x40:float32"]] == \
        [c.path for c in plan.shapes["24x40:float32"]]


@needs_native
def test_every_layer_runs_on_every_path_before_a_timed_call(cache_dir, monkeypatch):
    # time_paths cycles through a shape's layers; each one's first call on a path (its
    # weight cold) is made before the first timed round
    called, seen_at_first_timing = set(), []
    runner = lp.MeasuredLinear.runner

    def spy_runner(self, path):
        fn = runner(self, path)

        def run(x):
            called.add((id(self), path))
            return fn(x)
        return run
    best_of = lp.tuning.best_of

    def spy_best_of(candidates, **kwargs):
        if not seen_at_first_timing:
            seen_at_first_timing.append(set(called))
        return best_of(candidates, **kwargs)
    monkeypatch.setattr(lp.MeasuredLinear, "runner", spy_runner)
    monkeypatch.setattr(lp.tuning, "best_of", spy_best_of)
    net = nn.Sequential(*[nn.Linear(24, 24) for _ in range(3)])
    lp.install_linear_paths(net, torch.float32, busy=False)
    layers = list(net)
    assert seen_at_first_timing[0] == {(id(m), p) for m in layers for p in lp.candidate_paths(torch.float32)}


@needs_native
@pytest.mark.parametrize("us_at_129_rows, open_probe", [(100.0, lp.OPEN_BUCKET_CHUNK), (5000.0, 512)])
def test_open_bucket_is_timed_at_a_prefill_chunk_where_cheap(cache_dir, monkeypatch,
                                                             us_at_129_rows, open_probe):
    probes = []

    def scripted(layers, rows, deadline):
        probes.append(rows)
        return {p.value: (us_at_129_rows if rows == 129 else 10.0) + i
                for i, p in enumerate(layers[0].paths)}
    monkeypatch.setattr(lp, "time_paths", scripted)
    lp.install_linear_paths(nn.Sequential(nn.Linear(24, 24)), torch.float32, busy=False)
    assert probes == [1, 3, 9, 33, 129, open_probe]


@needs_native
def test_near_ties_go_to_the_layers_most_chosen_path(cache_dir, monkeypatch):
    # scripted times per probe (us): "a" wins four buckets outright; "b" leads 33 rows
    # by 3% (a near tie: "a" it is) and 129 rows by 10% (kept)
    lead = {33: 1.03, 129: 1.10}

    def scripted(layers, rows, deadline):
        a, b = (p.value for p in layers[0].paths[:2])
        times = {p.value: 1000.0 for p in layers[0].paths}
        times[b] = 100.0
        times[a] = 50.0 if rows not in lead else 100.0 * lead[rows]
        return times
    monkeypatch.setattr(lp, "time_paths", scripted)
    plan = lp.install_linear_paths(small_net(), torch.float32, busy=False)
    for choices in plan.shapes.values():
        a, b = choices[0].path, choices[4].path
        assert a != b
        assert [c.path for c in choices] == [a, a, a, a, b, a]
        assert all(c.source == "measured" for c in choices)


@needs_native
def test_gate_up_projections_are_measured_as_they_run(cache_dir, monkeypatch):
    # a gate/up projection's paths are timed with the activation (fused where a path fuses
    # it), under a shape key of their own
    torch.manual_seed(0)
    net = nn.Sequential(gate_up_linear(24, 64, "silu"), nn.Linear(32, 24))
    timed = []
    gated_runner = lp.MeasuredLinear.gated_runner

    def spy(self, path):
        timed.append(self.shape_key)
        return gated_runner(self, path)
    monkeypatch.setattr(lp.MeasuredLinear, "gated_runner", spy)
    plan = lp.install_linear_paths(net, torch.float32, busy=False)
    assert list(plan.shapes) == ["24x64:float32:silu-gated", "32x24:float32"]
    assert timed and set(timed) == {"24x64:float32:silu-gated"}


@needs_native
@pytest.mark.parametrize("activation, reference", [
    ("silu", lambda g: F.silu(g)), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh"))])
def test_every_paths_gated_runner_is_act_gate_times_up(activation, reference):
    torch.manual_seed(0)
    linear = gate_up_linear(24, 64, activation)
    layer = MeasuredLinear(linear, torch.float32, lp.candidate_paths(torch.float32),
                           gated_activation=activation)
    x = torch.randn(5, 24)
    gate, up = (x.double() @ linear.weight.double().T).chunk(2, dim=-1)
    expected = (reference(gate) * up).float()
    for path in layer.paths:
        torch.testing.assert_close(layer.gated_runner(path)(x), expected, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{path.value}: {m}")


def test_unknown_gated_activation_is_named():
    with pytest.raises(ValueError, match=r"gated_activation must be one of .*got 'relu2'"):
        MeasuredLinear(nn.Linear(4, 8), torch.float32, [LinearPath.TORCH],
                       gated_activation="relu2")


@needs_native
def test_unwritable_cache_is_reported_not_raised(cache_dir):
    (cache_dir / "linear-paths.json").mkdir(parents=True)  # a directory where the file goes
    plan = lp.install_linear_paths(small_net(), torch.float32, busy=False)
    assert plan.cache_error and all(c.source == "measured" for c in plan.shapes["24x40:float32"])


@needs_native
def test_busy_machine_measures_but_does_not_cache(cache_dir):
    plan = lp.install_linear_paths(small_net(), torch.float32, busy="load average 9.0 > 2 cores")
    assert all(c.source == "measured" for cs in plan.shapes.values() for c in cs)
    assert "busy" in plan.cache_error and not (cache_dir / "linear-paths.json").exists()
    assert any("not written: measured while busy" in line for line in plan.lines())


@needs_native
def test_time_cap_leaves_buckets_unmeasured_and_uncached(cache_dir):
    plan = lp.install_linear_paths(small_net(), torch.float32, budget_s=0.0, busy=False)
    assert all(c.source == "unmeasured" for cs in plan.shapes.values() for c in cs)
    assert not (cache_dir / "linear-paths.json").exists()


@needs_native
@pytest.mark.parametrize("how", ["argument", "env"])
def test_forced_path(cache_dir, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(lp.FORCE_ENV, "packed")
    net = small_net()
    plan = lp.install_linear_paths(net, torch.float32, force="packed" if how == "argument" else None)
    assert all(c.source == "forced" and c.path == "packed" for cs in plan.shapes.values() for c in cs)
    assert all(m.paths == [LinearPath.PACKED] for m in net.modules() if isinstance(m, MeasuredLinear))
    assert not (cache_dir / "linear-paths.json").exists()


@needs_native
def test_forced_path_rejections(cache_dir, monkeypatch):
    with pytest.raises(ValueError,
                       match="linear path must be one of packed, dpbf16, amx, torch, onednn, "
                             "got 'tiles'"):
        lp.install_linear_paths(small_net(), torch.float32, force="tiles")
    with pytest.raises(ValueError, match="linear path 'amx' cannot run 24x40:float32: .*bfloat16"):
        lp.install_linear_paths(small_net(), torch.float32, force="amx")
    with pytest.raises(ValueError, match="linear path 'dpbf16' cannot run 24x40:float32: .*bfloat16"):
        lp.install_linear_paths(small_net(), torch.float32, force="dpbf16")
    monkeypatch.setenv(lp.FORCE_ENV, "fast")
    with pytest.raises(ValueError, match="got 'fast'"):
        lp.install_linear_paths(small_net(), torch.float32, busy=False)


@needs_native
def test_info_lines_list_paths_and_cached_choices(cache_dir):
    before = "\n".join(lp.describe_here())
    assert "cached choices: none" in before
    assert all(p.value in before for p in LinearPath)
    # the weight-dtype reason is given on every CPU (another may follow where the CPU
    # also lacks the avx512bf16 kernels)
    assert "(dpbf16: takes bfloat16 weights only, got torch.float32" in before
    lp.install_linear_paths(small_net(), torch.float32, busy=False)
    after = "\n".join(lp.describe_here())
    assert "24x40:float32" in after and "257+:" in after
