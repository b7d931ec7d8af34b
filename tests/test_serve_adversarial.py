"""``pagedattn serve`` against hostile and careless clients (issue 34).

Every case is bounded in requests and time, talks to 127.0.0.1 only, and afterwards
checks that the server is whole: ``/health`` answers, a greedy completion equals the
baseline taken when the server started, and the ``/metrics`` gauges show nothing
running, nothing waiting and no KV block held.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from serve_helpers import BATCH_INVARIANT, serve_in_thread, serve_process, wait_idle

from pagedattn import LLM
from pagedattn.engine import sampler
from pagedattn.serve.body import MAX_JSON_DEPTH

BASE_PROMPT = "The capital of France is"
MATE_PROMPT = "Once upon a time,"
MATE_TOKENS = 48
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FAULT_SEED = 4242


def _greedy(url: str) -> tuple[str, str]:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": BASE_PROMPT, "max_tokens": 8,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["finish_reason"]


def _mate_body() -> dict:
    return {"model": "smollm2", "prompt": MATE_PROMPT, "max_tokens": MATE_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}


def _read_stream(lines) -> tuple[str, list[str], list[dict]]:
    """``(text, finish reasons, error events)`` of an SSE stream's remaining lines."""
    text, finishes, errors = "", [], []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(event["error"])
            continue
        for ch in event["choices"]:
            text += ch.get("text") or ch.get("delta", {}).get("content") or ""
            if ch["finish_reason"] is not None:
                finishes.append(ch["finish_reason"])
    return text, finishes, errors


class Server:
    def __init__(self, url: str, app) -> None:
        self.url = url
        self.app = app
        self.baseline = _greedy(url)
        with httpx.stream("POST", f"{url}/v1/completions", json=_mate_body(), timeout=120) as r:
            self.mate_alone = _read_stream(r.iter_lines())
        assert self.mate_alone[1] == ["length"]

    def post(self, path: str, body, headers=None, timeout: float = 60) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, timeout=timeout,
                          headers={"Content-Type": "application/json", **(headers or {})})

    def gauges(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"):
            m = re.search(rf"^pagedattn_{name}\{{[^}}]*\}} (\S+)$", text, re.M)
            out[name] = float(m.group(1))
        return out

    def wait_gauges_idle(self, timeout: float = 5.0) -> dict[str, float]:
        """The gauges once they show an idle engine (or at the deadline)."""
        deadline = time.monotonic() + timeout
        while True:
            g = self.gauges()
            if not any(g.values()) or time.monotonic() > deadline:
                return g
            time.sleep(0.05)

    def check_whole(self) -> None:
        """The server after a case: healthy, same greedy answer, gauges at rest."""
        t0 = time.perf_counter()
        assert httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        assert time.perf_counter() - t0 < 1.0
        assert _greedy(self.url) == self.baseline
        assert wait_idle(self.app) == (0, 0, 0)
        assert self.wait_gauges_idle() == {"num_requests_running": 0.0,
                                           "num_requests_waiting": 0.0,
                                           "kv_cache_blocks_used": 0.0}

    def with_batch_mate(self, fn):
        """``fn()`` while a greedy stream runs next to it; ``(fn's result, the mate's
        (text, finishes, errors))``. The mate is running before ``fn`` starts and runs
        on after it, so every step of ``fn``'s request also steps the mate."""
        with httpx.stream("POST", f"{self.url}/v1/completions", json=_mate_body(),
                          timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = []
            for line in lines:
                first.append(line)
                if line.startswith("data: "):
                    break
            result = fn()
            mate = _read_stream(first + list(lines))
        return result, mate


@pytest.fixture(scope="module")
def server():
    with serve_in_thread(LLM(model="smollm2", **BATCH_INVARIANT)) as (url, app):
        yield Server(url, app)


def _error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"], err
    return err


# ---------------------------------------------------------------------- 1. isolation


@pytest.mark.parametrize("extra", [
    dict(temperature=1e-300),
    dict(temperature=0.5, top_p=1e-300),
    dict(temperature=5e-3, top_p=1e-7, top_k=3),
], ids=["temperature", "top_p", "both"])
def test_tiny_sampling_values_are_clamped_and_harm_nobody(server, extra):
    body = {"model": "smollm2", "prompt": BASE_PROMPT, "max_tokens": 8, "seed": 7, **extra}
    r, mate = server.with_batch_mate(lambda: server.post("/v1/completions", body))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert mate == server.mate_alone
    server.check_whole()


@pytest.mark.parametrize("value", [1e-300, 0.0, 1e-3])
def test_repetition_penalty_below_the_floor_is_a_400(server, value):
    r = server.post("/v1/completions", {"model": "smollm2", "prompt": BASE_PROMPT,
                                        "repetition_penalty": value})
    _error(r, 400, "repetition_penalty")
    server.check_whole()


def _fault_on_seed(original):
    def faulty(row, req, gen, **kwargs):
        if req.sampling_params.seed == FAULT_SEED and len(req.output_token_ids) >= 2:
            raise RuntimeError("injected sampling fault")
        return original(row, req, gen, **kwargs)
    return faulty


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_a_sampling_failure_fails_its_request_alone(server, monkeypatch, stream, n):
    """Every choice of the faulty request fails in the same step (n=3: three failures
    of one request): it gets one error, its batch-mate nothing."""
    monkeypatch.setattr(sampler, "_pick", _fault_on_seed(sampler._pick))
    body = {"model": "smollm2", "prompt": BASE_PROMPT, "max_tokens": 16, "temperature": 0.7,
            "seed": FAULT_SEED, "stream": stream, "n": n}

    def bad():
        if not stream:
            return server.post("/v1/completions", body)
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            return r.status_code, list(r.iter_lines())

    r, mate = server.with_batch_mate(bad)
    assert mate == server.mate_alone
    if stream:
        status, lines = r
        assert status == 200
        _, finishes, errors = _read_stream(lines)
        assert finishes == [] and len(errors) == 1
        assert "injected sampling fault" in errors[0]["message"]
        assert errors[0]["type"] == "server_error"
        assert [x for x in lines if x][-1] == "data: [DONE]"
    else:
        err = _error(r, 500, "injected sampling fault")
        assert err["type"] == "server_error"
    monkeypatch.undo()
    server.check_whole()


def test_a_stop_string_failure_fails_its_request_alone(server, monkeypatch):
    engine = server.app.state.serve.llm.engine
    original = engine._hit_stop

    def faulty(req):
        if req.sampling_params.seed == FAULT_SEED:
            raise RuntimeError("injected stop-string fault")
        return original(req)

    monkeypatch.setattr(engine, "_hit_stop", faulty)
    body = {"model": "smollm2", "prompt": BASE_PROMPT, "max_tokens": 16, "temperature": 0,
            "seed": FAULT_SEED, "stop": ["zzz"]}
    r, mate = server.with_batch_mate(lambda: server.post("/v1/completions", body))
    _error(r, 500, "injected stop-string fault")
    assert mate == server.mate_alone
    monkeypatch.undo()
    server.check_whole()


def _raw_request(url: str, head: str, body_chunks, result: dict) -> None:
    """Send a request over a plain socket (the body in pieces, the server may answer and
    close before it is all sent); ``result["status"]``: the status line's code."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode())
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
        except OSError:  # answered and closed early: what a refusal should do
            pass
        data = b""
        try:
            while b"\r\n" not in data:
                part = s.recv(65536)
                if not part:
                    break
                data += part
        except OSError:
            pass
        result["status"] = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else None
        result["done"] = time.monotonic()


def _health_latencies(url: str, until: threading.Thread, minimum: int = 5) -> list[float]:
    times = []
    with httpx.Client(timeout=10) as c:
        while until.is_alive() or len(times) < minimum:
            t0 = time.perf_counter()
            assert c.get(f"{url}/health").status_code == 200
            times.append(time.perf_counter() - t0)
            time.sleep(0.01)
    return times


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_20mb_body_is_refused_with_413_while_health_answers(server, chunked):
    size = 20 * 2**20
    piece = b'{"model": "smollm2", "prompt": "' + b"a" * (2**20 - 40)
    if chunked:
        head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n")
        chunks = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n" for _ in range(20))
    else:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {size}\r\n\r\n")
        chunks = (piece for _ in range(20))
    result: dict = {}
    t = threading.Thread(target=_raw_request, args=(server.url, head, chunks, result))
    t0 = time.monotonic()
    t.start()
    latencies = _health_latencies(server.url, t)
    t.join(60)
    assert result["status"] == 413
    assert result["done"] - t0 < 10
    assert max(latencies) < 0.1, latencies
    server.check_whole()


def test_413_body_names_the_limit(server):
    r = server.post("/v1/completions", {"model": "smollm2", "prompt": "a" * (9 * 2**20)})
    err = _error(r, 413, "--max-request-bytes", str(8 * 2**20))
    assert err["code"] == "request_too_large"
    server.check_whole()


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """A 1 MB prompt fits under the body limit and takes the tokenizer about a second;
    meanwhile /health answers at once, and the prompt gets its 400 for the context."""
    result = {}

    def send():
        result["r"] = server.post("/v1/completions",
                                  {"model": "smollm2", "prompt": "hello world " * 90_000})

    t = threading.Thread(target=send)
    t.start()
    latencies = _health_latencies(server.url, t)
    t.join(60)
    assert _error(result["r"], 400, "tokens", "context")["code"] == "context_length_exceeded"
    assert sorted(latencies)[len(latencies) // 2] < 0.1, latencies
    assert max(latencies) < 0.5, latencies
    server.check_whole()


def test_a_text_too_long_for_any_tokenization_is_refused_untokenized(server):
    t0 = time.perf_counter()
    r = server.post("/v1/completions", {"model": "smollm2", "prompt": "x" * (7 * 2**20)})
    assert _error(r, 400, "characters", "context")["code"] == "context_length_exceeded"
    assert time.perf_counter() - t0 < 2.0
    server.check_whole()


# ---------------------------------------------------------------------- 2. client errors

C, CHAT = "/v1/completions", "/v1/chat/completions"
SURROGATE = '"\\ud800"'  # JSON's escape for a lone surrogate, as a client sends it

CLIENT_ERRORS = [
    # lone surrogates, in every place text goes
    ("surrogate prompt", C, f'{{"model": "smollm2", "prompt": {SURROGATE}}}', 400, "surrogate"),
    ("surrogate chat", CHAT, f'{{"model": "smollm2", "messages": [{{"role": "user", '
                             f'"content": {SURROGATE}}}]}}', 400, "surrogate"),
    ("surrogate stop", C, f'{{"model": "smollm2", "prompt": "hi", "stop": [{SURROGATE}]}}',
     400, "surrogate"),
    ("surrogate key", C, f'{{"model": "smollm2", "prompt": "hi", {SURROGATE}: 1}}', 400,
     "surrogate"),
    ("surrogate model", C, f'{{"model": {SURROGATE}, "prompt": "hi"}}', 400, "surrogate"),
    ("invalid utf-8", C, b'{"model": "smollm2", "prompt": "caf\xe9"}', 400, "UTF-8"),
    # out-of-vocabulary ids, prompt and stop_token_ids
    ("id -1", C, dict(prompt=[1, -1]), 400, "-1"),
    ("id 10**9", C, dict(prompt=[10**9]), 400, str(10**9)),
    ("id 2**70", C, dict(prompt=[2**70]), 400, str(2**70)),
    ("stop id", C, dict(prompt="hi", stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("stop id -1", CHAT, dict(messages=QUESTION, stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop id chat", CHAT, dict(messages=QUESTION, stop_token_ids=[2**70]), 400, str(2**70)),
    # max_tokens beyond the context
    ("max_tokens 10**12", C, dict(prompt="hi", max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens 2**63", CHAT, dict(messages=QUESTION, max_tokens=2**63), 400, "do not fit"),
    ("max_completion_tokens", CHAT, dict(messages=QUESTION, max_completion_tokens=8192), 400,
     "8192"),
    # booleans where numbers go
    ("max_tokens true", C, dict(prompt="hi", max_tokens=True), 400, "max_tokens"),
    ("temperature true", C, dict(prompt="hi", temperature=True), 400, "temperature"),
    ("seed false", CHAT, dict(messages=QUESTION, seed=False), 400, "seed"),
    ("top_k true", C, dict(prompt="hi", top_k=True), 400, "top_k"),
    ("logprobs true", C, dict(prompt="hi", logprobs=True), 400, "logprobs"),
    ("prompt id true", C, dict(prompt=[1, True]), 400, "True"),
    ("stop id true", C, dict(prompt="hi", stop_token_ids=[True]), 400, "stop_token_ids"),
    ("stream 1", C, dict(prompt="hi", stream=1), 400, "stream"),
    ("max_tokens '5'", C, dict(prompt="hi", max_tokens="5"), 400, "max_tokens"),
    ("n true", C, dict(prompt="hi", n=True), 400, "n: "),
    ("n 0", CHAT, dict(messages=QUESTION, n=0), 400, "n must be an int in [1, 16]"),
    ("n 10**6", C, dict(prompt="hi", n=10**6), 400, "(this server's --max-n), got 1000000"),
    # what JSON is not
    ("NaN", C, '{"model": "smollm2", "prompt": "hi", "temperature": NaN}', 400, "NaN"),
    ("Infinity", C, '{"model": "smollm2", "prompt": "hi", "repetition_penalty": Infinity}',
     400, "Infinity"),
    ("5000 digits", C, '{"model": "smollm2", "prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}",
     400, "not valid JSON"),
    ("empty body", C, b"", 400, "empty"),
    ("array body", C, "[1, 2]", 400, "JSON object"),
    ("deep", C, '{"model": "smollm2", "prompt": "hi", "stop": ' + "[" * (MAX_JSON_DEPTH + 5)
     + "]" * (MAX_JSON_DEPTH + 5) + "}", 400, "nests"),
    ("very deep", C, '{"model": "smollm2", "prompt": "hi", "stop": ' + "[" * 200_000
     + "]" * 200_000 + "}", 400, "nests"),
    ("prompt list of lists", C, dict(prompt=[[1, 2]]), 400, "prompt"),
    ("empty prompt ids", C, dict(prompt=[]), 400, "empty"),
    ("content part", CHAT, dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, "text content"),
]


@pytest.mark.parametrize("name, path, body, status, needle", CLIENT_ERRORS,
                         ids=[c[0] for c in CLIENT_ERRORS])
def test_client_errors_are_4xx_naming_them(server, name, path, body, status, needle):
    if isinstance(body, dict):
        body = {"model": "smollm2", **body}
    _error(server.post(path, body), status, needle)
    server.check_whole()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_wrong_content_type_is_a_415(server, content_type):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   content=json.dumps({"model": "smollm2", "prompt": "hi", "max_tokens": 1}),
                   headers={"Content-Type": content_type})
    err = _error(r, 415, "Content-Type", "application/json", content_type.split(";")[0])
    assert err["code"] == "unsupported_media_type"
    server.check_whole()


def test_json_content_types_and_none_are_read(server):
    body = json.dumps({"model": "smollm2", "prompt": BASE_PROMPT, "max_tokens": 8,
                       "temperature": 0})
    for headers in ({"Content-Type": "application/json; charset=utf-8"}, {}):
        r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=30,
                       headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == server.baseline[0]
    server.check_whole()


def test_valid_surrogate_pairs_are_text(server):
    r = server.post(C, '{"model": "smollm2", "prompt": "I like \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    server.check_whole()


@pytest.mark.parametrize("path, body", [
    (C, {"prompt": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                   "<|im_start|>assistant\n", "max_tokens": None}),
    (CHAT, {"messages": QUESTION, "max_tokens": None}),
    (CHAT, {"messages": QUESTION, "max_completion_tokens": None}),
])
def test_null_max_tokens_means_up_to_the_context(server, path, body):
    r = server.post(path, {"model": "smollm2", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "stop"  # the model's EOS, well before the end
    assert "Paris" in (out["choices"][0].get("text") or out["choices"][0]["message"]["content"])
    server.check_whole()


def test_max_tokens_that_just_fits_is_accepted(server):
    engine = server.app.state.serve.llm.engine
    ids = [1] * (engine.max_model_len - 3)
    r = server.post(C, {"model": "smollm2", "prompt": ids[:8], "max_tokens": 3,
                        "temperature": 0})
    assert r.status_code == 200
    _error(server.post(C, {"model": "smollm2", "prompt": ids, "max_tokens": 4}), 400,
           "leaving 3")
    server.check_whole()


def test_the_api_key_is_checked_before_the_body(server, monkeypatch):
    monkeypatch.setattr(server.app.state.serve, "api_key", "k3y")
    for body in ('{"model": "smollm2", "prompt": ', '{"model": "smollm2", "prompt": [true]}'):
        err = _error(server.post(C, body), 401, "API key")
        assert err["code"] == "invalid_api_key"
    # A body announced as larger than the limit is never read without the key either.
    result: dict = {}
    _raw_request(server.url, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             f"application/json\r\nContent-Length: {50 * 2**20}\r\n\r\n",
                 iter(()), result)
    assert result["status"] == 401
    assert server.post(C, {"model": "smollm2", "prompt": "hi", "max_tokens": 1},
                       headers={"Authorization": "Bearer k3y"}).status_code == 200
    monkeypatch.undo()
    server.check_whole()


@pytest.fixture(scope="module")
def encoder():
    with serve_in_thread(LLM(model="minilm", dtype="float32")) as (url, app):
        yield url


EMBEDDING_ERRORS = [
    ("surrogate", f'{{"model": "minilm", "input": {SURROGATE}}}', "surrogate"),
    ("surrogate in list", f'{{"model": "minilm", "input": ["ok", {SURROGATE}]}}', "surrogate"),
    ("invalid utf-8", b'{"model": "minilm", "input": "caf\xe9"}', "UTF-8"),
    ("id -1", dict(input=[101, -1]), "-1"),
    ("id 10**9", dict(input=[10**9]), str(10**9)),
    ("id 2**70", dict(input=[[101, 2**70]]), str(2**70)),
    ("id true", dict(input=[101, True]), "True"),
    ("empty", dict(input=[]), "empty"),
]


@pytest.mark.parametrize("name, body, needle", EMBEDDING_ERRORS,
                         ids=[c[0] for c in EMBEDDING_ERRORS])
def test_embedding_errors_are_400s_naming_them(encoder, name, body, needle):
    if isinstance(body, dict):
        body = json.dumps({"model": "minilm", **body})
    r = httpx.post(f"{encoder}/v1/embeddings", content=body, timeout=30,
                   headers={"Content-Type": "application/json"})
    _error(r, 400, needle)
    assert httpx.get(f"{encoder}/health").status_code == 200
    ok = httpx.post(f"{encoder}/v1/embeddings", json={"model": "minilm", "input": "a cat"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


# ---------------------------------------------------------------------- 3. state and shutdown


def test_gauges_follow_an_abort_with_nothing_else_running(server):
    body = {"model": "smollm2", "prompt": BASE_PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped iterator would close the connection now
        n = 0
        for line in lines:
            n += line.startswith("data: ")
            if n >= 3:
                break
        assert server.gauges()["num_requests_running"] == 1.0
    # the client is gone: no step runs after the abort, yet the gauges follow it
    assert server.wait_gauges_idle(timeout=3.0) == {"num_requests_running": 0.0,
                                                    "num_requests_waiting": 0.0,
                                                    "kv_cache_blocks_used": 0.0}
    server.check_whole()


def _abort_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(r'^pagedattn_request_total\{finish_reason="abort"[^}]*\} (\S+)$', text, re.M) \
        or re.search(r'^pagedattn_request_total\{[^}]*finish_reason="abort"[^}]*\} (\S+)$',
                     text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_gone_non_streaming_client_is_aborted_within_a_step(server):
    engine = server.app.state.serve.llm.engine
    aborted = _abort_count(server.url)
    body = json.dumps({"model": "smollm2", "prompt": BASE_PROMPT, "max_tokens": 4000,
                       "ignore_eos": True, "temperature": 0}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while not engine.running_request_ids():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # a few decode steps
    s.close()
    t0 = time.monotonic()
    assert wait_idle(server.app, timeout=5) == (0, 0, 0)
    assert time.monotonic() - t0 < 2.0  # 4000 tokens would take a minute
    assert _abort_count(server.url) == aborted + 1
    server.check_whole()


def test_sigterm_ends_every_stream_with_a_final_event_then_done():
    with serve_process("--model", "smollm2", "--shutdown-timeout", "3") as (url, proc):
        started = [threading.Event() for _ in range(4)]
        lines: list[list[str]] = [[] for _ in range(4)]

        def run(i: int) -> None:
            chat = i % 2 == 1
            body = {"model": "smollm2", "max_tokens": 5000, "ignore_eos": True,
                    "temperature": 0, "stream": True,
                    **({"messages": QUESTION} if chat else {"prompt": BASE_PROMPT})}
            try:
                with httpx.stream("POST", f"{url}{CHAT if chat else C}", json=body,
                                  timeout=60) as r:
                    for line in r.iter_lines():
                        lines[i].append(line)
                        if '"choices"' in line:
                            started[i].set()
            except httpx.HTTPError as exc:
                lines[i].append(f"cut: {type(exc).__name__}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=30) == 0
        for i, got in enumerate(lines):
            data = [x for x in got if x.startswith("data: ") or x.startswith("cut:")]
            assert data[-1] == "data: [DONE]", (i, data[-3:])
            last = json.loads(data[-2][6:])
            final = last["error"] if "error" in last else last["choices"][0]["finish_reason"]
            assert final == "abort" or "message" in final, (i, last)
