"""Shared-prefix decode: the plan that reads a shared prefix once against the plan that
reads it once per request, on the same block tables, side by side (alternating calls in
one process, over rotated KV copies so every call reads DRAM), for a grid of prefix
lengths and group sizes. This is how the planner's rule (``SHARED_PREFIX_MIN_KEYS``) was
measured: sharing must pay from there on.

    python benchmarks/bench_shared_prefix.py                        # the default grid
    python benchmarks/bench_shared_prefix.py --batch 32 --shared 2048 --own 128 --repeat 21

Each row: ``batch`` decode requests in one group whose first ``shared`` keys sit in the
same blocks, ``own`` keys each of their own; 32/8 heads x 128, bf16, block 32 (options).
Both outputs are checked against the reference first.
"""

from __future__ import annotations

import argparse
import sys

import torch

from pagedattn import ops
from pagedattn.backends.cpu_runtime import PlanGeometry, prefill_variant
from pagedattn.bench import probes
from pagedattn.bench.contenders import Prepared
from pagedattn.bench.runner import _Checker, alternating_medians
from pagedattn.bench.scenarios import Scenario, build_inputs, copies_for
from pagedattn.ops.isa import METADATA_HEADER


def prepared_run(inputs, share: bool) -> tuple[Prepared, int]:
    """pagedattn's call on ``inputs``, planned with the block table (``share``) or
    without; and the plan's number of shared-prefix groups."""
    s = inputs.scenario
    geometry = PlanGeometry(s.num_heads, s.num_kv_heads, s.head_size, s.torch_dtype, -1)
    isa = prefill_variant(geometry, s.block_size, s.cache_torch_dtype)
    meta = ops.cpu_attn_get_scheduler_metadata(
        s.batch, s.num_heads, s.num_kv_heads, s.head_size, inputs.seq_lens, s.torch_dtype,
        inputs.query_start_loc, True, -1, isa, True,
        block_table=inputs.block_tables[0] if share else None,
        block_size=s.block_size if share else None)
    groups = int(meta[METADATA_HEADER.index("num_groups")])
    out = torch.empty_like(inputs.query)
    kc, vc = inputs.key_cache, inputs.value_cache

    def run(copy: int) -> torch.Tensor:
        torch.ops.pagedattn.cpu_attention_with_kv_cache(
            inputs.query, kc, vc, out, inputs.query_start_loc, inputs.seq_lens, inputs.scale,
            True, None, -1, -1, inputs.block_tables[copy], 0.0, meta, None, 1.0, 1.0)
        return out
    return Prepared(run), groups


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="2,4,8,32", help="requests in the group")
    p.add_argument("--shared", default="32,64,128,256,2048", help="shared keys")
    p.add_argument("--own", type=int, default=128, help="each request's own keys")
    p.add_argument("--heads", default="32,8", help="query heads, kv heads")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args(argv)
    heads, kv_heads = (int(x) for x in args.heads.split(","))
    llc = probes.llc_bytes()
    print(f"ISA {ops.get_cpu_isa().value}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{heads}/{kv_heads} heads x {args.head_size}, block {args.block_size}, {args.own} own "
          f"keys; median of {args.repeat} alternating pairs")
    print(f"{'batch':>5} {'shared':>6} {'groups':>6} {'unshared plan':>13} {'shared plan':>11} "
          f"{'speed-up':>8}")
    for b in (int(x) for x in args.batch.split(",")):
        for shared in (int(x) for x in args.shared.split(",")):
            s = Scenario(f"decode-b{b}-c{shared + args.own}-shared{shared}", "decode",
                         (shared + args.own,) * b, (1,) * b, num_heads=heads,
                         num_kv_heads=kv_heads, head_size=args.head_size, dtype=args.dtype,
                         block_size=args.block_size, shared_prefix=shared)
            inputs = build_inputs(s, copies_for(s, llc))
            runs = []
            for share in (False, True):
                prepared, groups = prepared_run(inputs, share)
                ok, err, tol, _ = _Checker(inputs).check(prepared)
                if not ok:
                    print(f"{s.name}: WRONG (max |diff| {err:.3g} > {tol})", file=sys.stderr)
                    return 1
                runs.append((prepared, inputs.copies))
            a, t = alternating_medians(runs, args.repeat)
            print(f"{b:>5} {shared:>6} {groups:>6} {a * 1e3:>10.3f} ms {t * 1e3:>8.3f} ms "
                  f"{a / t:>7.2f}x", flush=True)
            del inputs, runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
