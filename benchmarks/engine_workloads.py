"""Workloads W1-W3 and W5-W6 of bench_engine.py as token-id prompts (shared by every
peer, so all of them see exactly the same inputs), and the timing protocol they all follow.

W1: one chat prompt, 128 new tokens          -> TTFT, decode tok/s
W2: 32 chat prompts of 20-200 tokens, 128 new -> output tok/s (EOS ignored)
W3: 4 prompts of ~2000 tokens, 64 new          -> prefill tok/s, decode tok/s
W5: 32 chats behind one ~2000-token system prompt, each with its own 30-80-token
    question, 128 new tokens                   -> decode tok/s (prefix caching on)
W6: n = 8 seeded samples of one ~2000-token prompt, 128 new tokens
                                               -> decode tok/s (prefix caching on)

A model without a chat template (the pretrained Gemma 3) gets the same texts as plain
prompts (its tokenizer adds BOS).

Protocol (identical for every peer): ``run(prompts, n)`` generates ``n`` greedy tokens
per prompt with EOS ignored and returns its wall time. TTFT / prefill time is the time
of ``run(prompts, 1)``; decode tok/s is ``len(prompts) * (n - 1) / (t_n - t_1)``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from pagedattn.bench.prompts import SENTENCES
from pagedattn.models.layers import PagedAttention

# The workloads' prompts were fixed on the first eight (W2 and W3 keep their lengths).
_SENTENCES = SENTENCES[:8]
_QUESTIONS = ["Summarise the text above in two sentences.", "What is the main topic?",
              "Write a short poem inspired by it.", "List the key facts."]


def _text(n_sentences: int, offset: int) -> str:
    return " ".join(_SENTENCES[(offset + i) % len(_SENTENCES)] for i in range(n_sentences))


def chat_ids(tokenizer, text: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text).input_ids
    conv = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False).input_ids


PEER_DTYPE_HELP = ("dtype of the peers (transformers, vLLM); auto: pagedattn's dtype, except "
                   "float32 for a bfloat16 run on a CPU without a native bf16 GEMM (there "
                   "torch's bf16 matmuls are ~100x slower than fp32: a peer is measured the "
                   "fastest way it runs, as pagedattn's engine keeps its linear layers fp32 "
                   "there too)")


def peer_dtype(requested: str, dtype: str) -> str:
    """The peers' dtype name for ``--peer-dtype requested`` next to pagedattn's ``dtype``."""
    if requested != "auto":
        return requested
    from pagedattn.engine.args import native_half_matmul

    return "float32" if dtype == "bfloat16" and not native_half_matmul() else dtype


def workloads(tokenizer, scale: float = 1.0) -> dict[str, tuple[list[list[int]], int]]:
    """``name -> (prompts as token ids, new tokens per prompt)``; ``scale`` < 1 shrinks
    the prompt counts, lengths and outputs for a quick run."""
    def n(x: int) -> int:
        return max(2, int(x * scale))

    w1 = [chat_ids(tokenizer, "What is the capital of France? Tell me about the city.")]
    w2 = []
    for i in range(n(32)):
        target = 20 + (180 * i) // max(1, n(32) - 1)  # 20 .. 200 tokens
        k = 1
        while len(chat_ids(tokenizer, _text(k, i) + " " + _QUESTIONS[i % 4])) < target:
            k += 1
        w2.append(chat_ids(tokenizer, _text(k, i) + " " + _QUESTIONS[i % 4]))
    w3 = []
    for i in range(4):
        k = 1
        while len(chat_ids(tokenizer, _text(k, i) + " " + _QUESTIONS[i])) < n(2000):
            k += 8
        w3.append(chat_ids(tokenizer, _text(k, i) + " " + _QUESTIONS[i]))
    return {"W1": (w1, n(128)), "W2": (w2, n(128)), "W3": (w3, n(64))}


@dataclass(frozen=True)
class SharedLoad:
    """A shared-prefix workload: its prompts (token ids), the new tokens of each, and the
    samples per prompt (``n``, drawn at ``temperature`` with ``seed``; 1: greedy)."""

    prompts: list[list[int]]
    new_tokens: int
    samples: int = 1
    temperature: float = 0.0
    seed: int | None = None

    def to_json(self) -> dict:
        return dict(prompts=self.prompts, new_tokens=self.new_tokens, samples=self.samples,
                    temperature=self.temperature, seed=self.seed)


def _chat_with_system(tokenizer, system: str, question: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(system + "\n\n" + question).input_ids
    conv = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False).input_ids


def shared_prefix_workloads(tokenizer, scale: float = 1.0) -> dict[str, SharedLoad]:
    """W5 and W6 (module docstring): prompts whose leading tokens are the same, which
    prefix caching keeps in the same KV blocks."""
    def n(x: int) -> int:
        return max(2, int(x * scale))

    k = 1
    while len(tokenizer(_text(k, 3)).input_ids) < n(2000):
        k += 4
    system = "Answer questions about the following notes. " + _text(k, 3)
    w5 = []
    for i in range(n(32)):
        target = 30 + (50 * i) // max(1, n(32) - 1)  # 30 .. 80 tokens of question
        words = 1
        while len(tokenizer(_text(words, i) + " " + _QUESTIONS[i % 4]).input_ids) < target:
            words += 1
        w5.append(_chat_with_system(tokenizer, system, _text(words, i) + " " + _QUESTIONS[i % 4]))
    document = chat_ids(tokenizer, _text(k, 5) + " " + _QUESTIONS[2])
    return {"W5": SharedLoad(w5, n(128)),
            "W6": SharedLoad([document], n(128), samples=8, temperature=0.8, seed=1234)}


def measure_shared(run: Callable[[SharedLoad, int], None], loads: dict[str, SharedLoad],
                   repeats: int) -> dict[str, float]:
    """Decode tok/s of W5 and W6 for one peer: ``run(load, n)`` generates ``n`` tokens
    per sample of every prompt (EOS ignored). Each load runs once first, so its prompts'
    blocks are in the prefix cache (the timed runs then share them, as a serving engine's
    requests behind a cached system prompt do); decode is the fastest ``n``-token run
    minus the fastest 1-token run, as in :func:`measure`."""
    def timed(load, n) -> float:
        t0 = time.perf_counter()
        run(load, n)
        return time.perf_counter() - t0

    figures = {}
    for name, load in loads.items():
        run(load, 2)
        ones, alls = [], []
        for _ in range(repeats):
            ones.append(timed(load, 1))
            alls.append(timed(load, load.new_tokens))
        sequences = len(load.prompts) * load.samples
        figures[f"{name} decode tok/s"] = (sequences * (load.new_tokens - 1)
                                           / max(min(alls) - min(ones), 1e-9))
    return figures


SHARED_COLUMNS = ["W5 decode tok/s", "W6 decode tok/s"]


def measure(run: Callable[[list[list[int]], int], None], loads, repeats: int) -> dict[str, float]:
    """The five figures of the table for one peer.

    Decode rates are differences of two runs (n tokens minus 1 token: the prefill cancels).
    Each run length is taken at its fastest over ``repeats``: W3's prefill takes ~17 s
    here and moves +-10% from run to run, which swamps the ~2 s of decode in a per-repeat
    difference (its median swung 50-190 tok/s between identical runs); the fastest run of
    each length is the least disturbed one. Single-run figures (TTFT, W2, W3 prefill) are
    the median."""
    def timed(prompts, n) -> float:
        t0 = time.perf_counter()
        run(prompts, n)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {}
    run(loads["W1"][0], 2)  # warm-up: first-call allocations and kernel set-up
    for _ in range(repeats):
        w1, n1 = loads["W1"]
        times.setdefault("W1 1", []).append(timed(w1, 1))
        times.setdefault("W1 n", []).append(timed(w1, n1))
        w2, n2 = loads["W2"]
        times.setdefault("W2 n", []).append(timed(w2, n2))
        w3, n3 = loads["W3"]
        times.setdefault("W3 1", []).append(timed(w3, 1))
        times.setdefault("W3 n", []).append(timed(w3, n3))
    (w1, n1), (w2, n2), (w3, n3) = loads["W1"], loads["W2"], loads["W3"]
    med = {k: statistics.median(v) for k, v in times.items()}
    fast = {k: min(v) for k, v in times.items()}
    return {
        "W1 TTFT ms": med["W1 1"] * 1e3,
        "W1 decode tok/s": (n1 - 1) / max(fast["W1 n"] - fast["W1 1"], 1e-9),
        "W2 output tok/s": len(w2) * n2 / med["W2 n"],
        "W3 prefill tok/s": sum(map(len, w3)) / med["W3 1"],
        "W3 decode tok/s": len(w3) * (n3 - 1) / max(fast["W3 n"] - fast["W3 1"], 1e-9),
    }


COLUMNS = ["W1 TTFT ms", "W1 decode tok/s", "W2 output tok/s", "W3 prefill tok/s", "W3 decode tok/s"]


class AttentionClock:
    """Seconds spent inside the attention layers (``PagedAttention.forward``: the impl's
    forward, cache write included) while installed: a benchmark-only wrapper, removed on
    exit. The native step op (:mod:`pagedattn.models.native_stack`) has no per-layer
    clock, so ``model`` (the engine's) runs the Python layer loop meanwhile: the shares are
    of that loop."""

    def __init__(self, model=None) -> None:
        self.seconds = 0.0
        self._model = model

    def __enter__(self) -> "AttentionClock":
        # Taken on entry, not construction: exit restores what was installed when timing began.
        self._original = original = PagedAttention.forward
        self._native = getattr(self._model, "native_stack", None)
        if self._native is not None:
            self._model.native_stack = False
        clock = self

        def timed_forward(layer, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(layer, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0

        PagedAttention.forward = timed_forward
        return self

    def __exit__(self, *exc) -> None:
        PagedAttention.forward = self._original
        if self._native is not None:
            self._model.native_stack = self._native
