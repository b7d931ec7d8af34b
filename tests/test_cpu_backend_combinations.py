"""CPU_ATTN says exactly what it runs: every configuration ``validate_configuration``
accepts runs through builder -> impl.forward and matches the reference, and every one it
rejects carries the documented reason (and the layer raises, naming the value).

Axes: model dtype x kv-cache dtype x head size x block size x attention type x feature.
The whole product (~200k points with the sink flag) is validated; running it all would
take hours, so the runs cover every *pair* of axis values (each head size with every
dtype, cache dtype, attention type and feature, each block size likewise, ...) except head
size x block size, which test_cpu_ops.py runs size by size under every ISA: a bug that
needs two particular values together is caught, with a few hundred small runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from pagedattn.backend import AttentionType, CommonAttentionMetadata
from pagedattn.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from pagedattn.config import CONFIGURABLE_BLOCK_SIZES, CacheConfig, BuilderConfig, ModelConfig
from pagedattn.kv_cache_spec import AttentionSpec, CrossAttentionSpec
from pagedattn.ops import kernel_shapes
from pagedattn.ops import reference as ref
from pagedattn.testing import TOLERANCES, BatchSpec, make_paged_batch

B = CPUAttentionBackend
H, HKV = 4, 2
FEATURES = ("plain", "sinks", "alibi", "window", "softcap")
SCALES = SimpleNamespace(_k_scale_float=0.04, _v_scale_float=0.03)


def advertised_axes() -> dict[str, list]:
    return {
        "dtype": B.get_supported_dtypes(),
        "cache": [str(c) for c in B.supported_kv_cache_dtypes],
        "head": B.get_supported_head_sizes(),
        "block": [b for b in CONFIGURABLE_BLOCK_SIZES if B.supports_block_size(b)],
        "attn_type": [t for t in AttentionType if B.supports_attn_type(t)],
        "feature": list(FEATURES),
    }


def validate(dtype, cache, head, block, attn_type, has_sink=False, **kw) -> list[str]:
    args = dict(head_size=head, dtype=dtype, kv_cache_dtype=cache, block_size=block,
                use_mla=False, has_sink=has_sink, use_sparse=False, use_mm_prefix=False,
                device_capability=(0, 0), attn_type=attn_type)
    args.update(kw)
    return B.validate_configuration(**args)


def test_advertised_sizes_are_the_kernel_rule():
    axes = advertised_axes()
    assert axes["head"] == list(kernel_shapes.SUPPORTED_HEAD_SIZES)
    assert axes["block"] == list(kernel_shapes.SUPPORTED_BLOCK_SIZES)
    assert 48 in axes["block"] and 512 in axes["block"] and 1 in axes["block"]
    assert {40, 72, 192, 320, 512} <= set(axes["head"])
    assert set(axes["cache"]) == {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}


def test_every_advertised_combination_validates():
    axes = advertised_axes()
    for dtype, cache, head, block, attn_type, sink in itertools.product(
            axes["dtype"], axes["cache"], axes["head"], axes["block"], axes["attn_type"],
            (False, True)):
        assert validate(dtype, cache, head, block, attn_type, has_sink=sink) == [], (
            dtype, cache, head, block, attn_type, sink)


def pairwise_rows() -> list[dict]:
    """Rows covering every pair of values of two axes, except head size x block size (each
    head size and each block size runs under every ISA with a cycling partner in
    test_cpu_ops.py::test_head_and_block_sizes; all 2074 pairs here would take minutes).
    Greedy: each new row takes, axis by axis, the value that covers most missing pairs."""
    axes = advertised_axes()
    names = list(axes)
    skip = {("head", "block"), ("block", "head")}
    missing = {(a, va, b, vb) for a, b in itertools.combinations(names, 2) if (a, b) not in skip
               for va in axes[a] for vb in axes[b]}
    rows = []
    for pair in sorted(missing, key=repr):
        if pair not in missing:
            continue
        a, va, b, vb = pair
        row = {a: va, b: vb}
        for n in names:
            if n in row:
                continue
            def gain(v, n=n):
                return sum((m, row[m], n, v) in missing or (n, v, m, row[m]) in missing
                           for m in row)
            row[n] = max(axes[n], key=gain)
        for x, y in itertools.combinations(names, 2):
            missing.discard((x, row[x], y, row[y]))
        rows.append(row)
    return rows


def _row_id(row: dict) -> str:
    dt = str(row["dtype"]).removeprefix("torch.")
    return f"{dt}-{row['cache']}-h{row['head']}-b{row['block']}-{row['attn_type'].value}-{row['feature']}"


def make_impl(row, head):
    feature, attn_type = row["feature"], row["attn_type"]
    gen = torch.Generator().manual_seed(5)
    window = 5 if feature == "window" and attn_type != AttentionType.ENCODER_DECODER else None
    return CPUAttentionBackendImpl(
        num_heads=H, head_size=head, scale=head ** -0.5, num_kv_heads=HKV,
        alibi_slopes=(torch.rand(H, generator=gen) * 0.2).tolist() if feature == "alibi" else None,
        sliding_window=window, kv_cache_dtype=row["cache"],
        logits_soft_cap=3.0 if feature == "softcap" else None, attn_type=attn_type,
        sinks=torch.randn(H, generator=gen) if feature == "sinks" else None,
    )


def stored(cache: torch.Tensor, fp8, scale: float) -> torch.Tensor:
    """What the layer's cache holds for these values (fp8: quantised)."""
    return cache.clone() if fp8 is None else ref.quantize_fp8(cache, scale, fp8)


def kv_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[2, ...]`` K then V (fp8 stacked as bytes: torch has few fp8 kernels)."""
    if k.dtype in ref.FP8_DTYPES:
        return torch.stack([k.view(torch.uint8), v.view(torch.uint8)]).view(k.dtype)
    return torch.stack([k, v])


def read(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return ref.dequantize_fp8(cache, scale) if cache.dtype in ref.FP8_DTYPES else cache.float()


def same_cache(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in ref.FP8_DTYPES:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        return torch.equal(a, b)
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def run_row(row: dict) -> None:
    dtype, head, block, attn_type = row["dtype"], row["head"], row["block"], row["attn_type"]
    fp8 = ref.FP8_CACHE_DTYPES.get(row["cache"])
    ks, vs = SCALES._k_scale_float, SCALES._v_scale_float
    impl = make_impl(row, head)
    config = BuilderConfig(
        model_config=ModelConfig(dtype=dtype, num_attention_heads=H, num_kv_heads=HKV,
                                 head_size=head),
        cache_config=CacheConfig(block_size=block, cache_dtype=row["cache"]))
    cache_dtype = fp8 or dtype
    encoder = attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
    cross = attn_type == AttentionType.ENCODER_DECODER
    lens = (19, 2) if not encoder else (6, 3)  # 19 keys: several blocks of 1, 8 and 16
    spec = BatchSpec("walk", lens, lens if (encoder or cross) else (2, 1))
    batch = make_paged_batch(spec, num_heads=H, num_kv_heads=HKV, head_size=head,
                             block_size=block, dtype=dtype, seed=head + block)
    window = impl.sliding_window[0] + 1 if impl.sliding_window[0] >= 0 else None
    kv_spec = (CrossAttentionSpec(block, HKV, head, cache_dtype, max_encoder_len=64) if cross
               else AttentionSpec(block, HKV, head, cache_dtype,
                                  sliding_window=None if encoder else window))
    builder = CPUAttentionMetadataBuilder(kv_spec, ["l0"], config, torch.device("cpu"))
    # The cache the layer holds before the step: the context only (new slots: NaN).
    context = torch.stack([batch.key_cache, batch.value_cache])
    if not encoder:
        for slot in batch.slot_mapping.tolist():
            context[:, slot // block, :, slot % block] = math.nan
    kv_cache = kv_pair(stored(context[0], fp8, ks), stored(context[1], fp8, vs))
    if cross:  # one decoder step over the encoder's keys, which arrive in this step
        query_lens, seq_lens = (2, 1), (2, 1)
        common = CommonAttentionMetadata.from_lens(query_lens, seq_lens, batch.block_table,
                                                   batch.slot_mapping, block_size=block)
        common = dataclasses.replace(common, encoder_seq_lens=batch.seq_lens.clone())
        query = torch.randn(3, H, head, generator=torch.Generator().manual_seed(2)).to(dtype)
        qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    else:
        common = CommonAttentionMetadata.from_lens(
            spec.query_lens, spec.seq_lens, batch.block_table, batch.slot_mapping,
            causal=not encoder, block_size=block)
        query, qsl = batch.query, batch.query_start_loc
    metadata = builder.build(0, common)
    output = torch.full_like(query, math.nan)
    impl.forward(SCALES, query, batch.new_keys, batch.new_values, kv_cache, metadata,
                 output=output)
    if encoder:  # no cache: the step's own keys, unquantised
        want_k, want_v = batch.key_cache.float(), batch.value_cache.float()
    else:  # the cache now holds what reshape_and_cache stores, and attention read that
        full = kv_pair(stored(batch.key_cache, fp8, ks), stored(batch.value_cache, fp8, vs))
        assert same_cache(kv_cache, full), "the written cache differs from the reference write"
        want_k, want_v = read(kv_cache[0], ks), read(kv_cache[1], vs)
    want = ref.paged_attention(
        query.float(), want_k, want_v, qsl, batch.seq_lens, batch.block_table,
        scale=impl.scale, causal=not (encoder or cross), sliding_window=impl.sliding_window,
        softcap=impl.logits_soft_cap, alibi_slopes=impl.alibi_slopes, s_aux=impl.sinks)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(output.float(), want.float(), atol=atol, rtol=rtol)


ROWS = pairwise_rows()


# The fast tier runs the first 50 rows: every dtype, cache dtype, attention type and
# feature appears in them (every head and block size runs in test_cpu_ops.py's
# test_head_and_block_sizes). The slow tier runs the rest, about 10 s per 50 rows on 2 cores.
@pytest.mark.parametrize("chunk", [pytest.param(c, marks=pytest.mark.slow if c else ())
                                   for c in range(0, len(ROWS), 50)], ids=lambda c: f"rows{c}")
def test_pairwise_advertised_combinations_run_and_match_reference(chunk):
    for row in ROWS[chunk:chunk + 50]:
        try:
            run_row(row)
        except Exception as exc:
            raise AssertionError(f"{_row_id(row)}: {type(exc).__name__}: {exc}") from exc


REJECTED = {
    # axis value -> (validate kwargs override, documented reason)
    "head_36": (dict(head=36), "head_size not supported"),
    "head_520": (dict(head=520), "head_size not supported"),
    "head_24": (dict(head=24), "head_size not supported"),
    "block_24": (dict(block=24), "block_size not supported"),
    "block_528": (dict(block=528), "block_size not supported"),
    "dtype_f64": (dict(dtype=torch.float64), "dtype not supported"),
    "cache_fp8_inc": (dict(cache="fp8_inc"), "kv_cache_dtype not supported"),
    "cache_bfloat16": (dict(cache="bfloat16"), "kv_cache_dtype not supported"),
    "mla": (dict(use_mla=True), "MLA not supported"),
    "sparse": (dict(use_sparse=True), "sparse not supported"),
    "mm_prefix": (dict(use_mm_prefix=True),
                  "partial multimodal token full attention not supported"),
}


@pytest.mark.parametrize("case", REJECTED)
def test_every_rejected_value_gives_its_documented_reason(case):
    override, reason = REJECTED[case]
    base = dict(dtype=torch.bfloat16, cache="auto", head=128, block=16,
                attn_type=AttentionType.DECODER)
    kw = {k: v for k, v in override.items() if k not in base}
    base.update({k: v for k, v in override.items() if k in base})
    assert validate(**base, **kw) == [reason]


@pytest.mark.parametrize("head", [36, 520])
def test_rejected_head_size_raises_from_the_op_naming_the_rule(head):
    from pagedattn import ops

    if not ops.native_available():
        pytest.skip("native extension not built")
    with pytest.raises(ValueError, match=f"head_size {head} is not supported; expected a "
                                         "multiple of 8 from 32 to 512"):
        ops.cpu_attn_get_scheduler_metadata(1, 4, 2, head, torch.tensor([4], dtype=torch.int32),
                                            torch.bfloat16, torch.tensor([0, 1], dtype=torch.int32),
                                            True, -1, "vec16", True)


@pytest.mark.parametrize("block", [2, 24, 528])
def test_rejected_block_size_raises_from_config_and_the_engine_naming_the_rule(block):
    from pagedattn.engine.args import EngineArgs

    with pytest.raises(ValueError, match=f"block_size must be one of .* got {block}"):
        CacheConfig(block_size=block)
    with pytest.raises(ValueError, match=f"block_size must be one of .*1, 8 or a multiple of "
                                         f"16 up to 512.* got {block}"):
        EngineArgs(block_size=block)


def test_rejected_cache_dtype_raises_from_the_impl():
    with pytest.raises(NotImplementedError, match="kv_cache_dtype 'fp8_inc' is unsupported"):
        CPUAttentionBackendImpl(H, 64, 0.1, HKV, None, None, "fp8_inc")
