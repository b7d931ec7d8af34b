"""Paged decode attention (one new token per request): pagedattn vs SDPA, gather+SDPA, FlexAttention, vLLM and the reference, with the DRAM roofline.

Examples::

    python benchmarks/bench_decode.py --model llama3-8b --batch 1,8 --context 2048
    python benchmarks/bench_decode.py --quick --contenders pagedattn,vllm --json out.json

Thin wrapper over :mod:`pagedattn.bench` (same checks, timing protocol and table as
``pagedattn bench``); ``--help`` lists the options and the named models.
"""

import sys

from pagedattn.bench.scripts import main

if __name__ == "__main__":
    sys.exit(main("decode", __doc__.splitlines()[0]))
