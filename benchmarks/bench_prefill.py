"""Causal prefill attention (query length = context): pagedattn vs the contenders, with the matmul roofline.

Examples::

    python benchmarks/bench_prefill.py --model llama3-8b --batch 1,8 --context 2048
    python benchmarks/bench_prefill.py --quick --contenders pagedattn,vllm --json out.json

Thin wrapper over :mod:`pagedattn.bench` (same checks, timing protocol and table as
``pagedattn bench``); ``--help`` lists the options and the named models.
"""

import sys

from pagedattn.bench.scripts import main

if __name__ == "__main__":
    sys.exit(main("prefill", __doc__.splitlines()[0]))
