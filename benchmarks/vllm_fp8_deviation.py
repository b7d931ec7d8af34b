"""How far the vLLM plugin's and vLLM's own fp8-cache attention sit from the reference.

Runs the plugin test suite's fp8 cases (decoder; window + softcap + ALiBi + sinks; cross
attention) with each fp8 format and prints, per case, the largest absolute deviation
from the reference of pagedattn's output and of vLLM's own CPU kernels (which take fp8
caches only on CPUs with AVX-512 or AMX), next to the outputs' largest magnitude.

    .venv-vllm/bin/python benchmarks/vllm_fp8_deviation.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "vllm_plugin")
sys.path.insert(0, TESTS)

import test_vllm_plugin_impl as cases  # noqa: E402


def main() -> int:
    print(f"CPU: AVX-512 {torch.cpu._is_avx512_supported()}, AMX "
          f"{torch.cpu._is_amx_tile_supported()}; bf16 queries, block size {cases.BLOCK_SIZE}")
    print("| case | kv cache | max abs(ref) | pagedattn - ref | vLLM - ref |")
    print("|---|---|---|---|---|")
    for case in cases.FP8_CASES:
        for kv in ("fp8", "fp8_e5m2"):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = cases.make_vllm_config(tmp, "bfloat16", cases.BLOCK_SIZE, cache_dtype=kv)
                ours, expected, theirs = cases.plugin_reference_and_vllm(
                    case, torch.bfloat16, cfg, kv)
                try:
                    vllm_dev = f"{(theirs().float() - expected).abs().max():.3f}"
                except NotImplementedError:
                    vllm_dev = "refused (no AVX-512/AMX)"
            ours_dev = (ours.float() - expected).abs().max()
            print(f"| {case.name} | {kv} | {expected.abs().max():.2f} | {ours_dev:.4f} | "
                  f"{vllm_dev} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
