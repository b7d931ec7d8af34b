"""``EngineArgs``: everything a user sets to build an engine, validated once, here.

``LLM(**kwargs)``, ``pagedattn generate`` and ``pagedattn serve`` all build one of these;
nothing downstream re-checks a value it holds. Names say what they hold:

* ``dtype``: the model's activations around attention and its weights;
* ``kv_cache_dtype``: what the KV cache stores (``"auto"`` = ``dtype``, or fp8);
  :attr:`EngineArgs.cache_dtype` is the torch dtype of the cache tensors;
* ``linear_impl`` / ``linear_dtype``: how the linear layers compute.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pagedattn.checks import is_int, require_choice, require_int
from pagedattn.config import validate_block_size
from pagedattn.engine.scheduler import SCHEDULING_POLICIES
from pagedattn.ops import reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", *reference.FP8_CACHE_DTYPES)
LINEAR_IMPLS = ("auto", "packed", "torch")
PREFILL_ATTENTION = ("auto", "kernel")
_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


def parse_dtype(dtype: str | torch.dtype, name: str = "dtype") -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {dtype!r}")


def parse_bytes(value: int | str, name: str = "kv_cache_memory") -> int:
    """A positive byte count from an int or a string such as ``"512MiB"`` / ``"2GiB"``."""
    if is_int(value) and value > 0:
        return value
    if isinstance(value, str):
        for unit, scale in _UNITS.items():
            if value.endswith(unit):
                try:
                    parsed = int(float(value[: -len(unit)]) * scale)
                except ValueError:
                    break
                if parsed > 0:
                    return parsed
                break
    raise ValueError(f"{name} must be a positive number of bytes or a string like "
                     f"'512MiB' / '2GiB', got {value!r}")


def native_half_matmul() -> bool:
    """Whether torch has a fast bf16 GEMM on this CPU (oneDNN with AVX512-BF16 or AMX);
    without one, torch's bf16 linear is far slower than fp32 (docs/performance.md)."""
    from pagedattn.ops import onednn

    return onednn.native_half_gemm(torch.bfloat16)


@dataclass(frozen=True)
class EngineArgs:
    """The engine's configuration. Every field is checked when the object is made.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, or a built-in name
            (``"smollm2"``, ``"gemma3"``, ``"minilm"``) served from an installed package.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: attention and the weights
            (Gemma 3 refuses ``"float16"``: its activations overflow it).
        kv_cache_dtype: ``"auto"`` (the cache stores ``dtype``) or ``"fp8"`` /
            ``"fp8_e4m3"`` / ``"fp8_e5m2"``: one byte per element, twice the tokens in the
            same ``kv_cache_memory``; K and V are stored as ``x / scale``.
        calculate_kv_scales: fp8 only. ``False``: every layer's ``k_scale`` and
            ``v_scale`` are 1.0. ``True``: each layer's scales are calibrated from the
            first prefill step (``amax / fp8 max``, per tensor) and then kept.
        linear_impl: ``"auto"`` (default with the native extension): weights in ``dtype``,
            activations in ``linear_dtype``, each layer shape and row count on the path
            measured fastest here (:mod:`pagedattn.models.linear_paths`); ``"packed"``:
            every layer on ``pagedattn.ops.packed_linear`` (fp32 activations); ``"torch"``:
            ``nn.Linear`` in ``linear_dtype``.
        linear_dtype: the activations of the linear layers. ``linear_impl="auto"``:
            ``None`` = bfloat16 for a bfloat16 model on a CPU with a native bf16 GEMM
            (AVX512-BF16 or AMX: the layers, RoPE and attention take bf16 activations
            around an fp32 residual stream, as vLLM's and transformers' bf16 runs round
            them), else float32; set ``"float32"`` to keep every activation in fp32.
            ``linear_impl="torch"``: dtype of the weights and activations around
            attention; ``None`` = ``dtype``, except on CPUs without a native
            half-precision GEMM, where it is float32.
        prefill_attention: kept for scripts that set it: ``"auto"`` and ``"kernel"``
            both run every request on the paged kernel. ``"flash"`` (long prefills on
            torch's flash attention for CPU) was retired on 2026-12-07, when the kernel
            measured faster at every prefill length on every CPU tried
            (docs/performance.md); asking for it is a ValueError.
        batch_invariant: ``True``: a request's tokens (greedy, or sampled with its own
            seed) do not depend on what else runs, how its prompt is chunked, prefix-cache
            hits or the thread count. Attention plans never split a row's keys and run
            every row on the vector kernels' generic path (no matrix-engine
            prefill), and every linear layer runs the packed kernel, whose rows are
            independent of the row count. Its measured cost is in docs/engine.md.
            Needs ``linear_impl`` ``"auto"`` or ``"packed"`` and a backend that offers it
            (CPU_ATTN).
        shared_prefix_attention: ``True``: where the step's requests hold a prefix in the
            same KV blocks (a shared system prompt with prefix caching, the ``n`` samples of
            one prompt), a backend that can reads those keys once for all of them (CPU_ATTN:
            docs/kernels.md, "Shared prefixes"); the results are the same within the
            dtype's rounding. ``False``: every request reads its own copy of the keys, as
            other engines do (for comparisons). Batch-invariant plans never share.
        backend: attention backend name (default: the registry's choice).
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV cache pool (int, or ``"512MiB"``).
        max_num_batched_tokens: per-step token budget (longer prefills are chunked).
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        max_model_len: longest request (prompt + output); default the model's context,
            capped at what ``kv_cache_memory`` holds.
        max_num_seqs: most requests running at once.
        scheduling_policy: the order waiting requests are admitted in: ``"fcfs"`` (first
            come first served) or ``"shortest_first"`` (fewest prompt tokens left first,
            with aging; lowers the median time to first token under bursts). See
            :mod:`pagedattn.engine.scheduler`.
        huge_pages: ``True``: the weights and the KV cache sit on 2 MiB transparent huge
            pages where the kernel allows it (``madvise`` or ``always``;
            :mod:`pagedattn.engine.huge_pages`); ``False``: on ordinary pages.
        native_step: ``True``: a step's decoder layers run in one native op
            (``ops.decoder_stack``, Llama family and Gemma 3) wherever it serves the step,
            with no Python between the layers' ops; bit for bit what the Python layer loop
            computes (:mod:`pagedattn.models.native_stack`). ``False``: always the Python
            loop.
        adaptive_threads: ``False`` (default): every step on ``torch.get_num_threads()``.
            pagedattn's kernels run on their own pool, whose loops never wait for a thread
            the scheduler has not run, so two threads beside busy neighbours get their
            share of the cores (:mod:`pagedattn.thread_policy`). ``True``: while other
            processes keep this process's CPUs busy, a step runs on the cores they leave
            free (at least one thread; :class:`pagedattn.thread_policy.StepThreads`),
            which spares torch's own OpenMP regions (oneDNN's GEMMs) their joins. A
            different thread count can change the last bits of a result unless
            ``batch_invariant``.
        seed: seeds the sampling of requests that bring no seed of their own.
        skip_tokenizer_init: no tokenizer (prompts must be token-id lists).
    """

    model: str = "smollm2"
    dtype: str | torch.dtype = "bfloat16"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    linear_impl: str | None = None
    linear_dtype: str | torch.dtype | None = None
    prefill_attention: str = "auto"
    batch_invariant: bool = False
    shared_prefix_attention: bool = True
    backend: str | None = None
    block_size: int = 16
    kv_cache_memory: int | str = "512MiB"
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    huge_pages: bool = True
    native_step: bool = True
    adaptive_threads: bool = False
    seed: int = 0
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)  # frozen: normalise in place once, here
        set_("dtype", parse_dtype(self.dtype))
        require_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales=True needs an fp8 kv_cache_dtype "
                             f"({', '.join(reference.FP8_CACHE_DTYPES)}), got 'auto'")
        if self.prefill_attention == "flash":
            raise ValueError("prefill_attention 'flash' was retired: the paged kernel runs "
                             "every prefill (it measured faster than torch's flash attention "
                             "at every length on every CPU tried); use 'auto' or 'kernel'")
        require_choice("prefill_attention", self.prefill_attention, PREFILL_ATTENTION)
        set_("linear_impl", _parse_linear_impl(self.linear_impl))
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.batch_invariant and self.linear_impl == "torch":
            raise ValueError("batch_invariant=True needs linear_impl 'auto' or 'packed' (the "
                             "packed kernel's rows do not depend on the row count; torch's "
                             "GEMMs' do), got linear_impl='torch'")
        set_("linear_dtype", self._resolve_linear_dtype())
        set_("kv_cache_memory", parse_bytes(self.kv_cache_memory))
        validate_block_size(self.block_size)  # the one check: it flows down as a value
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            require_int(name, getattr(self, name), 1)
        require_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        for name in ("huge_pages", "native_step", "adaptive_threads", "shared_prefix_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        require_int("seed", self.seed, 0)
        if self.max_model_len is not None:
            require_int("max_model_len", self.max_model_len, 1)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")

    @property
    def cache_dtype(self) -> torch.dtype:
        """The torch dtype of the KV cache tensors."""
        return reference.FP8_CACHE_DTYPES.get(self.kv_cache_dtype, self.dtype)

    def _resolve_linear_dtype(self) -> torch.dtype:
        requested = None if self.linear_dtype is None else parse_dtype(self.linear_dtype,
                                                                       "linear_dtype")
        if self.linear_impl == "torch":
            if requested is not None:
                return requested
            if self.dtype != torch.float32 and not native_half_matmul():
                return torch.float32
            return self.dtype
        bf16_ok = self.linear_impl == "auto" and self.dtype == torch.bfloat16
        if requested is None:
            return torch.bfloat16 if bf16_ok and native_half_matmul() else torch.float32
        if requested == torch.float32 or (requested == torch.bfloat16 and bf16_ok):
            return requested
        raise ValueError(f"linear_dtype must be float32 with linear_impl={self.linear_impl!r} "
                         f"and dtype={self.dtype} (bfloat16 activations need "
                         f"linear_impl='auto' and dtype='bfloat16'; any other dtype needs "
                         f"linear_impl='torch'), got {self.linear_dtype!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _parse_linear_impl(linear_impl: str | None) -> str:
    """``None`` picks ``"auto"`` where the native extension is loaded."""
    from pagedattn import ops

    if linear_impl is None:
        return "auto" if ops.native_available() else "torch"
    require_choice("linear_impl", linear_impl, LINEAR_IMPLS)
    if linear_impl != "torch" and not ops.native_available():
        raise ValueError(f"linear_impl={linear_impl!r} needs the native extension pagedattn._C, "
                         "which is not loaded; use linear_impl='torch'")
    return linear_impl
