"""The engine step probe (benchmarks/profile_engine.py): how it sorts perf's samples, and a
short run of the script end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from builtin_models import needs_smollm2

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_engine.py"


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("profile_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dso, symbol, category", [
    ("/x/torch/lib/libgomp.so.1", "0x1de62", "fork/join"),
    # the kernels' pool: a worker's loop, the caller's wait; not the chunks it runs
    ("/x/pagedattn/_C.cpython-311-x86_64-linux-gnu.so",
     "std::thread::_State_impl<std::thread::_Invoker<std::tuple<pagedattn::(anonymous "
     "namespace)::WorkPool::ensure_workers(long)::{lambda()#1}> > >::_M_run()", "fork/join"),
    ("/x/pagedattn/_C.cpython-311-x86_64-linux-gnu.so", "pagedattn::pool_run_chunks",
     "fork/join"),
    ("/x/pagedattn/_C.cpython-311-x86_64-linux-gnu.so",
     "void pagedattn::pool_parallel_for<pagedattn::rms_norm(at::Tensor const&)::{lambda(long, "
     "long)#1}>(long, long, long, pagedattn::rms_norm(at::Tensor const&)::{lambda(long, "
     "long)#1} const&)::{lambda(void*, long)#1}::_FUN(void*, long)", "kernels"),
    ("[JIT] tid 17535", "0x7fe7aaec0086", "gemm"),
    ("/tmp/perf-3235.map", "[unknown]", "gemm"),
    ("perf-3235.map", "[unknown]", "gemm"),
    ("/tmp/perf-x.map", "[unknown]", "other"),
    ("/x/torch/lib/libtorch_cpu.so",
     "dnnl::impl::cpu::x64::matmul::brgemm_matmul_t<129009>::compute_kernel", "gemm"),
    ("/x/torch/lib/libtorch_cpu.so", "at::native::AVX2::direct_copy_kernel", "elementwise"),
    ("/x/pagedattn/_C.cpython-311-x86_64-linux-gnu.so",
     "pagedattn::(anonymous namespace)::AttnKernel<VecAvx512, bf16_t, bf16_t>::attend_blocks",
     "attention"),
    # decode's q.k on the AMX tiles (matrix_amx.cpp) is attention, not a GEMM or a kernel
    ("/x/pagedattn/_C.cpython-311-x86_64-linux-gnu.so",
     "pagedattn::(anonymous namespace)::decode_scores<4>", "attention"),
    ("/x/pagedattn/_C.cpython-311-x86_64-linux-gnu.so",
     "pagedattn::(anonymous namespace)::linear_dp_tile<1, 4>", "gemm"),
    ("/x/pagedattn/_C.cpython-311-x86_64-linux-gnu.so",
     "pagedattn::(anonymous namespace)::act_mul_rows_entry<VecAvx512>", "kernels"),
    ("/x/pagedattn/_C.cpython-311-x86_64-linux-gnu.so",
     "pagedattn::(anonymous namespace)::rms_norm_rows_entry<VecAvx512>", "kernels"),
    ("/usr/lib/libpython3.11.so.1.0", "_PyEval_EvalFrameDefault", "python"),
    ("/x/torch/lib/libtorch_python.so", "THPVariable_getattr", "python"),
    ("/lib/x86_64-linux-gnu/libc.so.6", "_int_malloc", "os+alloc"),
    ("[kernel.kallsyms]", "clear_page_erms", "os+alloc"),
    ("/x/libfoo.so", "bar", "other"),
])
def test_samples_are_sorted_by_object_and_symbol(probe, dso, symbol, category):
    assert probe.classify(dso, symbol) == category


@needs_smollm2
def test_profile_engine_script_reports_times_and_the_split(probe, tmp_path):
    out = tmp_path / "probe.json"
    threads = torch.get_num_threads()
    try:
        assert probe.main(["--scale", "0.05", "--busy", "1", "--engines", "2", "--top", "3",
                           "--adaptive-threads", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert result["workload"] == "W2" and result["quiet_s"] > 0 and result["busy_s"] > 0
    assert "OpenMP" in result["threading"]
    assert "pagedattn's kernels on their own pool" in result["threading"]
    assert len(result["engines_s"]) == 2 and min(result["engines_s"]) > 0
    assert "steps:" in result["steps"]
    if probe.perf_unavailable() is None:
        split = result["split_percent"]
        assert set(split) == set(probe.CATEGORIES)
        assert sum(split.values()) == pytest.approx(100.0, abs=1.0)
        assert result["glue_percent"] == pytest.approx(
            sum(split[c] for c in probe.GLUE))


@pytest.mark.parametrize("args, message", [
    (["--busy", "-1"], "--busy: must be >= 0, got -1"),
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--engines", "0"], "--engines: must be >= 1, got 0"),
    (["--scale", "0"], "--scale: must be >= 0.001, got 0"),
    (["--freq", "many"], "--freq: expected an integer, got 'many'"),
    (["--workload", "W9"], "--workload: invalid choice: 'W9'"),
])
def test_bad_arguments_are_refused_by_name(probe, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        probe.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
