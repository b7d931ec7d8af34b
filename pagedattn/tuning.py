"""The one home of measured kernel choices: what a choice depends on (the machine key),
where choices are kept (one JSON file per kind of choice under
``$XDG_CACHE_HOME/pagedattn``), when a measurement may be trusted (the busy gate), how two
candidates are timed (the best-of timer), and what was chosen in this process, with the
times that decided it (:func:`choices_made`, printed by ``pagedattn info`` and
``generate --verbose``).

Kinds of choice made through it:

* ``linear-paths``: each linear layer shape's kernel per row-count bucket
  (:mod:`pagedattn.models.linear_paths`);
* ``attention-prefill``: per attention geometry, the vector kernels or the matrix-engine
  kernel (hint ``amx``) for prefill items (:func:`pagedattn.backends.cpu_runtime.prefill_variant`).

A file written under another machine key (CPU model and flags, threads, torch version,
the kernels' ISA, format) is ignored and rewritten. Choices measured while other processes
hold the cores are used but not kept.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from pagedattn import ops
from pagedattn.machine import cache_dir, cpu_flags, cpu_model

# 2: linear shape keys name the activation and output dtypes;
# 3: linear choices made by best_of's race and the near-tie rule
CACHE_FORMAT = 3


def machine_key() -> dict:
    """What every measured choice depends on; a cache written under another key is
    measured again."""
    return {"format": CACHE_FORMAT, "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "isa": ops.get_cpu_isa().value if ops.native_available() else "none",
            "extension": ops.native_build()}


def cache_path(kind: str) -> Path:
    """The file that keeps choices of ``kind`` (``linear-paths``, ``attention-prefill``)."""
    return cache_dir() / f"{kind}.json"


def load(kind: str, key: dict, path: Path | None = None) -> dict:
    """The cached ``{choice key: entry}`` of ``kind`` for ``key``; empty when the file is
    missing, unreadable, corrupt, or written under another key."""
    path = path or cache_path(kind)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("shapes"), dict):
        return {}
    return data["shapes"]


def save(kind: str, key: dict, entries: dict, path: Path | None = None) -> str | None:
    """Write ``entries`` atomically; the error text where they cannot be written."""
    path = path or cache_path(kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"key": key, "shapes": entries}, indent=1))
        tmp.replace(path)
    except OSError as exc:
        return str(exc)
    return None


def machine_busy() -> str | None:
    """Why measurements now would misjudge the candidates (other processes hold the
    cores), or None. Choices measured then are used but not kept."""
    try:
        load_avg = os.getloadavg()[0]
    except OSError:
        return None
    cores = os.cpu_count() or 1
    return f"load average {load_avg:.1f} > {cores} cores" if load_avg > cores else None


def best_of(candidates: Mapping[str, Callable[[], object]], *, deadline: float = math.inf,
            min_rounds: int = 3, max_rounds: int = 50, budget_s: float = 0.03,
            keep_within: float | None = 2.0, warm_each: bool = False) -> dict[str, float]:
    """Best time (us) of each candidate: ``min_rounds`` rounds, then more (up to
    ``max_rounds``) while the rounds have used under ``budget_s``, so small calls get many
    tries and one no other process interrupted is among them. Candidates run in turns, one
    call each per round, so a burst of load hits them alike. Each is called once first
    (first touch, JIT compiles), untimed.

    A race, not a census: from the second round on, a candidate whose best (of two calls
    at least, so one disturbed call does not decide) is over ``keep_within`` times the
    leader's is called no more (its best so far is what it reports), so the rounds of a
    large call go to the candidates that can still win; the race ends when one is left.
    ``None`` keeps every candidate to the end.

    ``warm_each``: each timed call comes right after an untimed call of the same
    candidate, as a kernel runs in a forward pass, after the step's other parallel loops:
    a thread pool's worker that idled through the other candidates' calls long enough to
    sleep would otherwise be woken inside the timing, which no step pays per call."""
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, math.inf)
    racing = dict(candidates)
    start = time.perf_counter()
    for i in range(max_rounds):
        for name, fn in racing.items():
            if warm_each:
                fn()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
        if keep_within is not None and i >= 1:
            cutoff = keep_within * min(best.values())
            racing = {name: fn for name, fn in racing.items() if best[name] <= cutoff}
        if len(racing) < 2:
            break
        now = time.perf_counter()
        if now >= deadline or (i + 1 >= min_rounds and now - start >= budget_s):
            break
    return {name: t * 1e6 for name, t in best.items()}


@dataclass(frozen=True)
class Choice:
    """One measured choice: its kind and key, what was chosen, and why (``measured`` now,
    ``cached``, ``forced`` by the environment, or ``only`` candidate), with the times."""

    kind: str
    key: str
    chosen: str
    source: str
    times_us: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def line(self) -> str:
        times = ", ".join(f"{n} {t:.0f} us" for n, t in sorted(self.times_us.items(),
                                                               key=lambda kv: kv[1]))
        extra = f"; {self.note}" if self.note else ""
        return f"{self.kind} {self.key}: {self.chosen} [{self.source}{': ' + times if times else ''}{extra}]"


_MADE: dict[tuple[str, str], Choice] = {}
_LOCK = threading.Lock()


def record(choice: Choice) -> Choice:
    """Remember ``choice`` as this process's answer for its kind and key."""
    with _LOCK:
        _MADE[(choice.kind, choice.key)] = choice
    return choice


def recorded(kind: str, key: str) -> Choice | None:
    with _LOCK:
        return _MADE.get((kind, key))


def choices_made() -> list[Choice]:
    """Every choice this process made through this module, in order."""
    with _LOCK:
        return list(_MADE.values())


def choose(kind: str, key: str, candidates: Callable[[], Mapping[str, Callable[[], object]]],
           *, force: str | None = None, cache: bool = True) -> Choice:
    """The fastest of ``candidates()`` (name -> zero-argument runner, built only when a
    measurement is needed) for ``key``: forced, made earlier in this process, cached for
    this machine, or measured now (and kept unless the machine is busy)."""
    if force is not None:
        return record(Choice(kind, key, force, "forced"))
    made = recorded(kind, key)
    if made is not None and made.source != "forced":
        return made
    mkey = machine_key()
    entries = load(kind, mkey) if cache else {}
    entry = entries.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("chosen"), str):
        return record(Choice(kind, key, entry["chosen"], "cached",
                             dict(entry.get("times_us") or {})))
    runners = candidates()
    if len(runners) == 1:
        return record(Choice(kind, key, next(iter(runners)), "only"))
    with torch.inference_mode():
        times = best_of(runners, budget_s=0.2)
    chosen = min(times, key=times.get)
    note = ""
    if cache:
        busy = machine_busy()
        error = f"measured while busy ({busy})" if busy else save(
            kind, mkey, {**entries, key: {"chosen": chosen, "times_us": times}})
        note = f"not kept: {error}" if error else ""
    return record(Choice(kind, key, chosen, "measured", times, note))
