"""XFORMERS_VLLM_V1: the parts that need neither a GPU nor Triton.

The forward paths run in tests/gpu_kernels/ (Triton interpreter, or a GPU).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pagedattn import paging
from pagedattn.backend import AttentionType, CommonAttentionMetadata
from pagedattn.backends.xformers import (
    XFormersAttentionBackend,
    XFormersAttentionImpl,
    XFormersAttentionMetadata,
    XFormersAttentionMetadataBuilder,
    xformers_problems,
)
from pagedattn.config import CacheConfig, DeviceCapability, BuilderConfig, ModelConfig
from pagedattn.kv_cache_spec import AttentionSpec
from pagedattn.ops.reference import visibility_mask
from pagedattn.testing import BatchSpec, make_paged_batch

H, HKV, D = 8, 2, 64


def test_backend_names_and_capabilities():
    B = XFormersAttentionBackend
    assert B.get_name() == "XFORMERS_VLLM_V1"
    assert B.accept_output_buffer is True
    assert B.get_supported_dtypes() == [torch.float16, torch.bfloat16]
    assert B.get_supported_head_sizes() == list(range(32, 257, 8))
    assert B.get_impl_cls() is XFormersAttentionImpl
    assert B.get_builder_cls() is XFormersAttentionMetadataBuilder
    assert B.get_metadata_cls() is XFormersAttentionMetadata
    assert B.use_cascade_attention() is False
    assert B.get_kv_cache_shape(10, 32, 2, 64) == (2, 10, 32, 2, 64)
    with pytest.raises(ValueError, match="Block size must be a multiple of 16."):
        B.get_kv_cache_shape(10, 8, 2, 64)
    with pytest.raises(ValueError, match=r"Head size 36 is not supported by XFormersAttention\. "
                                         r"Supported head sizes are: \[32, 40,"):
        B.validate_head_size(36)
    B.validate_head_size(72)


def test_impl_rejects_what_the_seed_rejects():
    args = dict(num_heads=H, head_size=D, scale=0.1, num_kv_heads=HKV, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto")
    with pytest.raises(NotImplementedError, match="KV sharing is not supported"):
        XFormersAttentionImpl(**args, kv_sharing_target_layer_name="layer.0")
    with pytest.raises(NotImplementedError, match="does not support alibi slopes"):
        XFormersAttentionImpl(**{**args, "alibi_slopes": [0.1] * H})
    with pytest.raises(NotImplementedError, match="Encoder self-attention"):
        XFormersAttentionImpl(**args, attn_type=AttentionType.ENCODER_DECODER)
    with pytest.raises(ValueError, match="Head size 36"):
        XFormersAttentionImpl(**{**args, "head_size": 36})
    with pytest.raises(NotImplementedError, match="fp8"):
        XFormersAttentionImpl(**{**args, "kv_cache_dtype": "fp8"})
    impl = XFormersAttentionImpl(**{**args, "sliding_window": 32}, logits_soft_cap=None)
    assert impl.sliding_window == (31, 0) and impl.logits_soft_cap == 0
    assert impl.num_queries_per_kv == 4
    out = torch.zeros(3, H, D)
    assert impl.forward(None, out, out, out, torch.zeros(2, 1, 16, HKV, D), None,
                        output=out) is out  # profiling run


def test_module_imports_without_xformers_and_triton_and_says_why():
    # Hide both libraries from a fresh interpreter (a None entry in sys.modules makes
    # their import fail like a missing package).
    code = textwrap.dedent("""
        import sys
        sys.modules["xformers"] = None
        sys.modules["triton"] = None
        import torch
        from pagedattn import registry
        import pagedattn.backends.xformers as xf
        import pagedattn.backends.triton_attn  # noqa: F401
        config = registry.default_selector_config(64, torch.float16, device="cpu")
        print(registry.unsupported_reasons("XFORMERS_VLLM_V1", config))
        print(registry.unsupported_reasons("TRITON_ATTN", config))
        from pagedattn.config import BuilderConfig, ModelConfig
        from pagedattn.kv_cache_spec import AttentionSpec
        try:
            xf.XFormersAttentionMetadataBuilder(
                AttentionSpec(16, 2, 64, torch.float16), ["l0"],
                BuilderConfig(model_config=ModelConfig(dtype=torch.float16)), "cpu")
        except RuntimeError as exc:
            print(exc)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    xformers_line, triton_line, builder_line = run.stdout.strip().splitlines()
    assert builder_line == ("XFORMERS_VLLM_V1 needs xformers: xformers is not installed "
                            "(pip install --no-deps xformers)")
    assert "device type cpu not supported (needs cuda)" in xformers_line
    assert "xformers is not installed" in xformers_line
    assert "triton is not installed" in triton_line


def test_problems_on_cpu_name_the_gpu():
    assert any("CUDA GPU" in p or "not installed" in p or "not importable" in p
               for p in xformers_problems(DeviceCapability(0, 0)))


# ------------------------------------------------------------------------- builder

def _builder(block_size=16):
    pytest.importorskip("xformers.ops.fmha.attn_bias",
                        reason="xformers is not installed (make setup installs it)")
    config = BuilderConfig(
        model_config=ModelConfig(dtype=torch.float16, num_attention_heads=H, num_kv_heads=HKV,
                                 head_size=D),
        cache_config=CacheConfig(block_size=block_size))
    spec = AttentionSpec(block_size, HKV, D, torch.float16)
    return XFormersAttentionMetadataBuilder(spec, ["layer0"], config, torch.device("cpu"))


def _common(batch, block_size):
    return CommonAttentionMetadata.from_lens(batch.spec.query_lens, batch.spec.seq_lens,
                                             batch.block_table, batch.slot_mapping,
                                             block_size=block_size)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_bias_materializes_to_the_reference_visibility(block_size, seed):
    builder = _builder(block_size)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = tuple(int(x) for x in torch.randint(1, 150, (5,), generator=gen))
    spec = BatchSpec("decodes_then_prefill", seq_lens + (40,), (1,) * 5 + (12,))
    batch = make_paged_batch(spec, num_heads=H, num_kv_heads=HKV, head_size=D,
                             block_size=block_size, dtype=torch.float16, seed=seed)
    meta = builder.build(0, _common(batch, block_size))
    assert (meta.num_decodes, meta.num_prefills) == (5, 1)
    assert (meta.num_decode_tokens, meta.num_prefill_tokens) == (5, 12)
    table = batch.block_table[:5]
    max_row = table.shape[1] * block_size
    dense = meta.attn_bias.materialize((5, 5 * max_row))
    # Reference: decode r sees exactly the slots of its visible keys.
    expected = torch.full((5, dense.shape[1]), float("-inf"))
    for r, kv_len in enumerate(seq_lens):
        visible = visibility_mask(1, kv_len, causal=True)[0]
        slots = paging.slots_for_positions(table[r], torch.arange(kv_len), block_size)
        expected[r, slots[visible]] = 0.0
    assert torch.equal(dense, expected)
    assert meta.decode_metadata.attn_bias is meta.attn_bias


def test_metadata_views_split_decodes_from_prefills_and_are_cached():
    builder = _builder()
    spec = BatchSpec("mixed", (30, 9, 50, 20), (1, 1, 7, 20))
    batch = make_paged_batch(spec, num_heads=H, num_kv_heads=HKV, head_size=D, block_size=16,
                             dtype=torch.float16)
    meta = builder.build(0, _common(batch, 16))
    prefill, decode = meta.prefill_metadata, meta.decode_metadata
    assert meta.prefill_metadata is prefill and meta.decode_metadata is decode
    assert prefill.query_start_loc.tolist() == [0, 7, 27]
    assert prefill.seq_lens.tolist() == [50, 20] and prefill.max_seq_len == 50
    assert prefill.max_query_len == 20 and prefill.num_actual_tokens == 27
    assert torch.equal(prefill.block_table, batch.block_table[2:])
    assert torch.equal(prefill.slot_mapping, batch.slot_mapping[2:])
    assert decode.query_start_loc.tolist() == [0, 1, 2] and decode.max_query_len == 1
    assert decode.seq_lens.tolist() == [30, 9] and decode.num_actual_tokens == 2
    only_prefill = builder.build(0, _common(make_paged_batch(
        BatchSpec("p", (12,), (12,)), num_heads=H, num_kv_heads=HKV, head_size=D,
        block_size=16, dtype=torch.float16), 16))
    assert only_prefill.decode_metadata is None and only_prefill.attn_bias is None


def test_builder_rejects_a_batch_that_was_not_reordered():
    builder = _builder()
    spec = BatchSpec("decode_prefill_decode", (30, 9, 4), (1, 5, 1))
    batch = make_paged_batch(spec, num_heads=H, num_kv_heads=HKV, head_size=D, block_size=16,
                             dtype=torch.float16)
    with pytest.raises(ValueError, match="decode after the first prefill"):
        builder.build(0, _common(batch, 16))


class _Batch:
    def __init__(self, req_ids):
        self.req_ids = list(req_ids)

    def swap_states(self, i, j):
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]


class _SchedulerOutput:
    def __init__(self, num_scheduled_tokens):
        self.num_scheduled_tokens = num_scheduled_tokens


def test_reorder_batch_puts_decodes_first():
    builder = _builder()
    assert builder.reorder_batch_threshold == 1
    batch = _Batch(["a", "b", "c", "d"])
    moved = builder.reorder_batch(batch, _SchedulerOutput({"a": 5, "b": 1, "c": 9, "d": 1}))
    assert moved and batch.req_ids == ["d", "b", "c", "a"]
    assert not builder.reorder_batch(batch, _SchedulerOutput({"a": 5, "b": 1, "c": 9, "d": 1}))
