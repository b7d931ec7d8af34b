"""The CPU prefill kernels side by side: the vector kernels (hint ``vec``/``vec16``) and
the matrix-engine kernel (hint ``amx``: oneDNN's brgemm), on the same paged batch.

Examples::

    python benchmarks/bench_prefill_variants.py
    python benchmarks/bench_prefill_variants.py --dtype float32 --heads 9/3 --head-size 64

Rows: a causal 4 x 512 prefill and a 512-token chunk over 1536 cached tokens. Each cell is
the best of alternating calls (``pagedattn.tuning.best_of``: the variants take turns, so
load from other tenants hits both alike), with the GFLOP/s of the visible (query, key)
pairs (4 x head_size FLOPs each).
"""

from __future__ import annotations

import argparse
import sys

import torch

from pagedattn import ops, tuning
from pagedattn.backends import cpu_runtime
from pagedattn.ops.isa import IsaHint
from pagedattn.testing import BatchSpec, make_paged_batch

ROWS = (BatchSpec("prefill 4 x 512", (512,) * 4, (512,) * 4),
        BatchSpec("512 after 1536", (2048,), (512,)))


def flops(spec: BatchSpec, num_heads: int, head_size: int) -> float:
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for s, q in zip(spec.seq_lens, spec.query_lens))
    return 4 * head_size * num_heads * pairs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--heads", default="32/8", help="query/kv heads (default 32/8)")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not ops.matrix_engine_available():
        print("torch's brgemm does not run here: no matrix-engine kernel to compare",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    geometry = cpu_runtime.PlanGeometry(heads, kv_heads, args.head_size, dtype, -1)
    vector = cpu_runtime.kernel_variant()
    print(f"{args.dtype}, {heads}/{kv_heads} heads x {args.head_size}, block "
          f"{args.block_size}, {args.threads} threads; bf16 microkernel: "
          f"{bool(torch.ops.pagedattn.matrix_engine_bf16())}")
    for spec in ROWS:
        batch = make_paged_batch(spec, num_heads=heads, num_kv_heads=kv_heads,
                                 head_size=args.head_size, block_size=args.block_size,
                                 dtype=dtype)
        out = torch.empty_like(batch.query)

        def runner(hint: IsaHint):
            plan = cpu_runtime.plan_step(geometry, hint, batch.query_start_loc,
                                         batch.seq_lens, causal=True)
            return lambda: cpu_runtime.attend(
                batch.query, batch.key_cache, batch.value_cache, out,
                query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                block_table=batch.block_table, scheduler_metadata=plan,
                scale=args.head_size ** -0.5, causal=True, window=(-1, -1),
                alibi_slopes=None, softcap=0.0, sinks=None)

        times = tuning.best_of({"vector": runner(vector), "matrix": runner(IsaHint.AMX)},
                               min_rounds=5, budget_s=2.0)
        work = flops(spec, heads, args.head_size)
        cells = "  ".join(f"{name} {t / 1e3:7.1f} ms {work / t / 1e3:5.0f} GFLOP/s"
                          for name, t in times.items())
        print(f"{spec.name:<16} {cells}  matrix/vector {times['vector'] / times['matrix']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
