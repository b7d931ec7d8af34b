"""KV-cache writes (cpu_attn_reshape_and_cache) of CONTEXT x BATCH tokens: pagedattn vs vLLM and the reference, with the DRAM roofline.

Examples::

    python benchmarks/bench_reshape_and_cache.py --model llama3-8b --batch 1,8 --context 2048
    python benchmarks/bench_reshape_and_cache.py --quick --contenders pagedattn,vllm --json out.json

Thin wrapper over :mod:`pagedattn.bench` (same checks, timing protocol and table as
``pagedattn bench``); ``--help`` lists the options and the named models.
"""

import sys

from pagedattn.bench.scripts import main

if __name__ == "__main__":
    sys.exit(main("reshape_and_cache", __doc__.splitlines()[0]))
