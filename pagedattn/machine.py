"""Facts about this machine that several layers read (the bench, the linear-path cache):
the CPU's model name, feature flags and last-level cache size, and where per-machine
measurements are cached."""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

DEFAULT_LLC_BYTES = 32 << 20


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), else 32 MiB."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or DEFAULT_LLC_BYTES


def cpu_flags() -> str:
    """A digest of this CPU's feature flags (``/proc/cpuinfo``; empty where unreadable)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("flags", "features")):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return "sha256:" + hashlib.sha256(flags.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pagedattn`` (default ``~/.cache/pagedattn``): the measurements
    kept per machine (the bench's probes, the linear paths)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedattn"
