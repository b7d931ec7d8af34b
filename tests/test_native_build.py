"""The native extension itself: ISA detection/forcing/switching, hint validation, the
generated C++ header, op registration (opcheck, torch.compile), metadata/thread-count
handling, and a native-vs-reference smoke test under every ISA this CPU executes.
(The full feature grid and bad-input table live in tests/test_cpu_ops.py.)"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from pagedattn import ops
from pagedattn.ops import reference as ref
from pagedattn.backends.cpu_runtime import kernel_variant
from pagedattn.ops.isa import CPU_ISA_NAMES, CpuIsa, IsaHint
from pagedattn.testing import TOLERANCES, BatchSpec, make_paged_batch

from header_generators import generator  # noqa: E402

native = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")


def _load_generator():
    return generator("generate_isa_header.py")


def test_generated_header_matches_python_names():
    gen = _load_generator()
    with open(gen.HEADER) as f:
        checked_in = f.read()
    assert gen.render(gen.load_isa_module()) == checked_in, (
        "csrc/cpu/isa_generated.h is stale: run python csrc/cpu/generate_isa_header.py")
    for code, name in enumerate(CPU_ISA_NAMES):
        assert f'case {code}: return "{name}";' in checked_in


def test_isa_names_parse_once_with_helpful_errors():
    assert CpuIsa.parse("AVX2") is CpuIsa.AVX2
    assert CpuIsa.from_code(CpuIsa.AVX512BF16.code) is CpuIsa.AVX512BF16
    with pytest.raises(ValueError, match=r"'sse4'.*'scalar', 'avx2'"):
        CpuIsa.parse("sse4")
    with pytest.raises(ValueError, match=r"'vec', 'vec16', 'neon', 'amx'"):
        IsaHint.parse("amx2")
    assert IsaHint.VEC.block_multiple == 32 and IsaHint.VEC16.block_multiple == 16


# ------------------------------------------------------------------ ISA selection


@native
def test_native_build_names_the_loaded_file_and_changes_with_it(tmp_path, monkeypatch):
    from pagedattn.ops import _native
    loaded = sys.modules["pagedattn._C"].__file__
    st = os.stat(loaded)
    assert ops.native_build() == f"{st.st_size}-{st.st_mtime_ns}"
    fake = tmp_path / "_C.so"
    fake.write_bytes(b"x" * 10)
    os.utime(fake, ns=(1, 1_000_000_000))
    monkeypatch.setattr(sys.modules["pagedattn._C"], "__file__", str(fake))
    first = ops.native_build()
    assert first == "10-1000000000"
    os.utime(fake, ns=(1, 2_000_000_000))  # rebuilt in place: same size, newer
    assert ops.native_build() != first
    fake.unlink()
    assert ops.native_build() == "unknown"
    monkeypatch.setattr(_native, "AVAILABLE", False)
    assert ops.native_build() == "none"


@native
def test_best_isa_is_supported_and_default():
    supported = ops.supported_cpu_isas()
    assert CpuIsa.SCALAR in supported
    assert ops.best_cpu_isa() in supported
    if "PAGEDATTN_CPU_ISA" not in os.environ:
        assert ops.get_cpu_isa() is ops.best_cpu_isa()


@native
def test_use_cpu_isa_switches_and_restores():
    before = ops.get_cpu_isa()
    with ops.use_cpu_isa("scalar") as isa:
        assert isa is CpuIsa.SCALAR and ops.get_cpu_isa() is CpuIsa.SCALAR
    assert ops.get_cpu_isa() is before


@native
def test_unsupported_isa_is_a_clear_error():
    missing = [i for i in CpuIsa if i not in ops.supported_cpu_isas()]
    if not missing:
        pytest.skip("this CPU executes every ISA")
    with pytest.raises(NotImplementedError, match=missing[0].value):
        ops.set_cpu_isa(missing[0])
    with pytest.raises(ValueError, match="valid|expected"):
        torch.ops.pagedattn.set_cpu_isa(99)


def _run_python(code: str, env_isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PAGEDATTN_CPU_ISA": env_isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


@native
def test_env_var_forces_a_lower_isa():
    done = _run_python("from pagedattn import ops; print(ops.get_cpu_isa().value)", "scalar")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "scalar"


@native
@pytest.mark.parametrize("value,pattern", [("sse4", r"not a known ISA.*avx2"),
                                           ("missing", r"not supported by this CPU")])
def test_env_var_naming_a_bad_isa_raises_on_use(value, pattern):
    if value == "missing":
        missing = [i for i in CpuIsa if i not in ops.supported_cpu_isas()]
        if not missing:
            pytest.skip("this CPU executes every ISA")
        value = missing[0].value
    code = ("from pagedattn import ops\n"
            "try:\n    ops.get_cpu_isa()\nexcept NotImplementedError as e:\n    print(e)\n")
    done = _run_python(code, value)
    assert done.returncode == 0, done.stderr
    assert "PAGEDATTN_CPU_ISA" in done.stdout
    import re
    assert re.search(pattern, done.stdout), done.stdout


# ------------------------------------------------------------------ hints


@native
def test_the_vector_variant_takes_every_block_size_and_the_hints_keep_vllms_contract():
    # One vector variant whatever the block size (prefill_variant may pick 'amx' on top):
    # the kernels read the size from the cache. vLLM's hint strings keep their contract at
    # the public wrappers: 'vec' admits multiples of 32, 'vec16' of 16.
    assert kernel_variant() in ("vec16", "neon")
    key = torch.randn(1, 1, 32)
    slots = torch.tensor([3])
    for block in (8, 16, 48, 64):
        cache = torch.zeros(2, 1, block, 32)
        torch.ops.pagedattn.cpu_attn_reshape_and_cache(key, key, cache, cache.clone(), slots)
        assert torch.equal(cache[0, 0, 3], key[0, 0])
        ops.cpu_attn_reshape_and_cache(key, key, cache, cache.clone(), slots, "vec16")
        if block % 32 and block >= 16:
            with pytest.raises(ValueError, match=rf"block_size {block} .*'vec'.*32"):
                ops.cpu_attn_reshape_and_cache(key, key, cache, cache.clone(), slots, "vec")
        else:
            ops.cpu_attn_reshape_and_cache(key, key, cache, cache.clone(), slots, "vec")


@native
def test_amx_hint_needs_the_matrix_engine_and_block_mismatch_are_errors():
    seq_lens = torch.tensor([5], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    kwargs = dict(num_reqs=1, num_heads=4, num_kv_heads=2, head_dim=64, seq_lens=seq_lens,
                  dtype=torch.float32, query_start_loc=qsl, causal=True,
                  sliding_window_size=-1, enable_kv_split=True)
    if ops.matrix_engine_available():
        # 'amx' selects the matrix-engine prefill kernel, for every block size.
        batch = _batch(BatchSpec("one", (5,), (1,)), 4, 2, 64, 16, torch.float32)
        _attend(batch, ops.cpu_attn_get_scheduler_metadata(isa="amx", **kwargs))
    else:
        # A ValueError naming the hints this CPU accepts (also a NotImplementedError).
        with pytest.raises(ValueError, match="'amx' needs torch's brgemm microkernels .*valid on this CPU: 'vec', 'vec16'"):
            ops.cpu_attn_get_scheduler_metadata(isa="amx", **kwargs)
        with pytest.raises(NotImplementedError):
            ops.cpu_attn_get_scheduler_metadata(isa="amx", **kwargs)
        with pytest.raises(NotImplementedError, match="brgemm"):  # raw op, int code
            torch.ops.pagedattn.cpu_attn_get_scheduler_metadata(
                1, 4, 2, 64, seq_lens, torch.float32, qsl, True, -1, IsaHint.AMX.code, True)
    if platform.machine() not in ("aarch64", "arm64"):
        with pytest.raises(ValueError, match="'neon' needs an Arm"):
            ops.cpu_attn_get_scheduler_metadata(isa="neon", **kwargs)
    # 'vec' needs block_size % 32 == 0: a block-16 cache is refused by the attention op.
    batch = _batch(BatchSpec("one", (5,), (1,)), 4, 2, 64, 16, torch.float32)
    meta = ops.cpu_attn_get_scheduler_metadata(isa="vec", **kwargs)
    with pytest.raises(ValueError, match=r"block_size 16 .*'vec'.*32"):
        _attend(batch, meta)


# ------------------------------------------------------------------ helpers


def _batch(spec, heads, kv_heads, head_size, block_size, dtype, seed=0):
    return make_paged_batch(spec, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                            block_size=block_size, dtype=dtype, seed=seed)


def _metadata(batch, hint="vec16", split=True, window=-1):
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch.seq_lens.numel(), num_heads=batch.query.shape[1],
        num_kv_heads=batch.key_cache.shape[1], head_dim=batch.query.shape[2],
        seq_lens=batch.seq_lens, dtype=batch.query.dtype, query_start_loc=batch.query_start_loc,
        causal=True, sliding_window_size=window, isa=hint, enable_kv_split=split)


def _attend(batch, meta, s_aux=None, window=(-1, -1)):
    out = torch.full_like(batch.query, float("nan"))
    ops.cpu_attention_with_kv_cache(
        batch.query, batch.key_cache, batch.value_cache, out, batch.query_start_loc,
        batch.seq_lens, batch.query.shape[2] ** -0.5, True, None, window, batch.block_table,
        0.0, meta, s_aux)
    return out


def _reference(batch, s_aux=None, window=(-1, -1)):
    return ref.paged_attention(
        batch.query.float(), batch.key_cache.float(), batch.value_cache.float(),
        batch.query_start_loc, batch.seq_lens, batch.block_table,
        scale=batch.query.shape[2] ** -0.5, causal=True, sliding_window=window, s_aux=s_aux)


# ------------------------------------------------------------------ smoke per ISA


SMOKE = BatchSpec("smoke", (3000, 17, 50), (1, 2, 50))  # split-KV decode + spec + prefill


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_native_matches_reference_under_each_isa(isa, dtype):
    batch = _batch(SMOKE, 8, 1, 80, 32, dtype)  # MQA: few items -> the 3000-key decode splits
    s_aux = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, 3.0, -2.0, 0.25])
    got = _attend(batch, _metadata(batch, "vec"), s_aux=s_aux)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), _reference(batch, s_aux), atol=atol, rtol=rtol)


@native
def test_split_kv_and_window_hint_do_not_change_results():
    batch = _batch(BatchSpec("long", (4000,), (1,)), 4, 1, 64, 16, torch.float32)
    split = _attend(batch, _metadata(batch, split=True))
    whole = _attend(batch, _metadata(batch, split=False))
    meta = _metadata(batch, split=True)
    assert int(meta[len(ops.METADATA_HEADER)]) > 1, "expected the scheduler to split a lone 4000-key decode"
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)
    hinted = _attend(batch, _metadata(batch, split=True, window=100))
    assert torch.equal(hinted, split)  # the window size is a load-balancing hint only


# ------------------------------------------------------------------ metadata


@native
def test_metadata_holds_header_requests_and_plan():
    batch = _batch(BatchSpec("m", (10, 300, 7), (10, 1, 7)), 4, 2, 32, 16, torch.bfloat16)
    meta = _metadata(batch)
    assert meta.dtype == torch.int32 and meta.dim() == 1
    assert meta.numel() > ops.metadata_numel(3)  # the work partition follows


@native
def test_metadata_from_another_thread_count_raises():
    batch = _batch(BatchSpec("t", (40,), (3,)), 4, 2, 64, 16, torch.float32)
    meta = _metadata(batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with pytest.raises(ValueError, match=rf"built for {threads} threads.*rebuild"):
            _attend(batch, meta)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(_attend(batch, meta), _reference(batch), atol=2e-5, rtol=2e-5)


@native
def test_foreign_metadata_is_rejected():
    batch = _batch(BatchSpec("f", (40,), (3,)), 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="not produced by"):
        _attend(batch, torch.zeros(ops.metadata_numel(1), dtype=torch.int32))


# ------------------------------------------------------------------ registration


@native
def test_schemas_annotate_mutation_and_spell_causal():
    att = torch.ops.pagedattn.cpu_attention_with_kv_cache.default._schema
    assert "Tensor(a!) output" in str(att) and "bool causal" in str(att)
    cache = str(torch.ops.pagedattn.cpu_attn_reshape_and_cache.default._schema)
    assert "Tensor(a!) key_cache" in cache and "Tensor(b!) value_cache" in cache
    meta = str(torch.ops.pagedattn.cpu_attn_get_scheduler_metadata.default._schema)
    assert "bool causal" in meta and "casual" not in meta


def _small_case():
    batch = _batch(BatchSpec("s", (20, 9), (3, 9)), 4, 2, 32, 16, torch.float32)
    meta = _metadata(batch)
    return batch, meta


@native
def test_opcheck_metadata():
    batch, _ = _small_case()
    torch.library.opcheck(
        torch.ops.pagedattn.cpu_attn_get_scheduler_metadata.default,
        (2, 4, 2, 32, batch.seq_lens, torch.float32, batch.query_start_loc, True, -1,
         IsaHint.VEC16.code, True))


@native
def test_opcheck_reshape_and_cache():
    batch, _ = _small_case()
    kc, vc = torch.zeros_like(batch.key_cache), torch.zeros_like(batch.value_cache)
    torch.library.opcheck(
        torch.ops.pagedattn.cpu_attn_reshape_and_cache.default,
        (batch.new_keys, batch.new_values, kc, vc, batch.slot_mapping))


@native
def test_opcheck_attention():
    batch, meta = _small_case()
    out = torch.zeros_like(batch.query)
    torch.library.opcheck(
        torch.ops.pagedattn.cpu_attention_with_kv_cache.default,
        (batch.query, batch.key_cache, batch.value_cache, out, batch.query_start_loc,
         batch.seq_lens, 0.2, True, None, -1, -1, batch.block_table, 0.0, meta,
         torch.zeros(4)))


@native
def test_torch_compile_fullgraph_runs_the_ops():
    batch, _ = _small_case()
    kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
    kc[0].zero_()  # a block the batch does not use; the write below must not touch it

    def step(q, k, v, kc, vc, slots, qsl, seq_lens, bt):
        meta = torch.ops.pagedattn.cpu_attn_get_scheduler_metadata(
            2, 4, 2, 32, seq_lens, q.dtype, qsl, True, -1, IsaHint.VEC16.code, True)
        torch.ops.pagedattn.cpu_attn_reshape_and_cache(k, v, kc, vc, slots)
        out = torch.empty_like(q)
        torch.ops.pagedattn.cpu_attention_with_kv_cache(
            q, kc, vc, out, qsl, seq_lens, 32 ** -0.5, True, None, -1, -1, bt, 0.0, meta, None)
        return out * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(batch.query, batch.new_keys, batch.new_values, kc, vc, batch.slot_mapping,
                   batch.query_start_loc, batch.seq_lens, batch.block_table)
    torch.testing.assert_close(got, 2 * _reference(batch), atol=4e-5, rtol=4e-5)
    assert torch.equal(kc[0], torch.zeros_like(kc[0]))


# ------------------------------------------------------------------ fallback


def test_without_native_ops_fall_back_to_reference_with_one_warning(monkeypatch):
    import warnings

    from pagedattn.ops import _native

    monkeypatch.setattr(_native, "AVAILABLE", False)
    monkeypatch.setattr(_native, "LOAD_ERROR", "ImportError: simulated")
    monkeypatch.setattr(ops, "_warned_fallback", False)
    batch = _batch(BatchSpec("fb", (30, 7), (2, 7)), 4, 2, 32, 16, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = _metadata(batch)
        got = _attend(batch, meta)
        kc, vc = torch.zeros_like(batch.key_cache), torch.zeros_like(batch.value_cache)
        ops.cpu_attn_reshape_and_cache(batch.new_keys, batch.new_values, kc, vc,
                                       batch.slot_mapping, "vec16")
    fallback = [w for w in caught if "reference" in str(w.message)]
    assert len(fallback) == 1 and "simulated" in str(fallback[0].message)
    assert meta.shape == (ops.metadata_numel(2),)
    torch.testing.assert_close(got, _reference(batch), atol=2e-5, rtol=2e-5)
    slot = int(batch.slot_mapping[0])
    torch.testing.assert_close(kc[slot // 16, :, slot % 16], batch.new_keys[0])
    with pytest.raises(ValueError, match="'vec', 'vec16'"):  # hints are still validated
        ops.cpu_attn_reshape_and_cache(batch.new_keys, batch.new_values, kc, vc,
                                       batch.slot_mapping, "avx")


@native
def test_softcap_prefill_matches_reference_under_each_isa(isa):
    batch = _batch(BatchSpec("sc", (90,), (90,)), 4, 2, 64, 32, torch.float32)
    want = ref.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                               batch.query_start_loc, batch.seq_lens, batch.block_table,
                               scale=0.9, softcap=3.0)
    out = torch.empty_like(batch.query)
    ops.cpu_attention_with_kv_cache(
        batch.query, batch.key_cache, batch.value_cache, out, batch.query_start_loc,
        batch.seq_lens, 0.9, True, None, (-1, -1), batch.block_table, 3.0,
        _metadata(batch, "vec"), None)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
