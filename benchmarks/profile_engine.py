"""Where an engine step's time goes: one workload of bench_engine.py (W2 by default: 32
chats, 128 new tokens each, so decode steps dominate) run once quietly for its time, then
again under ``perf record`` attached to this process, every sample sorted by the shared
object and symbol it landed in:

    gemm        oneDNN's JIT code and primitives, BLAS, our packed linear kernels
    attention   our attention kernels (decode, prefill, the cache write)
    kernels     our other native ops (norms, rotary, activations)
    elementwise torch's own kernels (copies, casts, fills, indexing)
    fork/join   threads waiting on each other: the OpenMP runtime (fork/join, barriers,
                the spin between regions) and the native kernels' pool (its workers'
                wait for a loop, the caller's wait for chunks a worker holds)
    python      the interpreter and the Python bindings
    os+alloc    the C library (malloc, memcpy), the dynamic loader and the kernel
                (page faults, futex wake-ups, scheduling)

``glue`` = fork/join + python + os+alloc. Shares are of all samples (every thread of the
process), as ``perf report`` counts them.

    .venv/bin/python benchmarks/profile_engine.py                  # SmolLM2, W2, 2 threads
    .venv/bin/python benchmarks/profile_engine.py --model gemma3 --workload W1
    .venv/bin/python benchmarks/profile_engine.py --busy 2         # beside 2 spinning processes
    .venv/bin/python benchmarks/profile_engine.py --engines 2      # and beside a second engine

Without ``perf`` (not installed, or not allowed: kernel.perf_event_paranoid) it prints the
quiet time and says why there is no split.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import pagedattn  # noqa: F401  (before torch: its OpenMP wait policy, pagedattn.thread_policy)
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import workloads  # noqa: E402

from pagedattn import LLM, SamplingParams, thread_policy  # noqa: E402
from pagedattn.models import native_stack  # noqa: E402

CATEGORIES = ("gemm", "attention", "kernels", "elementwise", "fork/join", "python",
              "os+alloc", "other")
GLUE = ("fork/join", "python", "os+alloc")

_GEMM_SYMBOLS = re.compile(r"dnnl|mkldnn|brgemm|gemm|blas|mkl_|linear_dp|packed_linear|"
                           r"linear_tile|amx_tile|amx_linear")
# The pool's own frames (csrc/cpu/work_pool.cpp): a worker's loop and wait, the caller's
# claim and wait. A chunk's work is a frame of its own (named for the op that runs it).
_POOL_SYMBOLS = re.compile(r"WorkPool|pool_run_chunks")
_PERF_MAP = re.compile(r"perf-\d+\.map")
_ATTENTION_SYMBOLS = re.compile(r"AttnKernel|attend|QkDp|PvDp|softmax|MatrixPrefill|TilePack|"
                                r"decode_scores|transpose_scores|"
                                r"matrix_pack|PrefetchCursor|execute_plan|attn_item|"
                                r"merge|slot_row|cache_write|reshape_and_cache|attention")


def classify(dso: str, symbol: str) -> str:
    """The category of one (shared object, symbol) sample."""
    name = os.path.basename(dso)
    if name.startswith(("libgomp", "libiomp", "libomp")):
        return "fork/join"
    # JIT code: perf names it "[JIT] tid N", or, where the JIT wrote a perf map (oneDNN's
    # kernels do), by the map file. The GEMMs are the JIT code a step runs.
    if dso.startswith("[JIT]") or _PERF_MAP.fullmatch(name) or "openblas" in name \
            or name.startswith(("libmkl", "libdnnl")):
        return "gemm"
    if name.startswith(("_C.", "_C_")):
        if _POOL_SYMBOLS.search(symbol):
            return "fork/join"
        if _GEMM_SYMBOLS.search(symbol):
            return "gemm"
        return "attention" if _ATTENTION_SYMBOLS.search(symbol) else "kernels"
    if name.startswith("libtorch_cpu"):
        return "gemm" if _GEMM_SYMBOLS.search(symbol) else "elementwise"
    if name.startswith(("libpython", "libtorch_python")) or ".cpython-" in name \
            or name.endswith(".abi3.so"):
        return "python"
    if name.startswith(("libc.so", "libc10", "ld-linux", "libm.so", "libstdc++", "[vdso]")) \
            or dso == "[kernel.kallsyms]":
        return "os+alloc"
    return "other"


def perf_unavailable() -> str | None:
    """Why ``perf record`` cannot sample this process, or None."""
    if shutil.which("perf") is None:
        return "perf is not installed (linux-perf)"
    try:
        level = int(open("/proc/sys/kernel/perf_event_paranoid").read())
    except OSError:
        level = 0
    if level > 2 and os.geteuid() != 0:
        return f"kernel.perf_event_paranoid is {level} (needs <= 2 or root)"
    return None


@contextmanager
def perf_record(path: str, freq: int):
    """Sample this process (all its threads) while the block runs."""
    proc = subprocess.Popen(["perf", "record", "-q", "-F", str(freq), "-p", str(os.getpid()),
                             "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # perf has attached once its first mmap events are in
    if proc.poll() is not None:
        raise RuntimeError(f"perf record failed: {proc.stderr.read().decode()[-500:]}")
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def perf_split(path: str) -> tuple[dict[str, float], list[tuple[float, str, str]]]:
    """Shares per category (percent of samples) and the raw ``(percent, dso, symbol)`` rows."""
    out = subprocess.run(["perf", "report", "-i", path, "--stdio", "--no-children",
                          "--sort", "dso,sym", "-t", "\t", "--percent-limit", "0"],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        pct = float(parts[0].strip().rstrip("%"))
        symbol = re.sub(r"^\[[.k]\]\s*", "", parts[2].strip())
        rows.append((pct, parts[1].strip(), symbol))
    split = dict.fromkeys(CATEGORIES, 0.0)
    for pct, dso, sym in rows:
        split[classify(dso, sym)] += pct
    return split, rows


@contextmanager
def busy_neighbours(count: int, seconds: float):
    """``count`` processes that only spin, each stopping by itself after ``seconds``."""
    procs = [subprocess.Popen([sys.executable, "-c",
                               f"import time\nend = time.time() + {seconds}\n"
                               "while time.time() < end: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def neighbour_engine_argv(args: argparse.Namespace) -> list[str]:
    """This script's command line for one neighbour engine: the same model and workload,
    run once when told to (``--neighbour``)."""
    argv = [sys.executable, os.path.abspath(__file__), "--neighbour", "--model", args.model,
            "--dtype", args.dtype, "--threads", str(args.threads), "--workload",
            args.workload, "--scale", str(args.scale)]
    return argv + [f for f, on in (("--no-native-step", args.no_native_step),
                                   ("--adaptive-threads", args.adaptive_threads)) if on]


def run_as_neighbour(run) -> int:
    """Say ``ready``, wait for ``go`` on stdin, run the workload once, print its time."""
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    print(f"{run():.6f}", flush=True)
    return 0


def beside_engines(count: int, args: argparse.Namespace, run, timeout_s: float) -> list[float]:
    """Run the workload here and in ``count`` neighbour engines (processes) at once; each
    engine's time, this one's first. Every neighbour is killed by ``timeout_s``."""
    procs = [subprocess.Popen(neighbour_engine_argv(args), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(count)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a neighbour engine failed to start (rc {p.wait(60)})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        mine = run()
        deadline = time.monotonic() + timeout_s
        theirs = []
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            theirs.append(float(out.split()[-1]))
        return [mine] + theirs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def at_least(low: float, kind=int):
    """An argparse type: ``kind`` values >= ``low``, refused by name otherwise."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 or gemma3 (or a model path)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=at_least(1), default=2)
    p.add_argument("--workload", choices=["W1", "W2", "W3"], default="W2")
    p.add_argument("--scale", type=at_least(0.001, float), default=1.0, help="shrink the workload (quick runs)")
    p.add_argument("--freq", type=at_least(1), default=999, help="perf samples per second per thread")
    p.add_argument("--busy", type=at_least(0), default=0,
                   help="also time the workload beside this many spinning processes")
    p.add_argument("--engines", type=at_least(1), default=1,
                   help="also time the workload in this many engines (processes) at once")
    p.add_argument("--top", type=at_least(0), default=12, help="print this many hottest symbols")
    p.add_argument("--no-native-step", action="store_true",
                   help="the decoder layers in the Python loop (EngineArgs.native_step=False)")
    p.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=False,
                   help="fewer threads per step while other processes keep the cores busy "
                        "(EngineArgs.adaptive_threads; default off)")
    p.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--perf-data", help="keep perf's samples here (perf report -i PATH)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, max_model_len=4096,
              kv_cache_memory="1GiB", native_step=not args.no_native_step,
              adaptive_threads=args.adaptive_threads)
    prompts, n = workloads(llm.tokenizer, args.scale)[args.workload]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def run() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t0

    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    if args.neighbour:
        return run_as_neighbour(run)
    quiet = min(run(), run())
    result = {"model": args.model, "workload": args.workload, "threads": args.threads,
              "quiet_s": quiet, "threading": thread_policy.describe(),
              "layers": native_stack.describe(llm.model)}
    print(f"{args.model} {args.workload}, {args.threads} threads: {quiet:.2f} s quiet "
          f"(best of 2); threading: {result['threading']}; {result['layers']}")
    if args.busy:
        with busy_neighbours(args.busy, 30 * quiet + 60):
            busy = run()
        result["busy_s"] = busy
        print(f"beside {args.busy} spinning processes: {busy:.2f} s, {busy / quiet:.2f}x quiet")
    if args.engines > 1:
        times = beside_engines(args.engines - 1, args, run, 30 * quiet + 120)
        result["engines_s"] = times
        print(f"{args.engines} engines at once: "
              + ", ".join(f"{t:.2f} s ({t / quiet:.2f}x)" for t in times)
              + f" (this one first; quiet {quiet:.2f} s)")
    result["steps"] = llm.engine.runner.threads.describe()
    print(f"threads per step: {result['steps']}")
    reason = perf_unavailable()
    if reason:
        print(f"no time split: {reason}")
    else:
        with tempfile.TemporaryDirectory() as d:
            path = args.perf_data or os.path.join(d, "perf.data")
            with perf_record(path, args.freq):
                run()
            split, rows = perf_split(path)
        result["split_percent"] = split
        result["glue_percent"] = sum(split[c] for c in GLUE)
        print("share of samples (all threads): "
              + ", ".join(f"{c} {split[c]:.1f}%" for c in CATEGORIES))
        print(f"glue (fork/join + python + os+alloc): {result['glue_percent']:.1f}%")
        print(f"hottest {args.top}:")
        for pct, dso, sym in sorted(rows, reverse=True)[:args.top]:
            print(f"  {pct:5.2f}%  {classify(dso, sym):11s} {os.path.basename(dso)}  {sym[:90]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
