"""Property-based fuzzing of the native ops (hypothesis): random valid calls must equal the
fp32 reference; mutated calls must raise a Python exception naming the bad value. Every
case runs in a worker process (fuzz_worker.py), so a crash or hang fails that one case.

Bounded by default (PAGEDATTN_FUZZ_EXAMPLES, default 50 per property, ~30 s). A long campaign:

    PAGEDATTN_FUZZ_EXAMPLES=10000 PAGEDATTN_FUZZ_REPORT=fuzz-report.json \\
        .venv/bin/python -m pytest tests/test_fuzz.py -q      (or: make fuzz)

PAGEDATTN_FUZZ_REPORT names a JSON file that gets the tally (cases by kind, outcomes).
"""

from __future__ import annotations

import collections
import json
import os
import platform
import selectors
import subprocess
import sys
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402

from pagedattn import ops  # noqa: E402
from pagedattn.ops.isa import ARM_PREFERENCE, X86_PREFERENCE  # noqa: E402

import fuzz_worker  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")

EXAMPLES = int(os.environ.get("PAGEDATTN_FUZZ_EXAMPLES", "50"))
CASE_TIMEOUT_S = float(os.environ.get("PAGEDATTN_FUZZ_TIMEOUT", "120"))
# The common sizes, plus the less common ones (head sizes that are multiples of 8 but
# not 16, up to 512; block sizes 1, 8 and multiples of 16 outside the Literal).
HEAD_SIZES = [32, 40, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256, 320, 512]
BLOCK_SIZES = [1, 8, 16, 32, 48, 64, 80, 128, 256]
KV_CACHE_DTYPES = ["auto", "auto", "auto", "fp8_e4m3", "fp8_e5m2"]
ISAS = [i for i in (ARM_PREFERENCE if platform.machine().lower() in ("arm64", "aarch64")
                    else X86_PREFERENCE) if i in {s.value for s in ops.supported_cpu_isas()}]
REPORT = os.environ.get("PAGEDATTN_FUZZ_REPORT")
# A campaign (a report file named) records every failure and goes on: no shrinking (it
# took over five minutes per failure), the tally is written every 200 cases and the
# failures are asserted once at the end. A plain run fails fast at the first bad case.
CAMPAIGN = REPORT is not None
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck),
                         phases=[Phase.generate] if CAMPAIGN else list(Phase))


class Worker:
    """One child process running cases; restarted after a crash or a hang."""

    def __init__(self):
        self.proc = None

    def start(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, "-u", fuzz_worker.__file__], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, case: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=CASE_TIMEOUT_S)
        sel.close()
        if not ready:
            self.stop()
            return dict(outcome="hang", detail=f"no answer in {CASE_TIMEOUT_S:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            err = self.proc.stderr.read()[-3000:]
            self.proc = None
            return dict(outcome="crash", detail=f"worker exited with {code}\n{err}")
        return json.loads(line)


class Tally:
    def __init__(self):
        self.by_kind = collections.Counter()
        self.outcomes = collections.Counter()
        self.failures = []
        self.started = time.monotonic()

    def add(self, case, result):
        self.by_kind[case["kind"]] += 1
        self.outcomes[result["outcome"]] += 1
        if result["outcome"] not in ("ok", "rejected"):
            self.failures.append(dict(case=case, **result))
        if REPORT and sum(self.by_kind.values()) % 200 == 0:
            self.write(REPORT)

    def write(self, path):
        with open(path, "w") as f:
            json.dump(self.report(), f, indent=1)

    def report(self) -> dict:
        return dict(cases=sum(self.by_kind.values()), by_kind=dict(self.by_kind),
                    outcomes=dict(self.outcomes), failures=self.failures[:50],
                    wall_s=round(time.monotonic() - self.started, 1))


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def tally():
    t = Tally()
    yield t
    report = t.report()
    print("\nfuzz tally:", json.dumps({k: v for k, v in report.items() if k != "failures"}))
    if REPORT:
        t.write(REPORT)
        assert not t.failures, f"{len(t.failures)} failing cases, see {REPORT}"


# ------------------------------------------------------------------ strategies

@st.composite
def batches(draw):
    """(seq_lens, query_lens): decodes, spec decodes, prefills and chunked prefills, empty
    requests, now and then a long context (KV splits)."""
    n = draw(st.integers(1, 5))
    long_ctx = draw(st.integers(0, 4)) == 0  # also: prefixes long enough to be shared
    seq_lens, query_lens = [], []
    for _ in range(n):
        shape = draw(st.sampled_from(["decode", "spec", "prefill", "chunk", "empty"]))
        if shape == "decode":
            q = 1
        elif shape == "spec":
            q = draw(st.integers(2, 8))
        elif shape == "empty":
            q = 0
        else:
            q = draw(st.integers(1, 80))
        ctx = 0 if shape == "prefill" else draw(st.integers(0, 2600 if long_ctx else 200))
        seq_lens.append(q + ctx if shape != "decode" else max(1, q + ctx))
        query_lens.append(q)
    return seq_lens, query_lens


@st.composite
def shared_prefixes(draw, seq_lens, block_size):
    """Groups of requests whose block tables begin with the same blocks (prefix caching):
    ``[[members], blocks]``, a request in one group at most; blocks may reach into a
    member's new tokens or past its length (the planner must cap what it shares)."""
    free = [r for r, s in enumerate(seq_lens) if s > 0]
    groups = []
    while len(free) >= 2 and draw(st.booleans()):
        members = draw(st.lists(st.sampled_from(free), min_size=2, max_size=len(free),
                                unique=True))
        most = max(1, min(-(-seq_lens[r] // block_size) for r in members))
        groups.append([members, draw(st.integers(1, most))])
        free = [r for r in free if r not in members]
    return groups


@st.composite
def attention_cases(draw, kind="attention_valid", mutation=None):
    seq_lens, query_lens = draw(batches())
    kv = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_size = draw(st.sampled_from(HEAD_SIZES))
    big_window = draw(st.sampled_from([2 ** 31, 2 ** 40, 2 ** 63 - 1]))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    return dict(
        kind=kind, mutation=mutation, k=draw(st.integers(0, 10 ** 6)),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        dtype=draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        kv_cache_dtype=draw(st.sampled_from(KV_CACHE_DTYPES)),
        k_scale=draw(st.sampled_from([1.0, 0.05, 3.0])),
        v_scale=draw(st.sampled_from([1.0, 0.05, 3.0])),
        head_size=head_size, block_size=block_size,
        shared=draw(shared_prefixes(seq_lens, block_size)), plan_shared=draw(st.booleans()),
        num_kv_heads=kv, num_heads=kv * group, seq_lens=seq_lens, query_lens=query_lens,
        pad_tokens=draw(st.integers(0, 3)), causal=draw(st.booleans()),
        window=[draw(st.sampled_from([-1, -1, 0, 1, 7, 40, 300, big_window])),
                draw(st.sampled_from([-1, -1, 0, 3, 50, big_window]))],
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 0.3, 5.0, 50.0, 1e4, 1e8])),
        scale=head_size ** -0.5 * draw(st.sampled_from([0.25, 1.0, 2.0, 4.0])),
        alibi=draw(st.booleans()), sinks=draw(st.booleans()),
        isa=draw(st.sampled_from(ISAS)), kv_split=draw(st.booleans()),
        threads=draw(st.sampled_from([1, 1, 2])),
    )


def check(worker, tally, case):
    result = worker.run(case)
    tally.add(case, result)
    if CAMPAIGN:
        return
    expected = "ok" if case["kind"] in ("attention_valid", "cache_valid") else None
    if expected == "ok":
        assert result["outcome"] == "ok", result
    else:
        assert result["outcome"] in ("ok", "rejected"), result


# ------------------------------------------------------------------ properties

@FUZZ_SETTINGS
@given(case=attention_cases())
def test_valid_calls_match_the_reference(worker, tally, case):
    check(worker, tally, case)


@FUZZ_SETTINGS
@given(case=st.sampled_from(sorted(fuzz_worker.ATTENTION_MUTATIONS)).flatmap(
    lambda m: attention_cases(kind="attention_invalid", mutation=m)))
def test_mutated_calls_raise_naming_the_bad_value(worker, tally, case):
    check(worker, tally, case)


@FUZZ_SETTINGS
@given(case=st.sampled_from(sorted(fuzz_worker.METADATA_MUTATIONS)).flatmap(
    lambda m: attention_cases(kind="metadata_invalid", mutation=m)))
def test_mutated_scheduler_metadata_calls_raise(worker, tally, case):
    check(worker, tally, case)


@FUZZ_SETTINGS
@given(case=st.sampled_from([None, "padding", "slot_out_of_range", "slot_dtype", "key_short",
                             "cache_none"]).flatmap(
    lambda m: attention_cases(kind="cache_valid" if m in (None, "padding") else "cache_invalid",
                              mutation=m)))
def test_reshape_and_cache(worker, tally, case):
    check(worker, tally, case)
