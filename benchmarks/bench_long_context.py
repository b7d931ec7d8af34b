"""Long-context engine benchmark: a few requests with very long prompts (default 4 x 16k
tokens, 256 new tokens each, greedy, EOS ignored) on a built-in model with a long context
(Gemma 3 270M: 32k), reporting prefill and decode rates and how much of each kind of step
is attention.

The prompts are random token ids (seeded): attention and the linear layers cost the same
whatever the tokens say, and random ids need no tokenizer-dependent text building.

Decode steps are the steps without a prefill token; the decode rate is their tokens over
their time, both from the engine's own step stats (the model's forward and sampling).
Attention time is the time inside the attention layers (the impl's forward,
cache write included), summed per step kind.

    python benchmarks/bench_long_context.py                 # gemma3, 4 x 16384 + 256
    python benchmarks/bench_long_context.py --prompt-tokens 4096 --new-tokens 32   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import AttentionClock  # noqa: E402

from pagedattn import LLM, SamplingParams  # noqa: E402


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids from 1000 up: clear of the special tokens the built-in models keep at the start.
    return torch.randint(1000, vocab_size, (count, length), generator=gen).tolist()


def run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Steps the engine over ``prompts`` and returns the figures of one run: times and
    token counts from the engine's own step stats, attention time per step kind from an
    :class:`AttentionClock`."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for ids in prompts:
        engine.add_request(ids, params)
    before = dataclasses.replace(engine.stats, ttfts=[])
    attention = {"prefill": 0.0, "decode": 0.0}
    decode_steps = 0
    with AttentionClock(llm.model) as clock:
        while engine.has_unfinished():
            prefilled, spent = engine.stats.num_prefill_tokens, clock.seconds
            engine.step()
            kind = "prefill" if engine.stats.num_prefill_tokens > prefilled else "decode"
            attention[kind] += clock.seconds - spent
            decode_steps += kind == "decode"
    s = engine.stats
    pt, dt = s.prefill_time - before.prefill_time, s.decode_time - before.decode_time
    dn = s.num_decode_tokens - before.num_decode_tokens
    pn = s.num_prefill_tokens - before.num_prefill_tokens
    return {"prefill_s": pt, "prefill_tok_s": pn / pt,
            "prefill_attention_share": attention["prefill"] / pt,
            "decode_s": dt, "decode_tokens": dn, "decode_tok_s": dn / dt,
            "decode_attention_share": attention["decode"] / dt,
            "decode_steps": decode_steps, "decode_step_ms": 1e3 * dt / decode_steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3", help="a built-in model with a long context")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if min(args.requests, args.prompt_tokens, args.new_tokens, args.threads) < 1:
        p.error("--requests, --prompt-tokens, --new-tokens and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    context = args.prompt_tokens + args.new_tokens
    # 48 KiB per token holds every built-in model's KV in fp32 (Gemma 3 270M: 18 KiB in bf16).
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=False, max_model_len=context,
              kv_cache_memory=f"{args.requests * context * 48 // 1024 + 64}MiB")
    prompts = random_prompts(llm.tokenizer.vocab_size, args.requests, args.prompt_tokens)
    run(llm, [prompts[0][:256]], 4)  # warm-up: first-call allocations and kernel set-up
    figures = run(llm, prompts, args.new_tokens)
    print(f"{args.model} {args.dtype} (KV {args.kv_cache_dtype}), {args.requests} x "
          f"{args.prompt_tokens} prompt tokens + {args.new_tokens} new, greedy, "
          f"{args.threads} threads")
    print(f"prefill: {figures['prefill_s']:.1f} s, {figures['prefill_tok_s']:.0f} tok/s, "
          f"attention {figures['prefill_attention_share']:.0%} of it")
    print(f"decode:  {figures['decode_tok_s']:.1f} tok/s ({figures['decode_step_ms']:.1f} ms "
          f"per step of up to {args.requests}), attention {figures['decode_attention_share']:.0%} "
          f"of it")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
