"""The plugin under vLLM's tensor parallelism: two worker processes (gloo plus vLLM's
shared-memory all-reduce), each running pagedattn's kernels on its share of the heads.

A random-weight Llama checkpoint with 8 query / 4 KV heads (4 / 2 per rank) in fp32: the
greedy tokens with ``tensor_parallel_size=2`` equal those of one process, with the plugin
and without it. One subprocess per plugin setting runs both engines (TP=1, then TP=2).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment; the vLLM "
                    "plugin tests run in .venv-vllm (make vllm-test)")

from greedy_checks import assert_same_greedy  # noqa: E402

from pagedattn.bench import vllm_plugin_runs as workloads  # noqa: E402

pytestmark = pytest.mark.slow  # four engine starts: make vllm-test-engine / test-all

NUM_PROMPTS, MAX_TOKENS = 8, 32
JOB_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{("off"|"on", tp): greedy results}`` for TP=1 and TP=2, plugin off and on."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor_parallel_size=2 needs 2 cores for vLLM's per-rank binding")
    directory = tmp_path_factory.mktemp("tp")
    path = str(workloads.save_random_checkpoint(workloads.TENSOR_PARALLEL_ARCH, directory))
    prompts = workloads.random_prompts(NUM_PROMPTS, min_len=40, max_len=160)
    jobs = [{"engine": {"model": path, "dtype": "float32", "max_model_len": 512,
                        "skip_tokenizer_init": True, "tensor_parallel_size": tp},
             "greedy": {"prompts": prompts, "max_tokens": MAX_TOKENS}} for tp in (1, 2)]
    job_file = directory / "jobs.json"
    job_file.write_text(json.dumps(jobs))
    out = {}
    for setting, plugin in (("off", False), ("on", True)):
        results = workloads.last_json_line(workloads.run_in_subprocess(
            ["pagedattn.bench.vllm_plugin_runs", str(job_file)], plugin=plugin,
            timeout=JOB_TIMEOUT_S))
        for tp, result in zip((1, 2), results):
            out[setting, tp] = result
    return out


@pytest.mark.parametrize("setting", ["off", "on"])
def test_two_ranks_give_the_tokens_of_one(runs, setting):
    one, two = runs[setting, 1]["greedy"], runs[setting, 2]["greedy"]
    assert len(one) == NUM_PROMPTS and all(len(r["ids"]) == MAX_TOKENS for r in one + two)
    notes = assert_same_greedy(one, two, f"plugin {setting}, TP=1 then TP=2")
    assert len(notes) <= 1, notes
    # Not a degenerate stream (a constant one would hide attention bugs).
    assert len({t for r in one for t in r["ids"]}) > 20


def test_each_rank_ran_pagedattn_kernels_only_with_the_plugin(runs):
    assert runs["off", 2]["pagedattn_attention_calls_per_worker"] == [0, 0]
    per_rank = runs["on", 2]["pagedattn_attention_calls_per_worker"]
    assert len(per_rank) == 2 and all(n > 0 for n in per_rank), per_rank
    # Both ranks run every layer of every step.
    assert per_rank[0] == per_rank[1]
    assert runs["on", 1]["pagedattn_attention_calls_per_worker"][0] > 0


def test_plugin_and_vllm_agree_at_two_ranks(runs):
    assert_same_greedy(runs["off", 2]["greedy"], runs["on", 2]["greedy"],
                       "TP=2, plugin off then on")
