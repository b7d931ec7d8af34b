"""Contenders with a fixed thread count, for thread-scaling rows: pagedattn itself, and
the runner's stream read over the scenario's KV bytes (how far the memory itself scales).

They time the very same inputs as the other columns, in the same loop, so "N threads vs
1 thread" is a side-by-side ratio rather than two separate runs. They are *not*
registered by default (``pagedattn bench`` keeps its columns); scripts register them for
one run.
"""

from __future__ import annotations

import contextlib

import torch

from pagedattn.bench import probes
from pagedattn.bench.contenders import Contender, PagedattnContender, Prepared
from pagedattn.bench.scenarios import Scenario, ScenarioInputs, stream_regions
from pagedattn.checks import require_int


@contextlib.contextmanager
def num_threads(n: int):
    """``torch.set_num_threads(n)`` for the block, the previous count restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _PinnedContender(Contender):
    """A thread count (validated) and the scenarios a pinned contender runs on."""

    def __init__(self, threads: int, scenarios: set[str] | None = None):
        self.threads = require_int("threads", threads, 1)
        self.scenarios = None if scenarios is None else set(scenarios)

    def unsupported_reason(self, scenario: Scenario) -> str | None:
        if self.scenarios is not None and scenario.name not in self.scenarios:
            return "not a thread-scaling scenario"
        return super().unsupported_reason(scenario)


class PinnedThreadsContender(_PinnedContender):
    """pagedattn's native kernels under ``threads`` threads, on ``scenarios`` only.

    The scheduler metadata records the thread count it was planned for (the attention
    op rejects a mismatch), so both ``prepare`` and every ``run`` happen under the pinned
    count; the switch back costs microseconds against milliseconds-long calls.
    """

    kinds = PagedattnContender.kinds

    def __init__(self, threads: int, scenarios: set[str] | None = None):
        super().__init__(threads, scenarios)
        self.name = f"pagedattn@{threads}t"
        self.description = f"pagedattn.ops native CPU kernels pinned to {threads} thread(s)"
        self._base = PagedattnContender()

    def unavailable_reason(self) -> str | None:
        return self._base.unavailable_reason()

    def unsupported_reason(self, scenario: Scenario) -> str | None:
        return super().unsupported_reason(scenario) or self._base.unsupported_reason(scenario)

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        with num_threads(self.threads):
            inner = self._base.prepare(inputs)
        n = self.threads

        def run(copy: int):
            with num_threads(n):
                return inner.run(copy)
        return Prepared(run, cache_rows=inner.cache_rows, attend=inner.attend,
                        poison=inner.poison, note=inner.note)


class PinnedStreamContender(_PinnedContender):
    """The runner's stream read (:func:`~pagedattn.bench.probes.stream_reader`: the
    native ``stream_read``, else ``torch.sum``) of a copy's region of the KV pool under
    ``threads`` threads, on ``scenarios`` only; named ``stream@<threads>t``. Its median
    against the scenario's stream time (the same read at the run's thread count after
    every call) is the memory's own scaling, measured in the same loop as pagedattn's.
    It computes no attention, so it is not checked."""

    kinds = ("decode",)
    checked = False

    def __init__(self, threads: int, scenarios: set[str] | None = None):
        super().__init__(threads, scenarios)
        self.name = f"stream@{threads}t"
        self.description = (f"{probes.stream_reader()[0]} over the scenario's KV bytes on "
                             f"{threads} thread(s)")

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        regions = stream_regions(inputs)
        _, read = probes.stream_reader()
        n = self.threads

        def run(copy: int) -> None:
            with num_threads(n):
                for part in regions[copy]:
                    read(part)
        return Prepared(run)
