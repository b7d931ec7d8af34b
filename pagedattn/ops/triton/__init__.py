"""GPU paged-attention ops in Triton: ``reshape_and_cache_flash`` and ``unified_attention``.

Both take the *flash* cache layout, one tensor each for keys and values::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
    key_cache[b, o, h, :] = key of the token in slot b * block_size + o

(``kv_cache.unbind(0)`` of a ``[2, num_blocks, block_size, num_kv_heads, head_size]``
cache). Semantics are docs/semantics.md, the definition
:mod:`pagedattn.ops.reference` implements.

The kernels launch on CUDA tensors; on CPU tensors only under Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment before the first call of the process), which
is how the test suite checks them on machines without a GPU. :func:`launch_problem`
says whether a device can run them, and why not. Importing this package needs neither
Triton nor CUDA: the kernels are imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Sequence

from dataclasses import dataclass, field

import torch

__all__ = ["reshape_and_cache_flash", "unified_attention", "launch_problem",
           "triton_import_problem", "FP8_CACHE_DTYPES", "KernelLaunch",
           "plan_reshape_and_cache_flash", "plan_unified_attention", "Tiles",
           "TILE_TABLE", "KVSplitPlan", "plan_kv_splits"]

from pagedattn.checks import is_int, is_number, require_int  # noqa: E402
from pagedattn.ops.reference import FP8_CACHE_DTYPES  # noqa: E402 (kv_cache_dtype -> fp8 dtype)

KV_CACHE_DTYPES = ("auto", *FP8_CACHE_DTYPES)
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_import_problem() -> str | None:
    """Why Triton cannot be imported here, or ``None`` (does not import it)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch_problem(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on ``device`` in this process, or ``None``."""
    problem = triton_import_problem()
    if problem is not None:
        return problem
    device = torch.device(device)
    if _kernels_loaded():
        interpreted = _kernel_module().INTERPRETED
    else:
        interpreted = _interpreter_requested()
    if device.type == "cuda":
        if interpreted:
            return "the Triton kernels were loaded under TRITON_INTERPRET=1 (CPU tensors only)"
        if not torch.cuda.is_available():
            return "CUDA is not available to torch"
        return None
    if device.type == "cpu":
        if interpreted:
            return None
        return ("Triton kernels need a CUDA GPU; CPU tensors run only under Triton's "
                "interpreter (TRITON_INTERPRET=1 set before the first call)")
    return f"device type {device.type} is not supported (needs cuda)"


def _kernels_loaded() -> bool:
    import sys

    return f"{__name__}._kernels" in sys.modules


def _kernel_module():
    return importlib.import_module(f"{__name__}._kernels")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ------------------------------------------------------------------------ validation


def _check_tensor(name: str, t: object, *, dim: int | None = None,
                  dtypes: Sequence[torch.dtype] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    return t


def _check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (the query's device)")


def _check_launchable(device: torch.device) -> None:
    problem = launch_problem(device)
    if problem is not None:
        raise RuntimeError(f"cannot launch the Triton kernels on {device}: {problem}")


def _scale_tensor(name: str, scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A one-element fp32 tensor on ``device`` holding ``scale``."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(scale.shape)}")
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    if not is_number(scale):
        raise TypeError(f"{name} must be a float or a one-element tensor, got {scale!r}")
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


FP8_E4M3_MIN_CAPABILITY = (8, 9)
"""Triton lowers float8_e4m3fn only from compute capability 8.9 (Ada, Hopper) on."""


def _check_fp8_lowering(dtype: torch.dtype, device: torch.device) -> None:
    if dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_E4M3_MIN_CAPABILITY:
        raise NotImplementedError(
            f"a float8_e4m3fn cache needs compute capability >= 8.9 for Triton, this GPU has "
            f"{capability[0]}.{capability[1]}; use kv_cache_dtype='fp8_e5m2'")


CHECK_VALUES_ENV = "PAGEDATTN_CHECK_VALUES"


def _reads_data_cheaply(t: torch.Tensor) -> bool:
    """Whether to run the checks that read tensor values (slots and block ids in range,
    lengths consistent). They are free on the CPU; on a GPU each costs a device sync
    (and breaks CUDA-graph capture), so there they run only with
    ``PAGEDATTN_CHECK_VALUES=1`` in the environment (debugging an engine)."""
    return t.device.type == "cpu" or os.environ.get(CHECK_VALUES_ENV, "0") not in ("", "0")


@dataclass(frozen=True)
class KernelLaunch:
    """One validated kernel launch: ``kernel`` (a name in ``_kernels``) over ``grid``
    with positional ``args``, keyword ``constexprs`` and launch ``options``
    (``num_warps``), followed by the launch ``then`` if any. Tests compile it for GPU
    targets without a GPU (``triton.compile``), the ops launch it."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    options: dict = field(default_factory=dict)
    then: KernelLaunch | None = None


def _run(launch: KernelLaunch | None, device: torch.device) -> None:
    _check_launchable(device)
    while launch is not None:
        kernel = getattr(_kernel_module(), launch.kernel)
        kernel[launch.grid](*launch.args, **launch.constexprs, **launch.options)
        launch = launch.then


# ------------------------------------------------------------------- cache writer


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | float,
    v_scale: torch.Tensor | float,
) -> None:
    """Write the first ``slot_mapping.numel()`` tokens' keys and values into the caches.

    Args:
        key, value: ``[T, num_kv_heads, head_size]``; only the first
            ``slot_mapping.numel()`` rows are read (the rest may be padding).
        key_cache, value_cache: flash layout ``[num_blocks, block_size, num_kv_heads,
            head_size]``, written in place.
        slot_mapping: int32/int64 ``[n]``, ``n <= T``: token ``t`` goes to block
            ``slot // block_size``, offset ``slot % block_size``; ``-1`` (any negative
            slot) is skipped.
        kv_cache_dtype: ``"auto"`` (the cache has key's dtype) or ``"fp8"`` /
            ``"fp8_e4m3"`` (cache ``torch.float8_e4m3fn``) / ``"fp8_e5m2"``
            (``torch.float8_e5m2``): the cache stores ``x / scale``, saturated to the
            format's finite range.
        k_scale, v_scale: float or one-element tensor (used for fp8 only).
    """
    _run(plan_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                      kv_cache_dtype, k_scale, v_scale), key.device)


def plan_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                 kv_cache_dtype, k_scale, v_scale) -> KernelLaunch | None:
    """Validate the arguments of :func:`reshape_and_cache_flash` and return its launch
    (``None``: nothing to write)."""
    key = _check_tensor("key", key, dim=3, dtypes=COMPUTE_DTYPES)
    value = _check_tensor("value", value, dim=3, dtypes=COMPUTE_DTYPES)
    key_cache = _check_tensor("key_cache", key_cache, dim=4)
    value_cache = _check_tensor("value_cache", value_cache, dim=4)
    slot_mapping = _check_tensor("slot_mapping", slot_mapping, dim=1,
                                 dtypes=(torch.int32, torch.int64))
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value ({tuple(value.shape)}, {value.dtype}) must match key "
                         f"({tuple(key.shape)}, {key.dtype})")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache ({tuple(value_cache.shape)}, {value_cache.dtype}) must "
                         f"match key_cache ({tuple(key_cache.shape)}, {key_cache.dtype})")
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    if tuple(key.shape[1:]) != (num_kv_heads, head_size):
        raise ValueError(f"key must be [T, {num_kv_heads}, {head_size}] to match the cache "
                         f"{tuple(key_cache.shape)}, got {tuple(key.shape)}")
    num_tokens = slot_mapping.numel()
    if num_tokens > key.shape[0]:
        raise ValueError(f"slot_mapping has {num_tokens} entries but key has only "
                         f"{key.shape[0]} tokens")
    expected = key.dtype if kv_cache_dtype == "auto" else FP8_CACHE_DTYPES[kv_cache_dtype]
    if key_cache.dtype != expected:
        raise TypeError(f"kv_cache_dtype={kv_cache_dtype!r} with key dtype {key.dtype} needs a "
                        f"{expected} cache, got {key_cache.dtype}")
    device = key.device
    _check_same_device(device, value=value, key_cache=key_cache, value_cache=value_cache,
                       slot_mapping=slot_mapping)
    if _reads_data_cheaply(slot_mapping) and num_tokens:
        top = int(slot_mapping.max())
        if top >= num_blocks * block_size:
            raise ValueError(f"slot_mapping holds slot {top}, out of range for {num_blocks} "
                             f"blocks of {block_size} (max slot {num_blocks * block_size - 1})")
    _check_fp8_lowering(key_cache.dtype, device)
    k_scale_t = _scale_tensor("k_scale", k_scale, device)
    v_scale_t = _scale_tensor("v_scale", v_scale, device)
    if num_tokens == 0:
        return None
    quantize = kv_cache_dtype != "auto"
    # fp8 formats: largest finite value, mantissa bits (eps = 2**-bits), smallest
    # normal exponent (tiny = 2**exp).
    info = torch.finfo(key_cache.dtype if quantize else torch.float8_e4m3fn)
    fp8_max = float(info.max) if quantize else 0.0
    return KernelLaunch(
        "reshape_and_cache_flash_kernel", (num_tokens,),
        (key, value, key_cache, value_cache, slot_mapping, k_scale_t, v_scale_t,
         *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
         num_kv_heads, head_size, block_size),
        dict(HEADS_P=_next_pow2(num_kv_heads), HEAD_P=_next_pow2(head_size),
             QUANTIZE=quantize, FP8_MAX=fp8_max,
             FP8_MANTISSA_BITS=-int(math.log2(info.eps)),
             FP8_MIN_NORMAL_EXP=int(math.log2(info.tiny))),
    )


# ------------------------------------------------------------------------ attention


def _check_descale(name: str, t: torch.Tensor | None, num_reqs: int,
                   num_kv_heads: int) -> torch.Tensor | None:
    """``[num_reqs, num_kv_heads]`` fp32 view of a descale (expanded views welcome)."""
    if t is None:
        return None
    _check_tensor(name, t, dtypes=(torch.float32,))
    try:
        return t.expand(num_reqs, num_kv_heads)
    except RuntimeError:
        raise ValueError(f"{name} must be [num_reqs={num_reqs}, num_kv_heads={num_kv_heads}] "
                         f"(or broadcast to it), got shape {tuple(t.shape)}") from None


def _check_batch_values(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                        block_table: torch.Tensor, max_seqlen_q: int, num_tokens: int,
                        num_blocks: int, block_size: int) -> None:
    """Data-dependent checks (lengths, block ids), on CPU tensors only."""
    starts = cu_seqlens_q.tolist()
    if starts[0] != 0:
        raise ValueError(f"cu_seqlens_q[0] must be 0, got {starts[0]}")
    if starts[-1] > num_tokens:
        raise ValueError(f"cu_seqlens_q[-1] ({starts[-1]}) exceeds the query's {num_tokens} tokens")
    for r, kv_len in enumerate(seqused_k.tolist()):
        q_len = starts[r + 1] - starts[r]
        if q_len < 0:
            raise ValueError(f"cu_seqlens_q must be non-decreasing; request {r} has length {q_len}")
        if q_len > max_seqlen_q:
            raise ValueError(f"request {r} has {q_len} queries > max_seqlen_q ({max_seqlen_q})")
        if kv_len < q_len:
            raise ValueError(f"seqused_k[{r}] ({kv_len}) must be >= its query length ({q_len})")
        needed = -(-kv_len // block_size)
        if needed > block_table.shape[1]:
            raise ValueError(f"request {r} needs {needed} blocks for {kv_len} keys, block_table "
                             f"has {block_table.shape[1]} columns")
        used = block_table[r, :needed]
        if needed and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(f"block_table[{r}] holds block ids {used.tolist()} outside "
                             f"[0, {num_blocks})")


MAX_KV_SPLITS = 64
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class Tiles:
    """Tile shape and launch options of :func:`unified_attention`'s kernel: a tile is
    ``block_q`` query tokens times ``group_p`` heads (rows) by ``block_n`` keys, the
    head padded to ``head_p``. :func:`plan_unified_attention` chooses one; its
    ``tiles=`` argument takes another (benchmarks/tune_gpu_prefill.py sweeps them)."""

    block_q: int
    group_p: int
    head_p: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.group_p


# (rows, keys, num_warps, num_stages) of a tile, by step kind, for head sizes up to 128
# (larger heads get proportionally fewer rows); rows = query tokens x the heads of a GQA
# group. The one place the tiles are chosen. Step kinds: "decode" (one query token per
# request), "short" (prefills shorter than LONG_PREFILL tokens: many small tiles keep
# every multiprocessor busy), "prefill".
# - "small": fp32 (whose tiles would not fit shared memory at the 16-bit sizes) and the
#   interpreter (where every tile costs Python time).
# - "gpu": 16-bit data on a GPU other than Hopper, as measured on an H100 before the
#   Hopper table existed.
# - "hopper": 16-bit data on compute capability 9.x, the best of
#   benchmarks/tune_gpu_prefill.py's sweep on an H200 (docs/gpu_backends.md). Prefill
#   wants 128 rows per warpgroup of 4 warps.
TILE_TABLE: dict[str, dict[str, tuple[int, int, int, int]]] = {
    "small": {"decode": (16, 32, 4, 2), "short": (64, 32, 4, 2), "prefill": (64, 32, 4, 2)},
    "gpu": {"decode": (16, 64, 4, 3), "short": (128, 64, 8, 3), "prefill": (128, 64, 8, 3)},
    "hopper": {"decode": (16, 128, 4, 2), "short": (64, 32, 4, 2),
               "prefill": (256, 64, 8, 3)},
}
LONG_PREFILL = 1024
SHARED_MEMORY_BUDGET = {"small": 160 * 1024, "gpu": 160 * 1024, "hopper": 227 * 1024}
"""Bytes of K/V stages plus the Q tile a plan may ask for (an overestimate of Triton's
use): under the per-block limit of Ampere's A100 (164 KB) and of Hopper (227 KB). Past
the budget a plan gives up stages, then keys per tile."""


def _tile_table_key(device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cuda" or dtype == torch.float32:
        return "small"
    return "hopper" if _capability(device)[0] == 9 else "gpu"


def _tile_sizes(max_seqlen_q: int, group: int, head_size: int, table: str,
                element_size: int = 2) -> Tiles:
    """Tile shape of :func:`unified_attention` from ``TILE_TABLE[table]``. ``tl.dot``
    needs every dimension >= 16, so a decode tile is one token times the group, padded
    to 16 rows; prefill tiles hold as many tokens as the table's rows allow."""
    group_p = _next_pow2(group)
    head_p = max(16, _next_pow2(head_size))
    kind = ("decode" if max_seqlen_q <= 1 else
            "short" if max_seqlen_q < LONG_PREFILL else "prefill")
    rows, block_n, num_warps, num_stages = TILE_TABLE[table][kind]
    if head_p > 128:  # the accumulator is rows x head_p: keep it in registers
        rows = max(16, rows * 128 // head_p)
    block_q = max(1, rows // group_p, 16 // group_p)
    block_q = min(block_q, max(_next_pow2(max_seqlen_q), 16 // group_p, 1))
    if block_q * group_p < rows:
        num_warps = min(num_warps, 4)  # a short prefill's tile is no bigger than a decode's

    def shared_bytes(n, stages):
        return element_size * head_p * (stages * 2 * n + block_q * group_p)

    budget = SHARED_MEMORY_BUDGET[table]
    while num_stages > 2 and shared_bytes(block_n, num_stages) > budget:
        num_stages -= 1
    while block_n > 16 and shared_bytes(block_n, num_stages) > budget:
        block_n //= 2
    return Tiles(block_q, group_p, head_p, block_n, num_warps, num_stages)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kv_splits_for(device: torch.device, programs: int, max_seqlen_q: int,
                   max_seqlen_k: int, block_n: int) -> int:
    """Split-KV for decode batches whose ``programs`` (requests x kv heads) would leave
    most of the GPU idle: enough splits for about two programs per multiprocessor,
    each split at least two key tiles long (the sweep in docs/gpu_backends.md: more
    splits than that cost more in partial states and the merge than they gain)."""
    if device.type != "cuda" or max_seqlen_q > 1 or programs == 0:
        return 1
    by_occupancy = 2 * _multiprocessors(device) // programs
    by_length = max_seqlen_k // (2 * block_n)
    return max(1, min(by_occupancy, by_length, MAX_KV_SPLITS))


@dataclass(frozen=True)
class KVSplitPlan:
    """One step's split-KV choice for :func:`unified_attention`: how many slices each
    request's keys are cut into, and the fp32 partial states of a split launch, sized
    for the step's tokens. Made once per step (:func:`plan_kv_splits`, called by the
    TRITON_ATTN builder) and read by every layer's launch."""

    num_kv_splits: int
    partial_acc: torch.Tensor | None = None
    """``[num_tokens, num_heads, num_kv_splits, head_p]`` (``None`` when not split)."""
    partial_ml: torch.Tensor | None = None
    """``[2, num_tokens, num_heads, num_kv_splits]``: each slice's row max and sum."""


def plan_kv_splits(device: torch.device | str, dtype: torch.dtype, *, num_tokens: int,
                   num_reqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                   max_seqlen_q: int, max_seqlen_k: int,
                   num_kv_splits: int | None = None) -> KVSplitPlan:
    """The split-KV plan of a batch of ``num_reqs`` requests and ``num_tokens`` query
    rows whose queries are ``dtype`` on ``device``: ``num_kv_splits`` when given, else
    the choice :func:`unified_attention` makes (on a GPU, decode batches too small to
    fill it are split; anything else is not), with the partial buffers it needs."""
    device = torch.device(device)
    require_int("num_kv_splits", num_kv_splits, 1, maximum=MAX_KV_SPLITS, allow_none=True)
    if num_kv_splits is None and device.type != "cuda":
        return KVSplitPlan(1)  # off the GPU, nothing is split unless asked
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    group = num_heads // num_kv_heads
    tiles = _tile_sizes(max_seqlen_q, group, head_size, _tile_table_key(device, dtype),
                        dtype.itemsize)
    return _split_plan(device, num_kv_splits or _kv_splits_for(
        device, num_reqs * num_kv_heads, max_seqlen_q, max_seqlen_k, tiles.block_n),
        num_tokens, num_heads, tiles.head_p)


def _split_plan(device: torch.device, splits: int, num_tokens: int, num_heads: int,
                head_p: int) -> KVSplitPlan:
    if splits == 1:
        return KVSplitPlan(1)
    return KVSplitPlan(
        splits,
        torch.empty(num_tokens, num_heads, splits, head_p, dtype=torch.float32, device=device),
        torch.empty(2, num_tokens, num_heads, splits, dtype=torch.float32, device=device))


def _check_split_plan(plan: KVSplitPlan, num_kv_splits: int | None, device: torch.device,
                      num_tokens: int, num_heads: int, head_p: int) -> None:
    if not isinstance(plan, KVSplitPlan):
        raise TypeError(f"kv_split_plan must be a KVSplitPlan, got {type(plan).__name__}")
    if num_kv_splits is not None:
        raise ValueError("give num_kv_splits or kv_split_plan, not both")
    splits = plan.num_kv_splits
    require_int("kv_split_plan.num_kv_splits", splits, 1, maximum=MAX_KV_SPLITS)
    if splits == 1:
        return
    expected = {"partial_acc": (num_tokens, num_heads, splits, head_p),
                "partial_ml": (2, num_tokens, num_heads, splits)}
    for name, shape in expected.items():
        t = getattr(plan, name)
        if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape
                or t.dtype != torch.float32 or t.device != device or not t.is_contiguous()):
            got = None if not isinstance(t, torch.Tensor) else \
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            raise ValueError(f"kv_split_plan.{name} must be a contiguous float32 {shape} "
                             f"tensor on {device} (the plan of this batch), got {got}")


def unified_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    window_size: tuple[int, int] | Sequence[int],
    block_table: torch.Tensor,
    softcap: float,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    *,
    num_kv_splits: int | None = None,
    tiles: Tiles | None = None,
    kv_split_plan: KVSplitPlan | None = None,
) -> None:
    """Paged attention of a varlen batch (decodes, chunked prefills and whole prefills
    mixed, in any order) in one launch; fills ``out[:cu_seqlens_q[-1]]``.

    Args:
        q: ``[num_tokens, num_heads, head_size]`` fp16/bf16/fp32; request ``r`` owns rows
            ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``.
        k, v: flash-layout caches ``[num_blocks, block_size, num_kv_heads, head_size]``,
            in q's dtype, or fp8 (``float8_e4m3fn``/``float8_e5m2``) with
            ``k_descale``/``v_descale``.
        out: like q; rows past ``cu_seqlens_q[-1]`` are left untouched.
        cu_seqlens_q: int32 ``[num_reqs + 1]``, starting at 0, non-decreasing.
        max_seqlen_q: the longest query of the batch (sizes the tiles).
        seqused_k: int32 ``[num_reqs]``, keys of each request incl. the new ones
            (>= its query length); query ``i`` sits at position
            ``seqused_k[r] - q_len + i``.
        max_seqlen_k: the longest ``seqused_k`` (informational).
        softmax_scale: multiplies ``q.k``.
        causal: hide keys after the query's position.
        alibi_slopes: fp32 ``[num_heads]`` or ``None``; adds ``slope[h] * (j - p)``.
        window_size: ``(left, right)``, ``-1`` = unbounded on that side.
        block_table: int32 ``[num_reqs, max_blocks]``.
        softcap: ``> 0`` maps scores to ``softcap * tanh(s / softcap)``; 0 = off.
        q_descale: must be ``None`` (quantized queries are not supported).
        k_descale, v_descale: fp32, ``[num_reqs, num_kv_heads]`` or broadcastable to it
            (e.g. ``layer._k_scale.expand(...)``): multiply an fp8 cache's values.
        sinks: ``[num_heads]`` sink logits (fp32/bf16), or ``None``.
        num_kv_splits: split each request's keys into this many slices, attended in
            parallel and merged (split-KV); ``None`` chooses: on a GPU, decode batches
            too small to fill it are split, anything else is not.
        tiles: the kernel's tile shape and launch options (:class:`Tiles`); ``None``
            takes the plan's (``TILE_TABLE``). For tuning.
        kv_split_plan: the step's split choice and partial buffers, made once per step
            by :func:`plan_kv_splits` (the TRITON_ATTN builder does); ``None`` plans
            here. Excludes ``num_kv_splits``.

    GQA/MQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``; any
    group size and any head size (padded inside the kernel) work.
    """
    _run(plan_unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k,
                                max_seqlen_k, softmax_scale, causal, alibi_slopes,
                                window_size, block_table, softcap, q_descale, k_descale,
                                v_descale, sinks, num_kv_splits=num_kv_splits, tiles=tiles,
                                kv_split_plan=kv_split_plan),
         q.device)


def _check_unified_tensors(q, k, v, out, cu_seqlens_q, seqused_k, block_table) -> None:
    """The types, shapes and dtypes of :func:`unified_attention`'s batch and caches."""
    _check_tensor("q", q, dim=3, dtypes=COMPUTE_DTYPES)
    _check_tensor("k", k, dim=4)
    _check_tensor("v", v, dim=4)
    _check_tensor("out", out, dim=3)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, dim=1, dtypes=(torch.int32,))
    _check_tensor("seqused_k", seqused_k, dim=1, dtypes=(torch.int32,))
    _check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32,))
    _, num_heads, head_size = q.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v ({tuple(v.shape)}, {v.dtype}) must match k ({tuple(k.shape)}, {k.dtype})")
    _, _, num_kv_heads, cache_head_size = k.shape
    if cache_head_size != head_size:
        raise ValueError(f"the caches' head_size ({cache_head_size}) differs from q's ({head_size})")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    quantized = k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if k.dtype != q.dtype and not quantized:
        raise TypeError(f"k/v must have q's dtype {q.dtype} or an fp8 dtype, got {k.dtype}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out ({tuple(out.shape)}, {out.dtype}) must match q "
                         f"({tuple(q.shape)}, {q.dtype})")
    num_reqs = seqused_k.numel()
    if cu_seqlens_q.numel() != num_reqs + 1:
        raise ValueError(f"cu_seqlens_q must have num_reqs + 1 = {num_reqs + 1} entries, got "
                         f"{cu_seqlens_q.numel()}")
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table must have at least num_reqs={num_reqs} rows, got "
                         f"shape {tuple(block_table.shape)}")


def _check_unified_options(num_heads, max_seqlen_q, max_seqlen_k, window_size, softcap,
                           q_descale, alibi_slopes, sinks) -> tuple[tuple[int, ...], float]:
    """The feature arguments of :func:`unified_attention`, checked: ``(window, softcap)``
    normalised."""
    require_int("max_seqlen_q", max_seqlen_q, 0)
    require_int("max_seqlen_k", max_seqlen_k, 0)
    window = tuple(window_size)
    if len(window) != 2 or any(not is_int(w) or w < -1 for w in window):
        raise ValueError(f"window_size must be (left, right) ints >= -1, got {window_size!r}")
    softcap = float(softcap or 0.0)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    if q_descale is not None:
        raise NotImplementedError("quantized queries are not supported: pass q_descale=None")
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes, dim=1, dtypes=(torch.float32,))
        if alibi_slopes.numel() != num_heads:
            raise ValueError(f"alibi_slopes must have num_heads={num_heads} entries, got "
                             f"{alibi_slopes.numel()}")
    if sinks is not None:
        _check_tensor("sinks", sinks, dim=1, dtypes=(torch.float32, torch.bfloat16))
        if sinks.numel() != num_heads:
            raise ValueError(f"sinks must have num_heads={num_heads} entries, got {sinks.numel()}")
    return window, softcap


def plan_unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                           softmax_scale, causal, alibi_slopes, window_size, block_table,
                           softcap, q_descale, k_descale, v_descale,
                           sinks=None, *, num_kv_splits=None,
                           tiles=None, kv_split_plan=None) -> KernelLaunch | None:
    """Validate the arguments of :func:`unified_attention` and return its launch
    (``None``: nothing to compute)."""
    _check_unified_tensors(q, k, v, out, cu_seqlens_q, seqused_k, block_table)
    num_tokens, num_heads, head_size = q.shape
    num_blocks, block_size, num_kv_heads, _ = k.shape
    quantized = k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    num_reqs = seqused_k.numel()
    window, softcap = _check_unified_options(num_heads, max_seqlen_q, max_seqlen_k,
                                             window_size, softcap, q_descale, alibi_slopes,
                                             sinks)
    device = q.device
    _check_same_device(device, k=k, v=v, out=out, cu_seqlens_q=cu_seqlens_q,
                       seqused_k=seqused_k, block_table=block_table,
                       alibi_slopes=alibi_slopes, sinks=sinks, k_descale=k_descale,
                       v_descale=v_descale)
    _check_fp8_lowering(k.dtype, device)
    k_descale = _check_descale("k_descale", k_descale, num_reqs, num_kv_heads)
    v_descale = _check_descale("v_descale", v_descale, num_reqs, num_kv_heads)
    if quantized:  # a missing descale means 1.0, as in the reference
        ones = torch.ones(1, 1, dtype=torch.float32, device=device).expand(num_reqs, num_kv_heads)
        k_descale = ones if k_descale is None else k_descale
        v_descale = ones if v_descale is None else v_descale
    if _reads_data_cheaply(cu_seqlens_q):
        _check_batch_values(cu_seqlens_q, seqused_k, block_table, max_seqlen_q, num_tokens,
                            num_blocks, block_size)
    if num_reqs == 0 or num_tokens == 0 or max_seqlen_q == 0:
        return None

    require_int("num_kv_splits", num_kv_splits, 1, maximum=MAX_KV_SPLITS, allow_none=True)
    group = num_heads // num_kv_heads
    if tiles is None:
        tiles = _tile_sizes(max_seqlen_q, group, head_size, _tile_table_key(device, q.dtype),
                            q.element_size())
    elif tiles.group_p != _next_pow2(group) or tiles.head_p < head_size:
        raise ValueError(f"tiles {tiles} do not fit a group of {group} and head size "
                         f"{head_size}")
    if kv_split_plan is None:
        kv_split_plan = _split_plan(device, num_kv_splits or _kv_splits_for(
            device, num_reqs * num_kv_heads, max_seqlen_q, max_seqlen_k, tiles.block_n),
            num_tokens, num_heads, tiles.head_p)
    else:
        _check_split_plan(kv_split_plan, num_kv_splits, device, num_tokens, num_heads,
                          tiles.head_p)
    splits = kv_split_plan.num_kv_splits
    # Request r's tiles start at cu_seqlens_q[r] // block_q + r (see the kernel), each
    # once per kv head.
    grid = ((num_tokens // tiles.block_q + num_reqs) * num_kv_heads, 1, splits)
    # Pointers of disabled features are never read: any tensor will do.
    dummy = q
    merge = None
    part_acc = part_ml = dummy
    if splits > 1:
        part_acc, part_ml = kv_split_plan.partial_acc, kv_split_plan.partial_ml
        merge = KernelLaunch(
            "merge_kv_splits_kernel", (num_tokens, num_heads),
            (part_acc, part_ml, sinks if sinks is not None else dummy, out, cu_seqlens_q,
             num_reqs, num_tokens, num_heads, splits, head_size, *out.stride()),
            dict(SPLITS_P=_next_pow2(splits), HEAD_P=tiles.head_p,
                 USE_SINKS=sinks is not None))
    k_descale = dummy if k_descale is None else k_descale
    v_descale = dummy if v_descale is None else v_descale
    descale_strides = (*k_descale.stride()[-2:], *v_descale.stride()[-2:]) if quantized \
        else (0, 0, 0, 0)
    # The kernel works in base 2 (exp2): log2(e) is folded into the score scale here.
    # With a soft-cap the scale goes inside the tanh and log2(e) onto the cap.
    if softcap > 0:
        qk_scale, cap = float(softmax_scale) / softcap, softcap * LOG2E
    else:
        qk_scale, cap = float(softmax_scale) * LOG2E, 0.0
    return KernelLaunch(
        "unified_attention_kernel", grid,
        (q, k, v, out, cu_seqlens_q, seqused_k, block_table,
         alibi_slopes if alibi_slopes is not None else dummy,
         sinks if sinks is not None else dummy,
         k_descale, v_descale,
         num_reqs, qk_scale, cap, window[0], window[1],
         *q.stride(), *out.stride(), *k.stride(), *v.stride(), *block_table.stride(),
         *descale_strides,
         head_size, num_kv_heads, group,
         part_acc, part_ml, num_tokens, num_heads, splits),
        dict(BLOCK_SIZE=block_size, BLOCK_Q=tiles.block_q, GROUP_P=tiles.group_p,
             HEAD_P=tiles.head_p, BLOCK_N=tiles.block_n,
             CAUSAL=bool(causal), USE_ALIBI=alibi_slopes is not None, USE_SOFTCAP=softcap > 0,
             USE_SINKS=sinks is not None, USE_LEFT=window[0] >= 0, USE_RIGHT=window[1] >= 0,
             DEQUANTIZE=quantized, FP32_DOT=q.dtype == torch.float32, SPLIT=splits > 1,
             PAD_HEAD=head_size != tiles.head_p,
             # A positive scale can wait until after the row max (see the kernel).
             FOLD_SCALE=softcap == 0 and alibi_slopes is None and softmax_scale > 0),
        dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        merge,
    )
