"""Benchmark scenarios: named batch shapes, their roofline counts, and their inputs.

A :class:`Scenario` is one row of the ``pagedattn bench`` table. Its inputs are built by
:func:`build_inputs` *vectorised* (no per-token Python loops, unlike
``pagedattn.testing.make_paged_batch``) so multi-GiB decode scenarios build in seconds.

Why several copies of the KV: a decode step reads every KV byte exactly once, so timing
the same cache over and over measures the last-level cache, not DRAM. ``build_inputs``
lays out ``copies`` independent copies of the batch's KV in one paged pool, copy ``c`` in
its own region of the pool (its blocks in random order inside it, its own block table),
and the runner rotates over them: call ``i`` reads copy ``i % copies``. After each timed
call the runner also streams a region (the ``t/stream`` column), half a rotation ahead
(:func:`stream_offset`), so the stream never reads what a call just read nor a call what
the stream just read: :func:`copies_for` makes at least 2x the LLC of other bytes pass
between two reads of any byte (:func:`reuse_gaps`), whatever the LLC.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field, replace

import torch

from pagedattn import paging
from pagedattn.ops.reference import FP8_CACHE_DTYPES

ATTENTION_KINDS = ("decode", "prefill", "mixed")
KINDS = ATTENTION_KINDS + ("reshape_and_cache",)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# KV-cache storage: "auto" = the model dtype, or an fp8 format (vLLM's kv_cache_dtype names).
KV_DTYPES = {"auto": None, **FP8_CACHE_DTYPES}
FP8_KV_SCALE = 0.05
"""k_scale = v_scale of fp8 scenarios: randn / 0.05 spans e4m3's normal range."""


@dataclass(frozen=True)
class Scenario:
    """One benchmark case.

    ``seq_lens[r]`` is request ``r``'s total KV length (prior context + new tokens),
    ``query_lens[r]`` its new tokens. For ``reshape_and_cache`` the request lengths give the
    tokens written (``query_lens``) and only the cache geometry matters for attention heads.

    ``shared_prefix`` > 0: the batch splits into ``shared_groups`` equal groups of
    consecutive requests, and each group's requests hold their first ``shared_prefix`` keys
    in the same blocks (prefix caching's shared system prompt, or the samples of one
    prompt): their block tables begin with the same block ids.
    """

    name: str
    kind: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    block_size: int = 32
    causal: bool = True
    kv_dtype: str = "auto"
    shared_prefix: int = 0
    shared_groups: int = 1

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"scenario {self.name!r}: kv_dtype must be one of {tuple(KV_DTYPES)}, got "
                f"{self.kv_dtype!r}"
            )
        if self.kind not in KINDS:
            raise ValueError(f"scenario {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"scenario {self.name!r}: dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}"
            )
        if not self.seq_lens or len(self.seq_lens) != len(self.query_lens):
            raise ValueError(
                f"scenario {self.name!r}: need one query_len per seq_len, got "
                f"{len(self.query_lens)} and {len(self.seq_lens)}"
            )
        for r, (s, q) in enumerate(zip(self.seq_lens, self.query_lens)):
            if q < 1 or s < q:
                raise ValueError(
                    f"scenario {self.name!r}: request {r} needs 1 <= query_len <= seq_len, "
                    f"got query_len {q}, seq_len {s}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"scenario {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.shared_prefix:
            if self.shared_prefix < 0 or self.shared_prefix % self.block_size:
                raise ValueError(f"scenario {self.name!r}: shared_prefix ({self.shared_prefix}) "
                                 f"must be a multiple of block_size ({self.block_size})")
            if self.shared_groups < 1 or self.batch % self.shared_groups:
                raise ValueError(f"scenario {self.name!r}: shared_groups ({self.shared_groups}) "
                                 f"must divide the batch ({self.batch})")
            if any(s - q < self.shared_prefix for s, q in zip(self.seq_lens, self.query_lens)):
                raise ValueError(f"scenario {self.name!r}: shared_prefix ({self.shared_prefix}) "
                                 "must fit in every request's context before its new tokens")

    # ------------------------------------------------------------------ descriptions
    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def cache_torch_dtype(self) -> torch.dtype:
        """dtype of the KV cache tensors: the model dtype, or the fp8 format."""
        return KV_DTYPES[self.kv_dtype] or self.torch_dtype

    @property
    def is_fp8(self) -> bool:
        return KV_DTYPES[self.kv_dtype] is not None

    @property
    def kv_scale(self) -> float:
        """Per-tensor k_scale / v_scale the cache is written and read with."""
        return FP8_KV_SCALE if self.is_fp8 else 1.0

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def context_label(self) -> str:
        """Context length(s) as a short string: ``2048`` or ``2048,1536+512``."""
        parts = []
        for s, q in dict.fromkeys(zip(self.seq_lens, self.query_lens)):
            parts.append(str(s) if q == 1 or q == s else f"{s - q}+{q}")
        if self.shared_prefix:  # ``2176/2048sh`` (x4: four groups)
            groups = f"x{self.shared_groups}" if self.shared_groups > 1 else ""
            return ",".join(parts) + f"/{self.shared_prefix}sh{groups}"
        return ",".join(parts)

    @property
    def batch_label(self) -> str:
        if self.kind == "reshape_and_cache":
            return f"{self.num_tokens} tok"
        if self.kind == "mixed":
            decodes = sum(q == 1 for q in self.query_lens)
            return f"{decodes}d+{self.batch - decodes}p"
        return str(self.batch)

    @property
    def short_dtype(self) -> str:
        """``bf16``, or ``bf16/fp8_e4m3`` for an fp8 KV cache."""
        return _SHORT_DTYPE[self.dtype] + (f"/{self.kv_dtype}" if self.is_fp8 else "")

    def describe(self) -> dict:
        """JSON-ready description (the ``scenario`` object of the results schema)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "batch": self.batch,
            "seq_lens": list(self.seq_lens),
            "query_lens": list(self.query_lens),
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "causal": self.causal,
            "kv_dtype": self.kv_dtype,
            "shared_prefix": self.shared_prefix,
            "shared_groups": self.shared_groups,
            "bytes": self.bytes_moved(),
            "flops": self.flops(),
        }

    # ------------------------------------------------------------------ roofline counts
    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def kv_bytes(self) -> int:
        """Bytes of K and V one call must read (attention: a shared prefix once per group)
        or write (reshape_and_cache)."""
        cache_element = torch.empty((), dtype=self.cache_torch_dtype).element_size()
        row = self.num_kv_heads * self.head_size * cache_element * 2  # K and V
        if self.kind == "reshape_and_cache":
            return self.num_tokens * row
        return self.kv_tokens() * row

    def kv_tokens(self) -> int:
        """Distinct cached tokens of the batch: a shared prefix counts once per group."""
        return sum(self.seq_lens) - (self.batch - self.shared_groups) * self.shared_prefix

    def bytes_moved(self) -> int:
        """Compulsory DRAM traffic of one call.

        Attention: the KV once, plus the query read and the output written.
        reshape_and_cache: the new K/V read once and written once into the cache.
        """
        if self.kind == "reshape_and_cache":
            return 2 * self.kv_bytes()
        qo = 2 * self.num_tokens * self.num_heads * self.head_size * self.element_size
        return self.kv_bytes() + qo

    def visible_pairs(self) -> int:
        """(query, key) pairs the attention mask lets through, summed over requests."""
        total = 0
        for s, q in zip(self.seq_lens, self.query_lens):
            if not self.causal:
                total += q * s
                continue
            # Query i sits at p = s - q + i and sees keys 0..p: (s - q + 1) + ... + s.
            total += q * (s - q) + q * (q + 1) // 2
        return total

    def flops(self) -> int:
        """Attention FLOPs counted honestly under the mask: ``QK^T`` and ``PV`` each
        cost ``2*d`` per visible pair per query head; masked pairs are not counted."""
        if self.kind == "reshape_and_cache":
            return 0
        return 4 * self.head_size * self.visible_pairs() * self.num_heads


def _decode(batch: int, ctx: int, kv_dtype: str = "auto", *, heads: tuple[int, int] = (32, 8),
            head_size: int = 128) -> Scenario:
    """A decode row; a geometry other than 32/8 heads x 128 is named in a suffix
    (``decode-b8-c2048-h32-32x128``: 32 query heads, 32 kv heads, head size 128)."""
    nh, nkv = heads
    geom = "" if (heads, head_size) == ((32, 8), 128) else f"-h{nh}-{nkv}x{head_size}"
    return with_kv_dtype(Scenario(f"decode-b{batch}-c{ctx}{geom}", "decode", (ctx,) * batch,
                                  (1,) * batch, num_heads=nh, num_kv_heads=nkv,
                                  head_size=head_size), kv_dtype)


def _shared_decode(batch: int, shared: int, own: int, groups: int = 1) -> Scenario:
    """A decode row whose requests hold their first ``shared`` keys in the same blocks
    (``groups`` groups of them, each its own prefix) and ``own`` keys each of their own:
    ``decode-b32-c2176-shared2048`` (one group), ``...-shared2048x4`` (four)."""
    tag = f"-shared{shared}" + (f"x{groups}" if groups > 1 else "")
    return Scenario(f"decode-b{batch}-c{shared + own}{tag}", "decode", (shared + own,) * batch,
                    (1,) * batch, shared_prefix=shared, shared_groups=groups)


def with_kv_dtype(s: Scenario, kv_dtype: str) -> Scenario:
    """``s`` with its KV cache stored as ``kv_dtype`` (named ``<name>-<kv_dtype>``)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == s.kv_dtype:
        return s
    base = s.name.removesuffix(f"-{s.kv_dtype}")
    name = base if kv_dtype == "auto" else f"{base}-{kv_dtype}"
    return replace(s, name=name, kv_dtype=kv_dtype)


def _prefill(batch: int, length: int) -> Scenario:
    return Scenario(f"prefill-b{batch}-c{length}", "prefill", (length,) * batch, (length,) * batch)


_MIXED = Scenario(
    "mixed-16d2048-p512c1536", "mixed", (2048,) * 16 + (1536 + 512,), (1,) * 16 + (512,)
)
_RESHAPE = Scenario("reshape_and_cache-4096", "reshape_and_cache", (4096,), (4096,))


# The attention geometries users run beside the 32/8 x 128 default (GQA 4): MHA (GQA 1),
# GQA 8, and Gemma 3's MQA 4/1 x 256.
_GEOMETRIES = (((32, 32), 128), ((32, 4), 128), ((4, 1), 256))


def _with_fp8(rows: list[Scenario]) -> list[Scenario]:
    """Each row followed by its fp8-cache twin (same run, same table)."""
    return [r for s in rows for r in (s, with_kv_dtype(s, "fp8"))]


def default_suite() -> list[Scenario]:
    """The full suite: decode batch 1/8/32 x context 512..8192 and 32k at batch 1 and 4
    (fp8-cache twins from 2048 on), the other head geometries (GQA 1 and 8, MQA 4/1 x
    256) with their fp8 twins, prefill, mixed, cache writes."""
    decode = []
    for b in (1, 8, 32):
        decode.append(_decode(b, 512))
        decode += _with_fp8([_decode(b, c) for c in (2048, 8192)])
    decode += _with_fp8([_decode(1, 32768), _decode(4, 32768)])
    for heads, hs in _GEOMETRIES:
        decode += _with_fp8([_decode(1, 8192, heads=heads, head_size=hs),
                             _decode(8, 2048, heads=heads, head_size=hs)])
    return [*decode, *shared_prefix_rows(), _prefill(1, 2048), _prefill(4, 512), _MIXED,
            _RESHAPE]


def shared_prefix_rows() -> list[Scenario]:
    """Decodes behind shared prefixes, each beside the same lengths unshared: 32 requests
    behind one 2048-token system prompt (and four prompts of 8), the 8 samples of one
    prompt (``n`` = 8)."""
    return [_decode(32, 2176), _shared_decode(32, 2048, 128),
            _shared_decode(32, 2048, 128, groups=4), _decode(8, 2176),
            _shared_decode(8, 2048, 128)]


def quick_suite() -> list[Scenario]:
    """A representative subset for ``--quick`` (under two minutes on 2 cores): one fp8
    decode beside its bf16 row and one 32k context among the decodes."""
    return [_decode(1, 8192), _decode(1, 8192, "fp8"), _decode(8, 2048), _decode(32, 2048),
            _decode(1, 32768), _shared_decode(32, 2048, 128), _prefill(4, 512), _MIXED,
            _RESHAPE]


def tiny_suite() -> list[Scenario]:
    """Toy shapes for smoke tests: every kind, milliseconds each."""
    small = dict(num_heads=4, num_kv_heads=2, head_size=32, block_size=16)
    return [
        Scenario("decode-b2-c100", "decode", (100, 37), (1, 1), **small),
        Scenario("prefill-b1-c48", "prefill", (48,), (48,), **small),
        Scenario("mixed-2d64-p16c32", "mixed", (64, 64, 48), (1, 1, 16), **small),
        Scenario("reshape_and_cache-96", "reshape_and_cache", (96,), (96,), **small),
    ]


SUITES = {"default": default_suite, "quick": quick_suite, "tiny": tiny_suite}


def select_scenarios(suite: list[Scenario], patterns: list[str] | None) -> list[Scenario]:
    """Keep the scenarios matching any pattern: a kind (``decode``), an exact name, or a
    shell glob over names (``decode-b8-*``). Raises ValueError naming the valid choices
    for a pattern that matches nothing."""
    if not patterns:
        return list(suite)
    keep: dict[str, Scenario] = {}
    for pattern in patterns:
        hits = [s for s in suite if s.kind == pattern or fnmatch.fnmatchcase(s.name, pattern)]
        if not hits:
            kinds = sorted({s.kind for s in suite})
            raise ValueError(
                f"unknown scenario {pattern!r}; valid: kinds {', '.join(kinds)} or names "
                f"{', '.join(s.name for s in suite)} (shell globs allowed)"
            )
        for s in hits:
            keep[s.name] = s
    return [s for s in suite if s.name in keep]


# ---------------------------------------------------------------------------- inputs


@dataclass
class ScenarioInputs:
    """Random inputs for one scenario, shared by every contender.

    query: ``[num_tokens, num_heads, head_size]``; kv_cache ``[2, num_blocks,
    num_kv_heads, block_size, head_size]`` (natural CPU layout, ``unbind(0)`` gives K, V);
    block_tables: one int32 ``[batch, max_blocks]`` per copy, placing that copy's blocks
    at random in the pool (block 0 is never used); query_start_loc int32 ``[batch+1]``;
    seq_lens int32 ``[batch]``.

    reshape_and_cache: new_keys/new_values are ``copies`` x ``[num_tokens, num_kv_heads,
    head_size]``; slot_mappings one int64 ``[num_tokens]`` per copy (disjoint random
    blocks of the pool, so each call writes fresh lines).
    """

    scenario: Scenario
    copies: int
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: list[torch.Tensor]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    new_keys: list[torch.Tensor] = field(default_factory=list)
    new_values: list[torch.Tensor] = field(default_factory=list)
    slot_mappings: list[torch.Tensor] = field(default_factory=list)
    sdpa_gqa_way: str | None = None
    """The fastest way to hand GQA to SDPA on these shapes, found by the first dense
    contender and reused by the next (they run the same SDPA calls)."""

    @property
    def key_cache(self) -> torch.Tensor:
        return self.kv_cache[0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.kv_cache[1]

    def copy_region(self, copy: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``copy``'s region of the pool, its K blocks and its V blocks: two
        contiguous ``[blocks_per_copy, num_kv_heads, block_size, head_size]`` views, every
        block its block table uses and no other."""
        if not 0 <= copy < self.copies:
            raise ValueError(f"copy must be in [0, {self.copies}), got {copy}")
        per_copy = (self.kv_cache.shape[1] - 1) // self.copies
        lo = 1 + copy * per_copy
        return self.kv_cache[0, lo:lo + per_copy], self.kv_cache[1, lo:lo + per_copy]

    @property
    def scale(self) -> float:
        return self.scenario.head_size ** -0.5


REUSE_LLC_MULTIPLE = 2
"""Bytes read between two reads of the same KV byte in the timed loop, in LLCs, at least:
with LRU-like replacement one LLC already evicts it, the second is margin."""
MAX_COPIES = 4096
"""A bound on the rotation for toy scenarios (a few KiB of KV against a large LLC)."""


def stream_offset(copies: int) -> int:
    """The runner streams region ``(c + stream_offset(copies)) % copies`` right after a
    call on copy ``c``: half a rotation ahead, the call's reads first when it cannot be
    exactly half (:func:`reuse_gaps`)."""
    return copies // 2 + 1


def reuse_gaps(copies: int, copy_bytes: int) -> tuple[int, int]:
    """Bytes read between two reads of the same byte in the timed loop, at least:
    ``(for the calls' reads, for the stream's)``, when each call reads its copy's region
    and each stream the region :func:`stream_offset` ahead, every read ``copy_bytes`` (or
    more: a region is whole blocks).

    With ``h = stream_offset(copies)`` (taken in ``1..copies``) the loop is
    ``K0 S(h) K1 S(1+h) K2 ...``; region ``r`` is streamed after call ``r - h``, so
    ``2h - 2`` reads pass between that stream and call ``r`` reading it, and
    ``2 (copies - h)`` between call ``r`` and the next stream of ``r``. Example, 3 copies
    (h = 2): ``K0 S2 K1 S0 K2 S1 K0``: two reads (S2 K1) between K0 and S0, two (K2 S1)
    between S0 and K0. Two copies cannot keep both apart: one gap is 0.
    """
    h = stream_offset(copies) % copies or copies
    return (2 * h - 2) * copy_bytes, 2 * (copies - h) * copy_bytes


def copies_for(scenario: Scenario, llc_bytes: int, *, max_copies: int = MAX_COPIES) -> int:
    """How many KV copies the rotation needs: for the bandwidth-bound kinds (decode, mixed,
    cache writes) the fewest, at least 3, with both :func:`reuse_gaps` at least
    ``REUSE_LLC_MULTIPLE`` x the LLC, so every byte a call or the stream reads comes from
    DRAM (at most ``max_copies``). An odd count keeps both gaps at ``copies - 1`` reads,
    so ``copies = 2 * ceil(LLC / kv_bytes) + 1``. Example:
    decode b1 c512 (2 MiB of KV) with a 480 MiB LLC needs 481 copies (a 962 MiB pool),
    b8 c2048 (64 MiB) with a 32 MiB LLC needs 3.

    Prefill is compute-bound (each KV byte is reused by every query row), so where its
    KV sits does not matter and two copies suffice.
    """
    if scenario.kind == "prefill":
        return 2
    need = -(-REUSE_LLC_MULTIPLE * llc_bytes // (2 * max(1, scenario.kv_bytes())))
    return max(3, min(max_copies, 2 * need + 1))


def _random_fill(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
                 store_as: torch.dtype | None = None, scale: float = 1.0) -> torch.Tensor:
    """Random normal data; above 16 Mi elements a random 16 Mi tile is repeated, which
    keeps multi-GiB pools cheap to build (timing does not depend on the values, and the
    correctness check compares against the reference on the very same data). With an fp8
    ``store_as`` the ``dtype`` values are quantised with ``scale`` as the cache op would."""
    from pagedattn.ops.reference import quantize_fp8

    def make(n: int) -> torch.Tensor:
        x = torch.randn(n, generator=gen, dtype=torch.float32).to(dtype)
        return x if store_as is None else quantize_fp8(x, scale, store_as)

    numel = math.prod(shape)
    tile = 1 << 24
    if numel <= tile:
        return make(numel).view(shape)
    base = make(tile)
    out = torch.empty(numel, dtype=base.dtype)
    # fp8 tensors are moved as their bytes (torch.roll has no fp8 kernel).
    src, dst = (base.view(torch.uint8), out.view(torch.uint8)) if store_as else (base, out)
    for start in range(0, numel, tile):
        n = min(tile, numel - start)
        # Rotate the tile so neighbouring blocks never repeat exactly.
        dst[start:start + n] = torch.roll(src, start // tile * 9973)[:n]
    return out.view(shape)


def build_inputs(scenario: Scenario, copies: int, *, seed: int = 0) -> ScenarioInputs:
    """Allocate the pool and the per-copy block tables (or slot mappings) for ``copies``
    rotated copies of ``scenario``."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    gen = torch.Generator().manual_seed(seed)
    s = scenario
    bs = s.block_size
    shared_blocks = s.shared_prefix // bs
    # A group's shared blocks once, then each request's own.
    blocks_per_req = [paging.cdiv(n, bs) - shared_blocks for n in s.seq_lens]
    per_copy = sum(blocks_per_req) + s.shared_groups * shared_blocks
    num_blocks = 1 + per_copy * copies  # block 0 reserved
    shape = (2, num_blocks, s.num_kv_heads, bs, s.head_size)
    kv_cache = _random_fill(shape, s.torch_dtype, gen,
                            store_as=s.cache_torch_dtype if s.is_fp8 else None, scale=s.kv_scale)

    # Copy c owns region c, blocks [1 + c * per_copy, 1 + (c + 1) * per_copy), in random
    # order: the runner streams whole regions (ScenarioInputs.copy_region).
    physical = torch.cat([torch.randperm(per_copy, generator=gen) + 1 + c * per_copy
                          for c in range(copies)]).tolist()
    block_tables = []
    group_size = s.batch // s.shared_groups
    for c in range(copies):
        # Copy c's requests take consecutive runs of its shuffled region, each group's
        # shared blocks first.
        at = c * per_copy
        tables = []
        for r in range(s.batch):
            if r % group_size == 0:
                prefix, at = physical[at:at + shared_blocks], at + shared_blocks
            tables.append(prefix + physical[at:at + blocks_per_req[r]])
            at += blocks_per_req[r]
        block_tables.append(paging.pad_block_tables(tables))

    query_start_loc = paging.query_start_loc(s.query_lens)
    inputs = ScenarioInputs(
        scenario=s,
        copies=copies,
        query=_random_fill((s.num_tokens, s.num_heads, s.head_size), s.torch_dtype, gen),
        kv_cache=kv_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(s.seq_lens, dtype=torch.int32),
    )
    if s.kind == "reshape_and_cache":
        for table in block_tables:
            inputs.slot_mappings.append(paging.slot_mapping_for_new_tokens(
                table, s.query_lens, s.seq_lens, bs))
            kv = _random_fill((2, s.num_tokens, s.num_kv_heads, s.head_size), s.torch_dtype, gen)
            inputs.new_keys.append(kv[0])
            inputs.new_values.append(kv[1])
    return inputs


def stream_regions(inputs: ScenarioInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every copy's region (:meth:`ScenarioInputs.copy_region`) as two flat fp32 views of
    its bytes, for the stream reads (reinterpreted: ``torch.sum`` has no fp8 kernel; a
    block is a multiple of 4 bytes)."""
    return [tuple(part.reshape(-1).view(torch.float32) for part in inputs.copy_region(c))
            for c in range(inputs.copies)]


def contiguous_kv(inputs: ScenarioInputs, copy: int, request_ids: list[int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather copy ``copy``'s KV of equal-length requests into ``[n, num_kv_heads,
    kv_len, head_size]`` K and V (what a non-paged engine would hold)."""
    s = inputs.scenario
    ids = list(range(s.batch)) if request_ids is None else request_ids
    lens = {s.seq_lens[r] for r in ids}
    if len(lens) != 1:
        raise ValueError(f"contiguous_kv needs equal seq_lens, got {sorted(lens)}")
    kv_len = lens.pop()
    nblk = paging.cdiv(kv_len, s.block_size)
    table = inputs.block_tables[copy][ids, :nblk].to(torch.int64)
    out = []
    for cache in (inputs.key_cache, inputs.value_cache):
        g = cache[table]  # [n, nblk, nkv, bs, d]
        g = g.permute(0, 2, 1, 3, 4).reshape(len(ids), s.num_kv_heads, nblk * s.block_size, s.head_size)
        out.append(g[:, :, :kv_len].contiguous())
    return out[0], out[1]
