"""The Triton paged-attention ops on a CUDA GPU against torch SDPA, side by side.

Decode rows time ``unified_attention`` on a paged cache (blocks in random order), in
bf16 (split-KV as chosen, and forced off: ``1split``) and with an fp8 (e4m3) cache, against SDPA on the same keys stored contiguously,
which is the best a non-paged kernel can do: the query heads of a GQA group are
folded into SDPA's query length, so one kv head is read once per group. Prefill rows
(causal, cache blocks of 16 and of 64 tokens) time it against SDPA with whichever GQA form is fastest there
(``enable_gqa=True`` or ``repeat_interleave``), named in the row. Every row checks
our output against SDPA's first. Timings are ``triton.testing.do_bench`` medians, which
clears the L2 cache before each call, so decode reads come from HBM; they include each
call's launch cost from Python. ``--cudagraph`` times CUDA-graph replays instead, as an
engine that captures graphs runs them.

Example (on a GPU)::

    python benchmarks/bench_gpu_attention.py --json gpu.json

Without a GPU, ``TRITON_INTERPRET=1 python benchmarks/bench_gpu_attention.py --smoke``
runs tiny shapes once on CPU tensors under Triton's interpreter (a check that the
script works, not a timing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pagedattn.ops import triton as tops

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DECODE_GRID = [(b, c) for b in (1, 8, 32, 128) for c in (1024, 4096, 16384)]
PREFILL_GRID = [(1, 2048), (4, 512), (1, 8192), (8, 1024)]
PREFILL_BLOCK_SIZES = (16, 64)  # the cache block sizes issue 35 asks to be fast
SMOKE_DECODE, SMOKE_PREFILL = [(2, 40)], [(2, 24)]


@dataclass
class Row:
    kind: str
    shape: str
    ours_us: float
    peer: str
    peer_us: float
    max_abs_err: float
    rate: str

    @property
    def speedup(self) -> float:
        return self.peer_us / self.ours_us


def load_ops(path: str):
    """Another copy of the ``pagedattn.ops.triton`` package (e.g. a previous commit's,
    ``git archive``d into ``path``), imported under its own name."""
    init = os.path.join(path, "__init__.py")
    spec = importlib.util.spec_from_file_location("other_triton_ops", init,
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _timer(device: torch.device, cudagraph: bool = False):
    if device.type == "cuda":
        import triton.testing

        if cudagraph:
            return lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100,
                                                                       return_mode="median")
        return lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100,
                                                         return_mode="median")

    def once(fn):
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)

    return once


def paged_cache(keys: torch.Tensor, values: torch.Tensor,
                cache_dtype: torch.dtype | None = None, block_size: int = BLOCK_SIZE):
    """``(key_cache, value_cache, block_table)`` holding ``keys``/``values``
    ``[B, L, kv, hs]`` in the flash layout, blocks placed in a random order."""
    batch, length = keys.shape[:2]
    blocks_per_seq = math.ceil(length / block_size)
    padded = blocks_per_seq * block_size
    order = torch.randperm(batch * blocks_per_seq, device=keys.device)

    def place(x):
        x = F.pad(x, (0, 0, 0, 0, 0, padded - length))
        blocks = x.reshape(batch * blocks_per_seq, block_size, *x.shape[2:])
        cache = torch.empty_like(blocks)
        cache[order] = blocks
        return cache if cache_dtype is None else cache.to(cache_dtype)

    block_table = order.view(batch, blocks_per_seq).to(torch.int32)
    return place(keys), place(values), block_table


def run_ours(q, key_cache, value_cache, block_table, query_lens, seq_lens, causal,
             num_kv_splits=None):
    device = q.device
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    used = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    descale = None
    if key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        descale = torch.ones(len(seq_lens), NUM_KV_HEADS, device=device)

    def call():
        tops.unified_attention(q, key_cache, value_cache, out, cu, max(query_lens), used,
                               max(seq_lens), 1 / math.sqrt(HEAD_SIZE), causal, None, (-1, -1),
                               block_table, 0.0, None, descale, descale,
                               num_kv_splits=num_kv_splits)
        return out

    return call


def random_inputs(batch: int, length: int, query_len: int, device, dtype):
    """``(q, keys, values, k_sdpa, v_sdpa)``: keys/values ``[B, L, kv, hs]`` and the same
    as SDPA's contiguous ``[B, kv, L, hs]``; q ``[B, query_len, heads, hs]``."""
    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    keys = randn(batch, length, NUM_KV_HEADS, HEAD_SIZE)
    values = randn(batch, length, NUM_KV_HEADS, HEAD_SIZE)
    q = randn(batch, query_len, NUM_HEADS, HEAD_SIZE)
    return q, keys, values, keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()


def decode_rows(grid, device, dtype, timer) -> list[Row]:
    rows = []
    group = NUM_HEADS // NUM_KV_HEADS
    for batch, context in grid:
        q, keys, values, k_sdpa, v_sdpa = random_inputs(batch, context, 1, device, dtype)
        q = q.view(batch, NUM_HEADS, HEAD_SIZE)
        # SDPA: [B, kv, group, hs] queries against [B, kv, L, hs] keys (contiguous).
        q_sdpa = q.view(batch, NUM_KV_HEADS, group, HEAD_SIZE)

        def sdpa():
            return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa)

        expected = sdpa().reshape(batch, NUM_HEADS, HEAD_SIZE).float()
        sdpa_us = timer(sdpa)
        kv_bytes = 2 * keys.numel() * keys.element_size()
        variants = (("", None, None), ("1split", None, 1), ("fp8", torch.float8_e4m3fn, None))
        for label, cache_dtype, splits in variants:
            kc, vc, table = paged_cache(keys, values, cache_dtype)
            ours = run_ours(q, kc, vc, table, [1] * batch, [context] * batch, causal=True,
                            num_kv_splits=splits)
            err = (ours().float() - expected).abs().max().item()
            ours_us = timer(ours)
            bytes_read = kv_bytes // (2 if cache_dtype is not None else 1)
            rows.append(Row(f"decode{'-' + label if label else ''}", f"B{batch} x {context}",
                            ours_us, f"sdpa (contiguous, {str(dtype)[6:]})", sdpa_us, err,
                            f"{bytes_read / ours_us / 1e3:.0f} GB/s"))
        del keys, values, k_sdpa, v_sdpa
    return rows


def prefill_rows(grid, device, dtype, timer) -> list[Row]:
    rows = []
    group = NUM_HEADS // NUM_KV_HEADS
    for batch, length in grid:
        q, keys, values, k_sdpa, v_sdpa = random_inputs(batch, length, length, device, dtype)
        q_sdpa = q.transpose(1, 2).contiguous()
        k_rep = k_sdpa.repeat_interleave(group, dim=1)
        v_rep = v_sdpa.repeat_interleave(group, dim=1)
        peers = {
            "sdpa enable_gqa": lambda: F.scaled_dot_product_attention(
                q_sdpa, k_sdpa, v_sdpa, is_causal=True, enable_gqa=True),
            "sdpa repeat_interleave": lambda: F.scaled_dot_product_attention(
                q_sdpa, k_sdpa.repeat_interleave(group, dim=1),
                v_sdpa.repeat_interleave(group, dim=1), is_causal=True),
            "sdpa pre-repeated kv": lambda: F.scaled_dot_product_attention(
                q_sdpa, k_rep, v_rep, is_causal=True),
        }
        expected = peers["sdpa pre-repeated kv"]().transpose(1, 2).reshape(
            batch * length, NUM_HEADS, HEAD_SIZE).float()
        peer_times = {name: timer(fn) for name, fn in peers.items()}
        best = min(peer_times, key=peer_times.get)
        flops = 4 * batch * NUM_HEADS * HEAD_SIZE * length * (length + 1) / 2
        for block_size in PREFILL_BLOCK_SIZES:
            kc, vc, table = paged_cache(keys, values, block_size=block_size)
            ours = run_ours(q.reshape(batch * length, NUM_HEADS, HEAD_SIZE), kc, vc, table,
                            [length] * batch, [length] * batch, causal=True)
            err = (ours().float() - expected).abs().max().item()
            ours_us = timer(ours)
            kind = "prefill" if block_size == BLOCK_SIZE else f"prefill-b{block_size}"
            rows.append(Row(kind, f"{batch} x {length}", ours_us, best, peer_times[best],
                            err, f"{flops / ours_us / 1e6:.0f} TFLOP/s"))
            del kc, vc
        del keys, values, k_rep, v_rep
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, one call each (CPU tensors under TRITON_INTERPRET=1)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--cudagraph", action="store_true",
                   help="time CUDA-graph replays (no launch overhead; L2 is not cleared "
                        "between calls, so small decodes may read from L2)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--ops-dir", help="time this copy of pagedattn/ops/triton instead (the "
                   "before column of a change)")
    args = p.parse_args(argv)
    if args.ops_dir:
        global tops
        tops = load_ops(args.ops_dir)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    problem = tops.launch_problem(device)
    if problem is not None:
        print(f"cannot run the Triton kernels on {device}: {problem}", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if device.type == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float16  # the interpreter's bf16 tl.dot is wrong
    timer = _timer(device, args.cudagraph)
    torch.manual_seed(0)
    decode_grid = SMOKE_DECODE if args.smoke else DECODE_GRID
    prefill_grid = SMOKE_PREFILL if args.smoke else PREFILL_GRID
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter)"
    print(f"{where}; {dtype}; {NUM_HEADS}/{NUM_KV_HEADS} heads x {HEAD_SIZE}, block "
          f"{BLOCK_SIZE}; torch {torch.__version__}; "
          f"{'CUDA-graph replays' if args.cudagraph else 'eager calls, L2 cleared before each'}"
          f"{'; ops from ' + args.ops_dir if args.ops_dir else ''}")
    rows = decode_rows(decode_grid, device, dtype, timer)
    rows += prefill_rows(prefill_grid, device, dtype, timer)
    print(f"{'what':<13} {'shape':<13} {'ours us':>9} {'peer us':>9} {'x peer':>7} "
          f"{'max err':>8} {'rate':>14}  peer")
    for r in rows:
        print(f"{r.kind:<13} {r.shape:<13} {r.ours_us:9.1f} {r.peer_us:9.1f} "
              f"{r.speedup:7.2f} {r.max_abs_err:8.4f} {r.rate:>14}  {r.peer}")
    bad = [r for r in rows if not r.max_abs_err < (0.25 if "fp8" in r.kind else 0.03)]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": where, "dtype": str(dtype), "torch": torch.__version__,
                       "cudagraph": args.cudagraph,
                       "rows": [asdict(r) | {"speedup": r.speedup} for r in rows]}, fh, indent=1)
    if bad:
        print(f"outputs differ from SDPA's: {[f'{r.kind} {r.shape}' for r in bad]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
