"""Prefill cost probe: the matrix-engine kernel's time outside its GEMMs, per (row, key).

Examples::

    python benchmarks/profile_prefill.py                     # probe + side by side, 2 threads
    python benchmarks/profile_prefill.py --threads 16 --rows 1x2048
    python benchmarks/profile_prefill.py --no-peers --json probe.json

For each row (a causal bf16 prefill, 32/8 heads x 128, block 32 by default) it reports:

* the matrix kernel (hint ``amx``) in core-nanoseconds per visible (query row, key) pair,
  split by the native cost probe (``matrix_engine_profile``) into the time inside the
  GEMM microkernel calls and the rest of the workers' busy time: packing, the softmax,
  masking, bookkeeping. That split needs no ``perf`` and no AMX: it is what this file's
  target (``<= 0.4 ns`` per pair outside the GEMMs on AVX-512) is measured with. The time
  outside is split again by the probe's own timers: ``pack`` (the call's shared K/V
  tiles, each packed by the first item that reads it), ``queries`` (each item's row state
  and Q rows in), ``softmax`` (between the GEMMs, masks included), ``tile_pack`` (tiles an
  item packs for itself alone: requests past the shared buffer's budget), ``finish``
  (output rows out) and ``rest`` (the loops around them). The JSON also has the time outside per
  query row (tokens x heads), the part that does not shrink with longer rows;
* the rows' traffic floor: the same query rows copied into an output-sized tensor by
  torch's own contiguous copy (every thread), each copy right after a kernel call (so it
  meets the caches as the kernel's next call does), in core-ns per pair. The kernel must
  read those bytes and write as many, so its ``queries`` plus ``finish`` cannot go far
  below it on that CPU; next to them it tells memory from instructions;
* side by side, on the same inputs, calls alternating, median of ``--repeat``: the matrix
  kernel with its bf16 GEMMs on oneDNN's brgemm instead of our AMX tile loop (``brgemm``,
  where the tile loop runs), the vector kernels, vLLM's CPU kernel with the hint vLLM itself picks (where its wheel loads:
  ``pagedattn.bench.vllm_contender``), and torch's SDPA on contiguous K/V (GQA expanded;
  pure prefills only), with each one's speed-up figure ``theirs / ours``.

A pair is 4 x head_size FLOPs (q.k and p.v); the AMX tiles' floor is ~0.25 ns per pair
at head size 128 (docs/performance.md). Name the CPU's ISA (printed) next to any figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedattn import ops
from pagedattn.backends import cpu_runtime
from pagedattn.bench import vllm_contender
from pagedattn.ops.isa import IsaHint
from pagedattn.testing import BatchSpec, make_paged_batch


@dataclass(frozen=True)
class Row:
    name: str
    spec: BatchSpec

    @property
    def pure_prefill(self) -> bool:
        return all(q == s for q, s in zip(self.spec.query_lens, self.spec.seq_lens))


def _rows() -> dict[str, Row]:
    mixed = BatchSpec("mixed", (2048,) * 16 + (2048,), (1,) * 16 + (512,))
    return {r.name: r for r in (
        Row("4x512", BatchSpec("4x512", (512,) * 4, (512,) * 4)),
        Row("1x2048", BatchSpec("1x2048", (2048,), (2048,))),
        Row("mixed", mixed),  # 16 decodes at 2048 + a 512 chunk over 1536 cached tokens
        Row("chunk", BatchSpec("chunk", (2048,), (512,))),  # the chunk alone
        Row("1x8192", BatchSpec("1x8192", (8192,), (8192,))),
    )}


ROWS = _rows()
# The native probe's phase totals, in the order matrix_engine_profile_totals gives them.
PHASES = ("queries", "softmax", "tile_pack", "finish")
DEFAULT_ROWS = ("4x512", "1x2048", "mixed")


def visible_pairs(spec: BatchSpec, num_heads: int) -> int:
    """Causal (query row, key) pairs the batch computes, over every query head."""
    return num_heads * sum(q * (s - q) + q * (q + 1) // 2
                           for s, q in zip(spec.seq_lens, spec.query_lens))


def on_brgemm(fn):
    """fn with the matrix kernel's bf16 GEMMs on oneDNN's brgemm instead of our AMX tile
    loop: the microkernel's share of the speed, side by side."""
    def run():
        torch.ops.pagedattn.matrix_engine_use_own_tiles(False)
        try:
            return fn()
        finally:
            torch.ops.pagedattn.matrix_engine_use_own_tiles(True)
    return run


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def alternate(fns: dict, repeat: int) -> dict[str, float]:
    """Median ms of each callable, their calls interleaved round by round."""
    for fn in fns.values():  # warm-up (oneDNN JIT, first-touch of scratch)
        fn()
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def vllm_runner(batch, args, heads, kv_heads):
    """vLLM's kernel on the same K/V, through its own cache writer; None where its wheel
    does not load (the reason is printed)."""
    lib, why = vllm_contender.load()
    if lib is None:
        print(f"vllm: not compared ({why})")
        return None
    call = vllm_contender._call
    bs, hs = args.block_size, args.head_size
    dtype = batch.query.dtype
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    # The hint vLLM itself picks (as pagedattn.bench.vllm_contender does).
    isa = ("amx" if amx and dtype == torch.bfloat16 and bs % 32 == 0
           else "vec" if bs % 32 == 0 else "vec16")
    nb = batch.key_cache.shape[0]
    raw = torch.zeros(nb, kv_heads, bs, 2 * hs, dtype=dtype)
    kc, vc = raw.view(nb, kv_heads, 2 * bs, hs).chunk(2, dim=2)
    keys = batch.key_cache.permute(0, 2, 1, 3).reshape(nb * bs, kv_heads, hs)
    values = batch.value_cache.permute(0, 2, 1, 3).reshape(nb * bs, kv_heads, hs)
    call("cpu_attn_reshape_and_cache", key=keys, value=values, key_cache=kc, value_cache=vc,
         slot_mapping=torch.arange(nb * bs, dtype=torch.int64), isa=isa)
    md = call("get_scheduler_metadata", num_req=batch.seq_lens.numel(), num_heads_q=heads,
              num_heads_kv=kv_heads, head_dim=hs, seq_lens=batch.seq_lens, dtype=dtype,
              query_start_loc=batch.query_start_loc, causal=True, window_size=-1,
              isa_hint=isa, enable_kv_split=True)
    out = torch.empty_like(batch.query)

    def run():
        call("cpu_attention_with_kv_cache", query=batch.query, key_cache=kc, value_cache=vc,
             output=out, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
             scale=hs ** -0.5, causal=True, alibi_slopes=None, sliding_window_size=-1,
             block_table=batch.block_table, softcap=0.0, scheduler_metadata=md, s_aux=None)
    return run


def sdpa_runner(batch, args, heads, kv_heads):
    """torch SDPA per request on contiguous K/V (GQA expanded beforehand, not timed)."""
    reqs = []
    starts = batch.query_start_loc.tolist()
    for r, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.query[starts[r]:starts[r + 1]].transpose(0, 1).unsqueeze(0)
        rep = heads // kv_heads
        kk = k.transpose(0, 1).repeat_interleave(rep, 0).unsqueeze(0).contiguous()
        vv = v.transpose(0, 1).repeat_interleave(rep, 0).unsqueeze(0).contiguous()
        reqs.append((q.contiguous(), kk, vv))

    def run():
        for q, k, v in reqs:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated, of {', '.join(ROWS)} (default {','.join(DEFAULT_ROWS)})")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--heads", default="32/8", help="query/kv heads (default 32/8)")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--no-peers", action="store_true", help="the probe only: no vLLM, no SDPA")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    if not ops.matrix_engine_available():
        print("torch's brgemm does not run here: no matrix-engine kernel to probe",
              file=sys.stderr)
        return 2
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    geometry = cpu_runtime.PlanGeometry(heads, kv_heads, args.head_size, dtype, -1)
    isa = ops.get_cpu_isa()
    bf16_mk = torch.ops.pagedattn.matrix_engine_bf16_microkernel()
    print(f"ISA {isa} (amx_tile: {ops.cpu_has_amx()}), torch {torch.__version__}, "
          f"{args.threads} threads; {args.dtype}, {heads}/{kv_heads} heads x {args.head_size}, "
          f"block {args.block_size}; bf16 microkernel: {bf16_mk}")
    results = []
    for name in names:
        row = ROWS[name]
        batch = make_paged_batch(row.spec, num_heads=heads, num_kv_heads=kv_heads,
                                 head_size=args.head_size, block_size=args.block_size,
                                 dtype=dtype)
        out = torch.empty_like(batch.query)

        def ours(hint: IsaHint):
            plan = cpu_runtime.plan_step(geometry, hint, batch.query_start_loc,
                                         batch.seq_lens, causal=True)
            return lambda: cpu_runtime.attend(
                batch.query, batch.key_cache, batch.value_cache, out,
                query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                block_table=batch.block_table, scheduler_metadata=plan,
                scale=args.head_size ** -0.5, causal=True, window=(-1, -1),
                alibi_slopes=None, softcap=0.0, sinks=None)

        matrix = ours(IsaHint.AMX)
        pairs = visible_pairs(row.spec, heads)
        # The probe: its own calls, so the timing wrappers never touch the side-by-side.
        matrix()
        torch.ops.pagedattn.matrix_engine_profile(True)
        try:
            wall = median_ms(matrix, args.repeat)
            busy_ns, gemm_ns, calls, pack_ns, *phase_ns = \
                torch.ops.pagedattn.matrix_engine_profile_totals()
        finally:
            torch.ops.pagedattn.matrix_engine_profile(False)
        per_call = 1.0 / args.repeat
        rec = {"row": name, "isa": isa, "threads": args.threads, "dtype": args.dtype,
               "pairs": pairs, "probe_wall_ms": wall,
               "core_ns_per_pair": busy_ns * per_call / pairs,
               "gemm_ns_per_pair": gemm_ns * per_call / pairs,
               "outside_ns_per_pair": (busy_ns - gemm_ns) * per_call / pairs,
               "gemm_calls_per_call": calls * per_call}
        outside = {"pack": pack_ns, **dict(zip(PHASES, phase_ns))}
        outside["rest"] = busy_ns - gemm_ns - sum(outside.values())
        rec["outside_split_ns_per_pair"] = {k: v * per_call / pairs for k, v in outside.items()}
        rows = sum(row.spec.query_lens) * heads
        rec["outside_ns_per_query_row"] = (busy_ns - gemm_ns) * per_call / rows
        sink = torch.empty_like(batch.query)
        copies = []
        for _ in range(args.repeat):
            matrix()
            t0 = time.perf_counter()
            sink.copy_(batch.query)
            copies.append(time.perf_counter() - t0)
        copy_ms = statistics.median(copies) * 1e3
        rec["rows_floor_ns_per_pair"] = copy_ms * 1e6 * args.threads / pairs
        fns = {"pagedattn": matrix, "vector": ours(cpu_runtime.kernel_variant())}
        if bf16_mk == "tiles" and args.dtype == "bfloat16":
            fns["brgemm"] = on_brgemm(matrix)
        if not args.no_peers:
            v = vllm_runner(batch, args, heads, kv_heads)
            if v is not None:
                fns["vllm"] = v
            if row.pure_prefill:
                fns["sdpa"] = sdpa_runner(batch, args, heads, kv_heads)
        ms = alternate(fns, args.repeat)
        rec["ms"] = ms
        rec["speedup"] = {k: ms[k] / ms["pagedattn"] for k in ms if k != "pagedattn"}
        results.append(rec)
        side = "  ".join(f"{k} {t:7.2f} ms" for k, t in ms.items())
        vs = "  ".join(f"x{k} {s:.2f}" for k, s in rec["speedup"].items())
        print(f"{name:<7} ns/pair: total {rec['core_ns_per_pair']:.2f} = gemm "
              f"{rec['gemm_ns_per_pair']:.2f} + outside {rec['outside_ns_per_pair']:.2f} "
              f"({rec['gemm_calls_per_call']:.0f} gemm calls)")
        split = " + ".join(f"{k} {v:.2f}" for k, v in rec["outside_split_ns_per_pair"].items())
        print(f"        outside = {split}")
        inout = sum(rec["outside_split_ns_per_pair"][k] for k in ("queries", "finish"))
        print(f"        rows' traffic floor (torch's copy of Q into an output-sized tensor) "
              f"{rec['rows_floor_ns_per_pair']:.2f}, against queries + finish {inout:.2f}")
        print(f"        {side}   speed-up {vs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
