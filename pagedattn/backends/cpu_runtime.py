"""The CPU-attention runtime: the one path from a backend to the native attention ops.

CPU_ATTN (and through it the engine) and the vLLM plugin both call these functions; no
other module calls ``torch.ops.pagedattn``'s attention ops. The runtime owns the choices
every caller would otherwise re-derive:

* the vector-kernel variant (:func:`kernel_variant`), and for a layer geometry's
  prefills the vector kernels or the matrix-engine kernel, measured
  (:func:`prefill_variant`);
* the window pair of a layer (:func:`window_pair`) and its fp8 cache dtype
  (:func:`fp8_cache_dtype`);
* the per-step plan (:func:`plan_step`, shared prefixes included, and the rule of
  :func:`shared_prefix_pays`) and the cross-attention query split
  (:func:`split_queries_longer_than_keys`);
* the per-layer calls (:func:`write_cache`, :func:`attend`). Callers validate their
  arguments once (impl construction, builder) and these call the native ops directly:
  the public wrappers in :mod:`pagedattn.ops` re-validate every argument, which cost
  ~30 us of Python per layer at batch 1. Without the extension they fall back to those
  wrappers (and so to the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import os

import torch

from pagedattn import ops, tuning
from pagedattn.backend import AttentionType, is_quantized_kv_cache
from pagedattn.checks import require_int
from pagedattn.ops import kernel_shapes
from pagedattn.ops.isa import (SHARED_PREFIX_LONG_KEYS, SHARED_PREFIX_MIN_KEYS,
                               SHARED_PREFIX_MIN_SAVED_KEYS, IsaHint)
from pagedattn.ops.reference import FP8_CACHE_DTYPES


native_available = ops.native_available
"""Whether the native kernels are loaded (else every call runs the reference)."""


def kernel_variant() -> IsaHint:
    """The vector kernels' variant: ``neon`` on Arm, else ``vec16``. The kernels read the
    block size from the cache tensor; vLLM's hints ``vec`` and ``vec16`` name the same
    kernels and differ only in the block sizes the public ops accept under them, and
    ``vec16`` accepts every size the kernels run. Whether prefills take the matrix-engine
    kernel instead is :func:`prefill_variant`'s measured choice."""
    return IsaHint.NEON if ops.on_arm() else IsaHint.VEC16


def block_size_problem(block_size: int) -> str | None:
    """Why the kernels cannot read caches of ``block_size`` blocks (None: they can)."""
    if kernel_shapes.is_supported_block_size(block_size):
        return None
    return f"block_size {block_size} (the kernels take {kernel_shapes.BLOCK_SIZE_RULE})"


PREFILL_KERNEL_ENV = "PAGEDATTN_PREFILL_KERNEL"
"""``vector`` or ``matrix``: skip the measurement of :func:`prefill_variant`."""
PREFILL_KERNELS = ("vector", "matrix")
PREFILL_PROBE_TOKENS = 256
"""The prompt length :func:`prefill_variant` times both kernels on."""


def prefill_variant(geometry: "PlanGeometry", block_size: int,
                    cache_dtype: torch.dtype | None = None) -> IsaHint:
    """The variant whose prefill items run fastest here for a layer ``geometry`` and its
    cache: :func:`kernel_variant`'s vector kernels, or ``amx``, the matrix-engine kernel
    (oneDNN's brgemm: AMX tiles where the CPU has them, AVX-512 or AVX2 code elsewhere).
    Measured once per geometry on a :data:`PREFILL_PROBE_TOKENS`-token prompt through
    :mod:`pagedattn.tuning` (cached per machine; ``PAGEDATTN_PREFILL_KERNEL`` forces one).
    Decode items run the vector kernels under either (under ``amx`` their bf16 q.k runs on
    the AMX tiles where they are: docs/kernels.md); each item's kernel depends on its own
    rows alone, never on its batch-mates."""
    vector = kernel_variant()
    if vector is IsaHint.NEON or not ops.matrix_engine_available():
        return vector
    cache_dtype = cache_dtype or geometry.dtype
    key = (f"{str(geometry.dtype)[6:]} cache {str(cache_dtype)[6:]} heads "
           f"{geometry.num_heads}/{geometry.num_kv_heads} x {geometry.head_dim} "
           f"block {block_size}")
    force = os.environ.get(PREFILL_KERNEL_ENV) or None
    if force is not None and force not in PREFILL_KERNELS:
        raise ValueError(f"{PREFILL_KERNEL_ENV}={force!r}: expected one of "
                         f"{', '.join(PREFILL_KERNELS)}")
    hints = {"vector": vector, "matrix": IsaHint.AMX}
    choice = tuning.choose(
        "attention-prefill", key,
        lambda: _prefill_probes(geometry, block_size, cache_dtype, hints), force=force)
    return hints.get(choice.chosen, vector)


def _prefill_probes(geometry: "PlanGeometry", block_size: int, cache_dtype: torch.dtype,
                    hints: dict[str, IsaHint]) -> dict:
    """One causal prompt of PREFILL_PROBE_TOKENS tokens on random data, under each hint."""
    tokens, gen = PREFILL_PROBE_TOKENS, torch.Generator().manual_seed(0)
    blocks = -(-tokens // block_size)
    heads, kv_heads, dim = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
    query = torch.randn(tokens, heads, dim, generator=gen).to(geometry.dtype)
    caches = [torch.randn(blocks, kv_heads, block_size, dim, generator=gen).to(cache_dtype)
              for _ in range(2)]
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    out = torch.empty_like(query)

    def runner(hint: IsaHint):
        plan = plan_step(geometry, hint, qsl, lens, causal=True)
        return lambda: attend(query, *caches, out, query_start_loc=qsl, seq_lens=lens,
                              block_table=table, scheduler_metadata=plan,
                              scale=dim ** -0.5, causal=True, window=(-1, -1),
                              alibi_slopes=None, softcap=0.0, sinks=None)

    return {name: runner(hint) for name, hint in hints.items()}


def window_pair(sliding_window: int | None, attn_type: str) -> tuple[int, int]:
    """A layer's window (``sliding_window`` keys including its own, ``None`` or ``-1`` =
    none) as the kernels' ``(left, right)``, as vLLM's CPU impl sets it: encoder-only
    layers see ``window - 1`` keys on each side; every other type (decoder, cross and
    ``ENCODER`` layers alike) looks back ``window - 1`` keys and none ahead."""
    if sliding_window is None or sliding_window == -1:
        return (-1, -1)
    require_int("sliding_window", sliding_window, 1, expected="a positive int, -1 or None")
    left = sliding_window - 1
    return (left, left) if AttentionType.parse(attn_type) == AttentionType.ENCODER_ONLY \
        else (left, 0)


def fp8_cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The fp8 torch dtype of an fp8 ``kv_cache_dtype`` (``fp8`` = ``fp8_e4m3``), ``None``
    for a model-dtype cache; NotImplementedError for other quantized caches."""
    name = str(kv_cache_dtype)
    if name in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[name]
    if is_quantized_kv_cache(name):
        raise NotImplementedError(
            f"kv_cache_dtype {name!r} is not supported by the CPU kernels; expected 'auto' or "
            f"one of {', '.join(FP8_CACHE_DTYPES)}")
    return None


@dataclass(frozen=True)
class PlanGeometry:
    """What the step plan needs of a group of layers."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window_size: int  # -1 = none


def plan_step(geometry: PlanGeometry, variant: IsaHint, query_start_loc: torch.Tensor,
              seq_lens: torch.Tensor, causal: bool, batch_invariant: bool = False,
              block_table: torch.Tensor | None = None, block_size: int | None = None,
              common_prefix_len: int = 0) -> torch.Tensor:
    """The step's work partition (KV splits on, unless ``batch_invariant``: then every
    row's result is independent of its batch-mates, chunking and thread count), computed
    once and read by every layer. With the step's ``block_table`` (and the cache's
    ``block_size``) the plan reads prefixes that requests share in the same blocks once
    for all of them (docs/kernels.md, "Shared prefixes"); ``common_prefix_len`` > 0 names
    a prefix every request shares (vLLM's cascade attention) instead of finding them.
    Batch-invariant plans never share."""
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(), num_heads=geometry.num_heads,
        num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, seq_lens=seq_lens,
        dtype=geometry.dtype, query_start_loc=query_start_loc, causal=causal,
        sliding_window_size=geometry.window_size, isa=variant, enable_kv_split=True,
        batch_invariant=batch_invariant, block_table=block_table,
        block_size=None if block_table is None else block_size,
        common_prefix_len=common_prefix_len)


def shared_prefix_pays(common_prefix_len: int, query_lens, batch_invariant: bool) -> bool:
    """Whether reading a ``common_prefix_len``-key prefix once for every request with
    queries (``query_lens``) pays: the planner's rule (``pagedattn/ops/isa.py``: at least
    ``SHARED_PREFIX_MIN_KEYS`` keys, and ``SHARED_PREFIX_LONG_KEYS`` of them or
    ``SHARED_PREFIX_MIN_SAVED_KEYS`` key reads saved), never in batch-invariant plans."""
    members = sum(1 for q in query_lens if int(q) > 0)
    keys = common_prefix_len
    return (not batch_invariant and members >= 2 and keys >= SHARED_PREFIX_MIN_KEYS
            and (keys >= SHARED_PREFIX_LONG_KEYS
                 or (members - 1) * keys >= SHARED_PREFIX_MIN_SAVED_KEYS))


def split_queries_longer_than_keys(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross attention may have more decoder queries than encoder keys, which the kernel
    rejects (``seq_len < query_len``). Without a causal mask or window a query's position
    does not matter, so such a request is cut into pieces of at most ``seq_len`` queries,
    each reading the same blocks."""
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    kv_lens = seq_lens.tolist()
    if all(q <= s for q, s in zip(query_lens, kv_lens)):
        return query_start_loc, seq_lens, block_table
    starts, lens, rows = [0], [], []
    for r, (q, s) in enumerate(zip(query_lens, kv_lens)):
        if s == 0 and q > 0:
            raise ValueError(f"cross attention request {r} has {q} queries but no encoder keys")
        pieces = [q] if q <= s else [s] * (q // s) + ([q % s] if q % s else [])
        for piece in pieces:
            starts.append(starts[-1] + piece)
            lens.append(s)
            rows.append(r)
    return (
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        block_table[torch.tensor(rows, dtype=torch.long)],
    )


def write_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store this step's keys and values at their slots (fp8 caches: ``x / scale``)."""
    if ops.native_available():
        torch.ops.pagedattn.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    else:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                       kernel_variant(), k_scale=k_scale, v_scale=v_scale)


def attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           output: torch.Tensor, *, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
           block_table: torch.Tensor, scheduler_metadata: torch.Tensor | None, scale: float,
           causal: bool, window: tuple[int, int], alibi_slopes: torch.Tensor | None,
           softcap: float, sinks: torch.Tensor | None, k_scale: float = 1.0,
           v_scale: float = 1.0) -> None:
    """Paged attention of the step's queries over the cache, written into ``output``."""
    if ops.native_available():
        left, right = window
        torch.ops.pagedattn.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal,
            alibi_slopes, left, right, block_table, softcap, scheduler_metadata, sinks,
            k_scale, v_scale)
        return
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=causal,
        alibi_slopes=alibi_slopes, sliding_window=window, block_table=block_table,
        softcap=softcap, scheduler_metadata=scheduler_metadata, s_aux=sinks,
        k_scale=k_scale, v_scale=v_scale)
