"""``pagedattn serve`` under N concurrent streaming clients (the official ``openai``
client), next to the offline engine on the same prompts, in the same run.

Workload W2 of engine_workloads.py: 32 chat prompts of 20-200 tokens, 128 new tokens
each, EOS ignored, greedy; prompts are sent as token ids so every peer sees the same
tokens; prefix caching is off everywhere. Per client count: output tok/s (all tokens / wall time), TTFT and inter-token
latency p50/p99. Offline, measured again just before each server (this machine's speed
drifts over minutes): ``LLM.generate`` on all prompts (tok/s) and the TTFT of each
1-client prompt alone. The 1-client run pairs each prompt: the offline engine runs it
alone, then the client sends it; the median of the per-prompt TTFT differences is the
server's cost over offline. With ``--vllm-python``, vLLM's OpenAI server
(its CPU engine, no pagedattn plugin) gets the same client load.

    .venv/bin/python benchmarks/bench_serve.py                            # 1, 4, 32 clients
    .venv/bin/python benchmarks/bench_serve.py --clients 1,4 --max-tokens 16   # quick check
    .venv/bin/python benchmarks/bench_serve.py --vllm-python .venv-vllm/bin/python

Servers listen on 127.0.0.1 on a free port and are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import PEER_DTYPE_HELP, peer_dtype, workloads  # noqa: E402

HOST = "127.0.0.1"


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def offline(llm, prompts: list[list[int]], n: int, one_client_prompts: int) -> dict[str, float]:
    """The offline rate on every prompt, and the median TTFT of each of the prompts the
    1-client run sends, alone (the same prompts: TTFT grows with the prompt)."""
    from pagedattn import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    ttfts = [offline_ttft(llm, p) for p in prompts[:one_client_prompts]]
    return {"tok_s": sum(len(o.token_ids) for o in outs) / wall,
            "ttft_1": statistics.median(ttfts)}


def offline_ttft(llm, prompt: list[int]) -> float:
    """Seconds for the offline engine to give ``prompt``'s first token, alone."""
    from pagedattn import SamplingParams

    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t


def _openai_client(base_url: str):
    import openai

    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                              timeout=3600)


async def _client_load(base_url: str, model: str, prompts, n: int, clients: int, oai=None):
    """``clients`` concurrent streaming clients over ``prompts``; ``oai``: an open client
    to reuse (it then stays open), else a new one."""
    own = oai is None
    oai = _openai_client(base_url) if own else oai
    todo = iter(prompts)
    ttfts, itls, tokens = [], [], [0]

    async def one(prompt):
        t0 = time.perf_counter()
        last = None
        stream = await oai.completions.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens[0] += chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            if last is None:
                ttfts.append(now - t0)
            else:
                itls.append(now - last)
            last = now

    async def worker():
        for prompt in todo:
            await one(prompt)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    if own:
        await oai.close()
    return _summary(ttfts, itls, tokens[0], wall)


def _summary(ttfts, itls, tokens, wall) -> dict:
    return {"tok_s": tokens / wall, "ttft_p50": _pct(ttfts, 0.5), "ttft_p99": _pct(ttfts, 0.99),
            "itl_p50": _pct(itls, 0.5), "itl_p99": _pct(itls, 0.99), "wall": wall,
            "ttfts": ttfts, "itls": itls, "tokens": tokens}


def _one_client_paired(url: str, model: str, prompts, n: int, offline_ttft) -> dict:
    """The 1-client run, each prompt sent right after the offline engine ran it alone:
    this machine's speed drifts over seconds to minutes, and a pair a second apart sees
    the same speed, so the median of the per-prompt differences is the server's own cost
    (the two medians apart can differ by the drift alone)."""
    ttfts, itls, tokens, wall, offline, gaps = [], [], 0, 0.0, [], []

    async def pairs():
        nonlocal tokens, wall
        oai = _openai_client(url)  # one client and connection for every pair, as one user
        await _client_load(url, model, prompts[:1], 1, 1, oai)  # connect, warm the client
        for prompt in prompts:
            offline.append(offline_ttft(prompt))  # blocks this loop: nothing else runs on it
            r = await _client_load(url, model, [prompt], n, 1, oai)
            ttfts.extend(r["ttfts"])
            itls.extend(r["itls"])
            tokens += r["tokens"]
            wall += r["wall"]
            gaps.append(r["ttfts"][0] - offline[-1])
        await oai.close()

    asyncio.run(pairs())
    return {**_summary(ttfts, itls, tokens, wall), "offline_ttft_p50": statistics.median(offline),
            "ttft_gap_p50": statistics.median(gaps)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(cmd: list[str], env: dict, port: int, log, start_timeout_s: float = 600):
    """The server process of ``cmd`` once its ``/health`` answers, stopped (SIGTERM, then
    SIGKILL after a minute) when the block ends."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start; see {log.name}")
            try:
                if httpx.get(f"http://{HOST}:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_peer(name: str, cmd: list[str], env: dict, port: int, model: str, prompts, n: int,
             client_counts: list[int], one_client_prompts: int,
             offline_ttft) -> dict[int, dict]:
    rows = {}
    with tempfile.NamedTemporaryFile("w", prefix=f"bench_serve_{name}_", suffix=".log",
                                     delete=False) as log:
        with serving(cmd, env, port, log):
            url = f"http://{HOST}:{port}"
            asyncio.run(_client_load(url, model, prompts[:2], 2, 2))  # warm-up
            for c in client_counts:
                if c == 1:
                    rows[c] = _one_client_paired(url, model, prompts[:one_client_prompts], n,
                                                 offline_ttft)
                else:
                    rows[c] = asyncio.run(_client_load(url, model, prompts, n, c))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--peer-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help=PEER_DTYPE_HELP)
    p.add_argument("--clients", default="1,4,32", help="comma-separated client counts")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens (default W2's 128)")
    p.add_argument("--one-client-prompts", type=int, default=4,
                   help="prompts run at 1 client (sequential runs are slow)")
    p.add_argument("--vllm-python", default=None,
                   help="a python with vLLM installed: also serve with vLLM's OpenAI server")
    p.add_argument("--hf-dir", default=os.path.expanduser("~/.cache/pagedattn/smollm2-hf"),
                   help="where the Hugging Face copy of SmolLM2 for vLLM is made (once)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--serve-args", default="",
                   help="extra options for pagedattn serve, e.g. '--max-num-batched-tokens 512'")
    args = p.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]
    args.peer_dtype = peer_dtype(args.peer_dtype, args.dtype)

    from pagedattn import LLM
    from pagedattn.models.loader import resolve_model

    model_dir = resolve_model(args.model)
    # Prefix caching off for every peer: the warm-up and repeated prompts would otherwise
    # be cache hits for some peers and runs and not others (TTFT would compare cache states).
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    prompts, n = workloads(llm.tokenizer)["W2"]
    n = args.max_tokens or n
    print(f"W2: {len(prompts)} prompts, {n} new tokens each (EOS ignored), greedy; "
          f"pagedattn {args.dtype}, vLLM's server {args.peer_dtype}")

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    peers = []
    port = free_port()
    peers.append(("pagedattn", [sys.executable, "-m", "pagedattn", "serve", "--model",
                                args.model, "--dtype", args.dtype, "--host", HOST,
                                "--port", str(port), "--log-level", "warning",
                                "--no-prefix-caching", *shlex.split(args.serve_args)],
                  env, port, args.model))
    if args.vllm_python:
        # vLLM reads no GGUF: the same converted checkpoint bench_engine.py gives it.
        from pagedattn.bench.vllm_plugin_runs import smollm2_checkpoint

        hf_dir = str(smollm2_checkpoint(args.hf_dir)) if args.model == "smollm2" else model_dir
        port = free_port()
        venv = {**env, "PAGEDATTN_VLLM": "0",  # vLLM's own kernels, not our plugin's
                "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "2",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        peers.append(("vllm", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                               "--model", hf_dir, "--dtype", args.peer_dtype, "--host", HOST,
                               "--port", str(port), "--max-model-len", "4096",
                               "--no-enable-prefix-caching"], venv, port, hf_dir))
    print(f"{'server':<10} {'clients':>7} {'tok/s':>8} {'x offline':>9} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}   (ms)")
    for name, cmd, penv, pport, served in peers:
        # Offline again right before each server: this machine's speed drifts over minutes,
        # and "x offline" compares runs a minute apart, not five (the idle LLM costs no CPU).
        off = offline(llm, prompts, n, args.one_client_prompts)
        print(f"(offline LLM.generate just before: {off['tok_s']:.1f} tok/s; TTFT of each "
              f"1-client prompt alone, median {off['ttft_1'] * 1e3:.1f} ms)")
        rows = run_peer(name, cmd, penv, pport, served, prompts, n, client_counts,
                        args.one_client_prompts, lambda p: offline_ttft(llm, p))
        for c, r in rows.items():
            print(f"{name:<10} {c:>7} {r['tok_s']:>8.1f} {r['tok_s'] / off['tok_s']:>9.2f} "
                  f"{r['ttft_p50'] * 1e3:>9.1f} {r['ttft_p99'] * 1e3:>9.1f} "
                  f"{r['itl_p50'] * 1e3:>8.1f} {r['itl_p99'] * 1e3:>8.1f}")
            if c == 1:
                print(f"{'':<10} {'':>7} per prompt, sent right after offline ran it: "
                      f"server TTFT - pagedattn offline TTFT, median {r['ttft_gap_p50'] * 1e3:+.1f} ms "
                      f"(offline median in these pairs {r['offline_ttft_p50'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
