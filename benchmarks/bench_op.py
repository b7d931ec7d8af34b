"""One attention op on a named model's head geometry, over a grid of batch x context:
pagedattn against the contenders, with the roofline, in ``pagedattn bench``'s checks,
timing protocol and table. The op comes first:

    python benchmarks/bench_op.py decode --model llama3-8b --batch 1,8 --context 2048
    python benchmarks/bench_op.py prefill --quick --contenders pagedattn,vllm --json out.json
    python benchmarks/bench_op.py reshape_and_cache --model qwen2.5-7b --batch 1,16

decode: one new token per request (DRAM roofline); prefill: causal, query length = context
(matmul roofline); reshape_and_cache: writing new keys and values into the paged cache.
``bench_op.py OP --help`` lists the options and the named models.
"""

import sys

from pagedattn.bench.scripts import main

OPS = {
    "decode": "Paged decode attention (one new token per request)",
    "prefill": "Causal prefill attention (query length = context)",
    "reshape_and_cache": "Writing new keys and values into the paged cache",
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in OPS:
        print(f"usage: bench_op.py {{{','.join(OPS)}}} [options]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], OPS[sys.argv[1]], sys.argv[2:]))
