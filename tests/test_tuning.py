"""tuning.best_of: rounds in turns, and the race that stops calling hopeless candidates.

A fake clock makes each candidate's cost exact, so the tests assert how many times each is
called and what each reports, not how fast this machine is."""

from __future__ import annotations

import math

import pytest

from pagedattn import tuning


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(tuning.time, "perf_counter", fake.perf_counter)
    return fake


def candidates(clock, costs: dict[str, list[float]]):
    """name -> runner taking its next cost from ``costs[name]`` (the last one repeats);
    ``calls[name]`` counts every call, the untimed first one included."""
    calls = dict.fromkeys(costs, 0)

    def runner(name):
        def run():
            seq = costs[name]
            clock.now += seq[min(calls[name], len(seq) - 1)]
            calls[name] += 1
        return run
    return {name: runner(name) for name in costs}, calls


def test_hopeless_candidates_leave_the_race_and_close_ones_keep_their_rounds(clock):
    runners, calls = candidates(clock, {"fast": [1.0], "close": [1.2], "slow": [2.5], "slower": [9.0]})
    best = tuning.best_of(runners, min_rounds=5, budget_s=0.0)
    # one untimed call and two timed rounds each; then only the two that can still win
    assert calls == {"fast": 6, "close": 6, "slow": 3, "slower": 3}
    assert best == pytest.approx({"fast": 1e6, "close": 1.2e6, "slow": 2.5e6, "slower": 9e6})


def test_one_disturbed_call_does_not_decide(clock):
    # the true winner's first timed call was disturbed (5x the other's): a second call
    # comes before any candidate leaves
    runners, calls = candidates(clock, {"a": [1.0, 5.0, 0.8], "b": [1.0]})
    best = tuning.best_of(runners, min_rounds=4, budget_s=0.0)
    assert calls == {"a": 5, "b": 5}
    assert min(best, key=best.get) == "a" and best["a"] == pytest.approx(0.8e6)


def test_race_ends_when_one_candidate_is_left(clock):
    runners, calls = candidates(clock, {"a": [1.0], "b": [3.0]})
    tuning.best_of(runners, min_rounds=5, budget_s=100.0)
    assert calls == {"a": 3, "b": 3}


def test_keep_within_none_times_every_candidate_every_round(clock):
    runners, calls = candidates(clock, {"a": [1.0], "b": [3.0]})
    best = tuning.best_of(runners, min_rounds=4, budget_s=0.0, keep_within=None)
    assert calls == {"a": 5, "b": 5} and best == pytest.approx({"a": 1e6, "b": 3e6})


def test_small_calls_get_rounds_until_the_budget_and_the_deadline_stops_them(clock):
    runners, calls = candidates(clock, {"a": [0.001], "b": [0.0011]})
    tuning.best_of(runners, min_rounds=3, max_rounds=50, budget_s=0.01)
    assert calls["a"] == calls["b"] == 1 + math.ceil(0.01 / 0.0021 - 1e-9)
    runners, calls = candidates(clock, {"a": [1.0], "b": [1.1]})
    tuning.best_of(runners, deadline=clock.now + 2.1 + 1.0, min_rounds=10, budget_s=0.0)
    assert calls == {"a": 2, "b": 2}  # the deadline passed during the first timed round


def test_warm_each_times_the_call_after_an_untimed_one(clock):
    # a candidate whose call right after another candidate's costs 4 (a pool worker that
    # went to sleep) and 1 when it follows its own call: warm_each reports the 1
    last = [None]

    def runner(name, cold, warm):
        def run():
            clock.now += warm if last[0] == name else cold
            last[0] = name
        return run

    runners = {"pool": runner("pool", 4.0, 1.0), "openmp": runner("openmp", 1.5, 1.5)}
    cold = tuning.best_of(runners, min_rounds=3, budget_s=0.0, keep_within=None)
    assert min(cold, key=cold.get) == "openmp"
    warm = tuning.best_of(runners, min_rounds=3, budget_s=0.0, keep_within=None, warm_each=True)
    assert warm == pytest.approx({"pool": 1e6, "openmp": 1.5e6})
