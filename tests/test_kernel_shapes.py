"""One source of truth for head sizes and block sizes: pagedattn/ops/kernel_shapes.py.
The C++ checks are generated from it (the checked-in header must be current) and agree
with it value by value; the backend and CacheConfig advertise exactly it."""

from __future__ import annotations

import pytest
import torch

from pagedattn import ops
from pagedattn.backends.cpu_attn import CPUAttentionBackend
from pagedattn.config import CONFIGURABLE_BLOCK_SIZES, CacheConfig
from pagedattn.ops import kernel_shapes

from header_generators import generator

native = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")


def test_generated_header_is_current():
    gen = generator("generate_shapes_header.py")
    with open(gen.HEADER) as f:
        assert gen.render(gen.load_shapes_module()) == f.read(), (
            "csrc/cpu/kernel_shapes_generated.h is stale: run "
            "python csrc/cpu/generate_shapes_header.py")


def test_the_rule():
    assert kernel_shapes.SUPPORTED_HEAD_SIZES == tuple(range(32, 513, 8))
    assert kernel_shapes.SUPPORTED_BLOCK_SIZES == (1, 8) + tuple(range(16, 513, 16))


def test_backend_and_config_advertise_exactly_the_rule():
    assert CPUAttentionBackend.get_supported_head_sizes() == list(kernel_shapes.SUPPORTED_HEAD_SIZES)
    assert CPUAttentionBackend.get_supported_kernel_block_sizes() == list(
        kernel_shapes.SUPPORTED_BLOCK_SIZES)
    for bs in range(0, 600):
        configurable = bs in CONFIGURABLE_BLOCK_SIZES
        assert configurable == kernel_shapes.is_supported_block_size(bs), bs
        assert CPUAttentionBackend.supports_block_size(bs) == configurable, bs
        if configurable:
            assert CacheConfig(block_size=bs).block_size == bs
        else:
            with pytest.raises(ValueError, match="block_size must be one of"):
                CacheConfig(block_size=bs)


@native
def test_cpp_head_size_check_agrees_value_by_value():
    lens = torch.tensor([4], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    for hs in range(1, 600):
        args = (1, 4, 2, hs, lens, torch.bfloat16, qsl, True, -1, "vec16", True)
        if kernel_shapes.is_supported_head_size(hs):
            ops.cpu_attn_get_scheduler_metadata(*args)
        else:
            with pytest.raises(ValueError, match=f"head_size {hs} is not supported"):
                ops.cpu_attn_get_scheduler_metadata(*args)


@native
def test_cpp_block_size_check_agrees_value_by_value():
    key = torch.zeros(1, 1, 32)
    slots = torch.tensor([0])
    for bs in range(1, 600):
        cache = torch.zeros(2, 1, bs, 32)
        # vec16 serves every multiple of 16 (and 1, 8); the rule itself decides the rest
        args = (key, key, cache, cache.clone(), slots, "vec16")
        if kernel_shapes.is_supported_block_size(bs):
            ops.cpu_attn_reshape_and_cache(*args)
        else:
            with pytest.raises(ValueError, match=f"block_size {bs} is not supported"):
                torch.ops.pagedattn.cpu_attn_reshape_and_cache(
                    key, key, cache, cache.clone(), slots)
