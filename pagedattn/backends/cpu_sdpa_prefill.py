"""Long prefills on torch's flash attention for CPU, where it measures faster.

ATen's CPU flash attention runs its matmuls on oneDNN's GEMM microkernels, AMX tiles
included; pagedattn's prefill kernel uses ``vdpbf16ps`` at best. On an AMX CPU a 2048-token
causal prefill then runs ~3x faster on ATen's, while on an AVX2 CPU without a native bf16
GEMM it is the other way round. So the choice is measured (:func:`measure_min_query_len`),
never assumed: the step's plan sends prefills of at least that many queries to this path
and everything else (decodes, short prefills) to the paged kernel.

A request with context (chunked prefill, prefix-cache hit) reads the context's keys and
values from the paged cache. Its attention is split in two flash calls, neither of which
needs a mask: the queries over the context (every key visible) and over their own keys
(causal, aligned top-left). Both return their log-sum-exp, which weighs the merge.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedattn import tuning
from pagedattn.ops.reference import visibility_mask


@dataclass(frozen=True)
class SdpaSeq:
    """One request of the step on this path."""

    row_lo: int
    row_hi: int
    """Its query rows ``[row_lo, row_hi)`` in the step."""
    context: int
    """Keys before its queries (cached by earlier steps)."""
    blocks: torch.Tensor
    """int64 ids of the blocks that hold its keys."""


@dataclass(frozen=True, eq=False)
class SdpaSplit:
    """Which requests of a step take this path, and the kernel's plan for the others."""

    seqs: tuple[SdpaSeq, ...]
    kernel_rows: torch.Tensor | None
    """int64 query rows of the kernel's requests, or ``None`` when they are the leading
    ``num_kernel_rows`` rows (decodes first: the usual case, no copy)."""
    num_kernel_rows: int
    query_start_loc: torch.Tensor
    """int32, the kernel's requests only (rows renumbered from 0)."""
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor | None


def split_step(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
               min_query_len: int, block_size: int, plan) -> SdpaSplit | None:
    """Prefills of ``>= min_query_len`` queries to this path, the rest to the kernel
    (``plan(query_start_loc, seq_lens)`` plans their step); ``None`` when no request
    qualifies."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    seqs, kernel = [], []
    for r, (lo, hi, s) in enumerate(zip(starts[:-1], starts[1:], lens)):
        if hi - lo >= max(min_query_len, 2):
            blocks = block_table[r, :(s + block_size - 1) // block_size].to(torch.long)
            seqs.append(SdpaSeq(lo, hi, s - (hi - lo), blocks))
        else:
            kernel.append(r)
    if not seqs:
        return None
    rows = [i for r in kernel for i in range(starts[r], starts[r + 1])]
    leading = rows == list(range(len(rows)))
    reqs = torch.tensor(kernel, dtype=torch.long)
    qlens = [starts[r + 1] - starts[r] for r in kernel]
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    kernel_lens = seq_lens.index_select(0, reqs)
    return SdpaSplit(tuple(seqs), None if leading else torch.tensor(rows, dtype=torch.long),
                     len(rows), qsl, kernel_lens, block_table.index_select(0, reqs),
                     plan(qsl, kernel_lens) if kernel else None)


def gather_cached(cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int,
                  dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``[kv_heads, num_tokens, head_size]`` keys (or values) of one request from the
    paged cache ``[num_blocks, kv_heads, block_size, head_size]``, in ``dtype``."""
    per_block = cache.index_select(0, blocks)  # [n, H, bs, D]
    h, d = per_block.shape[1], per_block.shape[3]
    out = per_block.transpose(0, 1).reshape(h, -1, d)[:, :num_tokens]
    if out.dtype != dtype:
        out = out.to(dtype)
        if scale != 1.0:
            out = out * scale
    return out


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [H, L, D], lse [H, L] fp32)`` of ``q [H, L, D]`` over ``k, v [H, S, D]``."""
    out, lse = _FLASH(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal,
                      scale=scale)[:2]
    return out[0], lse[0]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int,
                     scale: float) -> torch.Tensor:
    """``[H, L, D]``: queries at positions ``context .. context + L - 1`` over keys
    ``[0, context + L)`` (``k, v [kv_heads, S, D]``, GQA expanded here), causal."""
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    if _FLASH is None:  # no flash op in this torch: SDPA with a bottom-right causal mask
        mask = visibility_mask(q.shape[1], k.shape[1], True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    own, own_lse = _flash(q, k[:, context:], v[:, context:], True, scale)
    if context == 0:
        return own
    past, past_lse = _flash(q, k[:, :context], v[:, :context], False, scale)
    top = torch.maximum(own_lse, past_lse)
    w_own = torch.exp(own_lse - top).unsqueeze(-1)
    w_past = torch.exp(past_lse - top).unsqueeze(-1)
    merged = (own.float() * w_own + past.float() * w_past) / (w_own + w_past)
    return merged.to(q.dtype)


# ---------------------------------------------------------------------- measurement

QUERY_LENS = (64, 128, 256, 512, 1024, 2048)


def choose_min_query_len(model) -> tuple[int | None, str]:
    """The shortest prefill to run here for ``model`` (a
    :class:`pagedattn.backend.ModelAttention`), per its ``prefill_attention`` option
    (``"kernel"``: none; ``"flash"``: every prefill; ``"auto"``: measured by
    :func:`measure_min_query_len`), and a line saying what was chosen and why."""
    from pagedattn import ops

    if model.prefill_attention == "kernel":
        return None, "prefills on the kernel"
    if model.prefill_attention == "flash":
        return 2, "prefills on flash attention (forced)"
    if not ops.native_available():
        return None, "prefills on the kernel (no native extension to time)"
    min_len, times = measure_min_query_len(model.num_heads, model.num_kv_heads,
                                           model.head_size, model.dtype, model.block_size)
    timed = ", ".join(f"{n}: {k * 1e3:.2f}/{f * 1e3:.2f} ms" for n, (k, f) in times.items())
    chosen = "kernel only" if min_len is None else f"flash from {min_len} queries"
    return min_len, f"prefill attention {chosen}; kernel/flash measured {timed}"


def measure_min_query_len(num_heads: int, num_kv_heads: int, head_size: int,
                          dtype: torch.dtype, block_size: int,
                          budget_s: float = 1.5) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """Time the paged kernel and this path on one causal prefill per length in
    :data:`QUERY_LENS` (this model's heads, fresh requests). Returns the shortest length
    from which this path wins at that length and every longer one (``None``: it never
    does), and ``{length: (kernel_s, flash_s)}``."""
    from pagedattn.backends import cpu_runtime

    geometry = cpu_runtime.PlanGeometry(num_heads, num_kv_heads, head_size, dtype, -1)
    variant = cpu_runtime.prefill_variant(geometry, block_size)  # the faster kernel here
    gen = torch.Generator().manual_seed(0)
    deadline = time.perf_counter() + budget_s
    times: dict[int, tuple[float, float]] = {}
    for n in QUERY_LENS:
        blocks = (n + block_size - 1) // block_size
        kc = torch.randn(blocks, num_kv_heads, block_size, head_size, generator=gen).to(dtype)
        vc = torch.randn(kc.shape, generator=gen).to(dtype)
        q = torch.randn(n, num_heads, head_size, generator=gen).to(dtype)
        out = torch.empty_like(q)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        sl = torch.tensor([n], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
        plan = cpu_runtime.plan_step(geometry, variant, qsl, sl, True)
        scale = head_size ** -0.5

        def kernel():
            cpu_runtime.attend(q, kc, vc, out, query_start_loc=qsl, seq_lens=sl,
                               block_table=table, scheduler_metadata=plan, scale=scale,
                               causal=True, window=(-1, -1), alibi_slopes=None, softcap=0.0,
                               sinks=None)

        def flash():
            k = gather_cached(kc, table[0].long(), n, dtype, 1.0)
            v = gather_cached(vc, table[0].long(), n, dtype, 1.0)
            causal_attention(q.transpose(0, 1), k, v, 0, scale)

        best = tuning.best_of({"kernel": kernel, "flash": flash}, min_rounds=3, max_rounds=3)
        times[n] = (best["kernel"] / 1e6, best["flash"] / 1e6)
        if time.perf_counter() > deadline:
            break
    wins = [n for n, (k, f) in times.items() if f < k]
    measured = list(times)
    start = None
    for i, n in enumerate(measured):
        if all(m in wins for m in measured[i:]):
            start = n
            break
    return start, times
