"""Fixtures shared by the test files.

- ``isa``: runs a test once per instruction set of this machine's architecture family
  (x86: avx512bf16, avx512, avx2, scalar; Arm: neon, scalar), switched in-process with
  ``ops.use_cpu_isa``; the ones this CPU cannot execute are skipped with the reason. It is
  the one way tests iterate ISAs (``PAGEDATTN_CPU_ISA`` is covered by its own subprocess
  test).

The data the tests share with the benchmarks live in :mod:`pagedattn.testing`, one copy
each: the per-dtype (atol, rtol) table for kernels vs the fp32 reference
(``TOLERANCES``) and the named batch shapes (``BATCH_SPECS``).
"""

from __future__ import annotations

import os
import platform

import pytest

from pagedattn import ops
from pagedattn.ops.isa import ARM_PREFERENCE, X86_PREFERENCE

ISAS = list(ARM_PREFERENCE if platform.machine().lower() in ("arm64", "aarch64")
            else X86_PREFERENCE)
"""The instruction sets of this machine's architecture family, best first."""


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test under one instruction set; skip those this CPU (or a build without the
    native extension) cannot execute."""
    if request.param not in {i.value for i in ops.supported_cpu_isas()}:
        pytest.skip(f"this CPU cannot execute {request.param} (or the native extension "
                    "is not built)")
    with ops.use_cpu_isa(request.param):
        yield request.param


@pytest.fixture(autouse=True, scope="session")
def _private_cache_home(tmp_path_factory):
    """Engines built by the tests measure their linear paths into a session directory, never
    the user's ``~/.cache`` (tests that check the cache set their own)."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old
