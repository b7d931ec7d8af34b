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

pagedattn's own kernels (attention, the linear layers, norms, rotary, the cache write,
sampling) do not run on OpenMP but on their own pool (``csrc/cpu/work_pool.cpp``), whose
calling thread takes every chunk that no worker has claimed: a loop waits only for chunks
a worker has started, never for a worker that the scheduler has not run yet, and an idle
worker spins 50 us, then sleeps. Beside two spinning processes SmolLM2's W2 took 2.1-2.3x
its quiet time on two threads with it, against 2.7-2.9x with OpenMP and one-thread steps
(docs/performance.md, "The kernels' own thread pool").

The spin count alone does not make a busy machine fair: every parallel region of a step
ends in a join that waits until each of its threads has had a core, and while other
processes hold the cores that wait is a scheduler time slice per region. So an engine
step also runs on fewer threads while other processes keep this process's CPUs busy
(:class:`StepThreads`): the user's thread count is the ceiling, less the cores the
neighbours used over the last quarter second (:class:`NeighbourLoad`, from
``/proc/stat``). Two engines on two cores then run one thread each instead of fighting
over every join (docs/performance.md, "Threads per step beside neighbours").
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator

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
        openmp = f"OpenMP spins {SPIN_COUNT} then sleeps (pagedattn's default)"
    elif _applied == "environment":
        chosen = ", ".join(f"{n}={os.environ[n]}" for n in USER_VARIABLES if n in os.environ)
        openmp = f"OpenMP wait policy from the environment ({chosen})"
    else:
        openmp = (f"OpenMP's own wait policy (torch was imported before pagedattn; import "
                  f"pagedattn first, or set GOMP_SPINCOUNT={SPIN_COUNT}, for pagedattn's)")
    return f"{threads}, {openmp}{_kernel_pool(torch)}"


def _kernel_pool(torch) -> str:
    """The native kernels' own pool (csrc/cpu/work_pool.cpp), where the extension is
    loaded: read through torch.ops, as this module imports nothing from the package."""
    try:
        spin = torch.ops.pagedattn.work_pool_spin_micros()
    except (AttributeError, RuntimeError):
        return ""
    return (f"; pagedattn's kernels on their own pool (the caller runs every chunk no "
            f"worker has claimed; idle workers spin {spin} us, then sleep)")


LOAD_WINDOW_S = 0.25
"""The shortest span :class:`NeighbourLoad` averages over: ``/proc/stat`` counts in clock
ticks (10 ms), so over a quarter second on two CPUs one tick is a 4% error."""

NEIGHBOUR_CORES = 0.5
"""Below this many cores busy with other processes a step runs on the full thread count."""


def proc_stat_busy_seconds(cpus: list[int]) -> Callable[[], float | None]:
    """A reader of the seconds ``cpus`` have spent busy since boot (user, nice, system,
    irq and softirq time in ``/proc/stat``); it returns None where that file is missing or
    unreadable (not Linux, a sandbox)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    wanted = {f"cpu{c}" for c in cpus}

    def read() -> float | None:
        try:
            with open("/proc/stat", "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:
            return None
        busy, seen = 0, 0
        for line in text.splitlines():
            fields = line.split()
            if fields and fields[0] in wanted and len(fields) >= 8:
                user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
                busy += user + nice + system + irq + softirq
                seen += 1
        return busy / tick if seen else None

    return read


class NeighbourLoad:
    """How many of this process's CPUs other processes kept busy, averaged over windows of
    at least :data:`LOAD_WINDOW_S`: the CPUs' busy time less this process's own CPU time
    (every thread of it), over the wall time between two readings.

    ``busy_seconds``, ``own_seconds`` and ``clock`` are injectable for tests; the defaults
    read ``/proc/stat``, ``time.process_time`` and ``time.monotonic``."""

    def __init__(self, cpus: list[int] | None = None, *,
                 busy_seconds: Callable[[], float | None] | None = None,
                 own_seconds: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic,
                 window_s: float = LOAD_WINDOW_S) -> None:
        if cpus is None:
            cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else list(range(os.cpu_count() or 1))
        self.num_cpus = len(cpus)
        self._busy = busy_seconds if busy_seconds is not None else proc_stat_busy_seconds(cpus)
        self._own, self._clock, self._window = own_seconds, clock, window_s
        self.cores_busy = 0.0
        """The latest estimate (0 until a first window has passed)."""
        self._last = self._read()  # the first window starts now
        self.available = self._last is not None

    def _read(self) -> tuple[float, float, float] | None:
        busy = self._busy()
        return None if busy is None else (self._clock(), busy, self._own())

    def update(self) -> float:
        """The cores other processes kept busy over the last completed window."""
        if not self.available:
            return 0.0
        if self._clock() - self._last[0] < self._window:
            return self.cores_busy
        reading = self._read()
        if reading is None:  # unreadable for once: keep the last estimate
            return self.cores_busy
        (t0, busy0, own0), (t1, busy1, own1) = self._last, reading
        others = ((busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)
        self.cores_busy = min(max(others, 0.0), float(self.num_cpus))
        self._last = reading
        return self.cores_busy


class StepThreads:
    """The intra-op thread count of each engine step: ``torch.get_num_threads()`` (the
    user's choice) while the machine is otherwise idle; while other processes keep at
    least :data:`NEIGHBOUR_CORES` of this process's CPUs busy, the CPUs they leave free
    (at least one). The count is set for the step and restored after it, so the user's
    setting is what every other torch call sees. ``adaptive=False`` always runs the
    user's count."""

    def __init__(self, adaptive: bool = True, load: NeighbourLoad | None = None) -> None:
        self.adaptive = adaptive
        self.load = load if load is not None or not adaptive else NeighbourLoad()
        self.steps_by_threads: Counter[int] = Counter()
        """How many steps ran on each thread count."""
        self.last_threads = 0
        """The thread count of the latest step (0 before the first)."""
        self.steps_on_fewer = 0
        """Steps that ran on fewer threads than the user's count."""

    def choose(self, ceiling: int) -> int:
        """The thread count of a step whose user-set count is ``ceiling``."""
        if not self.adaptive:
            return ceiling
        others = self.load.update()
        if others < NEIGHBOUR_CORES:
            return ceiling
        return max(1, min(ceiling, int(self.load.num_cpus - others + 0.5)))

    @contextmanager
    def step(self) -> Iterator[int]:
        """Run the block (one engine step) on :meth:`choose`'s thread count."""
        import torch  # not at the top: this module runs before torch is loaded

        ceiling = torch.get_num_threads()
        threads = self.choose(ceiling)
        self.steps_by_threads[threads] += 1
        self.last_threads = threads
        self.steps_on_fewer += threads < ceiling
        if threads == ceiling:
            yield threads
            return
        torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            torch.set_num_threads(ceiling)

    def describe(self) -> str:
        """One line: the policy, and how many steps ran on each thread count so far."""
        if not self.adaptive:
            return "every step on the user's thread count (adaptive_threads=False)"
        if not self.load.available:
            return "every step on the user's thread count (/proc/stat unreadable: no load to adapt to)"
        counts = ", ".join(f"{n} on {t}" for t, n in sorted(self.steps_by_threads.items(),
                                                            reverse=True))
        return ("fewer threads while other processes keep cores busy"
                + (f" (steps: {counts})" if counts else ""))
