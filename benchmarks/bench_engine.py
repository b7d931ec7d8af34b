"""End-to-end engine benchmark: W1-W3 (see engine_workloads.py) on a built-in model
(SmolLM2-135M-Instruct, or Gemma 3 270M with ``--model gemma3``) for pagedattn's engine
and, side by side in the same run, transformers ``generate`` (sdpa, the same GGUF) and,
when a vLLM python is given, vLLM's own CPU engine (in a subprocess, on a Hugging Face
copy of the GGUF). Also prints the share of pagedattn's step time spent in attention.

W5 and W6 (shared prefixes: 32 chats behind one system prompt, 8 samples of one prompt)
run with prefix caching on, in a second table: pagedattn, pagedattn with its
shared-prefix attention off (``shared_prefix_attention=False``) and vLLM's engine.

    .venv/bin/python benchmarks/bench_engine.py                 # bf16, 2 threads, 3 repeats
    .venv/bin/python benchmarks/bench_engine.py --scale 0.25 --repeats 1   # quick
    .venv/bin/python benchmarks/bench_engine.py --model gemma3
    .venv/bin/python benchmarks/bench_engine.py --vllm-python /path/to/venv/bin/python
    .venv/bin/python benchmarks/bench_engine.py --workloads W5,W6 --peers pagedattn,vllm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import pagedattn  # noqa: F401  (before torch: its OpenMP wait policy, pagedattn.thread_policy)
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import (COLUMNS, PEER_DTYPE_HELP, SHARED_COLUMNS,  # noqa: E402
                              AttentionClock, measure, measure_shared, peer_dtype,
                              shared_prefix_workloads, workloads)

from pagedattn import LLM, SamplingParams  # noqa: E402
from pagedattn.models.loader import resolve_model  # noqa: E402


def pagedattn_peer(llm: LLM):
    def run(prompts, n):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return run


def pagedattn_shared_peer(llm: LLM):
    def run(load, n):
        llm.generate(load.prompts, SamplingParams(
            n=load.samples, temperature=load.temperature, seed=load.seed, max_tokens=n,
            ignore_eos=True))
    return run


def transformers_peer(model, pad_id: int):
    def run(prompts, n):
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=pad_id)
    return run


def attention_share(llm: LLM, loads) -> dict[str, float]:
    """Fraction of generate() time spent inside the attention layers (impl forward,
    cache write included), for W1's decode and W3 (prefill + decode)."""
    shares = {}
    for name in ("W1", "W3"):
        prompts, n = loads[name]
        with AttentionClock(llm.model) as clock:
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            shares[name] = clock.seconds / (time.perf_counter() - t0)
    return shares


MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}
HF_DIR_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "gemma-3-270m"}


def weight_bytes_per_token(llm: LLM) -> int:
    """Bytes of linear-layer weights one decode token reads (every layer once, the output
    head included; each layer's weights in the form its 1-row path reads)."""
    total = 0
    for module in llm.model.modules():
        for name in ("packed_weight", "dp_weight", "weight"):
            w = getattr(module, name, None) if hasattr(module, "out_features") else None
            if isinstance(w, torch.Tensor):
                total += w.numel() * w.element_size()
                break
    return total


def weight_streaming_fraction(llm: LLM, decode_tok_s: float) -> tuple[float, float, int]:
    """``(fraction, DRAM GB/s, bytes per token)``: how close W1's decode runs to the
    weight-streaming limit, the DRAM probe of ``pagedattn bench`` (the best of the native
    ``stream_read`` and torch.sum over fresh slices, :func:`measure_bandwidth`) over the
    bytes per token."""
    from pagedattn.bench.probes import llc_bytes, measure_bandwidth

    gbs, _ = measure_bandwidth(256 << 20, llc_bytes())
    nbytes = weight_bytes_per_token(llm)
    return decode_tok_s * nbytes / (gbs * 1e9), gbs, nbytes


def export_hf_dir(model: str, path: str) -> str:
    """A Hugging Face copy of the model's GGUF (for vLLM, which reads no GGUF), converted
    once under ``path`` by the vLLM plugin's converter (fp32 safetensors)."""
    from pagedattn.bench.vllm_plugin_runs import hf_checkpoint_from_gguf

    return str(hf_checkpoint_from_gguf(resolve_model(model), path, HF_DIR_NAMES[model]))


def vllm_peer_figures(python: str, hf_dir: str, loads, args, shared: bool = False
                      ) -> dict[str, float]:
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_engine_worker.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({k: v.to_json() if shared else list(v) for k, v in loads.items()}, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               # The peer is vLLM's own engine: a venv with our plugin would run our kernels.
               PAGEDATTN_VLLM="0")
    cmd = [python, worker, "--model", hf_dir, "--workloads", f.name, "--dtype", args.peer_dtype,
           "--repeats", str(args.repeats)] + (["--shared"] if shared else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    os.unlink(f.name)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM worker failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="smollm2")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="shrink the workloads (quick runs)")
    p.add_argument("--peers", default="pagedattn,transformers,vllm",
                   help="W5/W6 run pagedattn (also with its shared-prefix attention off) and "
                        "vllm; transformers has no prefix cache")
    p.add_argument("--workloads", default="W1,W2,W3,W5,W6",
                   help="W1-W3 (one table) and/or W5-W6 (shared prefixes, prefix caching on)")
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDATTN_VLLM_PYTHON"),
                   help="python of an environment with vLLM (its CPU engine runs there)")
    p.add_argument("--hf-dir", default=None,
                   help="where the HF copy of the model for vLLM is written (default "
                        "~/.cache/pagedattn/<model>-hf)")
    p.add_argument("--peer-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help=PEER_DTYPE_HELP)
    p.add_argument("--linear-impl", choices=["auto", "packed", "torch"], default="auto",
                   help="pagedattn's linear layers (auto: the path measured fastest per layer "
                        "shape and row count on this machine)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="pagedattn with EngineArgs.batch_invariant (the cost of the mode)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="pagedattn with EngineArgs.huge_pages=False (weights and KV cache on "
                        "ordinary pages: what huge pages buy)")
    p.add_argument("--no-native-step", action="store_true",
                   help="pagedattn with EngineArgs.native_step=False (the decoder layers in "
                        "the Python loop: what the native step op buys)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    return args


def _measure_peers(args, llm, loads, peers):
    """``(results, skipped, peer_info, attention shares)`` of every peer asked for."""
    dtype = getattr(torch, args.peer_dtype)
    hf_dir = args.hf_dir or os.path.expanduser(f"~/.cache/pagedattn/{args.model}-hf")
    results: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    peer_info: dict[str, dict] = {}
    shares = None
    if "pagedattn" in peers:
        results["pagedattn"] = measure(pagedattn_peer(llm), loads, args.repeats)
        plan = llm.linear_plan
        peer_info["pagedattn"] = {
            "dtype": args.dtype, "linear_impl": llm.linear_impl,
            "linear_activations": str(llm.act_dtype).split(".")[-1],
            "linear_paths": plan.to_json() if plan is not None else None}
        shares = attention_share(llm, loads)
    if "transformers" in peers:
        import transformers

        folder, file = os.path.split(resolve_model(args.model))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=file, dtype=dtype, attn_implementation="sdpa").eval()
        pad = model.config.pad_token_id
        results["transformers (sdpa)"] = measure(
            transformers_peer(model, 2 if pad is None else pad), loads, args.repeats)
        peer_info["transformers (sdpa)"] = {"dtype": args.peer_dtype}
        del model
    if "vllm" in peers:
        if not args.vllm_python or not os.path.exists(args.vllm_python):
            skipped["vllm"] = "no --vllm-python (or PAGEDATTN_VLLM_PYTHON) given"
        else:
            try:
                results["vLLM CPU engine"] = vllm_peer_figures(
                    args.vllm_python, export_hf_dir(args.model, hf_dir), loads, args)
                peer_info["vLLM CPU engine"] = {"dtype": args.peer_dtype}
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                skipped["vllm"] = str(exc)[-500:]

    return results, skipped, peer_info, shares


def _measure_shared(args, loads, peers) -> tuple[dict, dict]:
    """W5/W6 figures per peer: pagedattn with and without its shared-prefix attention (same
    engine options otherwise, prefix caching on), and vLLM's engine."""
    results: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    if "pagedattn" in peers:
        for label, sharing in (("pagedattn", True), ("pagedattn, shared prefixes off", False)):
            llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=True,
                      max_model_len=4096, kv_cache_memory="1GiB", linear_impl=args.linear_impl,
                      huge_pages=not args.no_huge_pages, native_step=not args.no_native_step,
                      shared_prefix_attention=sharing)
            results[label] = measure_shared(pagedattn_shared_peer(llm), loads, args.repeats)
            del llm
    if "vllm" in peers:
        if not args.vllm_python or not os.path.exists(args.vllm_python):
            skipped["vllm"] = "no --vllm-python (or PAGEDATTN_VLLM_PYTHON) given"
        else:
            hf_dir = args.hf_dir or os.path.expanduser(f"~/.cache/pagedattn/{args.model}-hf")
            try:
                results["vLLM CPU engine"] = vllm_peer_figures(
                    args.vllm_python, export_hf_dir(args.model, hf_dir), loads, args,
                    shared=True)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                skipped["vllm"] = str(exc)[-500:]
    return results, skipped


def _report_shared(args, loads, results, skipped) -> None:
    columns = [c for c in SHARED_COLUMNS if c.split()[0] in loads]
    print(f"\n{MODELS[args.model]}, pagedattn {args.dtype}, prefix caching on, {args.threads} "
          f"threads, decode of the fastest of {args.repeats}, scale {args.scale}")
    for name, load in loads.items():
        lens = sorted(map(len, load.prompts))
        print(f"{name}: {len(load.prompts)} prompts of {lens[0]}-{lens[-1]} tokens, "
              f"{load.samples} sample(s) each, {load.new_tokens} new tokens")
    print(f"| peer | {' | '.join(columns)} |")
    print("|---" * (len(columns) + 1) + "|")
    for peer, figs in results.items():
        print(f"| {peer} | " + " | ".join(f"{figs[c]:.1f}" for c in columns) + " |")
    ours = results.get("pagedattn")
    for peer, figs in results.items():
        if ours is not None and peer != "pagedattn":
            print(f"| pagedattn vs {peer} (x) | "
                  + " | ".join(f"{ours[c] / figs[c]:.2f}" for c in columns) + " |")
    for peer, why in skipped.items():
        print(f"skipped {peer}: {why}")


def _report(args, llm, results, skipped, peer_info, shares) -> None:
    print(f"\n{MODELS[args.model]}, pagedattn {args.dtype}, peers {args.peer_dtype}, greedy, "
          f"{args.threads} threads, median of {args.repeats}, scale {args.scale}")
    print(f"| peer | {' | '.join(COLUMNS)} |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for peer, figs in results.items():
        print(f"| {peer} | " + " | ".join(f"{figs[c]:.1f}" for c in COLUMNS) + " |")
    if "pagedattn" in results:
        ours = results["pagedattn"]
        for peer, figs in results.items():
            if peer == "pagedattn":
                continue
            # TTFT: lower is better, so the ratio is theirs / ours; throughput ours / theirs.
            ratios = [figs[c] / ours[c] if "ms" in c else ours[c] / figs[c] for c in COLUMNS]
            print(f"| pagedattn vs {peer} (x, >1 = faster) | "
                  + " | ".join(f"{r:.2f}" for r in ratios) + " |")
        print(f"\nattention share of pagedattn's step time: W1 {shares['W1']:.0%}, "
              f"W3 {shares['W3']:.0%}")
        w1_decode = next(c for c in COLUMNS if c.startswith("W1 decode"))
        fraction, gbs, nbytes = weight_streaming_fraction(llm, ours[w1_decode])
        peer_info["pagedattn"]["weight_streaming"] = {"fraction": fraction, "dram_gb_s": gbs,
                                                      "weight_bytes_per_token": nbytes}
        print(f"W1 decode at {fraction:.2f} of the weight-streaming limit ({nbytes / 1e6:.0f} MB "
              f"of weights per token, DRAM probe {gbs:.1f} GB/s)")
    for peer, why in skipped.items():
        print(f"skipped {peer}: {why}")
    print("\npeer dtypes: " + ", ".join(f"{p} {i['dtype']}" for p, i in peer_info.items()))
    if "pagedattn" in peer_info:
        info = peer_info["pagedattn"]
        print(f"pagedattn linear layers: {info['linear_impl']}, activations "
              f"{info['linear_activations']}, weights {args.dtype}")
        if llm.linear_plan is not None:
            print("\n".join(llm.linear_plan.lines()))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    names = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(names) - {"W1", "W2", "W3", "W5", "W6"})
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from W1, W2, W3, W5, W6")
    args.peer_dtype = peer_dtype(args.peer_dtype, args.dtype)
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, max_model_len=4096,
              kv_cache_memory="1GiB", linear_impl=args.linear_impl,
              batch_invariant=args.batch_invariant, huge_pages=not args.no_huge_pages,
              native_step=not args.no_native_step)
    doc = {"args": vars(args)}
    if any(w in names for w in ("W1", "W2", "W3")):
        loads = {k: v for k, v in workloads(llm.tokenizer, args.scale).items()}
        for name, (prompts, n) in loads.items():
            lens = sorted(map(len, prompts))
            print(f"{name}: {len(prompts)} prompts of {lens[0]}-{lens[-1]} tokens, {n} new tokens each")
        results, skipped, peer_info, shares = _measure_peers(args, llm, loads, peers)
        _report(args, llm, results, skipped, peer_info, shares)
        doc.update(results=results, skipped=skipped, peers=peer_info)
    shared_loads = {k: v for k, v in shared_prefix_workloads(llm.tokenizer, args.scale).items()
                    if k in names}
    if shared_loads:
        tokenizer_only = llm.tokenizer
        del llm
        results, skipped = _measure_shared(args, shared_loads, peers)
        _report_shared(args, shared_loads, results, skipped)
        doc.update(shared_results=results, shared_skipped=skipped)
        del tokenizer_only
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
