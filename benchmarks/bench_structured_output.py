"""What one structured-output request costs its batch-mates on ``pagedattn serve``.

N plain streaming completions (greedy, EOS ignored, ``--max-tokens`` each) run together
three ways, on one server:

* ``plain``: the N streams alone;
* ``+1 plain``: the N streams and one more plain stream (a bigger batch, the control);
* ``+1 json_schema``: the N streams and one ``response_format: json_schema`` request whose
  schema (an array with a large ``minItems``) keeps it constrained for the whole run.

For each, the batch-mates' decode rate: per stream, (completion tokens - 1) / (last chunk -
first chunk), then the mean over the N streams. The issue's bound: ``+1 json_schema``
within 10% of ``+1 plain``. The configurations alternate for ``--rounds`` rounds, so a
drift of the machine's speed falls on all of them, and each round's ratio
(``+1 json_schema`` / ``+1 plain``, measured a few seconds apart) is reported; the median
of those ratios is the figure.

``--offline`` measures the same in the engine itself (``LLM``, no HTTP): the decode steps'
time in each configuration, and the time spent in the grammar work (masking the
constrained row, advancing its matcher) per step.

    .venv/bin/python benchmarks/bench_structured_output.py            # 8 streams, 128 tokens
    .venv/bin/python benchmarks/bench_structured_output.py --streams 4 --max-tokens 64
    .venv/bin/python benchmarks/bench_structured_output.py --offline --rounds 5

The server listens on 127.0.0.1 on a free port and is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import HOST, free_port, serving  # noqa: E402

PROMPTS = ["The history of the printing press", "A guide to growing tomatoes",
           "Why the sky is blue", "How a steam engine works", "The life of a honey bee",
           "A short story about a lighthouse", "The rules of chess", "How rainbows form",
           "The water cycle explained", "A recipe for bread", "How volcanoes erupt",
           "The first moon landing", "How computers add numbers", "A walk in the forest",
           "The origin of the Olympic games", "How birds migrate"]

LONG_SCHEMA = {"type": "array", "minItems": 500, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome", "Berlin"]}},
    "required": ["name", "age", "city"]}}
"""Never complete within the run: the request stays constrained until its max_tokens."""


async def _stream(client, url: str, body: dict) -> tuple[int, float, float]:
    """``(completion tokens, first chunk time, last chunk time)`` of one streamed request."""
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first if first is not None else now
                last = now
    return tokens, first, last


async def _run(url: str, streams: int, max_tokens: int, extra: str | None) -> float:
    """Mean decode tok/s of the ``streams`` plain streams, with ``extra`` (None, "plain"
    or "json") alongside."""
    import httpx

    plain = [{"model": "smollm2", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
              "temperature": 0, "ignore_eos": True} for i in range(streams)]
    bodies = list(plain)
    if extra == "plain":
        bodies.append({"model": "smollm2", "prompt": "A list of people:", "temperature": 0,
                       "max_tokens": max_tokens + 16, "ignore_eos": True})
    elif extra == "json":
        bodies.append({"model": "smollm2", "prompt": "A list of people:", "temperature": 0,
                       "max_tokens": max_tokens + 16, "response_format": {
                           "type": "json_schema",
                           "json_schema": {"name": "people", "schema": LONG_SCHEMA}}})
    limits = httpx.Limits(max_connections=len(bodies) + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # the extra request goes first, so it is in the batch before the streams decode
        results = await asyncio.gather(*(_stream(client, url, b) for b in bodies[::-1]))
    rates = [(n - 1) / (t1 - t0) for n, t0, t1 in results[::-1][:streams] if n > 1 and t1 > t0]
    return statistics.mean(rates)


def _offline(args) -> None:
    """Engine-level: N plain greedy requests decoding, with nothing, one more plain or
    one json_schema request alongside; the mean decode step time, and the grammar work."""
    from pagedattn import LLM, SamplingParams, StructuredOutput
    from pagedattn.engine import llm_engine, sampler

    llm = LLM(model="smollm2", **dict(kv.split("=", 1) for kv in args.serve_args.split()))
    engine = llm.engine
    grammar_time = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                grammar_time[0] += time.perf_counter() - t
        return wrapper

    sampler_apply = sampler.apply_grammar_masks
    sampler.apply_grammar_masks = timed(sampler_apply)
    engine._advance_grammar = timed(engine._advance_grammar)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    extra_plain = SamplingParams(temperature=0, max_tokens=args.max_tokens + 16, ignore_eos=True)
    extra_json = SamplingParams(temperature=0, max_tokens=args.max_tokens + 16,
                                structured_output=StructuredOutput(json=LONG_SCHEMA))
    engine.compile_structured_output(extra_json.structured_output)

    def run(extra) -> tuple[float, float]:
        for i in range(args.streams):
            engine.add_request(engine.inputs.encode(PROMPTS[i % len(PROMPTS)]), plain)
        if extra is not None:
            engine.add_request(engine.inputs.encode("A list of people:"), extra)
        steps, total, grammar = 0, 0.0, 0.0
        while engine.has_unfinished():
            grammar_time[0] = 0.0
            t = time.perf_counter()
            result = engine.step()
            dt = time.perf_counter() - t
            # the decode steps in which all N plain requests and the extra one get a token
            if len(result.sampled) == args.streams + (extra is not None) and not result.finished:
                total += dt
                grammar += grammar_time[0]
                steps += 1
        return total / max(steps, 1), grammar / max(steps, 1)

    run(extra_json)  # warm-up
    names = {"plain": None, "+1 plain": extra_plain, "+1 json_schema": extra_json}
    step_ms: dict[str, list[float]] = {k: [] for k in names}
    grammar_ms = []
    for _ in range(args.rounds):
        for name, extra in names.items():
            step, gram = run(extra)
            step_ms[name].append(step * 1e3)
            if name == "+1 json_schema":
                grammar_ms.append(gram * 1e3)
    ratios = [j / p for j, p in zip(step_ms["+1 json_schema"], step_ms["+1 plain"])]
    print(f"offline engine: {args.streams} plain requests x {args.max_tokens} tokens, "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}")
    print("| batch | decode step ms (median of rounds) | rounds |")
    print("|---|---|---|")
    for name in names:
        xs = step_ms[name]
        print(f"| {name} | {statistics.median(xs):.2f} | {', '.join(f'{x:.2f}' for x in xs)} |")
    print(f"grammar work per step (mask + advance, one constrained row): "
          f"{statistics.median(grammar_ms):.3f} ms median "
          f"({100 * statistics.median(grammar_ms) / statistics.median(step_ms['+1 json_schema']):.1f}% "
          f"of the step)")
    print(f"step time +1 json_schema / +1 plain, per round: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-args", default="", help="extra arguments for pagedattn serve "
                    "(with --offline: LLM keyword arguments, key=value)")
    ap.add_argument("--offline", action="store_true", help="measure in the engine, no server")
    args = ap.parse_args()
    if args.offline:
        _offline(args)
        return

    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [sys.executable, "-m", "pagedattn", "serve", "--model", "smollm2", "--host", HOST,
           "--port", str(port), *args.serve_args.split()]
    with open(os.devnull, "w") as log, \
            serving(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, port, log, 300):
        # warm-up: compiles the schema (cached by key) and runs a few steps
        asyncio.run(_run(url, 2, 8, "json"))
        names = {None: "plain", "plain": "+1 plain", "json": "+1 json_schema"}
        rates: dict[str | None, list[float]] = {k: [] for k in names}
        for _ in range(args.rounds):
            for extra in names:
                rates[extra].append(asyncio.run(_run(url, args.streams, args.max_tokens, extra)))
        print(f"{args.streams} plain streams x {args.max_tokens} tokens, {args.rounds} rounds; "
              f"load average {os.getloadavg()[0]:.2f}")
        print("| batch | batch-mates' decode tok/s per stream (median of rounds) | rounds |")
        print("|---|---|---|")
        for extra, name in names.items():
            xs = rates[extra]
            print(f"| {name} | {statistics.median(xs):.2f} | {', '.join(f'{x:.2f}' for x in xs)} |")
        ratios = [j / p for j, p in zip(rates["json"], rates["plain"])]
        print(f"batch-mates' rate +1 json_schema / +1 plain, per round: "
              f"{', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f} "
              f"(slow-down {100 * (1 - statistics.median(ratios)):.1f}%)")


if __name__ == "__main__":
    main()
