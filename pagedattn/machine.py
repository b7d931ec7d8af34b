"""Facts about this machine that several layers read (the bench, the linear-path cache):
the CPU's model name and its last-level cache size."""

from __future__ import annotations

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
