"""Server limits and lifecycle: API key, full queue, `n` up to --max-n, embeddings on an
encoder, SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading
import time

import httpx
import pytest

from serve_helpers import client, serve_in_thread, serve_process, wait_idle

from pagedattn import LLM

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def limited():
    """One sequence runs at a time, one request may wait, the rest get 503; n is at most
    2; /v1 needs KEY."""
    llm = LLM(model="smollm2", max_num_seqs=1)
    with serve_in_thread(llm, api_key=KEY, max_queued_requests=1, max_n=2) as (url, app):
        yield url, app


def test_api_key_required_on_v1_routes(limited):
    import openai

    url, _ = limited
    with pytest.raises(openai.AuthenticationError, match="API key"):
        client(url, api_key="wrong").models.list()
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": "hi"},
                       headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client(url, api_key=KEY).models.list().data[0].id == "smollm2"
    assert httpx.get(f"{url}/health").status_code == 200  # open: probes carry no key


def test_full_queue_answers_503_with_retry_after(limited):
    url, app = limited
    oai = client(url, api_key=KEY)
    running = oai.completions.create(model="smollm2", prompt="Count:", max_tokens=400,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(running))  # it holds the only running slot now
    queued = {}

    def wait_in_queue():
        queued["r"] = httpx.post(f"{url}/v1/completions", timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"},
                                 json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})

    t = threading.Thread(target=wait_in_queue)
    t.start()
    loop = app.state.serve.loop
    deadline = time.monotonic() + 10
    while loop.num_queued < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "1"
    assert "--max-queued-requests=1" in r.json()["error"]["message"]
    running.close()  # frees the slot: the queued request runs and completes
    t.join(60)
    assert queued["r"].status_code == 200
    assert wait_idle(app) == (0, 0, 0)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The capital of France is"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
], ids=["completions", "chat"])
def test_n_above_max_n_is_a_400_and_n_up_to_it_runs(limited, path, body):
    """--max-n 2: n=3 is refused naming the limit; n=2 answers two choices, one after the
    other (one running sequence at a time: the second computes its prompt once the first
    has finished)."""
    url, app = limited
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "smollm2", "max_tokens": 4, "temperature": 0, **body}
    r = httpx.post(f"{url}{path}", headers=headers, json={**body, "n": 3}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "--max-n" in err["message"] and "got 3" in err["message"]
    r = httpx.post(f"{url}{path}", headers=headers, json={**body, "n": 2}, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    texts = [c.get("text") or c["message"]["content"] for c in choices]
    assert texts[0] == texts[1]  # greedy
    assert r.json()["usage"]["completion_tokens"] == 8
    assert wait_idle(app) == (0, 0, 0)


def test_serve_refuses_a_max_n_below_1():
    from pagedattn.serve.cli import _check, add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args([]).max_n == 16
    with pytest.raises(ValueError, match="--max-n must be >= 1, got 0"):
        _check(p.parse_args(["--max-n", "0"]))


def test_embeddings_on_an_encoder():
    import openai

    llm = LLM(model="minilm", dtype="float32")
    want = llm.embed(["a cat sat on the mat", "stock markets fell"])
    with serve_in_thread(llm) as (url, _):
        oai = client(url)
        got = oai.embeddings.create(model="minilm", input=["a cat sat on the mat",
                                                           "stock markets fell"])
        assert len(got.data) == 2 and got.usage.prompt_tokens > 0
        for row, ref in zip(got.data, want):
            assert row.embedding == pytest.approx(ref.tolist(), abs=1e-6)
        floats = oai.embeddings.create(model="minilm", input="a cat sat on the mat",
                                       encoding_format="float")
        assert floats.data[0].embedding == pytest.approx(want[0].tolist(), abs=1e-6)
        with pytest.raises(openai.BadRequestError, match="decoder model"):
            oai.completions.create(model="minilm", prompt="hi")


# Slow tier: ~20 s (its grace period); the fast tier's SIGTERM check is
# test_serve_adversarial's (every stream ends with a final event).
@pytest.mark.slow
def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0():
    # 8 s: the short request's 11 remaining tokens must fit in the grace period on a
    # machine whose cores other jobs share (4 s was missed there)
    with serve_process("--model", "smollm2", "--shutdown-timeout", "8") as (url, proc):
        oai = client(url)
        results = {}
        streaming = {"short": threading.Event(), "long": threading.Event()}

        def run(name, max_tokens):
            text, finish = "", None
            try:
                for c in oai.completions.create(model="smollm2", prompt="Count to ten:",
                                                max_tokens=max_tokens, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}):
                    streaming[name].set()
                    text += c.choices[0].text
                    finish = c.choices[0].finish_reason or finish
            except Exception as exc:  # noqa: BLE001 - the long one is cut off
                finish = f"cut: {type(exc).__name__}"
            results[name] = finish

        threads = [threading.Thread(target=run, args=("short", 12)),
                   threading.Thread(target=run, args=("long", 5000))]
        for t in threads:
            t.start()
        # Both are running (a fixed sleep was too short on a loaded machine).
        assert all(e.wait(60) for e in streaming.values())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no new connections once shutting down
            httpx.get(f"{url}/health", timeout=2)
        assert proc.wait(timeout=30) == 0
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert results["short"] == "length"
        assert results["long"] == "abort"  # ended by the server, with its finish reason
        assert elapsed < 8 + 10, elapsed
        out = proc.stdout.read()
        assert "pagedattn serve: http://127.0.0.1:" in out and "KV cache" in out
        assert "prompt +" in out  # the per-request log line
