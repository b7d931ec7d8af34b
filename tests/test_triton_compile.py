"""The Triton kernels compile for NVIDIA GPUs, checked without a GPU.

Triton's wheel ships ``ptxas``, so ``triton.compile`` lowers a kernel down to a cubin
for a named target on any machine. This catches what the interpreter cannot: typing of
loop-carried values, ``tl.dot`` shape and dtype rules, bf16 and fp8 lowering per
architecture. Numerics are checked elsewhere (tests/gpu_kernels, interpreter or GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedattn.ops import triton as tops
from pagedattn.testing import BatchSpec, make_paged_batch

triton = pytest.importorskip("triton", reason="triton is not installed (make setup installs it)")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("kernels are interpreted in this process; compiling needs JIT functions",
                allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402

from pagedattn.ops.triton import _kernels  # noqa: E402

_TRITON_TYPES = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
    torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
H100, A100 = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)


def compile_for(launch: tops.KernelLaunch, target: GPUTarget):
    """Compile ``launch`` (signature from its arguments) for ``target``."""
    fn = getattr(_kernels, launch.kernel)
    signature, constexprs = {}, {}
    args = list(launch.args)
    for name in fn.arg_names:
        if name in launch.constexprs:
            signature[name], constexprs[name] = "constexpr", launch.constexprs[name]
            continue
        arg = args.pop(0)
        if isinstance(arg, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[arg.dtype]
        elif isinstance(arg, int) and arg == 1:
            # Triton's launcher turns an int argument equal to 1 into a constant.
            signature[name], constexprs[name] = "constexpr", 1
        elif isinstance(arg, int):
            signature[name] = "i32"
        else:
            signature[name] = "fp32"
    assert not args, "launch has more arguments than the kernel"
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=target, options=launch.options)


def batch(dtype):
    return make_paged_batch(BatchSpec("mixed", (40, 1), (5, 1)), num_heads=6, num_kv_heads=2,
                            head_size=40, block_size=16, dtype=dtype, layout="flash")


@pytest.mark.parametrize("target, dtype", [(H100, torch.bfloat16), (H100, torch.float32)],
                         ids=["sm90-bf16", "sm90-fp32"])
def test_unified_attention_compiles_with_every_feature(target, dtype):
    b = batch(dtype)
    launch = tops.plan_unified_attention(
        b.query, b.key_cache, b.value_cache, torch.empty_like(b.query), b.query_start_loc, 5,
        b.seq_lens, 40, 0.1, True, torch.zeros(6), (3, 2), b.block_table, 2.0, None, None,
        None, sinks=torch.zeros(6))
    assert compile_for(launch, target).asm["cubin"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_split_kv_launches_compile(dtype):
    b = batch(dtype)
    attend = tops.plan_unified_attention(
        b.query, b.key_cache, b.value_cache, torch.empty_like(b.query), b.query_start_loc, 5,
        b.seq_lens, 40, 0.1, True, torch.zeros(6), (3, 2), b.block_table, 2.0, None, None,
        None, sinks=torch.zeros(6), num_kv_splits=3)
    assert attend.grid[2] == 3 and attend.then.kernel == "merge_kv_splits_kernel"
    assert compile_for(attend, H100).asm["cubin"]
    assert compile_for(attend.then, H100).asm["cubin"]


def test_a_step_plan_is_made_once_and_every_launch_uses_its_buffers():
    # The builder plans the split once per step; each layer's launch reads the plan's
    # partial buffers instead of allocating its own, and compiles the same.
    b = batch(torch.bfloat16)
    plan = tops.plan_kv_splits("cpu", torch.bfloat16, num_tokens=b.query.shape[0], num_reqs=2,
                               num_heads=6, num_kv_heads=2, head_size=40, max_seqlen_q=5,
                               max_seqlen_k=40, num_kv_splits=3)
    assert plan.partial_acc.shape == (b.query.shape[0], 6, 3, 64)
    assert plan.partial_ml.shape == (2, b.query.shape[0], 6, 3)
    args = (b.query, b.key_cache, b.value_cache, torch.empty_like(b.query), b.query_start_loc,
            5, b.seq_lens, 40, 0.1, True, None, (-1, -1), b.block_table, 0.0, None, None, None)
    layers = [tops.plan_unified_attention(*args, kv_split_plan=plan) for _ in range(2)]
    for attend in layers:
        assert attend.grid[2] == 3
        assert any(a is plan.partial_acc for a in attend.args)
        assert any(a is plan.partial_ml for a in attend.then.args)
    assert compile_for(layers[0], H100).asm["cubin"]
    # Off the GPU, nothing is split unless asked, and no buffer is made.
    assert tops.plan_kv_splits("cpu", torch.bfloat16, num_tokens=7, num_reqs=2, num_heads=6,
                               num_kv_heads=2, head_size=40, max_seqlen_q=1,
                               max_seqlen_k=40) == tops.KVSplitPlan(1)
    # A plan made for another batch is refused, naming what it should hold.
    other = tops.plan_kv_splits("cpu", torch.bfloat16, num_tokens=3, num_reqs=2, num_heads=6,
                                num_kv_heads=2, head_size=40, max_seqlen_q=5, max_seqlen_k=40,
                                num_kv_splits=3)
    with pytest.raises(ValueError, match=r"kv_split_plan.partial_acc must be .*\(the plan of "):
        tops.plan_unified_attention(*args, kv_split_plan=other)
    with pytest.raises(ValueError, match="not both"):
        tops.plan_unified_attention(*args, kv_split_plan=plan, num_kv_splits=3)


def test_unified_attention_compiles_when_ints_are_specialized_to_one():
    # One request, one kv head, one query per kv head: num_reqs, queries_per_kv and
    # several strides become compile-time 1s. (Also the fp16 / sm80 case.)
    b = make_paged_batch(BatchSpec("one", (30,), (1,)), num_heads=1, num_kv_heads=1,
                         head_size=64, block_size=16, dtype=torch.float16, layout="flash")
    launch = tops.plan_unified_attention(
        b.query, b.key_cache, b.value_cache, torch.empty_like(b.query), b.query_start_loc, 1,
        b.seq_lens, 30, 0.1, True, None, (1, -1), b.block_table, 0.0, None, None, None)
    assert compile_for(launch, A100).asm["cubin"]
    write = tops.plan_reshape_and_cache_flash(b.new_keys, b.new_values, b.key_cache,
                                              b.value_cache, b.slot_mapping, "auto", 1.0, 1.0)
    assert compile_for(write, A100).asm["cubin"]


@pytest.mark.parametrize("target, fp8", [(H100, torch.float8_e4m3fn),
                                         (A100, torch.float8_e5m2)], ids=["sm90-e4m3",
                                                                          "sm80-e5m2"])
def test_fp8_cache_kernels_compile(target, fp8):
    b = batch(torch.float16)
    cache = b.key_cache.float().nan_to_num(0.0).to(fp8)
    attend = tops.plan_unified_attention(
        b.query, cache, cache, torch.empty_like(b.query), b.query_start_loc, 5, b.seq_lens,
        40, 0.1, True, None, (-1, -1), b.block_table, 0.0, None, torch.ones(2, 2),
        torch.ones(2, 2))
    write = tops.plan_reshape_and_cache_flash(b.new_keys, b.new_values, cache, cache.clone(),
                                              b.slot_mapping, "fp8_e5m2" if fp8 ==
                                              torch.float8_e5m2 else "fp8", 1.0, 1.0)
    assert compile_for(attend, target).asm["cubin"]
    assert compile_for(write, target).asm["cubin"]


def test_e4m3_cache_does_not_lower_before_sm89_and_the_backend_says_so():
    b = batch(torch.float16)
    cache = b.key_cache.float().nan_to_num(0.0).to(torch.float8_e4m3fn)
    attend = tops.plan_unified_attention(
        b.query, cache, cache, torch.empty_like(b.query), b.query_start_loc, 5, b.seq_lens,
        40, 0.1, True, None, (-1, -1), b.block_table, 0.0, None, None, None)
    with pytest.raises(triton.compiler.errors.CompilationError, match="fp8e4nv not supported"):
        compile_for(attend, A100)
    from pagedattn.backends.triton_attn import TritonAttentionBackend
    from pagedattn.config import DeviceCapability

    reason = TritonAttentionBackend.supports_combination(
        40, torch.float16, "fp8", 16, False, False, False, DeviceCapability(8, 0))
    assert "use fp8_e5m2" in reason
    assert TritonAttentionBackend.supports_combination(
        40, torch.float16, "fp8", 16, False, False, False, DeviceCapability(9, 0)) is None
