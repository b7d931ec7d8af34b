"""Every linear path (packed, dpbf16, amx, torch, onednn: those that run here) side by side per layer shape and row count.

Examples::

    python benchmarks/bench_linear.py                       # SmolLM2-135M, bf16 weights
    python benchmarks/bench_linear.py --dtype float32 --rows 1,32,512 --threads 1

Prints one row per (shape, rows): each available path's best time (ms) and GFLOP/s
(``2 * rows * in * out`` flops), the fastest marked ``*``. Paths are timed in turns
(``linear_paths.time_paths``), so a burst of load elsewhere hits them alike, and each call
runs the next of the model's copies of that layer (``--hot``: one copy). The ``auto``
engine picks per row bucket the same way, at model load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

from pagedattn.models.linear_paths import MeasuredLinear, candidate_paths, time_paths

# (name, in_features, out_features, layers of that shape in the model) per distinct layer
MODELS = {
    "smollm2-135m": [("qkv_proj", 576, 960, 30), ("o_proj", 576, 576, 30),
                     ("gate_up_proj", 576, 3072, 30), ("down_proj", 1536, 576, 30),
                     ("lm_head", 576, 49152, 1)],
    "gemma3-270m": [("qkv_proj", 640, 1536, 18), ("o_proj", 1024, 640, 18),
                    ("gate_up_proj", 640, 4096, 18), ("down_proj", 2048, 640, 18)],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="smollm2-135m")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                   help="weight dtype (activations are fp32 into and out of every path)")
    p.add_argument("--rows", default="1,4,16,32,64,256,1024")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=7, help="timed calls per path (best kept)")
    p.add_argument("--hot", action="store_true",
                   help="time one copy of each layer (weights stay in cache)")
    p.add_argument("--json", help="also write the table to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    paths = candidate_paths(dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{args.model}, {args.dtype} weights, {args.threads} threads, best of {args.rounds}, "
          f"{'one copy per layer (hot)' if args.hot else 'every layer copy in turn'}, "
          f"load {os.getloadavg()[0]:.2f}")
    head = " | ".join(f"{q.value} ms | {q.value} GF/s" for q in paths)
    print(f"| layer | in x out | rows | {head} |")
    print("|---" * (3 + 2 * len(paths)) + "|")
    records = []
    torch.manual_seed(0)
    for name, k, n, count in MODELS[args.model]:
        # as many copies as the model has, called in turn (weights cold in L1/L2, as in a
        # forward pass); --hot: one copy, its weights in cache
        layers = [MeasuredLinear(nn.Linear(k, n, bias=False), dtype, paths)
                  for _ in range(1 if args.hot else count)]
        for rows in rows_list:
            with torch.inference_mode():
                us = time_paths(layers, rows, float("inf"), min_rounds=args.rounds,
                                max_rounds=args.rounds, budget_s=0.0)
            best = min(us, key=us.get)
            cells = []
            for q in paths:
                t = us[q.value]
                mark = "*" if q.value == best else ""
                cells.append(f"{t / 1e3:.3f}{mark} | {2 * rows * k * n / t / 1e3:.0f}")
            print(f"| {name} | {k}x{n} | {rows} | " + " | ".join(cells) + " |")
            records.append({"layer": name, "in": k, "out": n, "rows": rows, "us": us, "best": best})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
