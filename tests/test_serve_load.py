"""Load and faults at once: many concurrent openai clients, streaming and not, chat and
completions, random max_tokens, one in five with n=2; some disconnect mid-stream, some
send invalid requests. Every valid answer (each of its choices) equals the offline
greedy one, every invalid one gets its 4xx, none
gets a 5xx, and the engine ends empty (no KV block held, nothing waiting).

Bounded in count and time; the server listens on 127.0.0.1 only. The fast version runs
in the default tier; the full one is marked ``slow``."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from serve_helpers import BATCH_INVARIANT, async_client, expected_text, serve_in_thread, wait_idle

from pagedattn import LLM, SamplingParams
from pagedattn.serve.cli import SERVE_ENGINE_DEFAULTS

openai = pytest.importorskip("openai")

MAX_TOKENS = 16
TEXTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):",
         "The three primary colours are", "In 1969, the first", "My favourite recipe is",
         "The quick brown fox", "Water boils at"]
QUESTIONS = ["What is the capital of France?", "Name three fruits.", "What is 2 + 2?",
             "Write a haiku about rain.", "Who wrote Hamlet?", "Why is the sky blue?"]
INVALID = [  # (kwargs for create, exception class name, text the message must contain)
    (dict(temperature=-1), "BadRequestError", "-1"),
    (dict(n=0), "BadRequestError", "got 0"),
    (dict(model="no-such-model"), "NotFoundError", "no-such-model"),
    (dict(extra_body={"frobnicate": True}), "BadRequestError", "frobnicate"),
    (dict(top_p=7.5), "BadRequestError", "7.5"),
]


@pytest.fixture(scope="module")
def setup():
    ref = LLM(model="smollm2", **BATCH_INVARIANT)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    refs = {("text", t): o.token_ids for t, o in zip(TEXTS, ref.generate(TEXTS, sp))}
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    refs.update({("chat", q): o.token_ids for q, o in zip(QUESTIONS, ref.chat(convs, sp))})
    with serve_in_thread(LLM(model="smollm2", **BATCH_INVARIANT, **SERVE_ENGINE_DEFAULTS)) \
            as (url, app):
        yield url, app, ref, refs


async def _one(oai, rng: random.Random, ref, refs, tally: Counter, failures: list) -> None:
    roll = rng.random()
    chat = rng.random() < 0.5
    prompt = rng.choice(QUESTIONS if chat else TEXTS)
    max_tokens = rng.randint(1, MAX_TOKENS)
    stream = rng.random() < 0.5
    kw = dict(model="smollm2", max_tokens=max_tokens, temperature=0)
    if chat:
        create, kw["messages"] = oai.chat.completions.create, [{"role": "user", "content": prompt}]
    else:
        create, kw["prompt"] = oai.completions.create, prompt
    if roll < 0.05:
        bad, exc_name, needle = rng.choice(INVALID)
        try:
            await create(**{**kw, **bad})
            failures.append(f"invalid {bad} was accepted")
        except openai.APIStatusError as exc:
            if type(exc).__name__ != exc_name or needle not in str(exc):
                failures.append(f"invalid {bad}: got {exc.status_code} {exc}")
        tally["invalid"] += 1
        return
    if roll < 0.15:  # disconnect mid-stream
        resp = await create(**{**kw, "max_tokens": 200, "stream": True,
                               "extra_body": {"ignore_eos": True}})
        n = 0
        async for _chunk in resp:
            n += 1
            if n >= rng.randint(1, 3):
                break
        await resp.close()
        tally["disconnected"] += 1
        return
    want, want_finish = expected_text(ref.tokenizer, refs[("chat" if chat else "text", prompt)],
                                      ref.engine.eos_token_id, max_tokens)
    n = 2 if rng.random() < 0.2 else 1
    texts, finishes = [""] * n, [None] * n
    if stream:
        async for c in await create(**kw, n=n, stream=True):
            for ch in c.choices:
                texts[ch.index] += (ch.delta.content or "") if chat else ch.text
                finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    else:
        r = await create(**kw, n=n)
        for ch in r.choices:
            texts[ch.index] = ch.message.content if chat else ch.text
            finishes[ch.index] = ch.finish_reason
    for text, finish in zip(texts, finishes):
        if (text, finish) != (want, want_finish):
            failures.append(f"{prompt!r} max_tokens={max_tokens} stream={stream} n={n}: "
                            f"{(text, finish)!r} != {(want, want_finish)!r}")
    tally["streamed" if stream else "whole"] += 1


async def _load(url, ref, refs, requests: int, clients: int, seed: int):
    tally, failures = Counter(), []
    todo = iter(range(requests))

    async def client_loop(i: int):
        oai = async_client(url)
        rng = random.Random(seed * 1000 + i)
        try:
            for _ in todo:  # the clients share one counter: exactly `requests` in all
                try:
                    await _one(oai, rng, ref, refs, tally, failures)
                except openai.APIStatusError as exc:
                    tally[f"http {exc.status_code}"] += 1
                    failures.append(f"unexpected {exc.status_code}: {exc}")
        finally:
            await oai.close()

    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return tally, failures


def _run_load(setup, requests: int, clients: int, seed: int, limit_s: float) -> None:
    url, app, ref, refs = setup
    t0 = time.perf_counter()
    tally, failures = asyncio.run(asyncio.wait_for(_load(url, ref, refs, requests, clients, seed),
                                                   limit_s))
    elapsed = time.perf_counter() - t0
    idle = wait_idle(app)
    print(f"\nserve load: {requests} requests from {clients} clients in {elapsed:.1f} s: "
          f"{dict(sorted(tally.items()))}; mismatches/errors: {len(failures)}; "
          f"end state (KV blocks used, running, waiting) = {idle}")
    assert sum(tally.values()) == requests
    assert not failures, "\n".join(failures[:20])
    assert idle == (0, 0, 0)


def test_load_and_faults_small(setup):
    _run_load(setup, requests=40, clients=8, seed=1, limit_s=300)


@pytest.mark.slow
def test_load_and_faults_full(setup):
    _run_load(setup, requests=500, clients=32, seed=2, limit_s=1200)
