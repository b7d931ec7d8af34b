"""fp8 vs bf16 KV-cache decode, side by side: each repeat times one bf16 call and one fp8
call back to back (alternating which goes first), so load from other processes hits both
alike; the ratio of the medians is the fp8 speed-up.

Example::

    python benchmarks/bench_fp8_decode.py --batch 1,8,32 --context 2048,8192 --repeat 15

Same inputs, rotation over KV copies (reads come from DRAM) and reference check as
``pagedattn bench`` (whose default suite also has the -fp8 decode rows).
"""

from __future__ import annotations

import argparse
import sys

import torch

from pagedattn import ops
from pagedattn.bench import probes
from pagedattn.bench.contenders import PagedattnContender
from pagedattn.bench.runner import _Checker, alternating_medians
from pagedattn.bench.scenarios import build_inputs, copies_for, _decode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--context", default="2048,8192")
    p.add_argument("--kv-dtype", default="fp8", choices=["fp8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args(argv)
    llc = probes.llc_bytes()
    contender = PagedattnContender()
    print(f"ISA {ops.get_cpu_isa().value}, {torch.get_num_threads()} threads; "
          f"median of {args.repeat} alternating pairs")
    print(f"{'batch':>5} {'context':>7} {'bf16':>9} {args.kv_dtype:>9} {'speed-up':>8}")
    for b in (int(x) for x in args.batch.split(",")):
        for c in (int(x) for x in args.context.split(",")):
            runs = []
            for s in (_decode(b, c), _decode(b, c, args.kv_dtype)):
                inputs = build_inputs(s, copies_for(s, llc))
                prepared = contender.prepare(inputs)
                ok, err, tol, _ = _Checker(inputs).check(prepared)
                if not ok:
                    print(f"{s.name}: WRONG (max |diff| {err:.3g} > {tol})", file=sys.stderr)
                    return 1
                runs.append((prepared, inputs.copies))
            t_bf16, t_fp8 = alternating_medians(runs, args.repeat)
            print(f"{b:>5} {c:>7} {t_bf16 * 1e3:>7.2f}ms {t_fp8 * 1e3:>7.2f}ms "
                  f"{t_bf16 / t_fp8:>7.2f}x")
            del runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
