"""Body of ``benchmarks/bench_op.py``: one op, a named model's
head geometry, a grid of batch x context, the same checks/timing/table as ``pagedattn
bench``."""

from __future__ import annotations

import argparse
import itertools

from pagedattn.bench import report
from pagedattn.bench.cli import FULL, QUICK, _csv
from pagedattn.bench.runner import BenchOptions, run_bench
from pagedattn.bench.scenarios import Scenario

# name -> (query heads, kv heads, head size): the attention geometry of common models.
MODELS: dict[str, tuple[int, int, int]] = {
    "llama3-8b": (32, 8, 128),
    "llama2-7b": (32, 32, 128),
    "mistral-7b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "llama3-70b-tp8": (8, 1, 128),
    "gemma2-9b": (16, 8, 256),
    "phi3-mini": (32, 32, 96),
}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser(kind: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b",
                   help="head geometry (query heads / kv heads / head size)")
    p.add_argument("--batch", type=_ints, default=[1, 8, 32] if kind == "decode" else [1],
                   help="comma-separated batch sizes")
    default_ctx = {"decode": [512, 2048, 8192], "prefill": [512, 2048],
                   "reshape_and_cache": [4096]}[kind]
    p.add_argument("--context", type=_ints, default=default_ctx,
                   help="comma-separated context lengths (tokens written, for cache writes)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--contenders", action="append", metavar="NAMES")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="fewer repeats, smaller probes")
    p.add_argument("--remeasure", action="store_true")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.add_argument("--no-progress", action="store_true")
    return p


def scenarios_for(kind: str, args: argparse.Namespace) -> list[Scenario]:
    heads, kv_heads, head_size = MODELS[args.model]
    out = []
    for batch, ctx in itertools.product(args.batch, args.context):
        if kind == "decode":
            seq, q = (ctx,) * batch, (1,) * batch
        elif kind == "prefill":
            seq, q = (ctx,) * batch, (ctx,) * batch
        else:
            seq, q = (ctx * batch,), (ctx * batch,)
        out.append(Scenario(f"{kind}-{args.model}-b{batch}-c{ctx}", kind, seq, q,
                            num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                            dtype=args.dtype, block_size=args.block_size))
    return out


def main(kind: str, description: str, argv: list[str] | None = None) -> int:
    parser = build_parser(kind, description)
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    try:
        scenarios = scenarios_for(kind, args)
        opts = BenchOptions(
            contenders=_csv(args.contenders), threads=args.threads, remeasure=args.remeasure,
            repeat=args.repeat if args.repeat is not None else preset["repeat"],
            budget_s=args.budget if args.budget is not None else preset["budget_s"],
            progress=not args.no_progress, probe_bytes=preset["probe_bytes"],
            matmul_size=preset["matmul_size"])
        if args.plot:
            report.check_plot_available()
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    result = run_bench(opts, scenarios=scenarios)
    print()
    report.print_report(result)
    if args.json:
        report.write_json(report.to_json(result), args.json)
    if args.plot:
        report.write_plot(result, args.plot)
    return 0
