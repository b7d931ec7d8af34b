"""``pagedattn generate`` and ``pagedattn embed``: the engine from the command line."""

from __future__ import annotations

import argparse
import sys

from pagedattn import thread_policy
from pagedattn.engine import huge_pages
from pagedattn.models import native_stack
from pagedattn.engine.args import (
    DTYPES,
    KV_CACHE_DTYPES,
    LINEAR_IMPLS,
    PREFILL_ATTENTION,
    EngineArgs,
)
from pagedattn.engine.scheduler import SCHEDULING_POLICIES


def add_engine_arguments(p: argparse.ArgumentParser, default_dtype: str = "bfloat16") -> None:
    """The :class:`EngineArgs` a command line sets (``generate``, ``serve``)."""
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", choices=list(DTYPES), default=default_dtype)
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache storage: auto (= --dtype) or fp8 (1 byte per element: twice "
                        "the tokens in the same memory)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8: calibrate each layer's k/v scales from the first prefill "
                        "(default: scales of 1.0)")
    g.add_argument("--linear-impl", choices=LINEAR_IMPLS, default=None,
                   help="linear layers: auto (default with the extension: the path measured "
                        "fastest per layer shape and row count), the packed native kernel, "
                        "or torch nn.Linear")
    g.add_argument("--linear-dtype", choices=list(DTYPES), default=None,
                   help="activations of the linear layers (default: bfloat16 for a bfloat16 "
                        "model where the CPU has a native bf16 GEMM, else float32)")
    g.add_argument("--prefill-attention", choices=PREFILL_ATTENTION, default="auto",
                   help="kept for scripts that pass it: auto and kernel both run every "
                        "prefill on the paged kernel (torch's flash attention path was "
                        "retired)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens do not depend on its batch-mates, chunking or "
                        "threads (greedy or seeded); costs some speed (docs/engine.md)")
    g.add_argument("--no-shared-prefix-attention", action="store_true",
                   help="every request reads its own copy of a prefix it shares with others "
                        "(default: keys held in the same blocks are read once per step for "
                        "all of them)")
    g.add_argument("--backend", default=None, help="attention backend (default: registry choice)")
    g.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    g.add_argument("--kv-cache-memory", default=EngineArgs.kv_cache_memory,
                   help="KV cache pool size, e.g. 512MiB, 2GiB")
    g.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                   default=EngineArgs.scheduling_policy,
                   help="order of admission of waiting requests (shortest_first: fewest "
                        "prompt tokens first, with aging)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-huge-pages", action="store_true",
                   help="keep the weights and KV cache on ordinary pages (default: 2 MiB "
                        "transparent huge pages where the kernel allows them)")
    g.add_argument("--no-native-step", action="store_true",
                   help="run the decoder layers in the Python loop (default: one native op "
                        "per step where it serves the step; the same results)")
    g.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=False,
                   help="run a step on fewer threads while other processes keep the cores "
                        "busy (default: every step on all of torch's threads)")


def engine_args(args: argparse.Namespace, **overrides) -> EngineArgs:
    """The :class:`EngineArgs` of parsed ``add_engine_arguments`` options."""
    fields = dict(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  calculate_kv_scales=args.calculate_kv_scales, linear_impl=args.linear_impl,
                  linear_dtype=args.linear_dtype, prefill_attention=args.prefill_attention,
                  batch_invariant=args.batch_invariant,
                  shared_prefix_attention=not args.no_shared_prefix_attention,
                  backend=args.backend,
                  block_size=args.block_size,
                  kv_cache_memory=args.kv_cache_memory,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, scheduling_policy=args.scheduling_policy,
                  max_model_len=args.max_model_len,
                  enable_prefix_caching=not args.no_prefix_caching,
                  huge_pages=not args.no_huge_pages, native_step=not args.no_native_step,
                  adaptive_threads=args.adaptive_threads)
    return EngineArgs(**{**fields, **overrides})


def describe_engine(llm) -> str:
    """One line on what the engine runs: model, dtypes, backend, KV capacity, the pages its
    memory sits on, threads and their wait policy."""
    a, eng = llm.args, llm.engine
    kv = (f", KV cache {a.kv_cache_dtype} ({eng.kv_capacity_tokens} tokens in "
          f"{eng.num_blocks} blocks of {a.block_size})") if eng is not None else ""
    backend = llm.engine.attention.backend_cls.get_name() if eng is not None else \
        type(llm.embedder.builder).__name__
    prefill = f" ({eng.attention.prefill_plan})" if eng is not None and \
        eng.attention.prefill_plan else ""
    act = str(llm.act_dtype).removeprefix("torch.")
    pages = huge_pages.describe(a.huge_pages, llm.weights_on_huge_pages,
                                eng.runner.kv_on_huge_pages if eng is not None else None)
    sched = f", scheduler {a.scheduling_policy} ({a.max_num_batched_tokens} tokens a step)" \
        if eng is not None else ""
    layers = f"; {native_stack.describe(llm.model)}" if eng is not None else ""
    steps = f", {eng.runner.threads.describe()}" if eng is not None else ""
    return (f"model {a.model}, dtype {str(a.dtype).removeprefix('torch.')}, linear "
            f"{a.linear_impl} ({act} activations), attention {backend}{prefill}{kv}{sched}"
            f"{layers}; {pages}; {thread_policy.describe()}{steps}")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="HF model directory, .gguf file, or built-in name (smollm2, gemma3)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template (gemma3 has none)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--verbose", action="store_true",
                   help="print what the engine runs first: dtypes, backend, KV capacity, and "
                        "the linear path each layer shape and row bucket got, and why")
    add_engine_arguments(p)


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
    llm = LLM(**vars(engine_args(args)))
    if args.verbose:
        print(describe_engine(llm))
        plan = llm.linear_plan
        lines = plan.lines() if plan is not None else [f"linear paths: {llm.linear_impl} (forced)"]
        print("\n".join(lines))
        from pagedattn import tuning

        print("\n".join(["kernel choices:"] + [f"  {c.line()}" for c in tuning.choices_made()
                                                if c.kind != "linear-paths"]))
    progress = len(prompts) > 1
    missing = llm.chat_template_missing() if args.chat else None
    if missing:
        print(f"pagedattn generate --chat: {missing}; drop --chat to send the prompts as "
              "plain text", file=sys.stderr)
        return 2
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
