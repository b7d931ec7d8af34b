"""Stand-ins for the bench's slow machine probes, shared by the bench tests."""

from __future__ import annotations

import torch

from pagedattn.bench import probes


def fake_machine_limits(probe_bytes: int, matmul_size: int):
    """Stand-in for :func:`pagedattn.bench.probes.measure` in tests: fixed, plausible limits
    of a 2-core machine, returned at once (the real probes take seconds)."""
    return probes.MachineLimits(
        cpu_model="test cpu", logical_cores=2, threads=torch.get_num_threads(),
        llc_bytes=1 << 20, dram_read_gbps=10.0,
        matmul_gflops={"bfloat16": 100.0, "float32": 50.0}, probe_bytes=probe_bytes,
        matmul_size=matmul_size, measured_at="now", probe_version=probes.PROBE_VERSION)
