"""Child side of the property-based fuzz test (test_fuzz.py): runs one case per JSON line
read from stdin and answers one JSON line, so a crash or hang takes down only this process
(the parent records the case and starts a new worker).

A case is pure data (a dict drawn by hypothesis): batch geometry, features, ISA and either
no mutation (a valid call, checked against the fp32 reference) or one mutation of a valid
call that must raise a Python exception whose message matches the mutation's pattern
(naming the bad value or argument), or -- for "benign" mutations, which change nothing the
op may rely on -- raise or still be right.

Outcomes: ok | rejected (the expected exception) | wrong (result off the reference, or
padding rows written) | accepted (an invalid call returned silently) | unexpected (a valid
call raised, or an exception of the wrong type / message).
"""

from __future__ import annotations

import json
import math
import re
import sys
import traceback

import torch

from pagedattn import ops
from pagedattn.ops import reference as ref
from pagedattn.backends.cpu_runtime import kernel_variant
from pagedattn.ops.isa import METADATA_FIELDS_PER_REQ, IsaHint
from pagedattn.testing import TOLERANCES, BatchSpec, PagedBatch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
REJECT = (ValueError, TypeError, NotImplementedError, RuntimeError, IndexError, OverflowError,
          MemoryError)
SENTINEL = 7.0  # written into padding output rows; they must keep it


def paged_batch(spec: BatchSpec, *, num_heads, num_kv_heads, head_size, block_size, dtype,
                seed, shared=()) -> PagedBatch:
    """make_paged_batch's batch (random permuted block table, block 0 reserved, unused
    slots NaN), scattered with tensor indexing: the per-token loop dominated a fuzz case.

    ``shared``: groups ``[members, blocks]``: every member's first ``blocks`` table entries
    are the first member's (prefix caching's shared blocks; where a member writes its own
    keys into them, the last writer's keys are what every member reads, which the
    reference reads the same way, through the table)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    blocks = [-(-s // block_size) for s in spec.seq_lens]
    num_blocks = 1 + sum(blocks) + 2
    physical = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(blocks), max(blocks, default=0) + 1, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache, value_cache = torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)
    used = 0
    for r in range(len(blocks)):
        table[r, :blocks[r]] = physical[used:used + blocks[r]].to(torch.int32)
        used += blocks[r]
    for members, count in shared:
        for r in members[1:]:
            n = min(count, blocks[members[0]], blocks[r])
            table[r, :n] = table[members[0], :n]
    keys, values, slots = [], [], []
    for r, (seq_len, q_len) in enumerate(zip(spec.seq_lens, spec.query_lens)):
        pos = torch.arange(seq_len)
        blk, off = table[r, pos // block_size].long(), pos % block_size
        k, v = randn(seq_len, num_kv_heads, head_size), randn(seq_len, num_kv_heads, head_size)
        key_cache[blk, :, off], value_cache[blk, :, off] = k, v
        keys.append(k)
        values.append(v)
        slots.append((blk * block_size + off)[seq_len - q_len:])
    qsl = torch.zeros(len(blocks) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(spec.query_lens, dtype=torch.int32), 0)
    empty = torch.zeros(0, num_kv_heads, head_size, dtype=dtype)
    return PagedBatch(
        spec=spec, layout="cpu", query=randn(spec.num_tokens, num_heads, head_size), keys=keys,
        values=values, key_cache=key_cache, value_cache=value_cache, block_table=table,
        query_start_loc=qsl, seq_lens=torch.tensor(spec.seq_lens, dtype=torch.int32),
        slot_mapping=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
        new_keys=torch.cat([k[len(k) - q:] for k, q in zip(keys, spec.query_lens)] or [empty]),
        new_values=torch.cat([v[len(v) - q:] for v, q in zip(values, spec.query_lens)] or [empty]))


def build(case: dict):
    """Tensors and keyword arguments of the valid attention call `case` describes."""
    dtype = DTYPES[case["dtype"]]
    spec = BatchSpec("fuzz", tuple(case["seq_lens"]), tuple(case["query_lens"]))
    batch = paged_batch(spec, num_heads=case["num_heads"], num_kv_heads=case["num_kv_heads"],
                        head_size=case["head_size"], block_size=case["block_size"], dtype=dtype,
                        seed=case["seed"], shared=case.get("shared", ()))
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    h = case["num_heads"]
    query = torch.cat([batch.query, torch.randn(case["pad_tokens"], h, case["head_size"],
                                                generator=gen).to(dtype)])
    output = torch.full_like(query, SENTINEL)
    key_cache, value_cache = batch.key_cache, batch.value_cache
    k_scale, v_scale = case.get("k_scale", 1.0), case.get("v_scale", 1.0)
    fp8 = FP8_CACHE_DTYPES.get(case.get("kv_cache_dtype", "auto"))
    if fp8 is not None:  # the cache the fp8 write stores (unused slots stay NaN)
        key_cache = ref.quantize_fp8(key_cache, k_scale, fp8)
        value_cache = ref.quantize_fp8(value_cache, v_scale, fp8)
    window = tuple(case["window"])
    hint = kernel_variant()
    if case["seed"] % 2 and ops.matrix_engine_available():
        hint = IsaHint.AMX  # every other case on the matrix-engine prefill kernel
    meta_args = dict(
        num_reqs=len(case["seq_lens"]), num_heads=h, num_kv_heads=case["num_kv_heads"],
        head_dim=case["head_size"], seq_lens=batch.seq_lens, dtype=dtype,
        query_start_loc=batch.query_start_loc, causal=case["causal"],
        sliding_window_size=window[0] + 1 if window[0] >= 0 else -1, isa=hint,
        enable_kv_split=case["kv_split"])
    if case.get("plan_shared"):  # the plan reads the block table's shared prefixes once
        meta_args.update(block_table=batch.block_table, block_size=case["block_size"])
    args = dict(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, scale=case["scale"],
        causal=case["causal"],
        alibi_slopes=torch.rand(h, generator=gen) * 0.2 if case["alibi"] else None,
        sliding_window=window, block_table=batch.block_table, softcap=case["softcap"],
        scheduler_metadata=None, s_aux=torch.randn(h, generator=gen) + 1 if case["sinks"] else None)
    if fp8 is not None:
        args.update(k_scale=k_scale, v_scale=v_scale)
    return batch, meta_args, args


def reference(batch, args, num_tokens: int) -> torch.Tensor:
    key_cache, value_cache = args["key_cache"].float(), args["value_cache"].float()
    if "k_scale" in args:  # fp8: the stored value times the scale, in fp32
        key_cache = ref.dequantize_fp8(args["key_cache"], args["k_scale"])
        value_cache = ref.dequantize_fp8(args["value_cache"], args["v_scale"])
    return ref.paged_attention(
        args["query"][:num_tokens].float(), key_cache, value_cache,
        args["query_start_loc"], args["seq_lens"], args["block_table"], scale=args["scale"],
        causal=args["causal"], sliding_window=args["sliding_window"], softcap=args["softcap"],
        alibi_slopes=args["alibi_slopes"], s_aux=args["s_aux"])


# ------------------------------------------------------------------ mutations
# Each takes (meta_args, args, batch, k) -- k a drawn integer for choices -- edits the call
# in place and returns the regex the exception message must match.

def _used_block(args, k):
    """(request, column) of a block some query reads (the last block of a request with
    new tokens), or None."""
    qsl, sl = args["query_start_loc"].tolist(), args["seq_lens"].tolist()
    reqs = [r for r in range(len(sl)) if qsl[r + 1] > qsl[r]]
    if not reqs:
        return None
    r = reqs[k % len(reqs)]
    bs = args["key_cache"].shape[2]
    return r, (sl[r] - 1) // bs


def m_query_dtype(m, a, b, k):
    a["query"] = a["query"].to([torch.float64, torch.int32, torch.int8][k % 3])
    return r"float64|Double|Int|Char|int32|int8"


def m_output_dtype(m, a, b, k):
    other = torch.float16 if a["query"].dtype != torch.float16 else torch.bfloat16
    a["output"] = a["output"].to(other)
    return r"output.*(Half|BFloat16)|(Half|BFloat16)"


def m_query_rank(m, a, b, k):
    a["query"] = a["query"].flatten(1)
    return r"query must be 3-D"


def m_cache_rank(m, a, b, k):
    a["key_cache"] = a["key_cache"].flatten(2)
    return r"key_cache must be 4-D"


def m_value_cache_shape(m, a, b, k):
    a["value_cache"] = a["value_cache"][:-1]
    return r"value_cache shape"


def m_cache_dtype(m, a, b, k):
    other = torch.float16 if a["value_cache"].dtype != torch.float16 else torch.float32
    a["value_cache"] = a["value_cache"].to(other)
    return r"dtype|Half|Float"


def m_head_size_mismatch(m, a, b, k):
    d = a["query"].shape[2]
    a["query"] = a["query"][..., : d - 16].contiguous()
    a["output"] = a["output"][..., : d - 16].contiguous()
    return rf"head_size.*\b{d - 16}\b|\b{d - 16}\b.*head_size"


def m_heads_not_multiple(m, a, b, k):
    h, kv = a["query"].shape[1], a["key_cache"].shape[1]
    if kv == 1:
        return None
    a["query"] = torch.cat([a["query"], a["query"][:, :1]], 1)
    a["output"] = torch.empty_like(a["query"])
    return rf"num_heads \({h + 1}\) must be a multiple of num_kv_heads \({kv}\)"


def m_query_heads_strided(m, a, b, k):
    q = a["query"]
    a["query"] = q.transpose(0, 1).contiguous().transpose(0, 1)
    return r"stride|contiguous" if q.shape[0] > 1 and q.shape[1] > 1 else None


def m_cache_last_dim_strided(m, a, b, k):
    kc = a["key_cache"]
    a["key_cache"] = kc.transpose(2, 3).contiguous().transpose(2, 3)
    # With block_size 1 the round trip gives the same memory layout (head_size stride 1).
    return r"contiguous|stride" if a["key_cache"].stride(3) != 1 else None


def m_block_out_of_range(m, a, b, k):
    used = _used_block(a, k)
    if used is None:
        return None
    bad = a["key_cache"].shape[0] + k % 1000
    a["block_table"] = a["block_table"].clone()
    a["block_table"][used] = bad
    return rf"block_table\[{used[0]}, {used[1]}\] \({bad}\)"


def m_block_negative(m, a, b, k):
    used = _used_block(a, k)
    if used is None:
        return None
    bad = -1 - k % 7
    a["block_table"] = a["block_table"].clone()
    a["block_table"][used] = bad
    return rf"block_table\[{used[0]}, {used[1]}\] \({bad}\)"


def m_block_table_narrow(m, a, b, k):
    used = _used_block(a, k)
    if used is None:
        return None
    a["block_table"] = a["block_table"][:, : used[1]]
    return r"block_table has only \d+ columns"


def m_block_table_rows(m, a, b, k):
    if a["seq_lens"].numel() == 0:
        return None
    a["block_table"] = a["block_table"][: a["seq_lens"].numel() - 1]
    return r"block_table has \d+ rows"


def m_block_table_dtype(m, a, b, k):
    a["block_table"] = a["block_table"].long()
    return r"block_table must have dtype Int"


def m_seq_len_short(m, a, b, k):
    qsl = a["query_start_loc"].tolist()
    reqs = [r for r in range(len(qsl) - 1) if qsl[r + 1] > qsl[r]]
    if not reqs:
        return None
    r = reqs[k % len(reqs)]
    bad = qsl[r + 1] - qsl[r] - 1 - k % 3
    a["seq_lens"] = a["seq_lens"].clone()
    a["seq_lens"][r] = bad
    return rf"seq_lens\[{r}\] \({bad}\)"


def m_qsl_first(m, a, b, k):
    a["query_start_loc"] = a["query_start_loc"].clone()
    a["query_start_loc"][0] = 1 + k % 5
    return rf"query_start_loc\[0\] must be 0, got {1 + k % 5}"


def m_qsl_decreasing(m, a, b, k):
    qsl = a["query_start_loc"].clone()
    if qsl.numel() < 3:
        return None
    i = 1 + k % (qsl.numel() - 2)
    qsl[i] = qsl[i + 1] + 1
    a["query_start_loc"] = qsl
    return r"query_start_loc (must be non-decreasing|\[-1\])|seq_lens\[\d+\]"


def m_qsl_past_tokens(m, a, b, k):
    qsl = a["query_start_loc"].clone()
    qsl[-1] = a["query"].shape[0] + 1 + k % 9
    a["query_start_loc"] = qsl
    return r"query_start_loc|seq_lens\[\d+\]"


def m_qsl_length(m, a, b, k):
    a["query_start_loc"] = torch.cat([a["query_start_loc"], a["query_start_loc"][-1:]])
    return r"query_start_loc must have"


def m_index_dtype(m, a, b, k):
    name = ["seq_lens", "query_start_loc"][k % 2]
    a[name] = a[name].long()
    return rf"{name} must have dtype Int"


def m_alibi(m, a, b, k):
    h = a["query"].shape[1]
    a["alibi_slopes"] = [torch.zeros(h + 1), torch.zeros(h, dtype=torch.float64),
                         torch.zeros(h, 1)][k % 3]
    return r"alibi_slopes"


def m_sinks(m, a, b, k):
    h = a["query"].shape[1]
    a["s_aux"] = [torch.zeros(h + 2), torch.zeros(h, dtype=torch.float16)][k % 2]
    return r"s_aux"


def m_window(m, a, b, k):
    a["sliding_window"] = [(-2, 0), (0, -2 - k % 5), (3,), (1, 2, 3)][k % 4]
    return r"sliding_window"


def m_softcap(m, a, b, k):
    bad = [-1.0, math.nan, math.inf, 1e-46, 1e-40, 1e39][k % 6]
    a["softcap"] = bad
    return r"softcap"


def m_scale(m, a, b, k):
    a["scale"] = [math.nan, math.inf, -math.inf, 1e39][k % 4]
    return r"scale"


def m_meta_none(m, a, b, k):
    a["scheduler_metadata"] = None
    return r"scheduler_metadata must be a tensor"


def m_tensor_none(m, a, b, k):
    name = ["query", "key_cache", "value_cache", "output", "block_table", "seq_lens",
            "query_start_loc"][k % 7]
    a[name] = None
    return rf"{name}"


def m_meta_magic(m, a, b, k):
    meta = a["scheduler_metadata"].clone()
    meta[k % 2] += 1 + k % 3
    a["scheduler_metadata"] = meta
    return r"scheduler_metadata was not produced"


def m_meta_length(m, a, b, k):
    meta = a["scheduler_metadata"]
    n = 1 + k % 4
    a["scheduler_metadata"] = meta[:-n] if k % 2 else torch.cat([meta, meta[-n:]])
    return r"scheduler_metadata (has \d+ elements|was built for|was not produced)"


def m_meta_field(m, a, b, k):
    """Header fields the op relies on: heads, kv heads, head dim, threads, hint, tile."""
    meta = a["scheduler_metadata"].clone()
    field, delta = [(3, 1), (4, 1), (5, 16), (6, 1), (7, 17), (10, 1 << 28), (10, -1)][k % 7]
    meta[field] += delta
    a["scheduler_metadata"] = meta
    return r"scheduler_metadata|isa hint|hint"


def m_meta_dtype(m, a, b, k):
    a["scheduler_metadata"] = a["scheduler_metadata"].long()
    return r"scheduler_metadata must have dtype Int"


def m_output_shape(m, a, b, k):
    out = a["output"]
    # out[:-1] of a batch with no rows at all changes nothing: cut head_size then.
    a["output"] = out[:, :, :-16] if k % 2 or out.shape[0] == 0 else out[:-1]
    return r"output shape"


def m_output_overlap(m, a, b, k):
    if a["query"].shape[0] < 2:
        return None
    a["output"] = a["output"][:1].expand(a["query"].shape)
    return r"output rows overlap"


# Benign: the op must stay right (or raise) -- the split counts are load-balancing hints.
def m_meta_splits(m, a, b, k):
    meta = a["scheduler_metadata"].clone()
    n = a["seq_lens"].numel()
    if n == 0:
        return None
    at = len(ops.METADATA_HEADER) + len(METADATA_FIELDS_PER_REQ) * (k % n)
    meta[at + METADATA_FIELDS_PER_REQ.index("num_kv_splits")] = \
        [0, -5, 1, 64, 65, 1 << 30, -(1 << 31)][k % 7]
    a["scheduler_metadata"] = meta
    return "benign"


def m_shared_block_moved(m, a, b, k):
    """A block table whose shared prefix differs from the one the plan shared: a member's
    first block replaced by another block of the cache."""
    meta = a["scheduler_metadata"]
    base, step = len(ops.METADATA_HEADER), len(METADATA_FIELDS_PER_REQ)
    at = METADATA_FIELDS_PER_REQ.index("prefix_keys")
    members = [r for r in range(a["seq_lens"].numel()) if int(meta[base + r * step + at]) > 0]
    if not members:
        return None
    r = members[k % len(members)]
    table = a["block_table"].clone()
    table[r, 0] = (int(table[r, 0]) + 1 + k % 5) % a["key_cache"].shape[0]
    a["block_table"] = table
    return r"differs from block_table"


def m_meta_plan_word(m, a, b, k):
    """Any word after the fixed header: per-request fields, jobs, merges."""
    meta = a["scheduler_metadata"].clone()
    first = len(ops.METADATA_HEADER)
    if meta.numel() <= first:
        return None
    meta[first + k % (meta.numel() - first)] += [1, -1, 1 << 20, -(1 << 30)][k % 4]
    a["scheduler_metadata"] = meta
    return r"scheduler_metadata"


def m_meta_stale(m, a, b, k):
    """Metadata planned for the same requests with other lengths (another step)."""
    sl = m["seq_lens"].clone()
    if sl.numel() == 0:
        return None
    sl[k % sl.numel()] += 1 + k % 5
    a["scheduler_metadata"] = ops.cpu_attn_get_scheduler_metadata(**{**m, "seq_lens": sl})
    return r"scheduler_metadata does not match"


ATTENTION_MUTATIONS = {f.__name__[2:]: f for f in [
    m_query_dtype, m_output_dtype, m_query_rank, m_cache_rank, m_value_cache_shape,
    m_cache_dtype, m_head_size_mismatch, m_heads_not_multiple, m_query_heads_strided,
    m_cache_last_dim_strided, m_block_out_of_range, m_block_negative, m_block_table_narrow,
    m_block_table_rows, m_block_table_dtype, m_seq_len_short, m_qsl_first, m_qsl_decreasing,
    m_qsl_past_tokens, m_qsl_length, m_index_dtype, m_alibi, m_sinks, m_window, m_softcap,
    m_scale, m_meta_none, m_tensor_none, m_meta_magic, m_meta_length, m_meta_field,
    m_meta_dtype, m_output_shape, m_output_overlap, m_meta_splits, m_meta_plan_word,
    m_meta_stale, m_shared_block_moved]}

# Mutations of the scheduler-metadata op's own arguments.
METADATA_MUTATIONS = {
    "num_reqs": (lambda m, k: m.update(num_reqs=m["num_reqs"] + 1 + k % 3), r"num_reqs|seq_lens"),
    "negative_reqs": (lambda m, k: m.update(num_reqs=-1 - k % 4), r"num_reqs"),
    "heads_huge": (lambda m, k: m.update(num_heads=[2 ** 32 + 4, 2 ** 61, 2 ** 31][k % 3] * m["num_kv_heads"]),
                   r"num_heads"),
    "kv_heads_zero": (lambda m, k: m.update(num_kv_heads=[0, -1][k % 2]), r"num_kv_heads"),
    "head_dim": (lambda m, k: m.update(head_dim=[36, 0, -64, 520, 2 ** 40][k % 5]), r"head_size"),
    "window_hint": (lambda m, k: m.update(sliding_window_size=-2 - k % 3), r"sliding_window_size"),
    "hint": (lambda m, k: m.update(isa=["sse9", "", "vec32"][k % 3]), r"vec"),
    "dtype": (lambda m, k: m.update(dtype=[torch.float64, torch.int32][k % 2]), r"dtype"),
    "seq_lens_short": (lambda m, k: m.update(seq_lens=m["seq_lens"][:-1]), r"seq_lens"),
    # Reversed; a palindrome ([0, 0]: one empty request) would be unchanged, so it also
    # starts at 1.
    "qsl_bad": (lambda m, k: m.update(query_start_loc=m["query_start_loc"].flip(0) + (
        1 - int(m["query_start_loc"][-1] != 0))), r"query_start_loc|seq_lens"),
}


def run_attention(case: dict) -> dict:
    torch.set_num_threads(case.get("threads", 1))
    try:
        return _run_attention(case)
    finally:
        torch.set_num_threads(1)  # the reference and tensor set-up: no oversubscription


def _run_attention(case: dict) -> dict:
    batch, meta_args, args = build(case)
    name = case.get("mutation")
    meta_mutation = name in METADATA_MUTATIONS
    pattern = None
    with ops.use_cpu_isa(case["isa"]):
        if meta_mutation:
            apply, pattern = METADATA_MUTATIONS[name]
            apply(meta_args, case["k"])
            try:
                ops.cpu_attn_get_scheduler_metadata(**meta_args)
            except REJECT as exc:
                return judge_exception(exc, pattern)
            return dict(outcome="accepted", detail=f"scheduler metadata op accepted {name}")
        args["scheduler_metadata"] = ops.cpu_attn_get_scheduler_metadata(**meta_args)
        if name is not None:
            pattern = ATTENTION_MUTATIONS[name](meta_args, args, batch, case["k"])
            if pattern is None:  # the mutation does not apply to this batch
                name = None
        try:
            ops.cpu_attention_with_kv_cache(**args)
        except REJECT as exc:
            if name is None:
                return dict(outcome="unexpected", detail=describe(exc))
            return judge_exception(exc, pattern)
    if name is not None and pattern != "benign":
        return dict(outcome="accepted", detail=f"{name} was accepted")
    torch.set_num_threads(1)
    return check_output(batch, args)


def check_output(batch, args) -> dict:
    n = int(args["query_start_loc"][-1])
    out = args["output"]
    if not bool((out[n:] == SENTINEL).all()):
        return dict(outcome="wrong", detail="rows past query_start_loc[-1] were written")
    want = reference(batch, args, n)
    got = out[:n].float()
    atol, rtol = TOLERANCES[out.dtype]
    if not torch.isfinite(got).all():
        return dict(outcome="wrong", detail="non-finite output")
    err = (got - want).abs()
    bad = err > atol + rtol * want.abs()
    if bool(bad.any()):
        return dict(outcome="wrong", detail=f"max error {float(err.max()):.3g} at "
                                            f"{tuple(torch.nonzero(bad)[0].tolist())}")
    return dict(outcome="ok")


def run_cache(case: dict) -> dict:
    """reshape_and_cache: valid calls equal the reference; mutated ones raise."""
    batch, _, _ = build({**case, "shared": ()})  # shared slots would be written twice
    hint = kernel_variant()
    k = case["k"]
    cache_dtype = FP8_CACHE_DTYPES.get(case.get("kv_cache_dtype", "auto"), batch.key_cache.dtype)
    shape = batch.key_cache.shape
    args = dict(key=batch.new_keys, value=batch.new_values,
                key_cache=torch.zeros(shape, dtype=cache_dtype),
                value_cache=torch.zeros(shape, dtype=cache_dtype),
                slot_mapping=batch.slot_mapping.clone(), isa=hint)
    scales = {}
    if cache_dtype != batch.key_cache.dtype:
        scales = dict(k_scale=case["k_scale"], v_scale=case["v_scale"])
        args.update(scales)
    name = case.get("mutation")
    pattern = None
    sm = args["slot_mapping"]
    if name == "slot_out_of_range" and sm.numel():
        bad = batch.key_cache.shape[0] * case["block_size"] + k % 100
        sm[k % sm.numel()] = bad
        pattern = rf"slot.*{bad}|{bad}.*slot"
    elif name == "slot_dtype":
        args["slot_mapping"] = sm.int()
        pattern = r"slot_mapping"
    elif name == "key_short" and sm.numel():
        args["key"] = args["key"][:-1]
        pattern = r"key"
    elif name == "cache_none":
        args[["key_cache", "value_cache", "key", "slot_mapping"][k % 4]] = None
        pattern = r"key|value|slot"
    elif name is not None and sm.numel():
        sm[k % sm.numel()] = -1 - k % 3  # padding: skipped, still valid
        name = None
    elif name is not None:
        name = None
    with ops.use_cpu_isa(case["isa"]):
        want_k, want_v = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
        try:
            ops.cpu_attn_reshape_and_cache(**args)
        except REJECT as exc:
            if name is None:
                return dict(outcome="unexpected", detail=describe(exc))
            return judge_exception(exc, pattern)
        if name is not None:
            return dict(outcome="accepted", detail=f"{name} was accepted")
        ref.cpu_attn_reshape_and_cache(args["key"], args["value"], want_k, want_v,
                                       args["slot_mapping"], **scales)
    same = (lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))) if scales \
        else torch.equal  # fp8: the stored codes, bit for bit
    if same(args["key_cache"], want_k) and same(args["value_cache"], want_v):
        return dict(outcome="ok")
    return dict(outcome="wrong", detail="cache differs from the reference")


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def judge_exception(exc: BaseException, pattern: str | None) -> dict:
    if pattern in (None, "benign"):
        return dict(outcome="rejected", detail=describe(exc))
    if isinstance(exc, (MemoryError, RuntimeError)) and not isinstance(exc, NotImplementedError):
        # RuntimeError is for resource exhaustion only; bad input is ValueError/TypeError.
        return dict(outcome="unexpected", detail="RuntimeError for bad input: " + describe(exc))
    if re.search(pattern, str(exc), re.IGNORECASE | re.DOTALL) is None:
        return dict(outcome="unexpected", detail=f"message does not match {pattern!r}: {describe(exc)}")
    return dict(outcome="rejected", detail=describe(exc))


def run_case(case: dict) -> dict:
    try:
        if case["kind"].startswith("cache"):
            return run_cache(case)
        return run_attention(case)
    except Exception as exc:  # a bug in the harness or an unexpected exception type
        return dict(outcome="unexpected", detail=describe(exc) + "\n" + traceback.format_exc()[-1500:])


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        result = run_case(json.loads(line))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
