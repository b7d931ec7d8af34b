"""``pagedattn generate`` and ``pagedattn embed``: the engine from the command line."""

from __future__ import annotations

import argparse
import sys

from pagedattn.engine.llm import DTYPES, LINEAR_IMPLS


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="HF model directory, .gguf file, or built-in name (smollm2)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--backend", default=None, help="attention backend (default: registry choice)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--linear-impl", choices=LINEAR_IMPLS, default=None,
                   help="linear layers: auto (default with the extension: the path measured "
                        "fastest per layer shape and row count), the packed native kernel, "
                        "or torch nn.Linear")
    p.add_argument("--verbose", action="store_true",
                   help="print the linear path each layer shape and row bucket got, and why")


def add_embed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sentences", nargs="*", help="sentences to embed")
    p.add_argument("--model", default="minilm",
                   help="HF BERT model directory or built-in name (minilm)")
    p.add_argument("--file", help="a file with one sentence per line")
    p.add_argument("--similarity", action="store_true",
                   help="print the cosine-similarity table instead of the vectors")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--backend", default=None)
    p.add_argument("--linear-impl", choices=LINEAR_IMPLS, default=None)


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedattn import LLM, SamplingParams

    prompts = list(args.prompt) + (_lines(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        print("pagedattn generate: give --prompt TEXT (repeatable) or --prompts-file FILE",
              file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(model=args.model, dtype=args.dtype, backend=args.backend,
              linear_impl=args.linear_impl)
    if args.verbose:
        plan = llm.linear_plan
        lines = plan.lines() if plan is not None else [f"linear paths: {llm.linear_impl} (forced)"]
        print("\n".join(lines), file=sys.stderr)
    progress = len(prompts) > 1
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=progress)
    else:
        outs = llm.generate(prompts, params, use_tqdm=progress)
    for prompt, out in zip(prompts, outs):
        print(f"### {prompt}")
        if out.error:
            print(f"[error] {out.error}")
        else:
            print(out.text.strip())
        print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}]")
    print(llm.last_stats.line())
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    from pagedattn import LLM

    sentences = list(args.sentences) + (_lines(args.file) if args.file else [])
    if not sentences:
        print("pagedattn embed: give sentences as arguments or --file FILE", file=sys.stderr)
        return 2
    llm = LLM(model=args.model, dtype=args.dtype, backend=args.backend,
              linear_impl=args.linear_impl)
    vectors = llm.embed(sentences)
    if args.similarity:
        sim = vectors @ vectors.T
        width = max(len(s[:30]) for s in sentences)
        for i, s in enumerate(sentences):
            print(f"{s[:30]:<{width}}  " + " ".join(f"{v:6.3f}" for v in sim[i].tolist()))
    else:
        for s, v in zip(sentences, vectors):
            print(f"{s}\t" + " ".join(f"{x:.6f}" for x in v.tolist()))
    return 0
