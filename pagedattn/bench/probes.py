"""This machine's limits, measured by the bench itself, and cached per machine.

Two probes give the roofline's ceilings:

* **bandwidth** -- ``torch.sum`` over a buffer several times the LLC, rotated over fresh
  slices so every byte comes from DRAM: the best read rate plain PyTorch achieves.
* **matmul** -- ``torch.matmul`` of square matrices in bf16 and fp32: the compute peak
  the BLAS gives this process with its thread count.

Results are cached in ``$XDG_CACHE_HOME/pagedattn/machine-<hash>.json`` (default
``~/.cache``), the hash covering the CPU model and core count; entries inside are keyed by
thread count. ``--remeasure`` ignores and rewrites the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedattn.machine import DEFAULT_LLC_BYTES, cache_dir, cpu_model, llc_bytes  # noqa: F401 (re-exported)

PROBE_DTYPES = ("bfloat16", "float32")


@dataclass
class MachineLimits:
    """Measured ceilings. ``dram_read_gbps`` in GB/s (1e9 bytes); ``matmul_gflops`` per
    dtype name in GFLOP/s (1e9)."""

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

    def peak_gflops(self, dtype: str) -> float:
        """Compute roof for ``dtype``: its matmul peak (fp16, not probed, borrows bf16's),
        but never below fp32's -- a kernel can widen half-precision inputs to fp32 (as
        pagedattn's do on CPUs without a bf16 dot product), so where torch's bf16 GEMM is
        emulated and slow, fp32's peak is the one a bf16 kernel is held to."""
        native = self.matmul_gflops.get(dtype, self.matmul_gflops.get("bfloat16", 0.0))
        return max(native, self.matmul_gflops.get("float32", 0.0))

    def to_json(self) -> dict:
        return asdict(self)


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


def stream_views(pool: torch.Tensor, nbytes: int, copies: int) -> list[torch.Tensor]:
    """``copies`` disjoint fp32 views of ``nbytes`` (rounded down to 4) of ``pool``'s
    memory, spread evenly over it: streaming the benchmark's own KV pool costs no extra
    memory (a 2 GiB pool would otherwise need 2 GiB more of stream buffers)."""
    raw = pool.reshape(-1).view(torch.uint8)
    stride = (raw.numel() // copies) // 64 * 64
    n = min(nbytes, stride) // 4 * 4
    if n <= 0:
        raise ValueError(f"pool of {raw.numel()} bytes is too small for {copies} streams")
    return [raw[c * stride:c * stride + n].view(torch.float32) for c in range(copies)]


def measure_bandwidth(probe_bytes: int, llc: int, repeat: int = 5) -> float:
    """GB/s of ``torch.sum`` over fresh ``probe_bytes`` slices (rotation > 2x LLC)."""
    copies = max(2, -(-3 * llc // probe_bytes))
    buf = stream_buffers(probe_bytes, copies)

    def run(i: int = 0) -> None:
        buf[i % copies].sum()

    t = _median_time(run, repeat)
    return buf[0].numel() * 4 / t / 1e9


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
    bw = measure_bandwidth(probe_bytes, llc)
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
    )


def load_or_measure(probe_bytes: int, matmul_size: int, *, remeasure: bool = False,
                    busy: bool = False) -> MachineLimits:
    """Cached limits for this machine and thread count, measuring them when absent, when
    the cached probe was smaller than asked (a smoke test's), or when ``remeasure``.

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
            if limits.probe_bytes >= probe_bytes and limits.matmul_size >= matmul_size:
                return limits
        except TypeError:
            pass  # an older cache format: measure again
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
