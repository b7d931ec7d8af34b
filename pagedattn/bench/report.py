"""Turn a :class:`~pagedattn.bench.runner.BenchResult` into the table, the JSON
document and the plot.

Roofline: a call must move ``bytes`` through DRAM and do ``flops`` of arithmetic, so it
cannot take less than ``t_min = max(bytes / dram_read_bw, flops / matmul_peak)``. The
"% roof" column is ``t_min / t`` for pagedattn: 100 % means at the machine's limit.
Bandwidth-bound rows show GB/s (``bytes / t``), compute-bound rows GFLOP/s.
"""

from __future__ import annotations

import json
import sys
import time

from pagedattn.bench.runner import (
    BANDWIDTH_KINDS, BenchResult, Cell, ScenarioResult, load_warning,
)
from pagedattn.bench.schema import SCHEMA_VERSION, validate_result

MAIN = "pagedattn"


def roofline(sr: ScenarioResult, machine) -> dict:
    """``bound`` ("memory"/"compute") and the minimum time the limits allow."""
    s = sr.scenario
    t_mem = s.bytes_moved() / (machine.dram_read_gbps * 1e9)
    peak = machine.peak_gflops(s.dtype)
    t_cmp = s.flops() / (peak * 1e9) if peak > 0 else 0.0
    bound = "memory" if t_mem >= t_cmp else "compute"
    return {"bound": bound, "t_min_s": max(t_mem, t_cmp), "t_memory_s": t_mem, "t_compute_s": t_cmp}


def cell_metrics(cell: Cell, sr: ScenarioResult, machine) -> dict:
    """Rate, roofline fraction and pagedattn's speed-up over this cell (where defined)."""
    t = cell.median_s
    if cell.status != "ok" or not t:
        return {"gbps": None, "gflops": None, "roofline_fraction": None,
                "speedup_of_pagedattn": None}
    s = sr.scenario
    roof = roofline(sr, machine)
    main = sr.cells.get(MAIN)
    speedup = None
    if main is not None and main.status == "ok" and main.median_s:
        speedup = t / main.median_s
    return {"gbps": s.bytes_moved() / t / 1e9,
            "gflops": s.flops() / t / 1e9 if s.flops() else None,
            "roofline_fraction": roof["t_min_s"] / t,
            "speedup_of_pagedattn": speedup}


# ----------------------------------------------------------------------------- table


def fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    if t < 1e-3:
        return f"{t * 1e6:.0f}us"
    if t < 1:
        return f"{t * 1e3:.2f}ms" if t < 1e-2 else f"{t * 1e3:.1f}ms"
    return f"{t:.2f}s"


def _fmt_speedup(sp: float) -> str:
    if sp >= 100:
        return f"{sp:.0f}x"
    return f"{sp:.1f}x" if sp >= 0.1 else f"{sp:.2f}x"


def _cell_text(cell: Cell | None, sr: ScenarioResult, machine) -> str:
    if cell is None:
        return ""
    if cell.status == "wrong":
        return "WRONG"
    if cell.status == "unsupported":
        return "n/a"
    if cell.status == "unavailable":
        return "unavail."
    if cell.status == "error":
        return "ERROR"
    text = fmt_time(cell.median_s) + ("*" if cell.budget_limited else "")
    if cell.contender != MAIN:
        sp = cell_metrics(cell, sr, machine)["speedup_of_pagedattn"]
        if sp is not None:
            text += f" ({_fmt_speedup(sp)})"
    return text


def stream_time_for(sr: ScenarioResult) -> float:
    """The stream time scaled to exactly the scenario's bytes (the streamed slice may
    differ slightly: the KV alone, without query and output)."""
    return sr.stream_median_s * sr.scenario.bytes_moved() / max(1, sr.stream_bytes)


def _best(sr: ScenarioResult) -> str:
    ok = [c for c in sr.cells.values() if c.status == "ok" and c.median_s]
    return min(ok, key=lambda c: c.median_s).contender if ok else "-"


def _main_columns(sr: ScenarioResult, machine) -> tuple[str, str, str]:
    """(rate, % roof, time / stream) of pagedattn."""
    cell = sr.cells.get(MAIN)
    if cell is None or cell.status != "ok" or not cell.median_s:
        return "-", "-", "-"
    m = cell_metrics(cell, sr, machine)
    if roofline(sr, machine)["bound"] == "memory" or not m["gflops"]:
        rate = f"{m['gbps']:.1f} GB/s"
    else:
        rate = f"{m['gflops']:.0f} GFLOP/s"
    frac = f"{100 * m['roofline_fraction']:.0f}%"
    stream = "-"
    if (sr.scenario.kind in BANDWIDTH_KINDS and sr.stream_median_s
            and roofline(sr, machine)["bound"] == "memory"):
        stream = f"{cell.median_s / stream_time_for(sr):.2f}"
    return rate, frac, stream


def render_table(result: BenchResult) -> str:
    machine = result.machine
    names = list(result.contenders)
    head = ["kind", "batch", "context", "heads", "hs", "dtype", "bs", *names,
            "best", f"{MAIN} rate", "% roof", "t/stream"]
    rows = []
    for sr in result.scenarios:
        s = sr.scenario
        rows.append([
            s.kind.replace("reshape_and_cache", "cache-write"), s.batch_label, s.context_label,
            f"{s.num_heads}/{s.num_kv_heads}", str(s.head_size), s.short_dtype, str(s.block_size),
            *[_cell_text(sr.cells.get(n), sr, machine) for n in names],
            _best(sr), *_main_columns(sr, machine),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    right = set(range(7, len(head)))
    right.discard(len(head) - 4)  # "best" is a name

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _stream_methods(result: BenchResult) -> str:
    """The read(s) the run timed as its stream, e.g. ``stream_read/avx2``."""
    names = dict.fromkeys(sr.stream_method for sr in result.scenarios if sr.stream_method)
    return ", ".join(names) or "none timed"


def render_notes(result: BenchResult) -> str:
    """Footnotes: the legend, unavailable contenders, WRONG/ERROR details."""
    notes = [
        "times: median per call; (Nx) = pagedattn's speed-up over that contender; "
        "* = fewer repeats than --repeat (time budget)",
        "% roof = roofline time / pagedattn time (memory: bytes / DRAM read bw; compute: "
        "FLOPs / matmul peak); t/stream = pagedattn time / a plain read "
        f"({_stream_methods(result)}) of as many fresh bytes (memory-bound rows)",
    ]
    during = result.other_load_during_run
    threads = result.machine.threads
    if during is not None and load_warning(threads, during):
        notes.append(f"WARNING: other processes kept {during:.1f} cores busy on average during "
                     f"this run (the bench used {threads} threads): these timings are noisy; "
                     "rerun on a quiet machine")
    for name, info in result.contenders.items():
        if not info["available"]:
            notes.append(f"{name}: unavailable -- {info['reason']}")
    seen = set()
    for sr in result.scenarios:
        for cell in sr.cells.values():
            if cell.status in ("wrong", "error"):
                notes.append(f"{cell.contender} {cell.status.upper()} on {sr.scenario.name}: "
                             f"{cell.reason}")
            if cell.note and (cell.contender, cell.note) not in seen:
                seen.add((cell.contender, cell.note))
                notes.append(f"{cell.contender}: {cell.note}")
    return "\n".join(notes)


# ------------------------------------------------------------------------------ JSON


def to_json(result: BenchResult, argv: list[str] | None = None) -> dict:
    """The ``--json`` document; it validates against :data:`~pagedattn.bench.schema.SCHEMA`."""
    opts = result.options
    scenarios = []
    for sr in result.scenarios:
        cells = []
        for cell in sr.cells.values():
            cells.append({
                "contender": cell.contender, "status": cell.status, "reason": cell.reason,
                "note": cell.note, "times_s": list(cell.times_s), "median_s": cell.median_s,
                "repeats": len(cell.times_s), "budget_limited": cell.budget_limited,
                "max_abs_err": cell.max_abs_err, "tolerance": cell.tolerance,
                "wall_s": cell.wall_s,
                **cell_metrics(cell, sr, result.machine),
            })
        scenarios.append({
            "scenario": sr.scenario.describe(), "copies": sr.copies,
            "roofline": roofline(sr, result.machine),
            "stream": {"times_s": list(sr.stream_times_s), "median_s": sr.stream_median_s,
                       "bytes": sr.stream_bytes, "method": sr.stream_method},
            "results": cells,
        })
    doc = {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": list(argv) if argv is not None else list(sys.argv),
        "wall_s": result.wall_s,
        "other_load_cores": result.other_load_cores,
        "other_load_during_run": result.other_load_during_run,
        "machine": result.machine.to_json(),
        "versions": result.versions,
        "options": {"suite": opts.suite, "scenarios": opts.scenarios, "contenders": list(result.contenders),
                    "repeat": opts.repeat, "threads": opts.threads, "budget_s": opts.budget_s,
                    "warmup_s": opts.warmup_s, "interleave": opts.interleave,
                    "kv_dtype": opts.kv_dtype},
        "contenders": result.contenders,
        "scenarios": scenarios,
    }
    errors = validate_result(doc)
    if errors:  # a bug here, not bad user input: the writer and the schema disagree
        raise RuntimeError("bench JSON does not match its schema: " + "; ".join(errors[:5]))
    return doc


def write_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


# ------------------------------------------------------------------------------ plot


def check_plot_available() -> None:
    """Raise ImportError with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib: pip install 'pagedattn[bench]' (or pip install "
            "matplotlib)") from exc


def write_plot(result: BenchResult, path: str) -> None:
    """Two panels: pagedattn's speed-up over each contender per scenario (log scale,
    1x line), and pagedattn's fraction of the roofline per scenario."""
    check_plot_available()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    machine = result.machine
    labels = [f"{sr.scenario.kind.replace('reshape_and_cache', 'cache-write')}\n"
              f"{sr.scenario.batch_label} @ {sr.scenario.context_label}" for sr in result.scenarios]
    others = [n for n in result.contenders if n != MAIN]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(labels) + 3), 8.5),
                                   height_ratios=[3, 2])
    width = 0.8 / max(1, len(others))
    for k, name in enumerate(others):
        xs, ys = [], []
        for i, sr in enumerate(result.scenarios):
            cell = sr.cells.get(name)
            x = i - 0.4 + width * (k + 0.5)
            sp = cell_metrics(cell, sr, machine)["speedup_of_pagedattn"] if cell else None
            if sp:
                xs.append(x)
                ys.append(sp)
            elif cell is not None and cell.status in ("wrong", "error"):
                ax1.text(x, 1.0, cell.status.upper(), rotation=90, ha="center", va="bottom",
                         fontsize=7, color="red")
        bars = ax1.bar(xs, ys, width, label=name)
        ax1.bar_label(bars, [_fmt_speedup(y) for y in ys], fontsize=6)
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.set_yscale("log")
    ax1.set_ylabel("pagedattn speed-up (x, log)\n>1: pagedattn faster")
    title = f"pagedattn vs contenders -- {machine.cpu_model}, {machine.threads} threads"
    during = result.other_load_during_run
    if during is not None and load_warning(machine.threads, during):
        title += f"\nNOISY: other processes kept {during:.1f} cores busy during the run"
    ax1.set_title(title, color="black" if "NOISY" not in title else "darkred")
    ax1.set_xticks(range(len(labels)), labels, fontsize=7)
    ax1.legend(fontsize=8)
    fracs, colors = [], []
    for sr in result.scenarios:
        cell = sr.cells.get(MAIN)
        m = cell_metrics(cell, sr, machine) if cell else {"roofline_fraction": None}
        fracs.append(100 * (m["roofline_fraction"] or 0))
        colors.append("tab:blue" if roofline(sr, machine)["bound"] == "memory" else "tab:orange")
    bars = ax2.bar(range(len(labels)), fracs, color=colors)
    ax2.bar_label(bars, [f"{f:.0f}%" for f in fracs], fontsize=7)
    ax2.axhline(100, color="black", lw=0.8, ls="--")
    ax2.set_ylabel("% of machine limit")
    ax2.set_title(f"pagedattn roofline fraction (blue: DRAM {machine.dram_read_gbps:.0f} GB/s; "
                  f"orange: matmul peak)", fontsize=9)
    ax2.set_xticks(range(len(labels)), labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(result: BenchResult, out=None) -> None:
    out = sys.stdout if out is None else out  # resolved late: capture must see it
    print(render_table(result), file=out)
    print(file=out)
    print(render_notes(result), file=out)
