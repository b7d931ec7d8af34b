#!/usr/bin/env bash
# The GPU checks in one go, on a machine with a CUDA GPU and a Python that has torch and
# triton: the tests of tests/gpu_kernels with the kernels compiled for the GPU (bf16
# included, which the interpreter cannot check), then bench_gpu_attention.py. Logs and
# the bench's JSON go to $OUT (default: gpu-results/). Run from the repository root.
set -u -o pipefail
OUT=${OUT:-gpu-results}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
"$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__,
          'triton', triton.__version__, torch.cuda.get_device_name())"
"$PY" -c "import xformers; print('xformers', xformers.__version__)" 2>&1 | tail -1
"$PY" -c "from pagedattn.backends.xformers import xformers_problems as p; print('xformers paged decode:', p() or 'runs')" 2>&1 | tail -1
status=0
# -n: the kernels' specializations compile in parallel (one Triton JIT per worker).
# no:benchmark: pytest-benchmark (in some images) warns once per xdist worker.
timeout "${TEST_TIMEOUT_S:-300}" "$PY" -m pytest -q -rs -p no:cacheprovider -p no:benchmark \
    -n "${TEST_WORKERS:-8}" tests/gpu_kernels --junitxml "$OUT/gpu_tests.xml" \
    2>&1 | tee "$OUT/gpu_tests.log" || status=1
timeout "${BENCH_TIMEOUT_S:-240}" "$PY" benchmarks/bench_gpu_attention.py \
    --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log" || status=1
timeout "${BENCH_TIMEOUT_S:-240}" "$PY" benchmarks/bench_gpu_attention.py --cudagraph \
    --json "$OUT/gpu_bench_graph.json" 2>&1 | tee "$OUT/gpu_bench_graph.log" || status=1
exit $status
