"""Every ISA kernel table against an fp64 reference, outside torch.

``csrc/cpu/selftest/kernel_selftest.cpp`` links the torch-free kernel translation units
with a small driver. Natively it checks each table this CPU executes; cross-compiled for
aarch64 and run under qemu it checks the NEON kernels, which no x86 test can otherwise
execute (install ``g++-aarch64-linux-gnu`` and ``qemu-user`` to enable that case).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import platform

import pytest

from pagedattn import ops

# Slow tier: the builds take ~30 s natively and ~12 s for aarch64 on 2 cores, and the fast
# tier already checks every table this CPU runs through torch (test_cpu_ops.py).
pytestmark = pytest.mark.slow

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "cpu"
SOURCES = [CSRC / "selftest" / "kernel_selftest.cpp", *sorted(CSRC.glob("kernels_*.cpp"))]


def build(compiler: str, out: pathlib.Path, *extra: str) -> pathlib.Path:
    # One compiler process per translation unit, all at once (the ISA units take ~10 s
    # each; one process for all of them left a core idle), then one link.
    flags = [compiler, "-std=c++17", "-O2", *extra, f"-I{CSRC}"]
    objects = [out.with_name(f"{out.name}-{src.stem}.o") for src in SOURCES]
    procs = [subprocess.Popen([*flags, "-c", str(src), "-o", str(obj)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for src, obj in zip(SOURCES, objects)]
    for src, proc in zip(SOURCES, procs):
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{src.name}: {err[-4000:]}"
    proc = subprocess.run([*flags, *map(str, objects), "-o", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def native_selftest(tmp_path_factory) -> pathlib.Path:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    return build(compiler, tmp_path_factory.mktemp("selftest") / "selftest")


def test_native_kernel_tables_match_fp64_reference(native_selftest):
    out = run([str(native_selftest)])
    assert "ok   scalar" in out and "tables passed" in out


def test_neon_kernels_under_qemu(tmp_path):
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install "
                    "g++-aarch64-linux-gnu qemu-user)")
    binary = build(cross, tmp_path / "selftest-aarch64", "-static")
    out = run([qemu, str(binary), "scalar", "neon"])
    assert "ok   neon       bf16_everything_split" in out and "all 2 tables passed" in out


def test_selftest_rejects_an_unknown_table(native_selftest):
    proc = subprocess.run([str(native_selftest), "sve2"], capture_output=True, text=True)
    assert proc.returncode == 2 and "no kernel table sve2" in proc.stdout


def test_selftest_refuses_a_table_this_cpu_cannot_run(native_selftest):
    """Naming a table must not build it first: building runs code compiled for its ISA
    (an AVX2 CPU died of an illegal instruction looking up the avx512 table by name)."""
    runs = {isa.value for isa in ops.supported_cpu_isas()}
    missing = [n for n in ("avx2", "avx512", "avx512bf16") if n not in runs]
    if platform.machine() != "x86_64" or not missing:
        pytest.skip("this CPU runs every x86 kernel table")
    proc = subprocess.run([str(native_selftest), missing[-1]], capture_output=True, text=True)
    assert proc.returncode == 2 and f"cannot execute the {missing[-1]} kernels" in proc.stdout
