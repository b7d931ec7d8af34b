"""How long an idle OpenMP thread spins before it sleeps: the one home of that choice.

torch's OpenMP runtime (libgomp) reads ``GOMP_SPINCOUNT`` and ``OMP_WAIT_POLICY`` once,
when torch is imported. Its default spins 300,000 times (about 4 ms on the AMX Xeon we
measured) after every parallel region before it sleeps, so an idle thread spins through a
whole decode step (a hundred-odd regions with Python between them) and well past it. On
a shared machine that spin takes the cores from a neighbour, and from the engine's own
main thread when the neighbour is busy: W2 beside two spinning processes took 7x its
quiet time, two engines side by side 5.6x each, where the fair share is 2x.

pagedattn's default, ``GOMP_SPINCOUNT=30000`` (about 0.4 ms), still spans the gaps between
one step's regions, so a quiet step runs as fast as under libgomp's default; it sleeps in
longer gaps and while a neighbour holds the cores (3.2x and 3.4x in the same two cases).
Fewer spins cost the quiet step: a sleeping thread takes 35-90 us to wake on that machine,
and 10,000 spins (0.1-0.15 ms) made W2 12% slower. The measurements are in
docs/performance.md, "The engine's step and its neighbours".

It is applied when ``pagedattn`` is imported before torch, and only then: libgomp has read
its settings once torch is loaded. The user's own ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` always wins. The variable is set only while torch loads, so child
processes (vLLM's workers, say) start with the user's environment, not pagedattn's.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = 30000
"""pagedattn's ``GOMP_SPINCOUNT`` (spins before an idle OpenMP thread sleeps)."""

USER_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")

_applied: str | None = None
"""What :func:`apply_before_torch` found: 'pagedattn', 'environment' or 'torch first'."""


def apply_before_torch() -> None:
    """Load torch with pagedattn's spin count, unless torch is loaded already or the user
    chose a wait policy. Called once, from ``pagedattn/__init__.py``."""
    global _applied
    if _applied is not None:
        return
    if "torch" in sys.modules:
        _applied = "torch first"
        return
    if any(name in os.environ for name in USER_VARIABLES):
        _applied = "environment"
        return
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    try:
        import torch  # noqa: F401  (libgomp reads its environment as it loads)
    finally:
        del os.environ["GOMP_SPINCOUNT"]
    _applied = "pagedattn"


def describe() -> str:
    """One line: the intra-op threads and the wait policy they run under, and whose it is."""
    import torch

    threads = f"{torch.get_num_threads()} threads"
    if _applied == "pagedattn":
        return f"{threads}, OpenMP spins {SPIN_COUNT} then sleeps (pagedattn's default)"
    if _applied == "environment":
        chosen = ", ".join(f"{n}={os.environ[n]}" for n in USER_VARIABLES if n in os.environ)
        return f"{threads}, OpenMP wait policy from the environment ({chosen})"
    return (f"{threads}, OpenMP's own wait policy (torch was imported before pagedattn; "
            f"import pagedattn first, or set GOMP_SPINCOUNT={SPIN_COUNT}, for pagedattn's)")
