"""Public paged-attention ops (CPU): thin, validated wrappers over ``torch.ops.pagedattn``.

Cache layout (natural, every backend's reference can read it)::

    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_size]
    key_cache[b, h, o, :] = key of the token in slot b * block_size + o

Batches are varlen: request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]``
and ``seq_lens[r]`` keys (context + new tokens); query ``i`` of it sits at absolute position
``seq_lens[r] - q_len + i`` (``docs/semantics.md``).

Instruction sets: the native kernels pick the best ISA of the CPU at run time
(``avx512bf16 > avx512 > avx2 > scalar`` on x86, ``neon`` on Arm). ``PAGEDATTN_CPU_ISA``
(read once) forces a lower one; :func:`use_cpu_isa` switches in-process (tests).
The ``isa`` arguments take vLLM's kernel-variant hints (``vec``, ``vec16``, ``neon``,
``amx``) as strings or :class:`IsaHint` members; which one a cache gets is the backend's
policy (:func:`pagedattn.backends.cpu_runtime.kernel_variant`).

Without the native extension every op falls back to :mod:`pagedattn.ops.reference`
(one warning).
"""

from __future__ import annotations

import contextlib
import functools
import platform
import operator
import warnings
from collections.abc import Iterator, Sequence

import torch

from pagedattn.checks import is_int, require_int
from pagedattn.ops import _native, kernel_shapes
from pagedattn.ops._native import metadata_numel
from pagedattn.ops.reference import LINEAR_PANEL
from pagedattn.ops.isa import (
    ISA_HINTS,
    METADATA_HEADER,
    METADATA_MAGIC,
    METADATA_VERSION,
    CpuIsa,
    IsaHint,
)

__all__ = [
    "CpuIsa", "IsaHint", "native_available", "native_build", "supported_cpu_isas", "best_cpu_isa",
    "get_cpu_isa", "set_cpu_isa", "use_cpu_isa", "cpu_has_amx", "matrix_engine_available", "on_arm",
    "usable_isa_hints", "UnsupportedIsaHintError",
    "cpu_attn_get_scheduler_metadata", "cpu_attn_reshape_and_cache",
    "cpu_attention_with_kv_cache", "metadata_numel", "decoder_stack", "DECODER_STACK_STYLES",
    "LINEAR_PANEL", "PACKED_LINEAR_DTYPES", "pack_linear_weight", "packed_linear",
    "GATED_ACTIVATIONS", "packed_gated_linear",
    "dpbf16_linear_available", "pack_linear_weight_dpbf16", "packed_linear_dpbf16",
    "amx_linear_available", "packed_linear_amx", "packed_gated_linear_amx",
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding",
    "stream_read", "argmax_rows",
]

_warned_fallback = False


def native_available() -> bool:
    """True when the native extension ``pagedattn._C`` is built and loaded."""
    return _native.AVAILABLE


def native_build() -> str:
    """Which build of the native extension is loaded (``none`` without one). Measured
    kernel choices are keyed on it (:mod:`pagedattn.tuning`): a rebuilt or upgraded
    extension measures them again."""
    return _native.build_identity()


def _fallback(op: str):
    """The reference module, after warning (once per process) that it is used."""
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"pagedattn native CPU kernels unavailable ({_native.LOAD_ERROR}); {op} and the "
            "other ops use the slow pure-PyTorch reference. Rebuild with "
            "`pip install --no-build-isolation -e .`",
            RuntimeWarning,
            stacklevel=3,
        )
    from pagedattn.ops import reference

    return reference


# ------------------------------------------------------------------ instruction sets


def supported_cpu_isas() -> list[CpuIsa]:
    """ISAs this CPU and build can execute, in code order (``scalar`` always included)."""
    if not native_available():
        return []
    return [CpuIsa.from_code(c) for c in torch.ops.pagedattn.supported_cpu_isas()]


def best_cpu_isa() -> CpuIsa:
    """The ISA the kernels use by default on this CPU (ignoring ``PAGEDATTN_CPU_ISA``)."""
    _require_native("best_cpu_isa")
    return CpuIsa.from_code(torch.ops.pagedattn.best_cpu_isa())


def get_cpu_isa() -> CpuIsa:
    """The ISA the kernels use now. Raises NotImplementedError if ``PAGEDATTN_CPU_ISA``
    names an ISA this CPU lacks (until :func:`set_cpu_isa` picks a valid one)."""
    _require_native("get_cpu_isa")
    return CpuIsa.from_code(torch.ops.pagedattn.get_cpu_isa())


def set_cpu_isa(isa: str | CpuIsa) -> None:
    """Switch the kernels' ISA for the whole process (ValueError: unknown name;
    NotImplementedError: this CPU cannot execute it)."""
    parsed = CpuIsa.parse(isa)
    _require_native("set_cpu_isa")
    torch.ops.pagedattn.set_cpu_isa(parsed.code)


@contextlib.contextmanager
def use_cpu_isa(isa: str | CpuIsa) -> Iterator[CpuIsa]:
    """Run the enclosed ops with ``isa``, then restore the previous one. Not thread-safe:
    the ISA is process-wide."""
    previous = get_cpu_isa()
    set_cpu_isa(isa)
    try:
        yield CpuIsa.parse(isa)
    finally:
        set_cpu_isa(previous)


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (the matrix engine then runs on them)."""
    return native_available() and bool(torch.ops.pagedattn.cpu_has_amx())


@functools.cache
def matrix_engine_available() -> bool:
    """Whether torch's brgemm microkernels (oneDNN) run here: the ``amx`` hint's prefill
    kernel needs them. They use AMX tiles where the CPU has them, else AVX-512 or AVX2."""
    return native_available() and bool(torch.ops.pagedattn.matrix_engine_available())


def _require_native(what: str) -> None:
    if not native_available():
        raise RuntimeError(f"{what} needs the native extension: {_native.LOAD_ERROR}")


@functools.cache
def on_arm() -> bool:
    """Whether this is an Arm (aarch64) CPU (the ``neon`` hint needs one)."""
    return platform.machine().lower() in ("aarch64", "arm64")


class UnsupportedIsaHintError(ValueError, NotImplementedError):
    """A known hint this CPU cannot run (``amx`` without torch's brgemm microkernels,
    ``neon`` off Arm).

    A ``ValueError`` like any other bad hint, and a ``NotImplementedError`` for callers
    that treat missing hardware that way."""


@functools.cache
def _usable_hints() -> tuple[IsaHint, ...]:
    if on_arm():
        return (IsaHint.NEON, IsaHint.VEC, IsaHint.VEC16)
    hints = (IsaHint.VEC, IsaHint.VEC16)
    return hints + (IsaHint.AMX,) if matrix_engine_available() else hints


def usable_isa_hints() -> list[str]:
    """The hints this CPU accepts."""
    return [h.value for h in _usable_hints()]


def _parse_hint(isa: str | IsaHint) -> IsaHint:
    """The one check of an op's ``isa`` argument: a known hint (:meth:`IsaHint.parse`) that
    this CPU can run. Metadata carries :class:`IsaHint` members, so per call this is a
    membership test, not a string parse."""
    hint = IsaHint.parse(isa)
    if hint not in _usable_hints():
        need = ("torch's brgemm microkernels (oneDNN), which do not run here"
                if hint is IsaHint.AMX else "an Arm (aarch64) CPU")
        valid = ", ".join(repr(h) for h in usable_isa_hints())
        raise UnsupportedIsaHintError(
            f"isa hint {hint.value!r} needs {need}; valid on this CPU: {valid}"
        )
    return hint


# ------------------------------------------------------------------ ops


def cpu_attn_get_scheduler_metadata(
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    query_start_loc: torch.Tensor,
    causal: bool,
    sliding_window_size: int,
    isa: str | IsaHint,
    enable_kv_split: bool,
    batch_invariant: bool = False,
    block_table: torch.Tensor | None = None,
    block_size: int | None = None,
    common_prefix_len: int = 0,
) -> torch.Tensor:
    """Plan the work partition of one step; reuse the result for every layer of the step.

    Args:
        num_reqs: requests in the batch.
        num_heads, num_kv_heads, head_dim: attention geometry (GQA: heads % kv_heads == 0).
        seq_lens: int32 ``[num_reqs]`` total key length per request (context + new).
        dtype: query/cache dtype (float32, bfloat16, float16).
        query_start_loc: int32 ``[num_reqs + 1]``, non-decreasing, starts at 0.
        causal: whether the layers are causal.
        sliding_window_size: layer window as ``left + 1``, ``-1`` = none. A load-balancing
            hint only: results never depend on it.
        isa: kernel-variant hint (``vec``, ``vec16``, ``neon``, ``amx``).
        enable_kv_split: allow splitting long key ranges over threads (decode).
        batch_invariant: plan so that each query row's result is bitwise the same whatever
            else is in the batch, however a prompt is chunked and at any thread count: no
            key splits (small batches spread over groups of kv heads instead), and every
            item on the vector kernels' generic path. Needs a vector hint, not ``amx``.
        block_table: int32 ``[num_reqs, max_blocks]``, the step's block table (optional).
            With it the plan finds requests whose rows begin with the same block ids (a
            shared system prompt, the samples of one prompt) and reads those keys once for
            all of them (docs/kernels.md, "Shared prefixes"); the calls must then pass the
            same ids for those blocks. Batch-invariant plans never share.
        block_size: the cache's block size; given exactly when ``block_table`` is.
        common_prefix_len: keys every request shares (vLLM's cascade ``common_prefix_len``),
            ``0`` = find the shared prefixes in ``block_table``; needs ``block_table``, and
            every request with queries must have those keys in the same blocks.

    Returns:
        Opaque int32 tensor: a header, per-request fields and the whole work partition of
        the step (at least :func:`metadata_numel(num_reqs)` elements), so every layer's
        attention call only checks it and executes. It records ``torch.get_num_threads()``
        and a checksum of itself and the lengths; the attention op rejects it if the
        threads changed or it does not match the call's ``query_start_loc``/``seq_lens``.
    """
    hint = _parse_hint(isa)
    require_int("common_prefix_len", common_prefix_len, 0)
    if block_table is None:
        if block_size is not None or common_prefix_len:
            raise ValueError("block_size and common_prefix_len need a block_table, got "
                             f"block_size={block_size!r}, common_prefix_len={common_prefix_len!r}")
    else:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
        if block_size is None:
            raise ValueError("block_table needs its block_size")
        require_int("block_size", block_size, 1)
        if batch_invariant and common_prefix_len:
            raise ValueError(f"batch_invariant plans do not share prefixes, got "
                             f"common_prefix_len={common_prefix_len}")
    if batch_invariant and hint is IsaHint.AMX:
        raise ValueError("batch_invariant plans need a vector-kernel hint (vec, vec16, neon), "
                         "got 'amx': the matrix-engine kernel's arithmetic for a row depends "
                         "on its query tile")
    # A load-balancing hint: any window past int64 (left + 1 of an int64 left) is unbounded.
    if isinstance(sliding_window_size, int) and sliding_window_size > _INT64_MAX:
        sliding_window_size = _INT64_MAX
    if not native_available():
        _fallback("cpu_attn_get_scheduler_metadata")
        meta = torch.zeros(metadata_numel(num_reqs), dtype=torch.int32)
        header = dict(magic=METADATA_MAGIC, version=METADATA_VERSION, num_reqs=num_reqs,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      num_threads=torch.get_num_threads(), hint=hint.code, causal=int(causal),
                      enable_kv_split=int(enable_kv_split), q_tile_tokens=1, num_jobs=0,
                      num_merges=0, num_slots=0, slot_rows=0, max_rows=1,
                      batch_invariant=int(batch_invariant), num_groups=0, num_members=0,
                      prefix_rows=0, checksum=0)
        meta[: len(METADATA_HEADER)] = torch.tensor([header[k] for k in METADATA_HEADER])
        return meta
    return torch.ops.pagedattn.cpu_attn_get_scheduler_metadata(
        _int64("num_reqs", num_reqs), _int64("num_heads", num_heads),
        _int64("num_kv_heads", num_kv_heads), _int64("head_dim", head_dim), seq_lens, dtype,
        query_start_loc, bool(causal), int(sliding_window_size), hint.code,
        bool(enable_kv_split), bool(batch_invariant), block_table,
        0 if block_table is None else int(block_size), int(common_prefix_len),
    )


def cpu_attn_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str | IsaHint,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    """Write new keys/values into the paged cache, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_size]`` (last dim contiguous; token/head
            strides free). Only the first ``slot_mapping.numel()`` tokens are written.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_size]``,
            same dtype as key/value, or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``
            (then each element is stored as ``x / scale`` saturated to the format's largest
            finite value and rounded to nearest even, NaN kept: ``reference.quantize_fp8``);
            token ``t`` goes to block ``slot // block_size``, offset ``slot % block_size``.
        slot_mapping: int64 ``[n]``; ``-1`` (PAD_SLOT_ID, any negative) skips the token;
            ``slot >= num_blocks * block_size`` raises. Duplicate slots: unspecified winner.
        isa: kernel-variant hint; its block-size multiple is checked against the cache.
        k_scale, v_scale: per-tensor fp8 scales (vLLM's ``layer._k_scale_float``), a float
            or a 1-element tensor; ignored by non-fp8 caches.
    """
    hint = _parse_hint(isa)
    ks, vs = _kv_scale(k_scale, "k_scale"), _kv_scale(v_scale, "v_scale")
    _check_hint_block_size(hint, key_cache)
    if not native_available():
        _fallback("cpu_attn_reshape_and_cache").cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, hint.value, ks, vs)
        return
    torch.ops.pagedattn.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, ks, vs)


def _planned_hint(scheduler_metadata) -> IsaHint | None:
    """The hint a plan was made under (None for anything that is not a plan: the op's
    own checks then name the problem)."""
    if (not isinstance(scheduler_metadata, torch.Tensor) or scheduler_metadata.dim() != 1
            or scheduler_metadata.dtype != torch.int32
            or scheduler_metadata.numel() < len(METADATA_HEADER)
            or int(scheduler_metadata[0]) != METADATA_MAGIC
            or int(scheduler_metadata[1]) != METADATA_VERSION):
        return None
    code = int(scheduler_metadata[METADATA_HEADER.index("hint")])
    return IsaHint(ISA_HINTS[code][0]) if 0 <= code < len(ISA_HINTS) else None


def _check_hint_block_size(hint: IsaHint | None, key_cache) -> None:
    """vLLM's contract for its hint strings: ``vec`` takes caches whose block size is a
    multiple of 32, the others multiples of 16 (the small sizes 1 and 8, which no vLLM
    variant runs, under any hint). The kernels themselves run every supported size under
    every hint, so this is checked here, at the public boundary, and nowhere below."""
    if hint is None or not isinstance(key_cache, torch.Tensor) or key_cache.dim() != 4:
        return
    block_size = key_cache.shape[2]
    if block_size >= 16 and block_size % hint.block_multiple:
        raise ValueError(f"kv cache block_size {block_size} does not suit isa hint "
                         f"'{hint.value}', which needs a multiple of {hint.block_multiple}")


def _kv_scale(scale: torch.Tensor | float, name: str) -> float:
    from pagedattn.ops.reference import kv_scale_value

    return kv_scale_value(scale, name)


_INT64_MAX = 2 ** 63 - 1


def _int64(name: str, value) -> int:
    """An int argument of a native op: outside int64 the dispatcher would fail with
    "Expected a value of type 'int' ... found type 'int'"."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if not -_INT64_MAX - 1 <= v <= _INT64_MAX:
        raise ValueError(f"{name} must be an int in int64 range, got {value!r}")
    return v


def _window_pair(sliding_window: Sequence[int]) -> tuple[int, int]:
    if (not isinstance(sliding_window, (tuple, list)) or len(sliding_window) != 2
            or not all(is_int(w) and -1 <= w <= _INT64_MAX for w in sliding_window)):
        raise ValueError(
            f"sliding_window must be a (left, right) pair of ints in [-1, 2**63 - 1] "
            f"(-1 = unbounded), got {sliding_window!r}"
        )
    return int(sliding_window[0]), int(sliding_window[1])


def cpu_attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: tuple[int, int],
    block_table: torch.Tensor,
    softcap: float,
    scheduler_metadata: torch.Tensor,
    s_aux: torch.Tensor | None,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    """Paged attention of a varlen batch; writes ``output[:query_start_loc[-1]]`` in place.

    Args:
        query, output: ``[num_tokens, num_heads, head_size]`` float32/bfloat16/float16;
            heads packed per token (``stride(1) == head_size``), any token stride (slices
            like ``query[:n]`` are fine). Rows past ``query_start_loc[-1]`` are untouched.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_size]``, the
            query dtype or fp8 (``float8_e4m3fn`` / ``float8_e5m2``: read as stored value
            times ``k_scale`` / ``v_scale``, accumulated in fp32); block_size 1, 8 or a multiple of 16 up to 512; head_size a multiple of
            8 from 32 to 512 (:mod:`pagedattn.ops.kernel_shapes`).
        query_start_loc: int32 ``[num_reqs + 1]``; seq_lens: int32 ``[num_reqs]``
            (``>= query length``).
        scale: multiplies ``q.k``. causal: hide keys after the query position.
        alibi_slopes: float32 ``[num_heads]`` or None; adds ``slope[h] * (j - p)``.
        sliding_window: ``(left, right)``, ``-1`` = unbounded on that side.
        block_table: int32 ``[>= num_reqs, max_blocks]``; only blocks a request reads are
            checked against ``num_blocks``.
        softcap: ``> 0`` applies ``softcap * tanh(s / softcap)``; ``0`` = off.
        scheduler_metadata: from :func:`cpu_attn_get_scheduler_metadata` for this batch.
        s_aux: float32/bfloat16 ``[num_heads]`` sink logits or None.
        k_scale, v_scale: per-tensor fp8 scales, a float or a 1-element tensor; ignored
            by non-fp8 caches.
    """
    left, right = _window_pair(sliding_window)
    ks, vs = _kv_scale(k_scale, "k_scale"), _kv_scale(v_scale, "v_scale")
    _check_hint_block_size(_planned_hint(scheduler_metadata), key_cache)
    if not native_available():
        _fallback("cpu_attention_with_kv_cache").cpu_attention_with_kv_cache(
            query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal,
            alibi_slopes, (left, right), block_table, softcap, scheduler_metadata, s_aux,
            ks, vs)
        return
    torch.ops.pagedattn.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, output, query_start_loc, seq_lens, float(scale),
        bool(causal), alibi_slopes, left, right, block_table, float(softcap),
        scheduler_metadata, s_aux, ks, vs,
    )


# ------------------------------------------------------------------ linear layers

PACKED_LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pack_linear_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A linear layer's ``[out_features, in_features]`` weight in the layout
    :func:`packed_linear` streams: ``[ceil(out_features / 16), in_features, 16]`` in
    ``dtype`` (default: the weight's), output column ``n`` at ``[n // 16, :, n % 16]``,
    the last panel padded with zero columns. Pack once, at load time."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be a 2-D tensor [out_features, in_features], got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    dtype = weight.dtype if dtype is None else dtype
    if dtype not in PACKED_LINEAR_DTYPES:
        raise TypeError(f"packed weight dtype must be one of {PACKED_LINEAR_DTYPES}, got {dtype}")
    if weight.device.type != "cpu":
        raise ValueError(f"weight must be a CPU tensor, got device {weight.device}")
    n, k = weight.shape
    panels = -(-n // LINEAR_PANEL)
    padded = weight.new_zeros((panels * LINEAR_PANEL, k), dtype=dtype)
    padded[:n] = weight
    return padded.view(panels, LINEAR_PANEL, k).transpose(1, 2).contiguous()


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight packed by :func:`pack_linear_weight`.

    Args:
        x: float32 ``[num_tokens, in_features]`` (last dim contiguous).
        packed_weight: ``[ceil(out_features / 16), in_features, 16]``, float32, bfloat16
            or float16; widened to fp32 in registers, products accumulated in fp32.
        bias: float32 ``[out_features]`` or None.
        out_features: the layer's output width (the packing pads it to a multiple of 16).

    Returns float32 ``[num_tokens, out_features]``. Decode-sized batches stream the weights
    once at memory speed, so half-precision weights run about twice as fast as fp32 ones
    (and, on CPUs without a native bf16 GEMM, far faster than torch's bf16 linear).
    """
    n = _int64("out_features", out_features)
    if not native_available():
        return _fallback("packed_linear").packed_linear(x, packed_weight, bias, n)
    return torch.ops.pagedattn.packed_linear(x, packed_weight, bias, n)


GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def packed_gated_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                        out_features: int, activation: str) -> torch.Tensor:
    """A gated MLP's gate/up projection and its activation in one kernel:
    ``act(h[:, :d]) * h[:, d:]`` of ``h = x @ W.T + bias``, where ``W`` (packed by
    :func:`pack_linear_weight`) holds the gate's ``d`` rows, then the up projection's.

    Args:
        x, packed_weight, bias: as for :func:`packed_linear`.
        out_features: ``2 d``, the projection's width; ``d`` must be a multiple of 16
            (whole weight panels per half).
        activation: ``"silu"`` (Llama's MLP) or ``"gelu_tanh"`` (GELU's tanh
            approximation, Gemma's).

    Returns float32 ``[num_tokens, d]``, equal to :func:`silu_and_mul` /
    :func:`gelu_tanh_and_mul` of :func:`packed_linear`'s output; the ``[num_tokens, 2 d]``
    projection is never written to memory.
    """
    n = _int64("out_features", out_features)
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
    if not native_available():
        return _fallback("packed_gated_linear").packed_gated_linear(x, packed_weight, bias, n,
                                                                    activation)
    return torch.ops.pagedattn.packed_gated_linear(x, packed_weight, bias, n, activation)


def dpbf16_linear_available() -> bool:
    """Whether :func:`packed_linear_dpbf16` runs here: the native extension with the
    ``avx512bf16`` kernels in use (a CPU with AVX512-BF16, not forced to a lower ISA)."""
    return native_available() and get_cpu_isa() is CpuIsa.AVX512BF16


def pack_linear_weight_dpbf16(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's ``[out_features, in_features]`` weight in the layout
    :func:`packed_linear_dpbf16` streams: bfloat16 ``[ceil(out_features / 16),
    ceil(in_features / 2), 32]``, where ``[p, i, 2 c + t]`` holds ``W[16 p + c, 2 i + t]``
    (pairs of inputs interleaved per column, the operand layout of ``vdpbf16ps``). Zero
    columns pad the last panel, a zero input pads an odd ``in_features``. The weight is
    rounded to bfloat16 (nearest even). Pack once, at load time."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be a 2-D tensor [out_features, in_features], got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got {weight.dtype}")
    if weight.device.type != "cpu":
        raise ValueError(f"weight must be a CPU tensor, got device {weight.device}")
    n, k = weight.shape
    panels, pairs = -(-n // LINEAR_PANEL), -(-k // 2)
    padded = weight.new_zeros((panels * LINEAR_PANEL, 2 * pairs), dtype=torch.bfloat16)
    padded[:n, :k] = weight
    # [panel, column, pair, t] -> [panel, pair, column, t]
    return (padded.view(panels, LINEAR_PANEL, pairs, 2).permute(0, 2, 1, 3)
            .reshape(panels, pairs, 2 * LINEAR_PANEL).contiguous())


def packed_linear_dpbf16(x: torch.Tensor, packed_weight: torch.Tensor,
                         bias: torch.Tensor | None, out_features: int,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` on AVX512-BF16's ``vdpbf16ps``, for a weight packed by
    :func:`pack_linear_weight_dpbf16`.

    Args:
        x: ``[num_tokens, in_features]`` (any strides): bfloat16, or float32 rounded to
            bfloat16 (nearest even; fp32 subnormals, ``|x| < 2**-126``, become zero) once
            per call.
        packed_weight: bfloat16 ``[ceil(out_features / 16), ceil(in_features / 2), 32]``.
        bias: float32 ``[out_features]`` or None (added in fp32).
        out_features: the layer's output width.
        out_dtype: float32 (default) or bfloat16 (the fp32 sums rounded, nearest even).

    Returns ``[num_tokens, out_features]`` of ``out_dtype``: exact products of the bf16
    operands, summed in fp32. Raises NotImplementedError unless
    :func:`dpbf16_linear_available`.
    """
    n = _int64("out_features", out_features)
    if not native_available():
        _require_native("packed_linear_dpbf16")
    return torch.ops.pagedattn.packed_linear_dpbf16(x, packed_weight, bias, n, out_dtype)


def amx_linear_available() -> bool:
    """Whether :func:`packed_linear_amx` runs here: the native extension on a CPU with
    AMX-BF16 whose tiles Linux grants this process."""
    return native_available() and bool(torch.ops.pagedattn.amx_linear_available())


def packed_linear_amx(x: torch.Tensor, packed_weight: torch.Tensor,
                      bias: torch.Tensor | None, out_features: int,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`packed_linear_dpbf16`'s product (same arguments, same packed weight) on AMX
    tiles: each 16-column panel of the weight is read in place as the tiles' B operand,
    against 32 rows of ``x`` at a time. Products of the bf16 operands are exact and summed
    in fp32, in the tile unit's order. For batches of rows (decode steps of many
    requests); one row wastes 15 of a tile's 16. Raises NotImplementedError unless
    :func:`amx_linear_available`."""
    n = _int64("out_features", out_features)
    if not native_available():
        _require_native("packed_linear_amx")
    return torch.ops.pagedattn.packed_linear_amx(x, packed_weight, bias, n, out_dtype)


def packed_gated_linear_amx(x: torch.Tensor, packed_weight: torch.Tensor,
                            bias: torch.Tensor | None, out_features: int, activation: str,
                            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A gated MLP's ``act(gate) * up`` from its gate/up projection on AMX tiles:
    :func:`packed_linear_amx`'s product of ``x`` and a ``[2 d, in_features]`` weight (gate
    rows, then up rows; ``d`` a multiple of 16) packed by :func:`pack_linear_weight_dpbf16`,
    with ``activation`` (``"silu"`` or ``"gelu_tanh"``, as :func:`silu_and_mul` /
    :func:`gelu_tanh_and_mul` compute them) applied to the fp32 sums plus bias before one
    rounding to ``out_dtype``. Returns ``[num_tokens, d]``; the ``[num_tokens, 2 d]``
    projection is never written."""
    n = _int64("out_features", out_features)
    if not native_available():
        _require_native("packed_gated_linear_amx")
    return torch.ops.pagedattn.packed_gated_linear_amx(x, packed_weight, bias, n, activation,
                                                       out_dtype)


# ------------------------------------------------------------------ layer steps
# One op each instead of torch's chains of small ops: at batch 1 a decode step's time is
# mostly per-op overhead outside the linear layers. Semantics: the reference functions.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Llama's RMSNorm of ``x`` ``[T, d]`` (float32 or bfloat16, last dim contiguous) with
    float32 ``weight`` ``[d]``, computed in fp32; returns a new ``[T, d]`` tensor of
    ``out_dtype`` (float32 or bfloat16; default ``x.dtype``), rounded once."""
    if not native_available():
        return _fallback("rms_norm").rms_norm(x, weight, eps, out_dtype)
    return torch.ops.pagedattn.rms_norm(x, weight, float(eps), out_dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``residual += x`` (in place; ``residual`` float32 ``[T, d]``, ``x`` float32 or
    bfloat16), then :func:`rms_norm` of the sum into ``out_dtype`` (default ``x.dtype``)."""
    if not native_available():
        return _fallback("fused_add_rms_norm").fused_add_rms_norm(x, residual, weight, eps,
                                                                  out_dtype)
    return torch.ops.pagedattn.fused_add_rms_norm(x, residual, weight, float(eps), out_dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x`` ``[T, 2 d]`` (float32 or bfloat16, computed
    in fp32); returns ``[T, d]`` of ``x.dtype``."""
    if not native_available():
        return _fallback("silu_and_mul").silu_and_mul(x)
    return torch.ops.pagedattn.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[:, :d]) * x[:, d:]`` (GELU with the tanh approximation, Gemma's MLP
    gate) for ``x`` ``[T, 2 d]`` (float32 or bfloat16, computed in fp32); returns ``[T, d]``
    of ``x.dtype``."""
    if not native_available():
        return _fallback("gelu_tanh_and_mul").gelu_tanh_and_mul(x)
    return torch.ops.pagedattn.gelu_tanh_and_mul(x)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate-half (GPT-NeoX layout) RoPE, in place on ``query`` ``[T, H, D]`` and ``key``
    ``[T, Hk, D]`` (both float32 or both bfloat16, rotated in fp32; last dims contiguous; token/head strides free, so the views
    of a fused QKV output work), int64 ``positions`` ``[T]``, float32 ``cos_sin_cache``
    ``[max_positions, D]``: the ``D / 2`` cosines then sines of each position. A position
    outside the cache raises."""
    if not native_available():
        _fallback("rotary_embedding").rotary_embedding(positions, query, key, cos_sin_cache)
        return
    torch.ops.pagedattn.rotary_embedding(positions, query, key, cos_sin_cache)


DECODER_STACK_STYLES = {"llama": 2, "gemma3": 6}
"""The layer shapes :func:`decoder_stack` runs, and the norms each layer has."""


def decoder_stack(style: str, x: torch.Tensor, positions: torch.Tensor,
                  cos_sin: list[torch.Tensor], norm_weights: list[torch.Tensor],
                  linear_weights: list[torch.Tensor], linear_biases: list[torch.Tensor | None],
                  linear_paths: list[int], linear_out_features: list[int],
                  kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, scheduler_metadata: torch.Tensor, causal: bool,
                  attn_scalars: list[float], windows: list[int],
                  output_rows: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                  eps: float, act_dtype: torch.dtype,
                  attn_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One step of a decoder, every layer then the final norm, in one op: the ops of
    :class:`pagedattn.models.llama.LlamaDecoderLayer` (``style="llama"``) or
    :class:`pagedattn.models.gemma3.Gemma3DecoderLayer` (``"gemma3"``) in their order, with
    no Python between them (:mod:`pagedattn.models.native_stack` builds the arguments).

    Per layer ``i`` (``L`` layers, one KV cache each in ``kv_caches``): ``cos_sin[i]``, its
    rotary table; its norms' float32 weights in ``norm_weights`` (Llama: input and
    post-attention; Gemma 3, as ``1 + w``: input, q, k, post-attention, pre- and
    post-feedforward; :data:`DECODER_STACK_STYLES`), the final norm's last;
    ``linear_weights[4 i + j]``, ``linear_biases[4 i + j]`` and ``linear_paths[4 i + j]`` for
    ``j`` = qkv, o, gate_up, down, each weight in the form its path reads (path codes: 0
    packed, 1 dpbf16, 2 torch, 3 oneDNN prepacked, 4 the packed gate/up with the MLP's
    activation fused, 5 amx, 6 the amx gate/up with the activation fused;
    ``linear_out_features``: the four widths); ``attn_scalars[4 i:4 i +
    4]`` = scale, softcap, k_scale, v_scale and ``windows[2 i:2 i + 2]`` = left, right.
    ``x`` (the embeddings, float32 ``[T, hidden]``) becomes the residual stream: it is
    updated in place. The KV caches get the step's keys and values, as the per-layer ops
    write them. ``attn_dtype`` (default ``act_dtype``): the dtype attention runs in; Q, K
    and V are cast to it after the rotary embedding, its output back to ``act_dtype``.

    Returns the final norm's output, ``[T, hidden]`` (``[len(output_rows), hidden]`` when
    ``output_rows`` picks the rows the last layer carries past attention) in
    ``act_dtype``."""
    _require_native("decoder_stack")
    return torch.ops.pagedattn.decoder_stack(
        style, x, positions, cos_sin, norm_weights, linear_weights, linear_biases,
        linear_paths, linear_out_features, kv_caches, slot_mapping, query_start_loc, seq_lens,
        block_table, scheduler_metadata, causal, attn_scalars, windows, output_rows,
        num_heads, num_kv_heads, float(eps), act_dtype, attn_dtype)


# ------------------------------------------------------------------ memory streaming


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of 2-D ``[rows, vocab]`` logits (float32 or bfloat16, last
    dim contiguous, ``vocab >= 1``): int64 ``[rows]``, each row's first maximal index, or its
    first NaN where it has one, as torch answers. Greedy sampling's token per row, in two
    vector passes per row (torch's CPU argmax reduces one element at a time).

    Raises TypeError for another dtype and ValueError for another shape, an empty vocab or
    a strided last dim."""
    if not native_available():
        return _fallback("argmax_rows").argmax_rows(logits)
    return torch.ops.pagedattn.argmax_rows(logits)


def stream_read(buf: torch.Tensor) -> int:
    """Read every byte of ``buf`` once, as fast as this machine reads memory, and return
    the sum of its bytes (each an unsigned 8-bit integer, whatever ``buf``'s dtype; exact
    below 2**56 bytes, as the native sum is).

    The read runs on ``torch.get_num_threads()`` threads (the native kernels' pool: a few
    contiguous ranges each, taken in turn), with the widest loads of the ISA in use
    (64-byte AVX-512, 32-byte AVX2, 16-byte NEON or portable) and nothing but a byte sum
    per load: the bench's DRAM roof
    (:mod:`pagedattn.bench.probes`). The sum depends on every byte, so no load can be
    skipped.

    Args:
        buf: a non-empty, contiguous CPU tensor of any dtype (``buf.nbytes`` bytes read).

    Raises TypeError when ``buf`` is no tensor, ValueError when it is not on the CPU, not
    contiguous or empty. Without the native extension, the reference
    (:func:`pagedattn.ops.reference.stream_read`) gives the same sum, at PyTorch's speed.
    """
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.device.type != "cpu":
        raise ValueError(f"buf must be a CPU tensor, got device {buf.device}")
    if buf.layout != torch.strided:
        raise ValueError(f"buf must be a dense (strided) tensor, got layout {buf.layout}")
    if buf.numel() == 0:
        raise ValueError(f"buf must be non-empty, got shape {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise ValueError(f"buf must be contiguous, got shape {tuple(buf.shape)} with strides "
                         f"{buf.stride()} (call .contiguous() first)")
    if not native_available():
        return _fallback("stream_read").stream_read(buf)
    return int(torch.ops.pagedattn.stream_read(buf))
