"""``pagedattn serve`` driven by the official ``openai`` client: every answer at
temperature 0 equals the offline ``LLM`` output; bad input gets an OpenAI-shaped 4xx
that names the bad value; a disconnect or a failure inside one request disturbs nothing
else."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from serve_helpers import BATCH_INVARIANT, client, expected_text, serve_in_thread, wait_idle

from pagedattn import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N = 8


@pytest.fixture(scope="module")
def ref():
    return LLM(model="smollm2", **BATCH_INVARIANT)


@pytest.fixture(scope="module")
def server():
    with serve_in_thread(LLM(model="smollm2", **BATCH_INVARIANT)) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def oai(server):
    return client(server[0])


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N, **kw)


# ---------------------------------------------------------------------- parity


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_offline(oai, ref, prompt):
    want = ref.generate(prompt, _greedy())[0]
    got = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=N, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_completion_equals_offline(oai, ref):
    want = ref.generate(PROMPTS[1], _greedy())[0]
    chunks = list(oai.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=N,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_equals_offline(oai, ref):
    want = ref.chat(QUESTION, _greedy())[0]
    got = oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=N,
                                      temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_chat_equals_offline(oai, ref):
    want = ref.chat(QUESTION, _greedy())[0]
    chunks = list(oai.chat.completions.create(model="smollm2", messages=QUESTION,
                                              max_completion_tokens=N, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_stop_string_cuts_the_text_like_offline(oai, ref):
    sp = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])
    want = ref.chat(QUESTION, sp)[0]
    for stream in (False, True):
        got = oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=40,
                                          temperature=0, stop=["Paris"], stream=stream)
        text = ("".join(c.choices[0].delta.content or "" for c in got) if stream
                else got.choices[0].message.content)
        assert text == want.text
        assert "Paris" not in text


def test_vllm_extensions_are_honoured(oai, ref):
    kw = dict(ignore_eos=True, min_tokens=6, repetition_penalty=1.3, top_k=5)
    want = ref.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=N, **kw))[0]
    got = oai.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=N,
                                 temperature=0, extra_body=kw)
    assert got.choices[0].text == want.text
    eos = ref.engine.eos_token_id
    got = oai.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                 extra_body={"stop_token_ids": [want.token_ids[2]],
                                             "skip_special_tokens": False})
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == 3 or want.token_ids[:2].count(want.token_ids[2])
    assert eos is not None


def test_logprobs(oai, ref):
    want = ref.generate(PROMPTS[0], _greedy())[0]
    got = oai.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=N,
                                 temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def _choices(got, chat: bool, stream: bool, n: int) -> tuple[dict[int, str], dict[int, str], object]:
    """``({index: text}, {index: finish reason}, usage)`` of a whole or streamed answer."""
    if not stream:
        assert [c.index for c in got.choices] == list(range(n))
        texts = {c.index: c.message.content if chat else c.text for c in got.choices}
        return texts, {c.index: c.finish_reason for c in got.choices}, got.usage
    texts, finishes, usage, roles = {}, {}, None, []
    for chunk in got:
        if chunk.usage is not None:
            assert not chunk.choices and usage is None and len(finishes) == n  # once, last
            usage = chunk.usage
        for c in chunk.choices:  # each chunk is about one choice
            assert len(chunk.choices) == 1 and 0 <= c.index < n and c.index not in finishes
            if chat and c.delta.role:
                roles.append(c.index)
            text = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + text
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert roles == (list(range(n)) if chat else [])
    return texts, finishes, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_choices_equal_offline(oai, ref, chat, stream):
    """n=3 seeded samples: each choice (by its index) is the offline completion of that
    index, the usage counts the prompt once and every choice's tokens."""
    n, seed = 3, 77
    sp = SamplingParams(temperature=0.8, max_tokens=N, seed=seed, n=n)
    want = (ref.chat(QUESTION, sp) if chat else ref.generate(PROMPTS[1], sp))[0]
    kw = dict(model="smollm2", max_tokens=N, temperature=0.8, seed=seed, n=n, stream=stream)
    if stream:
        kw["stream_options"] = {"include_usage": True}
    got = (oai.chat.completions.create(messages=QUESTION, **kw) if chat
           else oai.completions.create(prompt=PROMPTS[1], **kw))
    texts, finishes, usage = _choices(got, chat, stream, n)
    assert texts == {c.index: c.text for c in want.outputs}
    assert len(set(texts.values())) > 1, "the choices should be different samples"
    assert finishes == {c.index: c.finish_reason for c in want.outputs}
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_n_greedy_choices_are_one_answer(oai, ref):
    want = ref.generate(PROMPTS[0], _greedy())[0]
    got = oai.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=N,
                                 temperature=0, n=4, logprobs=1)
    assert [c.text for c in got.choices] == [want.text] * 4
    assert all(len(c.logprobs.tokens) == len(want.token_ids) for c in got.choices)
    # null is OpenAI's default: one choice
    got = httpx.post(f"{oai.base_url}completions", json={
        "model": "smollm2", "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0,
        "n": None}, timeout=60).json()
    assert [c["text"] for c in got["choices"]] == [want.text]


def test_seeded_sampling_is_reproducible(oai):
    def run():
        return oai.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=N,
                                      temperature=0.9, seed=1234).choices[0].text
    assert run() == run()


# ---------------------------------------------------------------------- other routes


def test_models_health_metrics(oai, server):
    url, _ = server
    assert [m.id for m in oai.models.list().data] == ["smollm2"]
    assert httpx.get(f"{url}/health").status_code == 200
    oai.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=2)
    text = httpx.get(f"{url}/metrics").text
    for name in ("pagedattn_time_to_first_token_seconds_bucket",
                 "pagedattn_inter_token_latency_seconds_bucket",
                 "pagedattn_e2e_request_latency_seconds_count", "pagedattn_num_requests_running",
                 "pagedattn_num_requests_waiting", "pagedattn_kv_cache_blocks_used",
                 "pagedattn_kv_cache_blocks_total", "pagedattn_prefix_cache_hit_rate",
                 "pagedattn_num_preemptions_total", 'finish_reason="length"',
                 "pagedattn_steps_on_fewer_threads_total"):
        assert name in text, name
    # a request ran, so the latest step's thread count is set
    threads = re.search(r'^pagedattn_step_threads\{model_name="smollm2"\} (\S+)$', text, re.M)
    assert threads is not None and float(threads.group(1)) >= 1


# ---------------------------------------------------------------------- bad input


def _post(url: str, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


BAD = [
    ("malformed json", "/v1/completions", '{"model": "smollm2", "prompt": ', 400, "not valid JSON"),
    ("temperature", "/v1/completions", dict(prompt="hi", temperature=-1), 400, "-1"),
    ("top_p", "/v1/chat/completions", dict(messages=QUESTION, top_p=1.5), 400, "1.5"),
    ("max_tokens", "/v1/completions", dict(prompt="hi", max_tokens=0), 400, "max_tokens"),
    ("unknown field", "/v1/completions", dict(prompt="hi", best_of_all=3), 400, "best_of_all"),
    ("unknown model", "/v1/completions", dict(prompt="hi", model="gpt-9"), 404, "gpt-9"),
    ("token id", "/v1/completions", dict(prompt=[1, 10**9]), 400, str(10**9)),
    ("too long", "/v1/completions", dict(prompt=[1] * 9000), 400, "9000 tokens"),
    ("top_logprobs", "/v1/chat/completions", dict(messages=QUESTION, top_logprobs=2), 400,
     "top_logprobs"),
    ("min_tokens", "/v1/completions", dict(prompt="hi", max_tokens=2, min_tokens=5), 400,
     "min_tokens"),
    ("role", "/v1/chat/completions", dict(messages=[{"role": "robot", "content": "x"}]), 400,
     "robot"),
    ("embeddings on a decoder", "/v1/embeddings", dict(input="hi"), 400, "encoder"),
]


@pytest.mark.parametrize("name, path, body, status, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_naming_it(server, name, path, body, status, needle):
    url, app = server
    if isinstance(body, dict):
        body = {"model": "smollm2", **body}
    r = _post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err
    assert wait_idle(app) == (0, 0, 0)


@pytest.mark.parametrize("n, needle", [
    (0, "got 0"), (-2, "got -2"), (17, "[1, 16]"), (10**30, "got 1000"), (1.5, "got 1.5"),
    (2.0, "got 2.0"), (True, "got True"), ("2", "got '2'"), ([2], "got [2]"),
])
@pytest.mark.parametrize("path, body", [("/v1/completions", dict(prompt="hi")),
                                        ("/v1/chat/completions", dict(messages=QUESTION))],
                         ids=["completions", "chat"])
def test_bad_n_is_a_400_naming_n(server, path, body, n, needle):
    url, app = server
    r = _post(url, path, {"model": "smollm2", "max_tokens": 2, **body, "n": n})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["message"].startswith("n") and needle in err["message"]
    assert wait_idle(app) == (0, 0, 0)


def test_openai_client_raises_on_bad_input(oai):
    with pytest.raises(openai_module().BadRequestError, match="temperature"):
        oai.completions.create(model="smollm2", prompt="hi", temperature=5)
    with pytest.raises(openai_module().NotFoundError, match="nope"):
        oai.completions.create(model="nope", prompt="hi")


def openai_module():
    import openai

    return openai


def test_chat_without_template_says_why(server, oai):
    tok = server[1].state.serve.llm.tokenizer
    saved = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(openai_module().BadRequestError, match="no chat template"):
            oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2)
    finally:
        tok.chat_template = saved


# ---------------------------------------------------------------------- faults


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_mid_stream_aborts_and_frees_blocks(server, oai, n):
    _, app = server
    stream = oai.completions.create(model="smollm2", prompt=PROMPTS[2], max_tokens=2000, n=n,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    engine = app.state.serve.llm.engine
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_blocks
    stream.close()
    assert wait_idle(app) == (0, 0, 0)
    assert 'finish_reason="abort"' in httpx.get(f"{server[0]}/metrics").text


@pytest.mark.parametrize("n", [1, 3])
def test_exception_in_one_request_fails_it_alone(server, oai, ref, monkeypatch, n):
    """A fault injected into the engine thread's per-request processing (seed 4242)
    fails that request, all its ``n`` choices, with a 500 while a concurrent one
    completes."""
    loop = server[1].state.serve.loop
    original = loop._process

    def faulty(progress, tracked, now):
        if tracked.params.seed == 4242 and progress.num_output_tokens >= 2:
            raise RuntimeError("injected fault")
        return original(progress, tracked, now)

    monkeypatch.setattr(loop, "_process", faulty)
    want = ref.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24))[0]
    results = {}

    def good():
        results["good"] = oai.completions.create(model="smollm2", prompt=PROMPTS[0],
                                                 max_tokens=24, temperature=0)

    t = threading.Thread(target=good)
    t.start()
    with pytest.raises(openai_module().InternalServerError, match="injected fault"):
        oai.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=24, seed=4242,
                               temperature=0, n=n)
    t.join(60)
    assert results["good"].choices[0].text == want.text
    stream = oai.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=24,
                                    seed=4242, stream=True, n=n)
    chunks = []
    with pytest.raises(openai_module().APIError, match="injected fault"):
        for c in stream:
            chunks.append(c)
    assert wait_idle(server[1]) == (0, 0, 0)
    monkeypatch.undo()
    assert oai.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=24,
                                  temperature=0).choices[0].text == want.text


def test_expected_text_helper(ref):
    out = ref.generate(PROMPTS[0], _greedy())[0]
    text, reason = expected_text(ref.tokenizer, out.token_ids, ref.engine.eos_token_id, N)
    assert (text, reason) == (out.text, out.finish_reason)
