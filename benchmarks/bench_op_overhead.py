"""Per-call overhead of the native attention op on a tiny decode (default: B1, ctx 128,
8 q / 2 kv heads x 128, bf16, 1 thread): median wall time of many calls of
``torch.ops.pagedattn.cpu_attention_with_kv_cache`` with one scheduler metadata reused, as
a 30-layer model reuses it for every layer of a step. At this size the kernel itself is a
small part; the rest is validation, planning and dispatch.

Compare two builds side by side (alternate runs, same machine state)::

    for lib in build/before/_C.so pagedattn/_C*.so build/before/_C.so pagedattn/_C*.so; do
        PAGEDATTN_NATIVE_LIB=$lib python benchmarks/bench_op_overhead.py --label $lib
    done
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedattn import ops
from pagedattn.testing import BatchSpec, make_paged_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = BatchSpec("overhead", (args.context,) * args.batch, (1,) * args.batch)
    batch = make_paged_batch(spec, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                             dtype=torch.bfloat16, fill=0.0)
    meta = ops.cpu_attn_get_scheduler_metadata(
        args.batch, 8, 2, 128, batch.seq_lens, torch.bfloat16, batch.query_start_loc, True, -1,
        "vec16", True)
    out = torch.empty_like(batch.query)
    op = torch.ops.pagedattn.cpu_attention_with_kv_cache
    call = (batch.query, batch.key_cache, batch.value_cache, out, batch.query_start_loc,
            batch.seq_lens, 128 ** -0.5, True, None, -1, -1, batch.block_table, 0.0, meta, None)
    for _ in range(2000):
        op(*call)
    times = []
    clock = time.perf_counter_ns
    for _ in range(args.calls):
        t0 = clock()
        op(*call)
        times.append(clock() - t0)
    q = statistics.quantiles(times, n=10)
    print(f"{args.label or 'op'}: B{args.batch} ctx{args.context} {args.threads} thread(s): "
          f"median {statistics.median(times) / 1e3:.2f} us/call (p10 {q[0] / 1e3:.2f}, "
          f"p90 {q[-1] / 1e3:.2f}) over {args.calls} calls")


if __name__ == "__main__":
    main()
