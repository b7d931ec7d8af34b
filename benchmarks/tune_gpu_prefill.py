"""Sweep the tile shapes of ``unified_attention`` on a CUDA GPU against torch SDPA.

For the causal prefills of ``bench_gpu_attention.py`` (32/8 heads x 128, bf16, blocks
in random order) with cache blocks of 16 and of 64 tokens, every tile shape of the grid
(rows x keys x warps x stages) is compiled, checked against SDPA and timed; shapes that
fail to compile or to launch (shared memory) are skipped and listed. Decode batches
B8-B32 get a second, smaller sweep over keys per tile, stages and the split-KV count.

Compiling is most of the cost, so it runs first in a pool of processes that fill
Triton's on-disk cache with the exact specialisations timed later; timing is serial.
Timings are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``):
kernel time without the Python launch cost, which ``bench_gpu_attention.py`` reports.

``--baseline DIR`` also times another copy of ``pagedattn/ops/triton`` (e.g. the
previous commit's, ``git archive``d into DIR) with its own default tiles: the before
column. Results: a table on stdout, all rows in ``--out``/tune.json.

Example (on a GPU)::

    PYTHONPATH=$PWD python3 benchmarks/tune_gpu_prefill.py --out results --baseline .baseline
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, wait
from multiprocessing import get_context

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_attention import (HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS,  # noqa: E402
                                 load_ops, paged_cache, random_inputs)

from pagedattn.ops import triton as tops  # noqa: E402

GROUP = NUM_HEADS // NUM_KV_HEADS
PREFILL_SHAPES = [(1, 2048), (4, 512), (1, 8192), (8, 1024)]
PREFILL_BLOCK_SIZES = (16, 64)
# (rows, keys, warps, stages); rows = tokens x the 4 heads of a GQA group.
PREFILL_CONFIGS = [c for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
PREFILL_CONFIGS += [(256, n, 8, s) for n in (32, 64) for s in (2, 3)]
# The likeliest first: a run cut short by its deadlines still covers them.
PREFILL_CONFIGS.sort(key=lambda c: (c[0] != 128, c[2] != 8, c[1] == 32, c[0], c))
DECODE_SHAPES = [(8, 1024), (8, 16384), (16, 4096), (32, 1024), (32, 16384)]
DECODE_CONFIGS = [(16, n, 4, s) for n in (32, 64, 128) for s in (2, 3, 4)]
DECODE_SPLITS = (None, 1, 2, 4, 8, 16)  # None: the plan's choice
MAX_ERR = 0.03  # bf16 against SDPA, as bench_gpu_attention.py
DEVICE, DTYPE = "cuda", torch.bfloat16
# Pool workers compile decode kernels on this context length (the block table's
# stride keeps the same divisibility, so the timed shapes hit Triton's cache) rather
# than allocate 16 copies of the largest caches.
DECODE_COMPILE_LENGTH = 1024


def smoke() -> None:
    """Tiny shapes on CPU tensors under TRITON_INTERPRET=1: the script's own check."""
    global PREFILL_SHAPES, PREFILL_CONFIGS, DECODE_SHAPES, DECODE_CONFIGS, DECODE_SPLITS
    global DEVICE, DTYPE, DECODE_COMPILE_LENGTH
    PREFILL_SHAPES, DECODE_SHAPES = [(1, 40), (2, 24)], [(2, 70)]
    PREFILL_CONFIGS, DECODE_CONFIGS = [(64, 32, 4, 2), (32, 16, 4, 2)], [(16, 32, 4, 2)]
    DECODE_SPLITS, DEVICE, DTYPE, DECODE_COMPILE_LENGTH = (None, 2), "cpu", torch.float16, 70


def tiles_for(cfg, max_seqlen_q: int) -> tops.Tiles:
    rows, block_n, warps, stages = cfg
    group_p = 1 << (GROUP - 1).bit_length()
    block_q = max(1, rows // group_p)
    block_q = min(block_q, max(1 << (max_seqlen_q - 1).bit_length(), 16 // group_p))
    return tops.Tiles(block_q, group_p, max(16, 1 << (HEAD_SIZE - 1).bit_length()),
                      block_n, warps, stages)


class Problem:
    """One batch on the GPU: paged caches, SDPA's reference output and a caller for
    ``unified_attention`` (ours, or the baseline's) with given tiles/splits."""

    def __init__(self, batch, length, query_len, block_size, seed=0):
        torch.manual_seed(seed)
        device = torch.device(DEVICE)
        q, keys, values, k_sdpa, v_sdpa = random_inputs(batch, length, query_len, device,
                                                        DTYPE)
        self.kc, self.vc, self.table = paged_cache(keys, values, block_size=block_size)
        self.decode = query_len == 1
        if self.decode:
            q_sdpa = q.view(batch, NUM_KV_HEADS, GROUP, HEAD_SIZE)
            self.sdpa = lambda: F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa)
        else:
            q_sdpa = q.transpose(1, 2).contiguous()
            k_rep = k_sdpa.repeat_interleave(GROUP, dim=1)
            v_rep = v_sdpa.repeat_interleave(GROUP, dim=1)
            # SDPA's faster GQA form on this machine (bench_gpu_attention.py times both).
            self.sdpa_forms = [
                lambda: F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, is_causal=True,
                                                       enable_gqa=True),
                lambda: F.scaled_dot_product_attention(q_sdpa, k_rep, v_rep, is_causal=True)]
            self.sdpa = self.sdpa_forms[1]
        self.expected = self.sdpa().transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_SIZE).float() \
            if not self.decode else self.sdpa().reshape(-1, NUM_HEADS, HEAD_SIZE).float()
        self.q = q.reshape(batch * query_len, NUM_HEADS, HEAD_SIZE)
        self.out = torch.empty_like(self.q)
        self.cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * query_len
        self.used = torch.full((batch,), length, dtype=torch.int32, device=device)
        self.query_len, self.length = query_len, length
        self.flops = 4 * batch * NUM_HEADS * HEAD_SIZE * length * (length + 1) / 2
        self.kv_bytes = 2 * keys.numel() * keys.element_size()
        if self.decode:
            self.sdpa_forms = [self.sdpa]

    def caller(self, ops=tops, tiles=None, splits=None):
        kwargs = {} if tiles is None else {"tiles": tiles}
        if splits is not None:
            kwargs["num_kv_splits"] = splits

        def call():
            ops.unified_attention(self.q, self.kc, self.vc, self.out, self.cu, self.query_len,
                                  self.used, self.length, 1 / math.sqrt(HEAD_SIZE), True, None,
                                  (-1, -1), self.table, 0.0, None, None, None, **kwargs)
            return self.out
        return call

    def error(self, call) -> float:
        self.out.fill_(float("nan"))
        return (call().float() - self.expected).abs().max().item()


def _compile_task(task):
    """In a pool worker: run one configuration once on every shape it will be timed on
    (compiling it into Triton's cache); its error against SDPA, or why it failed."""
    kind, block_size, cfg, baseline = task
    try:
        ops = load_ops(baseline) if cfg is None else tops
        results = {}
        shapes = PREFILL_SHAPES if kind == "prefill" else DECODE_SHAPES
        for batch, length in shapes:
            if kind == "decode":
                length = DECODE_COMPILE_LENGTH
            prob = Problem(batch, length, length if kind == "prefill" else 1, block_size)
            splits_list = (None,) if kind == "prefill" or cfg is None else DECODE_SPLITS
            for splits in splits_list:
                tiles = None if cfg is None else tiles_for(cfg, prob.query_len)
                err = prob.error(prob.caller(ops, tiles, splits))
                results[f"{batch}x{length}/{splits}"] = err
            del prob
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return task, results, None
    except Exception as exc:  # a config that does not compile or launch is skipped
        return task, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def graph_us(fn) -> float:
    if DEVICE == "cpu":
        begin = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - begin)
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="tune-results")
    p.add_argument("--baseline", help="directory of another pagedattn/ops/triton package")
    p.add_argument("--workers", type=int, default=None,
                   help="compile processes (default: up to 16; 0 compiles in this one)")
    p.add_argument("--compile-s", type=float, default=100,
                   help="configurations not compiled after this many seconds are dropped")
    p.add_argument("--prefill-s", type=float, default=60,
                   help="stop timing new prefill configurations after this many seconds")
    p.add_argument("--decode-s", type=float, default=40,
                   help="stop timing new decode configurations after this many seconds")
    p.add_argument("--only", help="time only these prefill configs, "
                   "e.g. '128,64,8,3;128,128,8,2' (no decode sweep)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU tensors (TRITON_INTERPRET=1): checks the script")
    args = p.parse_args(argv)
    if args.workers is None:
        args.workers = 0 if args.smoke else min(16, os.cpu_count() or 1)
    return args


def _compile_all(args, tasks, report) -> dict:
    """``{(kind, block, cfg): errors}`` of the tasks that compiled in time; the others go
    to ``report["failed"]``."""
    if args.workers:
        pool = ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"))
        futures = [pool.submit(_compile_task, t) for t in tasks]
        done, late = wait(futures, timeout=args.compile_s)
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list((pool._processes or {}).values()):  # stragglers would skew timings
            proc.terminate()
        outcomes = [f.result() for f in futures if f in done]
        report["failed"] += [{"kind": t[0], "block": t[1], "cfg": t[2], "why": "compile deadline"}
                             for t, f in zip(tasks, futures) if f in late]
    else:
        outcomes = [_compile_task(t) for t in tasks]
    compiled = {}
    for task, errors, why in outcomes:
        kind, bs, cfg, _ = task
        if why is not None:
            report["failed"].append({"kind": kind, "block": bs, "cfg": cfg, "why": why})
        else:
            compiled[(kind, bs, cfg)] = errors
    return compiled


def _timed(error_of, call, report, failure: dict):
    """``(error_of(), graph-replay us of call)`` (us NaN when the error is too large), or
    None when either raised: then ``failure`` goes to the report with the reason."""
    try:
        err = error_of()
        return err, graph_us(call) if err < MAX_ERR else float("nan")
    except Exception as exc:
        report["failed"].append({**failure, "why": f"timing: {exc}"[:200]})
        return None


def _time_prefill(args, prefill_configs, compiled, baseline, record, report) -> None:
    # Configurations outermost: a run cut short by the budget drops whole configurations
    # and every one it kept covers every shape.
    problems = {}
    for bs in PREFILL_BLOCK_SIZES:
        for batch, length in PREFILL_SHAPES:
            prob = problems[(bs, batch, length)] = Problem(batch, length, length, bs)
            prob.sdpa_us = min(graph_us(fn) for fn in prob.sdpa_forms)
            record(kind="prefill", block=bs, shape=f"{batch}x{length}", cfg="sdpa",
                   us=prob.sdpa_us, err=0.0, tflops=prob.flops / prob.sdpa_us / 1e6)
    timing_start = time.time()
    for cfg in ([None] if baseline else []) + list(prefill_configs):
        if cfg is not None and time.time() - timing_start > args.prefill_s:
            print(f"budget: prefill configs from {cfg} on not timed", flush=True)
            break
        for (bs, batch, length), prob in problems.items():
            if cfg is not None and ("prefill", bs, cfg) not in compiled:
                continue
            ops = baseline if cfg is None else tops
            call = prob.caller(ops, None if cfg is None else tiles_for(cfg, length))
            timed = _timed(lambda: prob.error(call), call, report,
                           {"kind": "prefill", "block": bs, "cfg": cfg})
            if timed is None:
                continue
            err, us = timed
            record(kind="prefill", block=bs, shape=f"{batch}x{length}",
                   cfg="baseline" if cfg is None else list(cfg), us=us, err=err,
                   tflops=prob.flops / us / 1e6, x_sdpa=prob.sdpa_us / us)


def _time_decode(args, decode_configs, compiled, baseline, record, report) -> None:
    problems = {}
    for batch, length in DECODE_SHAPES if decode_configs else []:
        prob = problems[(batch, length)] = Problem(batch, length, 1, 16)
        prob.sdpa_us = graph_us(prob.sdpa)
        record(kind="decode", block=16, shape=f"B{batch}x{length}", cfg="sdpa",
               us=prob.sdpa_us, err=0.0, gbps=prob.kv_bytes / prob.sdpa_us / 1e3)
    candidates = [(None, None)] if baseline else []
    candidates += [(c, s) for c in decode_configs if ("decode", 16, c) in compiled
                   for s in DECODE_SPLITS]
    timing_start = time.time()
    for cfg, splits in candidates if problems else []:
        if time.time() - timing_start > args.decode_s:
            print(f"budget: decode configs from {cfg}/{splits} on not timed", flush=True)
            break
        for (batch, length), prob in problems.items():
            ops = baseline if cfg is None else tops
            call = prob.caller(ops, None if cfg is None else tiles_for(cfg, 1), splits)
            timed = _timed(lambda: prob.error(call), call, report,
                           {"kind": "decode", "cfg": cfg, "splits": splits})
            if timed is None:
                continue
            err, us = timed
            record(kind="decode", block=16, shape=f"B{batch}x{length}",
                   cfg="baseline" if cfg is None else [*cfg, splits or 0], us=us, err=err,
                   gbps=prob.kv_bytes / us / 1e3, x_sdpa=prob.sdpa_us / us)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.smoke:
        smoke()
    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    only = [tuple(int(x) for x in c.split(",")) for c in args.only.split(";")] \
        if args.only else None
    prefill_configs = only or PREFILL_CONFIGS
    decode_configs = [] if only else DECODE_CONFIGS
    # The few baseline and decode tasks first, then the prefill grid in its order.
    tasks = []
    if args.baseline:
        tasks += [("prefill", bs, None, args.baseline) for bs in PREFILL_BLOCK_SIZES]
        if decode_configs:
            tasks.append(("decode", 16, None, args.baseline))
    tasks += [("decode", 16, cfg, args.baseline) for cfg in decode_configs]
    tasks += [("prefill", bs, cfg, args.baseline) for cfg in prefill_configs
              for bs in PREFILL_BLOCK_SIZES]
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
              "torch": torch.__version__,
              "triton": __import__("triton").__version__, "rows": [], "failed": []}
    print(f"{report['device']}; torch {report['torch']}; triton {report['triton']}; "
          f"{len(tasks)} compile tasks on {args.workers} workers", flush=True)
    compiled = _compile_all(args, tasks, report)
    print(f"compiled in {time.time() - start:.0f} s; {len(report['failed'])} failed",
          flush=True)
    baseline = load_ops(args.baseline) if args.baseline else None

    def record(**row):
        report["rows"].append(row)
        with open(os.path.join(args.out, "tune.json"), "w") as fh:
            json.dump(report, fh, indent=1)

    _time_prefill(args, prefill_configs, compiled, baseline, record, report)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    _time_decode(args, decode_configs, compiled, baseline, record, report)
    summarize(report)
    print(f"total {time.time() - start:.0f} s", flush=True)
    return 0


def summarize(report) -> None:
    rows = report["rows"]
    for why in report["failed"][:12]:
        print("failed:", why)
    print(f"{len(report['failed'])} failed in all")

    def geomean(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")

    for kind in ("prefill", "decode"):
        mine = [r for r in rows if r["kind"] == kind and isinstance(r["cfg"], list)]
        for bs in sorted({r["block"] for r in mine}):
            by_cfg = {}
            for r in mine:
                if r["block"] == bs and r["us"] == r["us"]:
                    by_cfg.setdefault(tuple(r["cfg"]), {})[r["shape"]] = r["x_sdpa"]
            shapes = sorted({r["shape"] for r in mine if r["block"] == bs})
            full = {c: v for c, v in by_cfg.items() if len(v) == len(shapes)}
            ranked = sorted(full, key=lambda c: -geomean(list(full[c].values())))
            print(f"\n{kind}, block {bs}: best configs by geometric mean of x SDPA "
                  f"(rows,keys,warps,stages{',splits' if kind == 'decode' else ''})")
            print(f"{'config':<22}" + "".join(f"{s:>12}" for s in shapes) + f"{'geomean':>9}")
            for c in ranked[:6]:
                print(f"{str(c):<22}" + "".join(f"{full[c][s]:12.2f}" for s in shapes)
                      + f"{geomean(list(full[c].values())):9.2f}")
            print(f"{'best per shape':<22}" + "".join(
                f"{max(v.get(s, 0) for v in by_cfg.values()):12.2f}" for s in shapes))
        print(f"\n{kind}: per shape (graph-replay us)")
        for r in rows:
            if r["kind"] == kind and not isinstance(r["cfg"], list):
                print(f"  block {r['block']:>2} {r['shape']:<10} {r['cfg']:<9} {r['us']:9.1f} us"
                      + (f"  x{r['x_sdpa']:.2f}" if "x_sdpa" in r else "")
                      + (f"  {r['tflops']:.0f} TFLOP/s" if "tflops" in r else
                         f"  {r['gbps']:.0f} GB/s"))
        best = {}
        for r in mine:
            key = (r["block"], r["shape"])
            if r["us"] == r["us"] and (key not in best or r["us"] < best[key]["us"]):
                best[key] = r
        for (bs, shape), r in sorted(best.items()):
            print(f"  block {bs:>2} {shape:<10} best {str(r['cfg']):<22} {r['us']:9.1f} us"
                  f"  x{r['x_sdpa']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
