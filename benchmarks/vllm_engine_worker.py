"""Runs W1-W3 (or, with ``--shared``, W5-W6 with prefix caching on) on vLLM's own engine;
started by bench_engine.py with a vLLM python. Prints one JSON line with the figures
(same protocol as engine_workloads.measure / measure_shared)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import SharedLoad, measure, measure_shared  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--workloads", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shared", action="store_true",
                   help="the workloads are shared-prefix ones (W5, W6): prefix caching on")
    args = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.workloads) as f:
        raw = json.load(f)
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=args.shared,
              max_model_len=4096, max_num_batched_tokens=2048)

    if args.shared:
        loads = {k: SharedLoad(**v) for k, v in raw.items()}

        # vLLM 0.32's CPU sampler fails seeded requests here ("CPU Generator does not use
        # offset", the engine dies; seen with n = 8 at 2,000 tokens), so its samples are
        # drawn unseeded: the same work per token.
        def run_shared(load, n):
            params = SamplingParams(n=load.samples, temperature=load.temperature,
                                    seed=None, max_tokens=n, ignore_eos=True)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in load.prompts], params,
                         use_tqdm=False)

        print(json.dumps(measure_shared(run_shared, loads, args.repeats)))
        return 0

    loads = {k: (v[0], v[1]) for k, v in raw.items()}

    def run(prompts, n):
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)

    print(json.dumps(measure(run, loads, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
