"""What the engine's batch-invariant mode costs: the W1-W3 workloads of bench_engine.py on
two engines in one process, the default one and ``batch_invariant=True``, timed
alternately (ABBA per round), so machine drift and load hit both alike. Prints per
workload each engine's median time and the ratio.

    python benchmarks/bench_batch_invariant.py [--model smollm2] [--rounds 3] [--scale 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import workloads  # noqa: E402

from pagedattn import LLM, SamplingParams  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="shrink the workloads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    common = dict(dtype=args.dtype, enable_prefix_caching=False, max_model_len=4096,
                  kv_cache_memory="1GiB")
    engines = {"default": LLM(args.model, **common),
               "batch-invariant": LLM(args.model, batch_invariant=True, **common)}
    loads = workloads(engines["default"].tokenizer, args.scale)
    runs = {"W1 decode (1 chat, n new)": ("W1", None), "W2 (32 chats, n new)": ("W2", None),
            "W3 prefill (4 long, 1 new)": ("W3", 1), "W3 (4 long, n new)": ("W3", None)}

    def timed(llm, prompts, n) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    for llm in engines.values():  # warm-up
        timed(llm, loads["W1"][0], 2)
    times = {name: {e: [] for e in engines} for name in runs}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name, (load, fixed) in runs.items():
            prompts, n = loads[load]
            for e in order:
                times[name][e].append(timed(engines[e], prompts, fixed or n))
    print(f"{args.model} {args.dtype}, {args.threads} threads, {args.rounds} rounds "
          f"(median s; ratio = batch-invariant / default time)")
    for name in runs:
        d, b = (statistics.median(times[name][e]) for e in engines)
        print(f"  {name:<28} default {d:7.3f}  batch-invariant {b:7.3f}  ratio {b / d:5.3f}")


if __name__ == "__main__":
    main()
