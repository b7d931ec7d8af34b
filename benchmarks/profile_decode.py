"""Decode timing experiments for "what binds" (docs/performance.md, "AVX-512 decode"):
each call of a decode row (the bench's scenarios, inputs and KV rotation, so reads come
from DRAM) is followed by a native stream_read of as many fresh bytes, so load from other
processes hits both alike. Prints wall time, CPU time (process_time: robust on a shared
machine at 1 thread) and t/stream.

    python benchmarks/profile_decode.py --threads 1 \\
        --rows 'dec(1,8192); dec(1,8192,kv="fp8"); dec(8,2048); dec(1,8192,4,1,256)'

dec(batch, context, heads=32, kv_heads=8, head_size=128, kv="auto", dtype="bfloat16").
PAGEDATTN_CPU_ISA=avx2 (etc.) picks the ISA. --hot also times one LLC-resident copy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedattn import ops
from pagedattn.bench import probes
from pagedattn.bench.contenders import PagedattnContender
from pagedattn.bench.scenarios import Scenario, build_inputs, copies_for, with_kv_dtype


def dec(b, c, nh=32, nkv=8, hs=128, kv="auto", dtype="bfloat16") -> Scenario:
    s = Scenario(f"decode-b{b}-c{c}-{nh}/{nkv}x{hs}", "decode", (c,) * b, (1,) * b,
                 num_heads=nh, num_kv_heads=nkv, head_size=hs, dtype=dtype)
    return with_kv_dtype(s, kv)


def time_row(s: Scenario, copies: int, repeat: int) -> tuple[float, float, float]:
    inputs = build_inputs(s, copies)
    prep = PagedattnContender().prepare(inputs)
    n = s.kv_bytes()
    buf = torch.ones(4 * n + (64 << 20), dtype=torch.uint8)
    wall, cpu, stream = [], [], []
    for i in range(repeat + 3):
        c0, t0 = time.process_time(), time.perf_counter()
        prep.run(i % inputs.copies)
        t1, c1 = time.perf_counter(), time.process_time()
        ops.stream_read(buf[(i % 4) * n:(i % 4 + 1) * n])
        t2 = time.perf_counter()
        if i >= 3:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
            stream.append(t2 - t1)
    return statistics.median(wall), statistics.median(cpu), statistics.median(stream)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default='dec(1,8192); dec(1,8192,kv="fp8"); dec(8,2048)')
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeat", type=int, default=11)
    p.add_argument("--hot", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llc = probes.llc_bytes()
    print(f"ISA {ops.get_cpu_isa().value}, {args.threads} threads")
    for expr in args.rows.split(";"):
        s = eval(expr.strip(), {"dec": dec})  # noqa: S307 (a local experiment's row list)
        wall, cpu, stream = time_row(s, copies_for(s, llc), args.repeat)
        line = (f"{s.name:28s} {s.kv_dtype:5s} {wall * 1e3:8.3f} ms  cpu {cpu * 1e3:8.3f} ms  "
                f"stream {stream * 1e3:7.3f} ms  t/stream {wall / stream:5.2f}")
        if args.hot:
            hot = time_row(s, 1, args.repeat)[0]
            line += f"  LLC-hot/DRAM {hot / wall:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
