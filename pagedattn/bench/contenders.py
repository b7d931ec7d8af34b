"""Contenders: the implementations the bench times side by side, in one registry.

A :class:`Contender` says whether it can run here (``unavailable_reason``) and on which
scenario kinds (``unsupported_reason``), then ``prepare``s a scenario into a
:class:`Prepared` whose ``run(copy)`` is the timed call. ``run`` returns the attention
output ``[num_tokens, num_heads, head_size]`` (or ``None`` for cache writes), which the
runner checks against the reference before any timing.

Register extra contenders with :func:`register` (tests inject a deliberately broken one;
plugins can add theirs); ``CONTENDERS`` keeps insertion order, which is the table's
column order.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pagedattn import paging
from pagedattn.bench.scenarios import ATTENTION_KINDS, Scenario, ScenarioInputs, contiguous_kv

RunFn = Callable[[int], "torch.Tensor | None"]


@dataclass
class Prepared:
    """A contender bound to one scenario's inputs.

    run: the timed call; ``run(copy)`` processes copy ``copy`` of the batch and returns the
        attention output (attention kinds) or ``None`` (``reshape_and_cache``).
    cache_rows: for ``reshape_and_cache`` -- ``cache_rows(copy)`` returns what the contender
        wrote, ``[2, num_tokens, num_kv_heads, head_size]`` (K then V at the copy's slots,
        natural layout); ``None`` when its cache layout is private (then ``attend`` is used).
    attend: for ``reshape_and_cache`` with a private cache layout -- ``attend(copy, query)``
        runs the contender's own attention of ``query [1, H, D]`` over the tokens it wrote
        (one request, block table of ``copy``), returning ``[1, H, D]``.
    poison: for ``reshape_and_cache`` -- ``poison(copy)`` fills the copy's target slots
        with NaN so a contender that writes nothing cannot pass the check on stale data.
    note: shown in the table footnotes (e.g. "reference fallback").
    """

    run: RunFn
    cache_rows: Callable[[int], torch.Tensor] | None = None
    attend: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    poison: Callable[[int], None] | None = None
    note: str = ""


class Contender:
    """Base class; subclasses set ``name``, ``description``, ``kinds`` and ``prepare``."""

    name: str = ""
    description: str = ""
    kinds: tuple[str, ...] = ATTENTION_KINDS
    #: the oracle is not checked against itself.
    is_reference: bool = False
    #: False for probes that time something other than attention (nothing to check).
    checked: bool = True

    def unavailable_reason(self) -> str | None:
        """``None`` when this contender can run in this process, else a one-line reason."""
        return None

    def unsupported_reason(self, scenario: Scenario) -> str | None:
        if scenario.kind not in self.kinds:
            return f"no {scenario.kind} path"
        return None

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        raise NotImplementedError

    def versions(self) -> dict[str, str]:
        """Versions worth recording in the JSON (e.g. a third-party wheel's)."""
        return {}


CONTENDERS: dict[str, Contender] = {}


def register(contender: Contender, *, replace: bool = False) -> Contender:
    """Add ``contender`` to the registry (a new table column)."""
    if not contender.name:
        raise ValueError("a contender needs a non-empty name")
    if contender.name in CONTENDERS and not replace:
        raise ValueError(f"contender {contender.name!r} is already registered")
    CONTENDERS[contender.name] = contender
    return contender


def unregister(name: str) -> None:
    CONTENDERS.pop(name, None)


# ------------------------------------------------------------------- shared helpers


def natural_cache_rows(inputs: ScenarioInputs, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, copy: int) -> torch.Tensor:
    """``[2, T, nkv, d]``: the rows at copy ``copy``'s slots of natural-layout caches."""
    blocks, offsets = paging.split_slots(inputs.slot_mappings[copy], inputs.scenario.block_size)
    return torch.stack([key_cache[blocks, :, offsets], value_cache[blocks, :, offsets]])


def poison_slots(inputs: ScenarioInputs, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, copy: int) -> None:
    blocks, offsets = paging.split_slots(inputs.slot_mappings[copy], inputs.scenario.block_size)
    for cache in (key_cache, value_cache):
        cache[blocks, :, offsets] = float("nan")


def _groups(s: Scenario) -> list[tuple[int, int, list[int]]]:
    """Requests grouped by equal ``(query_len, seq_len)``: one dense SDPA call each."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for r, (kv, q) in enumerate(zip(s.seq_lens, s.query_lens)):
        by_shape.setdefault((q, kv), []).append(r)
    return [(q, kv, ids) for (q, kv), ids in by_shape.items()]


def _token_index(inputs: ScenarioInputs, ids: list[int], q_len: int) -> torch.Tensor:
    starts = inputs.query_start_loc[ids].to(torch.int64)
    return (starts.unsqueeze(1) + torch.arange(q_len)).reshape(-1)


def bottom_right_causal_mask(q_len: int, kv_len: int) -> torch.Tensor:
    """Bool ``[q_len, kv_len]``: query ``i`` (position ``kv_len - q_len + i``) sees keys
    ``0..kv_len - q_len + i`` -- SDPA's own ``is_causal`` aligns top-left instead."""
    pos = kv_len - q_len + torch.arange(q_len).unsqueeze(1)
    return torch.arange(kv_len).unsqueeze(0) <= pos


class _DenseGroupPlan:
    """Per-group query gather / output scatter shared by the dense contenders."""

    def __init__(self, inputs: ScenarioInputs):
        s = inputs.scenario
        self.inputs = inputs
        self.groups = []
        for q_len, kv_len, ids in _groups(s):
            tokens = _token_index(inputs, ids, q_len)
            q = inputs.query[tokens].view(len(ids), q_len, s.num_heads, s.head_size)
            q = q.transpose(1, 2).contiguous()  # [n, H, q_len, d]
            self.groups.append((q_len, kv_len, ids, tokens, q))

    def attend(self, attention, kv_for_group, copy: int) -> torch.Tensor:
        s = self.inputs.scenario
        out = torch.empty_like(self.inputs.query)
        for g, (q_len, kv_len, ids, tokens, q) in enumerate(self.groups):
            k, v = kv_for_group(g, copy)
            o = attention(q, k, v, q_len, kv_len)  # [n, H, q_len, d]
            out[tokens] = o.transpose(1, 2).reshape(-1, s.num_heads, s.head_size)
        return out


# Ways to hand GQA to SDPA (q [n, H, L, d], k/v [n, Hkv, S, d], H = Hkv * G). A user calls
# SDPA the fastest correct way, so the dense contenders do too:
# * "fold": the G query heads of a kv head become G * L query rows against the shared K/V
#   (q.view(n, Hkv, G * L, d); the mask repeats per head) -- one GEMM per kv head, no
#   K/V copy; for decode (L = 1) no mask at all. On this CPU 8-10x faster than enable_gqa
#   for decode.
# * "enable_gqa": SDPA's own flag.  * "repeat_interleave": copy K/V to H heads first.
GQA_WAYS = ("fold", "enable_gqa", "repeat_interleave")


def _sdpa(q, k, v, q_len, kv_len, scale, way: str = "fold"):
    n, num_heads, _, d = q.shape
    group = num_heads // k.shape[1]
    causal = q_len > 1
    mask = None
    if causal and q_len != kv_len:
        mask = bottom_right_causal_mask(q_len, kv_len)
    if way == "fold" and group > 1:
        qf = q.reshape(n, k.shape[1], group * q_len, d)
        if causal:
            mask = (mask if mask is not None else bottom_right_causal_mask(q_len, kv_len)).repeat(group, 1)
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
        return o.view(n, num_heads, q_len, d)
    if way == "repeat_interleave" and group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    gqa = way == "enable_gqa" and group > 1
    if causal and mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _fastest_gqa_way(inputs: ScenarioInputs, run_way) -> str:
    """Decode: "fold" (its advantage is large and stable). Prefill and mixed: each way
    timed on copy 0 (best of 2 after a warm call), fastest wins; ``run_way(way, copy)``.
    The choice is kept on ``inputs`` for the other dense contender."""
    import time

    s = inputs.scenario
    if s.kind == "decode" or s.num_heads == s.num_kv_heads:
        return "fold"
    if inputs.sdpa_gqa_way is not None:
        return inputs.sdpa_gqa_way
    best, best_t = "fold", float("inf")
    for way in GQA_WAYS:
        run_way(way, 0)
        t = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            run_way(way, 0)
            t = min(t, time.perf_counter() - t0)
        if t < best_t:
            best, best_t = way, t
    inputs.sdpa_gqa_way = best
    return best


def _gqa_note(s: Scenario, way: str) -> str:
    if s.num_heads == s.num_kv_heads:
        return ""
    if s.kind == "decode":
        return "GQA decode: query heads folded into the query rows (no mask)"
    return f"GQA on {s.name}: {way} (fastest of {', '.join(GQA_WAYS)})"


def _no_fp8(s: Scenario) -> str | None:
    return "no fp8 KV cache path" if s.is_fp8 else None


# ------------------------------------------------------------------------ contenders


class PagedattnContender(Contender):
    name = "pagedattn"
    description = "pagedattn.ops native CPU kernels (paged KV, scheduler metadata)"
    kinds = ATTENTION_KINDS + ("reshape_and_cache",)

    def _ops(self):
        from pagedattn import ops
        return ops

    def unavailable_reason(self) -> str | None:
        try:
            ops = self._ops()
        except Exception as exc:  # the package may be mid-build: say why, don't crash
            return f"pagedattn.ops failed to import: {type(exc).__name__}: {exc}"
        missing = [n for n in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache",
                               "cpu_attn_get_scheduler_metadata", "native_available") if not hasattr(ops, n)]
        if missing:
            return f"pagedattn.ops lacks {', '.join(missing)}"
        return None

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        ops = self._ops()
        s = inputs.scenario
        from pagedattn.backends.cpu_runtime import PlanGeometry, kernel_variant, prefill_variant

        kc, vc = inputs.key_cache, inputs.value_cache
        isa = kernel_variant()
        note = "" if ops.native_available() else "native extension not loaded: reference fallback"
        if s.kind != "reshape_and_cache" and ops.native_available():
            # The engine's measured choice for this geometry (vector or matrix prefills).
            geometry = PlanGeometry(s.num_heads, s.num_kv_heads, s.head_size, s.torch_dtype, -1)
            isa = prefill_variant(geometry, s.block_size, kc.dtype)
            note = f"variant {isa.value}"
        if s.kind == "reshape_and_cache":
            def run(copy: int) -> None:
                ops.cpu_attn_reshape_and_cache(inputs.new_keys[copy], inputs.new_values[copy],
                                               kc, vc, inputs.slot_mappings[copy], isa,
                                               k_scale=s.kv_scale, v_scale=s.kv_scale)
            return Prepared(run, cache_rows=lambda c: natural_cache_rows(inputs, kc, vc, c),
                            poison=lambda c: poison_slots(inputs, kc, vc, c), note=note)
        # Planned with the block table, as the engine plans: shared prefixes are read once.
        # Every copy's tables share the same requests' blocks, so one plan serves them all.
        metadata = ops.cpu_attn_get_scheduler_metadata(
            s.batch, s.num_heads, s.num_kv_heads, s.head_size, inputs.seq_lens, s.torch_dtype,
            inputs.query_start_loc, s.causal, -1, isa, True,
            block_table=inputs.block_tables[0], block_size=s.block_size)
        out = torch.empty_like(inputs.query)

        def run(copy: int) -> torch.Tensor:
            ops.cpu_attention_with_kv_cache(
                inputs.query, kc, vc, out, inputs.query_start_loc, inputs.seq_lens,
                inputs.scale, s.causal, None, (-1, -1), inputs.block_tables[copy], 0.0,
                metadata, None, k_scale=s.kv_scale, v_scale=s.kv_scale)
            return out
        return Prepared(run, note=note)


class ReferenceContender(Contender):
    name = "reference"
    description = "pagedattn.ops.reference: pure-PyTorch fp32 oracle, one request at a time"
    kinds = ATTENTION_KINDS + ("reshape_and_cache",)
    is_reference = True

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        from pagedattn.ops import reference

        s = inputs.scenario
        kc, vc = inputs.key_cache, inputs.value_cache
        if s.kind == "reshape_and_cache":
            def run(copy: int) -> None:
                reference.cpu_attn_reshape_and_cache(
                    inputs.new_keys[copy], inputs.new_values[copy], kc, vc,
                    inputs.slot_mappings[copy], k_scale=s.kv_scale, v_scale=s.kv_scale)
            return Prepared(run, cache_rows=lambda c: natural_cache_rows(inputs, kc, vc, c),
                            poison=lambda c: poison_slots(inputs, kc, vc, c))
        out = torch.empty_like(inputs.query)

        def run(copy: int) -> torch.Tensor:
            reference.cpu_attention_with_kv_cache(
                inputs.query, kc, vc, out, inputs.query_start_loc, inputs.seq_lens,
                inputs.scale, s.causal, None, (-1, -1), inputs.block_tables[copy], 0.0,
                k_scale=s.kv_scale, v_scale=s.kv_scale)
            return out
        return Prepared(run)


def _sdpa_fastest_way(inputs: ScenarioInputs, plan: _DenseGroupPlan, kv_of) -> Prepared:
    """SDPA over ``plan``'s groups, the K/V of group ``g`` and copy ``c`` being
    ``kv_of(g, c)``, run the GQA way that measures fastest here."""
    scale = inputs.scale

    def run_way(way: str, copy: int) -> torch.Tensor:
        return plan.attend(lambda q, k, v, ql, kl: _sdpa(q, k, v, ql, kl, scale, way),
                           kv_of, copy)
    way = _fastest_gqa_way(inputs, run_way)
    return Prepared(lambda copy: run_way(way, copy), note=_gqa_note(inputs.scenario, way))


class SdpaContiguousContender(Contender):
    name = "sdpa-contiguous"
    description = ("torch SDPA on the same KV stored contiguously per request "
                   "([batch, kv_heads, seq, d]): the no-paging baseline; GQA the fastest "
                   "way (GQA_WAYS)")

    def unsupported_reason(self, scenario: Scenario) -> str | None:
        return super().unsupported_reason(scenario) or _no_fp8(scenario)

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        plan = _DenseGroupPlan(inputs)
        # One contiguous K/V per (group, copy), built up front: paging costs nothing here.
        kv = [[contiguous_kv(inputs, c, ids) for c in range(inputs.copies)]
              for _, _, ids, _, _ in plan.groups]
        return _sdpa_fastest_way(inputs, plan, lambda g, c: kv[g][c])


class GatherSdpaContender(Contender):
    name = "gather+sdpa"
    description = ("gather the paged blocks into contiguous K/V on every call (fp8 caches: "
                   "dequantised in the gather), then torch SDPA, GQA the fastest way")

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        plan = _DenseGroupPlan(inputs)
        s = inputs.scenario
        ids_of = [ids for _, _, ids, _, _ in plan.groups]

        def gather(g: int, c: int):
            k, v = contiguous_kv(inputs, c, ids_of[g])
            if s.is_fp8:
                k = k.to(s.torch_dtype) * s.kv_scale
                v = v.to(s.torch_dtype) * s.kv_scale
            return k, v
        return _sdpa_fastest_way(inputs, plan, gather)


class FlexContender(Contender):
    name = "flex"
    description = ("torch FlexAttention (torch.compile'd) on contiguous K/V, causal "
                   "block mask aligned bottom-right")

    _compiled = None
    # The first compile's failure ("" before it or after a success): a torch build whose
    # inductor cannot lower flex on CPU is reported by that row, and every later row
    # fails fast with the same reason instead of compiling again.
    _compile_error: str = ""

    def unsupported_reason(self, scenario: Scenario) -> str | None:
        return super().unsupported_reason(scenario) or _no_fp8(scenario)

    def unavailable_reason(self) -> str | None:
        # No toy compile here: on a cold inductor cache each compile costs ~10 s on
        # 2 cores, and the first real row surfaces a broken build just as well.
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except Exception as exc:
            return f"torch {torch.__version__} has no FlexAttention ({exc})"
        if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
            return "torch.compile needs a C++ compiler on PATH for the CPU backend"
        return None

    @classmethod
    def _flex(cls):
        if cls._compiled is None:
            import torch._dynamo
            from torch.nn.attention.flex_attention import flex_attention

            # Every scenario is a new shape; don't let dynamo fall back to eager.
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 256)
            # Only the batch dim is dynamic (marked in prepare): one decode kernel serves
            # every batch size, saving a ~5 s compile per scenario at the same run time,
            # while sequence lengths stay static so flex keeps its specialised kernels.
            torch._dynamo.config.automatic_dynamic_shapes = False
            cls._compiled = torch.compile(flex_attention)
        return cls._compiled

    def prepare(self, inputs: ScenarioInputs) -> Prepared:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = self._flex()
        plan = _DenseGroupPlan(inputs)
        kv = [[contiguous_kv(inputs, c, ids) for c in range(inputs.copies)]
              for _, _, ids, _, _ in plan.groups]
        masks = {}
        for q_len, kv_len, _, _, _ in plan.groups:
            if q_len > 1:
                offset = kv_len - q_len

                def causal(b, h, qi, ki, offset=offset):
                    return ki <= qi + offset
                masks[(q_len, kv_len)] = create_block_mask(causal, None, None, q_len, kv_len,
                                                           device="cpu")
        scale = inputs.scale
        s = inputs.scenario
        group = s.num_heads // s.num_kv_heads

        def attention(q, k, v, q_len, kv_len):
            n, num_heads, _, d = q.shape
            # A decode row sees every key: fold the GQA group into the query rows (see
            # GQA_WAYS); prefill keeps flex's own GQA under its causal block mask.
            fold = q_len == 1 and group > 1
            if fold:
                q = q.reshape(n, s.num_kv_heads, group, d)
            if q.shape[0] > 1:  # dynamo specialises size-1 dims; mark the others
                for t in (q, k, v):
                    torch._dynamo.mark_dynamic(t, 0)
            o = flex(q, k, v, block_mask=masks.get((q_len, kv_len)), scale=scale,
                     enable_gqa=not fold)
            return o.view(n, num_heads, q_len, d)

        def run(copy: int) -> torch.Tensor:
            return plan.attend(attention, lambda g, c: kv[g][c], copy)

        if FlexContender._compile_error:
            raise RuntimeError(FlexContender._compile_error)
        try:
            run(0)  # the compile, so that a failure is recorded once
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            FlexContender._compile_error = (f"torch.compile(flex_attention) fails on this "
                                            f"build: {type(exc).__name__}: {first}")
            raise RuntimeError(FlexContender._compile_error) from exc
        note = ("" if group == 1 else "GQA decode: query heads folded into the query rows"
                if s.kind == "decode" else "GQA prefill: flex's enable_gqa")
        return Prepared(run, note=note)


for _c in (PagedattnContender(), ReferenceContender(), SdpaContiguousContender(),
           GatherSdpaContender(), FlexContender()):
    register(_c)
