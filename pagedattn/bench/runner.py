"""Run the suite: for every scenario build the inputs once, then for every contender
check its output against the reference, and only then time it.

Timing protocol (per scenario x contender):

1. ``run(0)`` is the correctness check; a contender that disagrees with the reference
   is WRONG and is not timed.
2. Warm-up: untimed calls for at least ``warmup_s`` seconds (at least one call), so the
   timed calls find the thread pool awake and the process settled (the first calls of a
   process ran 2-5x slower on the 2-core VM). The last warm-up call's time decides how
   many repeats fit the time budget (at most ``repeat``; a first call slower than the
   whole budget is kept as the one sample, flagged).
3. Every call of a scenario (warm-up or timed, of any contender) reads the next copy of
   a rotation ``1, 2, ..., copies - 1, 0, 1, ...``: the least recently read copy, evicted
   from the LLC since, even when contenders alternate. For bandwidth-bound kinds the
   strongest plain read (:func:`pagedattn.bench.probes.stream_reader`: the native
   ``stream_read``, else ``torch.sum``) of as many fresh bytes is timed right after each
   timed call: the scenario's stream time. It reads the region of the KV pool half a
   rotation ahead (:func:`~pagedattn.bench.scenarios.stream_offset`; separate buffers
   for cache writes), so neither it nor the calls read bytes still in the LLC
   (:func:`~pagedattn.bench.scenarios.copies_for`).

Reported times are medians of the repeats.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from pagedattn import paging
from pagedattn.bench import probes
from pagedattn.bench.contenders import CONTENDERS, Contender, Prepared
from pagedattn.bench.scenarios import (
    KV_DTYPES, SUITES, Scenario, ScenarioInputs, build_inputs, copies_for, select_scenarios,
    stream_offset, stream_regions, with_kv_dtype,
)

STATUSES = ("ok", "wrong", "unavailable", "unsupported", "error")
BANDWIDTH_KINDS = ("decode", "mixed", "reshape_and_cache")


@dataclass
class BenchOptions:
    """What to run. ``budget_s`` caps the timed seconds per scenario x contender."""

    suite: str = "default"
    scenarios: list[str] | None = None
    contenders: list[str] | None = None
    repeat: int = 9
    threads: int | None = None
    budget_s: float = 20.0
    remeasure: bool = False
    progress: bool = True
    probe_bytes: int = 256 << 20
    matmul_size: int = 1536
    #: time the contenders of a scenario round-robin (A B A B ...) instead of one after the
    #: other, so a burst of load from other tenants hits all of them alike; every
    #: contender's prepared state is then held at once (more memory)
    interleave: bool = False
    #: minimum seconds of untimed warm-up calls per scenario x contender (0: one call)
    warmup_s: float = 0.1
    #: store every scenario's KV cache as this (``auto``, ``fp8``, ``fp8_e4m3``,
    #: ``fp8_e5m2``); None keeps the suite's own (the default suite has fp8 decode rows)
    kv_dtype: str | None = None
    #: the suite after the ``scenarios`` filter (resolved at construction)
    selected: list[Scenario] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise ValueError(f"unknown suite {self.suite!r}; valid: {', '.join(SUITES)}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s}")
        if self.warmup_s < 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s}")
        if self.contenders is not None:
            valid = list(CONTENDERS)
            unknown = [c for c in self.contenders if c not in valid]
            if unknown:
                raise ValueError(
                    f"unknown contender {unknown[0]!r}; valid: {', '.join(valid)}")
        # Resolve the scenario filter now, so a typo fails before any probe runs.
        suite = SUITES[self.suite]()
        if self.kv_dtype is not None:
            if self.kv_dtype not in KV_DTYPES:
                raise ValueError(
                    f"unknown kv_dtype {self.kv_dtype!r}; valid: {', '.join(KV_DTYPES)}")
            by_name = {}
            for s in suite:
                s = with_kv_dtype(s, self.kv_dtype)
                by_name.setdefault(s.name, s)
            suite = list(by_name.values())
        self.selected = select_scenarios(suite, self.scenarios)

    def contender_names(self) -> list[str]:
        """Table columns: pagedattn first (the table is about it), then the others.
        The checks call the reference module directly, so its column is optional."""
        names = self.contenders if self.contenders else list(CONTENDERS)
        return list(dict.fromkeys(["pagedattn", *names]))


@dataclass
class Cell:
    """One contender on one scenario. ``times_s`` are the raw timed samples."""

    contender: str
    status: str
    reason: str = ""
    note: str = ""
    times_s: list[float] = field(default_factory=list)
    max_abs_err: float | None = None
    tolerance: float | None = None
    budget_limited: bool = False
    wall_s: float = 0.0  # prepare + check + timing, for planning runs

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None


@dataclass
class ScenarioResult:
    scenario: Scenario
    copies: int
    cells: dict[str, Cell]
    stream_times_s: list[float] = field(default_factory=list)
    stream_bytes: int = 0
    stream_method: str = ""  # the read timed as the stream (probes.stream_reader)

    @property
    def stream_median_s(self) -> float | None:
        return statistics.median(self.stream_times_s) if self.stream_times_s else None


@dataclass
class BenchResult:
    options: BenchOptions
    machine: probes.MachineLimits
    versions: dict
    contenders: dict[str, dict]
    scenarios: list[ScenarioResult]
    wall_s: float = 0.0
    other_load_cores: float | None = None  # cores other processes kept busy at the start
    other_load_during_run: float | None = None  # ... and on average during the run


# -------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr (one line per step when stderr is no TTY)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        line = (f"[{bar}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.0f}s  "
                f"{label}")
        if self.tty:
            sys.stderr.write("\r" + line[:118].ljust(118))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
        self.done += 1

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + " " * 118 + "\r")
            sys.stderr.flush()


# ---------------------------------------------------------------------------- checks


def _check_ids(s: Scenario) -> list[int]:
    """Requests whose output is checked: first, last, and the first multi-token one --
    requests are independent, so a subset checks every code path at a fraction of the
    reference's cost on multi-GiB batches."""
    ids = [0, s.batch - 1]
    ids += [r for r, q in enumerate(s.query_lens) if q > 1][:1]
    return sorted(set(ids))


def _reference_rows(inputs: ScenarioInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token rows, expected [rows, H, D])`` of copy 0 from the reference."""
    from pagedattn.ops import reference

    s = inputs.scenario
    ids = _check_ids(s)
    qsl = inputs.query_start_loc.to(torch.int64)
    rows = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in ids])
    sub_qsl = paging.query_start_loc([s.query_lens[r] for r in ids])
    key_cache, value_cache = inputs.key_cache, inputs.value_cache
    table = inputs.block_tables[0][ids]
    if s.is_fp8:  # dequantise only the checked requests' blocks (pools are GiBs)
        used = torch.unique(table)
        key_cache = reference.dequantize_fp8(key_cache[used.long()], s.kv_scale)
        value_cache = reference.dequantize_fp8(value_cache[used.long()], s.kv_scale)
        table = torch.searchsorted(used, table).to(torch.int32)
    expected = reference.paged_attention(
        inputs.query[rows], key_cache, value_cache, sub_qsl,
        inputs.seq_lens[ids], table, scale=inputs.scale, causal=s.causal)
    return rows, expected


def _reference_attend_written(inputs: ScenarioInputs, query: torch.Tensor) -> torch.Tensor:
    """Reference attention of ``query [1, H, D]`` over copy 0's new tokens (positions
    ``0..T-1`` of one request), built from the tensors that were to be written."""
    from pagedattn.ops import reference

    s = inputs.scenario
    t, bs = s.num_tokens, s.block_size
    nblk = paging.cdiv(t, bs)
    kv = torch.zeros(2, nblk * bs, s.num_kv_heads, s.head_size, dtype=s.torch_dtype)
    kv[0, :t], kv[1, :t] = inputs.new_keys[0], inputs.new_values[0]
    cache = kv.view(2, nblk, bs, s.num_kv_heads, s.head_size).transpose(2, 3).contiguous()
    table = torch.arange(nblk, dtype=torch.int32).unsqueeze(0)
    return reference.paged_attention(
        query, cache[0], cache[1], torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([t], dtype=torch.int32), table, scale=inputs.scale, causal=s.causal)


def _compare(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
             exact: bool = False) -> tuple[bool, float, float]:
    from pagedattn.testing import TOLERANCES

    atol, rtol = (0.0, 0.0) if exact else TOLERANCES[dtype]
    got, expected = got.float(), expected.float()
    if not bool(torch.isfinite(got).all()):
        return False, float("inf"), atol
    diff = (got - expected).abs()
    ok = bool((diff <= atol + rtol * expected.abs()).all())
    return ok, float(diff.max()) if diff.numel() else 0.0, atol


class _Checker:
    """Expected values of one scenario, computed lazily and once."""

    def __init__(self, inputs: ScenarioInputs):
        self.inputs = inputs
        self._rows = None
        gen = torch.Generator().manual_seed(1)
        s = inputs.scenario
        self.probe_query = torch.randn(1, s.num_heads, s.head_size, generator=gen).to(s.torch_dtype)
        self._attend_expected = None

    def check(self, prepared: Prepared) -> tuple[bool, float, float, str]:
        """Run copy 0 and compare: ``(ok, max_abs_err, atol, what was compared)``."""
        s = self.inputs.scenario
        if s.kind != "reshape_and_cache":
            if self._rows is None:
                self._rows = _reference_rows(self.inputs)
            rows, expected = self._rows
            out = prepared.run(0)
            if out is None:
                raise RuntimeError("an attention contender's run() must return its output")
            ok, err, tol = _compare(out[rows], expected, s.torch_dtype)
            return ok, err, tol, f"{len(rows)} token rows vs reference"
        if prepared.poison is not None:
            prepared.poison(0)
        prepared.run(0)
        if prepared.cache_rows is not None:
            want = torch.stack([self.inputs.new_keys[0], self.inputs.new_values[0]])
            if s.is_fp8:
                from pagedattn.ops.reference import quantize_fp8

                want = quantize_fp8(want, s.kv_scale, s.cache_torch_dtype)
            ok, err, tol = _compare(prepared.cache_rows(0), want, s.torch_dtype, exact=True)
            return ok, err, tol, "written cache rows, exact"
        if prepared.attend is None:
            raise RuntimeError("a reshape_and_cache contender needs cache_rows or attend")
        if self._attend_expected is None:
            self._attend_expected = _reference_attend_written(self.inputs, self.probe_query)
        got = prepared.attend(0, self.probe_query)
        ok, err, tol = _compare(got, self._attend_expected, s.torch_dtype)
        return ok, err, tol, "attention over the written cache vs reference"


# ---------------------------------------------------------------------------- timing


class _CopyRotation:
    """Hands out the copy each call of a scenario reads: 1, 2, ..., copies - 1, 0, 1, ...
    (copy 0 went to the correctness checks), whichever contender makes the call."""

    def __init__(self, copies: int):
        self.copies, self.calls = copies, 0

    def next(self) -> int:
        self.calls += 1
        return self.calls % self.copies


def _warm_up(prepared: Prepared, rotation: _CopyRotation, repeat: int, budget_s: float,
             warmup_s: float) -> tuple[float, int]:
    """Untimed calls for at least ``warmup_s`` (at least one); returns the last call's
    time and how many timed repeats fit the budget (0: the first call alone exceeded it
    and is the only sample)."""
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        prepared.run(rotation.next())
        last = time.perf_counter() - t0
        if last >= budget_s:
            return last, 0
        if t0 + last - start >= min(warmup_s, budget_s):
            break
    return last, max(1, min(repeat, int(budget_s / max(last, 1e-9))))


def _time_cell(prepared: Prepared, rotation: _CopyRotation, opts: BenchOptions,
               stream=None) -> tuple[list[float], list[float], bool]:
    """Timed samples of ``prepared.run`` (and interleaved stream samples)."""
    warm, n = _warm_up(prepared, rotation, opts.repeat, opts.budget_s, opts.warmup_s)
    if n == 0:
        return [warm], [], True
    times, stream_times = [], []
    for _ in range(n):
        copy = rotation.next()
        t0 = time.perf_counter()
        prepared.run(copy)
        times.append(time.perf_counter() - t0)
        if stream is not None:
            t0 = time.perf_counter()
            stream(copy)
            stream_times.append(time.perf_counter() - t0)
    return times, stream_times, n < opts.repeat


def alternating_medians(runs: list[tuple[Prepared, int]], repeat: int,
                        warmup_pairs: int = 2) -> list[float]:
    """Median seconds per call of each ``(prepared, copies)`` run, timed in turns (the
    order reversed every other round, so that load from other processes hits them alike),
    each call on the next of its run's KV copies; ``warmup_pairs`` rounds first, untimed.
    The side-by-side timer of the benchmark scripts that compare two kernels or plans."""
    times: list[list[float]] = [[] for _ in runs]
    calls = [0] * len(runs)
    for i in range(repeat + warmup_pairs):
        order = list(range(len(runs))) if i % 2 == 0 else list(range(len(runs)))[::-1]
        for k in order:
            prepared, copies = runs[k]
            copy = calls[k] % copies
            calls[k] += 1
            t0 = time.perf_counter()
            prepared.run(copy)
            if i >= warmup_pairs:
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def _prepare_checked(contender: Contender, inputs: ScenarioInputs, checker: _Checker
                     ) -> tuple[Cell, Prepared | None]:
    """The contender's prepared call, checked against the reference (None: not timeable,
    the cell says why)."""
    reason = contender.unsupported_reason(inputs.scenario)
    if reason:
        return Cell(contender.name, "unsupported", reason), None
    cell = Cell(contender.name, "ok")
    try:
        prepared = contender.prepare(inputs)
        cell.note = prepared.note
        if contender.checked and not contender.is_reference:
            ok, err, tol, what = checker.check(prepared)
            cell.max_abs_err, cell.tolerance = err, tol
            if not ok:
                cell.status = "wrong"
                cell.reason = f"max |diff| {err:.3g} > tolerance ({what})"
                return cell, None
        return cell, prepared
    except Exception as exc:
        return Cell(contender.name, "error", _one_line(exc), note=cell.note), None


def _run_interleaved(contenders: dict[str, Contender], inputs: ScenarioInputs,
                     checker: _Checker, opts: BenchOptions, rotation: _CopyRotation, stream,
                     progress) -> tuple[dict[str, Cell], list[float]]:
    """Like :func:`_run_cell` for every contender, but the timed calls go round-robin:
    repeat ``i`` of every contender runs before repeat ``i + 1`` of any, each call on the
    next copy of the scenario's rotation."""
    cells: dict[str, Cell] = {}
    ready: dict[str, Prepared] = {}
    for name, contender in contenders.items():
        progress.step(f"{inputs.scenario.name} · {name}")
        cells[name], prepared = _prepare_checked(contender, inputs, checker)
        if prepared is not None:
            ready[name] = prepared
    rounds: dict[str, int] = {}
    for name, prepared in list(ready.items()):
        try:
            warm, n = _warm_up(prepared, rotation, opts.repeat, opts.budget_s, opts.warmup_s)
        except Exception as exc:
            cells[name] = Cell(name, "error", _one_line(exc), note=cells[name].note)
            del ready[name]
            continue
        if n == 0:
            cells[name].times_s, cells[name].budget_limited = [warm], True
            del ready[name]
            continue
        rounds[name] = n
        cells[name].times_s = []
        cells[name].budget_limited = rounds[name] < opts.repeat
    stream_times: list[float] = []
    for i in range(max(rounds.values(), default=0)):
        for name, prepared in ready.items():
            if i >= rounds[name] or cells[name].status != "ok":
                continue
            copy = rotation.next()
            try:
                t0 = time.perf_counter()
                prepared.run(copy)
                cells[name].times_s.append(time.perf_counter() - t0)
            except Exception as exc:
                cells[name] = Cell(name, "error", _one_line(exc), note=cells[name].note)
                continue
            if stream is not None:
                t0 = time.perf_counter()
                stream(copy)
                stream_times.append(time.perf_counter() - t0)
    ready.clear()  # freed by reference counting; run_bench collects once per scenario
    return cells, stream_times


def _run_cell(contender: Contender, inputs: ScenarioInputs, checker: _Checker,
              opts: BenchOptions, rotation: _CopyRotation, stream
              ) -> tuple[Cell, list[float]]:
    cell, prepared = _prepare_checked(contender, inputs, checker)
    if prepared is None:
        return cell, []
    try:
        times, stream_times, limited = _time_cell(prepared, rotation, opts, stream)
        cell.times_s, cell.budget_limited = times, limited
        return cell, stream_times
    except Exception as exc:  # one broken contender must not sink the whole table
        return Cell(contender.name, "error", _one_line(exc), note=cell.note), []
    finally:
        # Freed by reference counting; the full gc.collect() (0.3 s with torch's modules
        # loaded) runs once per scenario, not per cell.
        del prepared


# ------------------------------------------------------------------------------ main


def _versions(names: list[str]) -> dict:
    import platform

    import pagedattn

    info: dict = {"pagedattn": pagedattn.__version__, "torch": torch.__version__,
                  "python": platform.python_version(), "platform": platform.platform()}
    try:
        import numpy
        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    try:
        from pagedattn import ops
        native = bool(ops.native_available())
        info["native"] = native
        if native and hasattr(ops, "get_cpu_isa"):
            info["cpu_isa"] = str(getattr(ops.get_cpu_isa(), "value", ops.get_cpu_isa()))
    except Exception as exc:
        info["native"] = False
        info["native_error"] = _one_line(exc)
    for name in names:
        info.update(CONTENDERS[name].versions())
    return info


def run_bench(opts: BenchOptions, *, scenarios: list[Scenario] | None = None, log=print
              ) -> BenchResult:
    """Measure the machine (or load its cached limits), then run every selected scenario
    (or the explicit ``scenarios``) x contender. ``log`` receives the lines printed above
    the table."""
    started = time.perf_counter()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    load = other_load()  # before our own probes make the machine busy
    snapshot = load_snapshot()
    warning = load_warning(torch.get_num_threads(), load)
    machine = probes.load_or_measure(opts.probe_bytes, opts.matmul_size,
                                     remeasure=opts.remeasure, busy=warning is not None)
    contenders = {n: CONTENDERS[n] for n in opts.contender_names()}
    availability = {}
    for n, c in contenders.items():
        reason = c.unavailable_reason()
        availability[n] = {"available": reason is None, "reason": reason or "",
                           "description": c.description}
    log_machine(machine, log)
    if warning:
        log(warning)

    scenarios = opts.selected if scenarios is None else scenarios
    progress = Progress(len(scenarios) * len(contenders), opts.progress)
    results = []
    for s in scenarios:
        copies = copies_for(s, machine.llc_bytes)
        inputs = build_inputs(s, copies)
        checker = _Checker(inputs)
        stream, stream_bytes, stream_method = None, 0, ""
        if s.kind in BANDWIDTH_KINDS:
            stream_method, read = probes.stream_reader()
            if s.kind == "reshape_and_cache":  # the pool is written to: own buffers
                regions = [(b,) for b in probes.stream_buffers(s.bytes_moved(), copies)]
            else:  # the KV is read-only: stream the pool's own bytes, region by region
                regions = stream_regions(inputs)
            stream_bytes = sum(t.numel() * t.element_size() for t in regions[0])
            ahead = stream_offset(copies)

            def stream(copy: int, regions=regions, read=read, ahead=ahead) -> None:
                for part in regions[(copy + ahead) % len(regions)]:
                    read(part)
        cells: dict[str, Cell] = {}
        stream_times: list[float] = []
        rotation = _CopyRotation(copies)
        if opts.interleave:
            available = {n: c for n, c in contenders.items() if availability[n]["available"]}
            t0 = time.perf_counter()
            cells, stream_times = _run_interleaved(available, inputs, checker, opts,
                                                   rotation, stream, progress)
            for name in contenders:  # table order; wall time is shared
                if name not in cells:
                    progress.step(f"{s.name} · {name}")
                    cells[name] = Cell(name, "unavailable", availability[name]["reason"])
                cells[name].wall_s = time.perf_counter() - t0
            cells = {n: cells[n] for n in contenders}
        for name, contender in contenders.items() if not opts.interleave else ():
            progress.step(f"{s.name} · {name}")
            if not availability[name]["available"]:
                cells[name] = Cell(name, "unavailable", availability[name]["reason"])
                continue
            t0 = time.perf_counter()
            cell, st = _run_cell(contender, inputs, checker, opts, rotation, stream)
            cell.wall_s = time.perf_counter() - t0
            cells[name] = cell
            stream_times += st
        results.append(ScenarioResult(s, copies, cells, stream_times, stream_bytes,
                                      stream_method))
        del inputs, checker, stream
        gc.collect()
    progress.close()
    return BenchResult(opts, machine, _versions(list(contenders)), availability, results,
                       wall_s=time.perf_counter() - started, other_load_cores=load,
                       other_load_during_run=other_load_since(snapshot))


def _cpu_busy_s() -> float | None:
    """Busy CPU-seconds of the whole machine so far (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def load_snapshot() -> tuple[float | None, float, float]:
    """(machine busy CPU-s, our CPU-s, wall clock) now, for :func:`other_load_since`."""
    return _cpu_busy_s(), time.process_time(), time.perf_counter()


def other_load_since(snapshot: tuple[float | None, float, float]) -> float | None:
    """Average cores kept busy by *other* processes since ``snapshot`` (ours subtracted)."""
    busy0, self0, t0 = snapshot
    busy1, self1, t1 = load_snapshot()
    if busy0 is None or busy1 is None or t1 <= t0:
        return None
    return max(0.0, (busy1 - busy0) - (self1 - self0)) / (t1 - t0)


def other_load(sample_s: float = 0.3) -> float | None:
    """Cores kept busy by *other* processes over a short sample."""
    snapshot = load_snapshot()
    time.sleep(sample_s)
    return other_load_since(snapshot)


def load_warning(threads: int, load: float | None) -> str | None:
    """A warning when other processes take cores the benchmark threads need."""
    if load is None:
        return None
    spare = (os.cpu_count() or 1) - threads
    if load > spare + 0.25:
        return (f"warning   other processes keep {load:.1f} of {os.cpu_count()} cores busy while "
                f"the bench uses {threads} threads: timings will be noisy")
    return None


def log_machine(machine: probes.MachineLimits, log) -> None:
    src = "cached" if machine.cached else "measured now"
    if "not_cached" in machine.details:
        src += " (not cached: other processes were busy)"
    flops = ", ".join(f"{k} {v:,.0f}" for k, v in machine.matmul_gflops.items())
    log(f"machine   {machine.cpu_model}, {machine.logical_cores} cores, {machine.threads} threads, "
        f"LLC {machine.llc_bytes >> 20} MiB")
    log(f"limits    DRAM read {machine.dram_read_gbps:.1f} GB/s ({machine.bandwidth_note()}); "
        f"matmul peak GFLOP/s: {flops}  [{src} {machine.measured_at}; --remeasure to redo]")
