"""Runs W1-W3 on vLLM's own engine; started by bench_engine.py with a vLLM python.
Prints one JSON line with the figures (same protocol as engine_workloads.measure)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import measure  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--workloads", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.workloads) as f:
        loads = {k: (v[0], v[1]) for k, v in json.load(f).items()}
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=4096, max_num_batched_tokens=2048)

    def run(prompts, n):
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)

    print(json.dumps(measure(run, loads, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
