"""This machine's limits, measured by the bench itself, and cached per machine.

Two probes give the roofline's ceilings:

* **bandwidth** -- the fastest plain read of memory this process achieves: pagedattn's
  native ``stream_read`` (every byte once, the widest loads of the ISA in use, all threads,
  nothing but a byte sum per load) and ``torch.sum``, each timed over a few slice sizes,
  the slices taken in turn from a pool so large that every byte read was last read at
  least 4x the LLC ago (it comes from DRAM). The roof is the best median of any
  (method, size); ``MachineLimits.details["bandwidth"]`` keeps every figure and which one
  won. Without the native extension only ``torch.sum`` runs, and the details say so. A
  kernel that reads its bytes once cannot beat this read, so the roof is an upper bound
  (``torch.sum`` alone was not: decode kernels read at 99-119 % of it).
* **matmul** -- ``torch.matmul`` of square matrices in bf16 and fp32: the compute peak
  the BLAS gives this process with its thread count.

Results are cached in ``$XDG_CACHE_HOME/pagedattn/machine-<hash>.json`` (default
``~/.cache``), the hash covering the CPU model and core count; entries inside are keyed by
thread count and carry :data:`PROBE_VERSION`: an entry of another version (an older probe)
is measured again and rewritten. ``--remeasure`` ignores and rewrites the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedattn.machine import DEFAULT_LLC_BYTES, cache_dir, cpu_model, llc_bytes  # noqa: F401 (re-exported)

PROBE_DTYPES = ("bfloat16", "float32")

PROBE_VERSION = 2
"""What the probes measure, as cached. 1 (entries without the field): ``torch.sum`` alone
over 2-3 slices. 2: the best of the native ``stream_read`` and ``torch.sum`` over several
slice sizes, >= 4 LLCs read between two reads of a byte. Other versions are re-measured."""

BANDWIDTH_LLC_MULTIPLE = 4
"""Bytes the bandwidth probe reads between two reads of the same byte, in LLCs."""
PROBE_POOL_MAX_BYTES = 2 << 30
"""Memory of the bandwidth probe (its pool of slices) at most; the slices shrink to fit."""
_MIN_LARGEST_SLICE = 16 << 20  # a slice still long next to a thread pool's wake-up
_PAGE = 4096


@dataclass
class MachineLimits:
    """Measured ceilings. ``dram_read_gbps`` in GB/s (1e9 bytes); ``matmul_gflops`` per
    dtype name in GFLOP/s (1e9). ``details["bandwidth"]``: every figure of the bandwidth
    probe (:func:`measure_bandwidth`)."""

    cpu_model: str
    logical_cores: int
    threads: int
    llc_bytes: int
    dram_read_gbps: float
    matmul_gflops: dict[str, float]
    probe_bytes: int
    matmul_size: int
    measured_at: str
    cached: bool = False
    details: dict = field(default_factory=dict)
    probe_version: int = 1  # entries cached before the field existed are version 1

    def peak_gflops(self, dtype: str) -> float:
        """Compute roof for ``dtype``: its matmul peak (fp16, not probed, borrows bf16's),
        but never below fp32's -- a kernel can widen half-precision inputs to fp32 (as
        pagedattn's do on CPUs without a bf16 dot product), so where torch's bf16 GEMM is
        emulated and slow, fp32's peak is the one a bf16 kernel is held to."""
        native = self.matmul_gflops.get(dtype, self.matmul_gflops.get("bfloat16", 0.0))
        return max(native, self.matmul_gflops.get("float32", 0.0))

    def bandwidth_note(self) -> str:
        """How the DRAM roof was read, for the ``limits`` line: the winning method and
        slice size, and the other method's best."""
        bw = self.details.get("bandwidth") if isinstance(self.details, dict) else None
        best = bw.get("best") if isinstance(bw, dict) else None
        if not isinstance(best, dict) or not {"method", "slice_bytes"} <= best.keys():
            return f"{_mib(self.probe_bytes)} probe"
        text = f"{best['method']}, {_mib(best['slice_bytes'])} slices"
        others = [f"{m} {g:.1f}" for m, g in bw.get("best_by_method", {}).items()
                  if m != best["method"]]
        if others:
            text += "; " + ", ".join(others)
        if str(bw.get("native", "")).startswith("unavailable"):
            text += "; native stream_read unavailable"
        return text

    def to_json(self) -> dict:
        return asdict(self)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MiB"


def machine_key() -> str:
    raw = f"{cpu_model()}|{os.cpu_count()}|{platform.machine()}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def cache_path() -> Path:
    return cache_dir() / f"machine-{machine_key()}.json"


def _median_time(fn, repeat: int, budget_s: float = float("inf")) -> float:
    """Median of up to ``repeat`` timed calls after a warm-up, stopping early once the
    timed calls have used ``budget_s`` (at least one call is always timed)."""
    fn()  # warm-up: first-touch page faults and lazy initialisation
    times: list[float] = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if sum(times) >= budget_s:
            break
    return statistics.median(times)


def stream_buffers(nbytes: int, copies: int) -> torch.Tensor:
    """``copies`` fresh fp32 slices of ``nbytes`` each, as one ``[copies, n]`` tensor."""
    n = max(1, nbytes // 4)
    return torch.ones(copies, n, dtype=torch.float32)


# ------------------------------------------------------------------------ reading memory


def read_methods() -> tuple[dict[str, Callable[[torch.Tensor], object]], str]:
    """``({name: read}, native)``: the plain reads of a buffer this process has, strongest
    first -- pagedattn's native ``stream_read`` (named with the ISA in use) when the
    extension is built, then ``torch.sum`` -- and the native read's ISA or why it is
    unavailable."""
    from pagedattn import ops

    methods: dict[str, Callable[[torch.Tensor], object]] = {}
    if not ops.native_available():
        native = f"unavailable: {ops._native.LOAD_ERROR}"
    else:
        try:
            native = ops.get_cpu_isa().value
            # The op itself, not ops.stream_read: the buffers here are contiguous CPU views
            # by construction and the C++ op checks them anyway, while the wrapper's
            # Python checks cost ~3 us a call, a few % of a 2 MiB stream.
            methods[f"stream_read/{native}"] = torch.ops.pagedattn.stream_read
        except (NotImplementedError, RuntimeError) as exc:  # PAGEDATTN_CPU_ISA unusable
            native = f"unavailable: {exc}"
    methods["torch.sum"] = torch.Tensor.sum
    return methods, native


def stream_reader() -> tuple[str, Callable[[torch.Tensor], object]]:
    """``(name, read)``: the strongest plain read (:func:`read_methods`), the one the
    runner times next to each kernel call (the ``t/stream`` column)."""
    methods, _ = read_methods()
    name = next(iter(methods))
    return name, methods[name]


def bandwidth_plan(probe_bytes: int, llc: int) -> tuple[int, list[int]]:
    """``(pool_bytes, slice_sizes)`` of the bandwidth probe.

    Slices of ``probe_bytes`` / 4, / 2 and ``probe_bytes`` (4 KiB multiples; the largest
    shrunk, not below 16 MiB, where the pool would pass :data:`PROBE_POOL_MAX_BYTES`) are
    read in address order from one pool of ``4 * llc + 3 * largest`` bytes; a slice that
    would pass the end starts again at 0 (leaving under ``largest`` unread there), so
    between two reads of a byte at least ``pool - 3 * largest = 4 * llc`` bytes are read:
    it comes from DRAM. Only past a 500 MiB LLC is the margin smaller (the pool stays at
    its cap; ``details["bandwidth"]["reuse_llc"]`` says how much).

    Example, 32 MiB LLC, ``probe_bytes`` 256 MiB: slices 64/128/256 MiB in a 896 MiB pool.
    """
    margin = BANDWIDTH_LLC_MULTIPLE * llc
    largest = min(probe_bytes, max((PROBE_POOL_MAX_BYTES - margin) // 3, _MIN_LARGEST_SLICE))
    largest = max(_PAGE, largest // _PAGE * _PAGE)
    sizes = sorted({max(_PAGE, (largest >> k) // _PAGE * _PAGE) for k in (2, 1, 0)})
    pool = max(3 * largest, min(PROBE_POOL_MAX_BYTES, margin + 3 * largest))
    return pool, sizes


def measure_bandwidth(probe_bytes: int, llc: int, repeat: int = 5) -> tuple[float, dict]:
    """``(GB/s, details)``: the best median read rate of any method of
    :func:`read_methods` at any slice size of :func:`bandwidth_plan`.

    For each size, one untimed read per method, then ``repeat`` rounds that time every
    method once, each read on the next slice of the pool (so the methods share the
    conditions of each round). ``details``: ``best`` {method, slice_bytes, gbps},
    ``figures`` (every method x size median), ``best_by_method``, ``pool_bytes``,
    ``reuse_llc`` (LLCs read between two reads of a byte, at least) and ``native`` (the
    native read's ISA, or why it did not run).
    """
    methods, native = read_methods()
    pool_bytes, sizes = bandwidth_plan(probe_bytes, llc)
    pool = torch.ones(pool_bytes // 4, dtype=torch.float32)  # every page touched up front
    cursor = 0

    def next_slice(nbytes: int) -> torch.Tensor:
        nonlocal cursor
        if cursor + nbytes > pool_bytes:
            cursor = 0
        start, cursor = cursor, cursor + nbytes
        return pool[start // 4:(start + nbytes) // 4]

    figures = []
    for size in sizes:
        times: dict[str, list[float]] = {name: [] for name in methods}
        for name, read in methods.items():
            read(next_slice(size))  # warm-up: the thread pool, lazy initialisation
        for _ in range(repeat):
            for name, read in methods.items():
                view = next_slice(size)
                t0 = time.perf_counter()
                read(view)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            figures.append({"method": name, "slice_bytes": size,
                            "gbps": size / statistics.median(ts) / 1e9})
    del pool
    best = max(figures, key=lambda f: f["gbps"])
    by_method = {name: max(f["gbps"] for f in figures if f["method"] == name) for name in methods}
    details = {"best": best, "figures": figures, "best_by_method": by_method,
               "pool_bytes": pool_bytes,
               "reuse_llc": round((pool_bytes - 3 * sizes[-1]) / max(1, llc), 2),
               "native": native}
    return best["gbps"], details


def measure_matmul(size: int, dtype: torch.dtype, repeat: int = 5) -> float:
    """GFLOP/s of ``a @ b`` for square ``size`` matrices of ``dtype``."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)

    def run(i: int = 0) -> None:
        torch.matmul(a, b)

    # Without a native bf16 GEMM a 1536^3 bf16 matmul takes ~7 s here: cap the probe.
    t = _median_time(run, repeat, budget_s=2.0)
    return 2 * size ** 3 / t / 1e9


def measure(probe_bytes: int, matmul_size: int) -> MachineLimits:
    threads = torch.get_num_threads()
    llc = llc_bytes()
    bw, bw_details = measure_bandwidth(probe_bytes, llc)
    flops = {}
    for name in PROBE_DTYPES:
        # The best of two sizes: small matrices underfeed the BLAS, big ones take long
        # (when the small one already runs at under 10 GFLOP/s the BLAS is not the
        # limit: the big one is skipped).
        small = measure_matmul(matmul_size // 2, getattr(torch, name))
        big = measure_matmul(matmul_size, getattr(torch, name)) if small >= 10 else 0.0
        flops[name] = max(small, big)
    return MachineLimits(
        cpu_model=cpu_model(),
        logical_cores=os.cpu_count() or 1,
        threads=threads,
        llc_bytes=llc,
        dram_read_gbps=bw,
        matmul_gflops=flops,
        probe_bytes=probe_bytes,
        matmul_size=matmul_size,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        details={"bandwidth": bw_details},
        probe_version=PROBE_VERSION,
    )


def load_or_measure(probe_bytes: int, matmul_size: int, *, remeasure: bool = False,
                    busy: bool = False) -> MachineLimits:
    """Cached limits for this machine and thread count, measuring them when absent, when
    the cached probe was smaller than asked (a smoke test's) or of another
    :data:`PROBE_VERSION` (an older probe), or when ``remeasure``. An unreadable cache
    file or entry is measured again and rewritten, never fatal.

    ``busy``: other processes are loading the cores, so a fresh measurement is used for
    this run only and never cached (it would understate the limits of every later run).
    """
    path = cache_path()
    threads = str(torch.get_num_threads())
    entries: dict = {}
    if path.exists():
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = {}  # a corrupt cache is re-measured, never fatal
    entry = entries.get(threads) if isinstance(entries, dict) else None
    if entry and not remeasure:
        try:
            limits = MachineLimits(**{**entry, "cached": True})
            if (limits.probe_version == PROBE_VERSION and limits.probe_bytes >= probe_bytes
                    and limits.matmul_size >= matmul_size):
                return limits
        except TypeError:
            pass  # another cache format: measure again
    limits = measure(probe_bytes, matmul_size)
    if busy:
        limits.details["not_cached"] = "measured while other processes loaded the cores"
        return limits
    entries = entries if isinstance(entries, dict) else {}
    entries[threads] = {**limits.to_json(), "cached": False}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)
        limits.details["cache_file"] = str(path)
    except OSError as exc:
        limits.details["cache_error"] = str(exc)
    return limits
