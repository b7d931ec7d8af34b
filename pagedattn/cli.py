"""The ``pagedattn`` command.

    pagedattn info      version, torch, CPU instruction set, every backend and whether
                        it is usable on this machine (and why not)
    pagedattn bench     side-by-side attention benchmark with a roofline (see
                        ``pagedattn bench --help``)
    pagedattn generate  generate text with a model through the engine (SmolLM2, Gemma 3 built in)
    pagedattn embed     sentence embeddings with an encoder (MiniLM built in)
    pagedattn serve     an OpenAI-compatible HTTP server on the engine
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

import pagedattn
from pagedattn import thread_policy
from pagedattn.engine import huge_pages


def _native_status() -> tuple[str, str]:
    """(``native extension`` line, ``CPU ISA`` line)."""
    from pagedattn import ops

    if not ops.native_available():
        from pagedattn.ops import _native

        return (f"not loaded ({_native.LOAD_ERROR}); ops run the pure-PyTorch reference",
                f"n/a (torch reports {torch.backends.cpu.get_cpu_capability()})")
    detected = ops.best_cpu_isa()
    active = ops.get_cpu_isa()
    isa = detected.value if active == detected else f"{active.value} (forced; CPU supports {detected.value})"
    return "loaded", isa


def _backend_rows(head_size: int, dtype: torch.dtype, block_size: int) -> list[tuple[str, str]]:
    from pagedattn import registry

    config = registry.default_selector_config(head_size, dtype, block_size=block_size)
    rows = []
    for name in registry.registered_backends():
        reasons = registry.unsupported_reasons(name, config)
        rows.append((name, "usable" if not reasons else "not usable: " + "; ".join(reasons)))
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    native, isa = _native_status()
    print(f"pagedattn {pagedattn.__version__}")
    print(f"torch     {torch.__version__}  ({thread_policy.describe()})")
    print(f"python    {platform.python_version()}  ({platform.machine()})")
    print(f"native    {native}")
    print(f"CPU ISA   {isa}")
    print(f"pages     THP {huge_pages.kernel_mode()}: the engine's weights and KV cache on "
          f"{'2 MiB' if huge_pages.available() else '4 KiB'} pages")
    dtype = getattr(torch, args.dtype)
    print(f"backends  (head_size={args.head_size}, dtype={args.dtype}, block_size={args.block_size}):")
    for name, status in _backend_rows(args.head_size, dtype, args.block_size):
        print(f"  {name:<18} {status}")
    from pagedattn.models.linear_paths import describe_here

    print("linear paths per weight dtype (fp32 activations; chosen by measurement):")
    print("\n".join(describe_here()))
    print("\n".join(describe_attention_choices()))
    return 0


def describe_attention_choices() -> list[str]:
    """The attention kernels' measured choices kept for this machine (pagedattn.tuning)."""
    from pagedattn import ops, tuning
    from pagedattn.backends.cpu_runtime import PREFILL_KERNEL_ENV

    if ops.matrix_engine_available():
        bf16_gemm = {"tiles": "bf16 GEMMs on its own AMX tile loop, other shapes on oneDNN brgemm",
                     "brgemm": "oneDNN brgemm" + (", AMX tiles" if ops.cpu_has_amx() else ""),
                     "none": "oneDNN brgemm, fp32 GEMMs only"}
        engine = f"runs ({bf16_gemm[torch.ops.pagedattn.matrix_engine_bf16_microkernel()]})"
    else:
        engine = "does not run here"
    lines = [f"attention prefill kernel: vector or matrix ('amx': the matrix engine {engine}); "
             f"measured per model geometry when a model loads, {PREFILL_KERNEL_ENV} forces one"]
    path = tuning.cache_path("attention-prefill")
    entries = tuning.load("attention-prefill", tuning.machine_key())
    for key, entry in entries.items():
        times = ", ".join(f"{n} {t:.0f} us" for n, t in sorted(
            (entry.get("times_us") or {}).items(), key=lambda kv: kv[1]))
        lines.append(f"  {key}: {entry.get('chosen')} [{times}]")
    if not entries:
        lines.append(f"  cached choices: none for this machine ({path})")
    return lines


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedattn.bench import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedattn", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show version, CPU ISA and usable backends")
    info.add_argument("--head-size", type=int, default=128)
    info.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    info.add_argument("--block-size", type=int, default=16)
    info.set_defaults(func=cmd_info)
    bench = sub.add_parser("bench", help="time pagedattn against other attention "
                           "implementations, with this machine's roofline",
                           description="Time pagedattn's CPU attention against other "
                           "implementations on a scenario suite; every output is checked "
                           "against the reference first.")
    from pagedattn.bench.cli import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=cmd_bench, bench_parser=bench)
    from pagedattn.engine import cli as engine_cli

    gen = sub.add_parser("generate", help="generate text with a model (default: SmolLM2)")
    engine_cli.add_generate_arguments(gen)
    gen.set_defaults(func=engine_cli.cmd_generate)
    emb = sub.add_parser("embed", help="sentence embeddings with an encoder (default: MiniLM)")
    engine_cli.add_embed_arguments(emb)
    emb.set_defaults(func=engine_cli.cmd_embed)
    from pagedattn.serve import cli as serve_cli

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: SmolLM2 on "
                           "127.0.0.1:8000)")
    serve_cli.add_serve_arguments(serve)
    serve.set_defaults(func=serve_cli.cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
