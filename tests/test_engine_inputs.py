"""Request inputs checked once for the offline ``LLM`` and the server
(``engine/inputs.py``), and a failure inside one request of a batch failing it alone."""

from __future__ import annotations

import pytest

from pagedattn import LLM, SamplingParams
from pagedattn.engine import sampler

PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="smollm2", linear_impl="packed")


def test_a_sampling_failure_fails_one_request_and_the_batch_goes_on(llm, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(PROMPTS, greedy)
    original = sampler._pick

    def faulty(row, req, gen, **kwargs):
        if req.sampling_params.seed == 99 and len(req.output_token_ids) >= 3:
            raise RuntimeError("injected")
        return original(row, req, gen, **kwargs)

    monkeypatch.setattr(sampler, "_pick", faulty)
    bad = SamplingParams(temperature=0.8, seed=99, max_tokens=12, ignore_eos=True)
    got = llm.generate(PROMPTS, [greedy, bad, greedy])
    assert got[1].finish_reason == "error"
    assert got[1].error == "sampling failed: RuntimeError: injected"
    assert len(got[1].token_ids) == 3
    for i in (0, 2):
        assert (got[i].token_ids, got[i].finish_reason) == (want[i].token_ids, "length")
    assert not llm.engine.has_unfinished()


def test_a_stop_string_failure_fails_one_request(llm, monkeypatch):
    original = llm.engine._hit_stop

    def faulty(req):
        if req.sampling_params.seed == 99:
            raise ValueError("broken stop check")
        return original(req)

    monkeypatch.setattr(llm.engine, "_hit_stop", faulty)
    sp = [SamplingParams(temperature=0, max_tokens=6, stop=["zzz"], seed=s) for s in (1, 99)]
    ok, bad = llm.generate(PROMPTS[:2], sp)
    assert ok.finish_reason == "length"
    assert bad.finish_reason == "error" and "broken stop check" in bad.error


@pytest.mark.parametrize("prompt, match", [
    ("caf\ud800", r"lone surrogate \(U\+D800\) at character 3"),
    ([1, 10**9], "token id 1000000000 is outside the vocabulary"),
    ([1, -1], "token id -1 is outside the vocabulary"),
    ("x" * 3_000_000, "characters, more than a context of"),
])
def test_bad_prompts_raise_and_leave_nothing_queued(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 1000000000 is outside"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10**9]))
    assert not llm.engine.has_unfinished()


def test_chat_messages_are_checked(llm):
    with pytest.raises(ValueError, match=r"messages\[0\].content: the text holds a lone surrogate"):
        llm.chat([{"role": "user", "content": "\udfff"}])


def test_max_new_tokens_is_the_room_left_or_an_error(llm):
    engine = llm.engine
    assert engine.max_new_tokens(10, None) == engine.max_model_len - 10
    assert engine.max_new_tokens(10, 5) == 5
    with pytest.raises(ValueError, match="max_tokens: 10000000000 new tokens do not fit"):
        engine.max_new_tokens(10, 10**10)


def test_stop_strings_cut_at_the_first_one_to_appear(llm):
    from pagedattn.engine.detokenizer import cut_at_stop

    assert cut_at_stop("abcd", ["cd", "bc"]) == "a"
    assert cut_at_stop("abcd", ["x"]) == "abcd"
