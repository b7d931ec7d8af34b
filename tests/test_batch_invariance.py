"""Batch invariance (``EngineArgs.batch_invariant``): a request's tokens, greedy or sampled
with its own seed, are the same run alone and inside concurrent mixes with random
``max_tokens``, when the prefix cache hits, when chunked prefill splits its prompt, and at
another thread count.

The kernel-level half: a batch-invariant plan gives every query row bitwise the same
output whatever else is in the call, however the request's queries are chunked, and on
1 or 2 threads, for every cache dtype and the GQA shapes the engine's models use.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedattn import ops
from pagedattn.backends import cpu_runtime
from pagedattn.engine.args import EngineArgs
from pagedattn.ops.isa import IsaHint

from builtin_models import SMOLLM2, SMOLLM2_WHY

native = pytest.mark.skipif(not ops.native_available(), reason="needs pagedattn._C")


# ------------------------------------------------------------------ the kernels


def _attend(reqs, caches, geometry, block_size, batch_invariant):
    """One call over ``reqs`` = [(query [q, H, D], kv_len, block ids)]; each request's
    output rows."""
    query = torch.cat([q for q, _, _ in reqs])
    qsl = torch.tensor([0] + [q.shape[0] for q, _, _ in reqs], dtype=torch.int32).cumsum(0)
    qsl = qsl.to(torch.int32)
    lens = torch.tensor([n for _, n, _ in reqs], dtype=torch.int32)
    width = max(b.numel() for _, _, b in reqs)
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(reqs):
        table[i, : blocks.numel()] = blocks
    variant = cpu_runtime.kernel_variant()
    plan = cpu_runtime.plan_step(geometry, variant, qsl, lens, True, batch_invariant)
    out = torch.empty_like(query)
    cpu_runtime.attend(query, *caches, out, query_start_loc=qsl, seq_lens=lens,
                       block_table=table, scheduler_metadata=plan,
                       scale=geometry.head_dim ** -0.5, causal=True, window=(-1, -1),
                       alibi_slopes=None, softcap=0.0, sinks=None)
    return [out[qsl[i]:qsl[i + 1]] for i in range(len(reqs))]


@native
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (32, 8, 128, 32),  # the bench's geometry
    (9, 3, 64, 16),    # SmolLM2
    (4, 1, 256, 16),   # Gemma 3 (MQA)
])
@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float8_e4m3fn)])
def test_a_rows_output_does_not_depend_on_its_call(heads, kv_heads, head_dim, block_size,
                                                   dtype, cache_dtype):
    gen = torch.Generator().manual_seed(heads * head_dim)
    blocks = 400
    caches = [torch.randn(blocks, kv_heads, block_size, head_dim, generator=gen)
              .to(cache_dtype) for _ in range(2)]
    geometry = cpu_runtime.PlanGeometry(heads, kv_heads, head_dim, dtype, -1)
    ctx, q_len = 37 * block_size + 5, 40

    def request(kv_len, n, first_block):
        ids = torch.arange(first_block, first_block + -(-kv_len // block_size),
                           dtype=torch.int32)
        return torch.randn(n, heads, head_dim, generator=gen).to(dtype), kv_len, ids

    query, _, ids = request(ctx, q_len, 0)
    whole = _attend([(query, ctx, ids)], caches, geometry, block_size, True)[0]
    mates = [request(200 + 61 * i, 1 if i % 2 else 24, 40 + 25 * i) for i in range(12)]
    threads = torch.get_num_threads()
    try:
        for last in (1, 2, 5, 17, 40):  # the prompt's last chunk: decode-like to whole
            tail = (query[-last:], ctx, ids)
            for n_threads in sorted({1, threads}):
                torch.set_num_threads(n_threads)
                alone = _attend([tail], caches, geometry, block_size, True)[0]
                mixed = _attend(mates[:5] + [tail] + mates[5:], caches, geometry,
                                block_size, True)[5]
                assert torch.equal(alone, whole[-last:]), (last, n_threads)
                assert torch.equal(mixed, whole[-last:]), (last, n_threads)
    finally:
        torch.set_num_threads(threads)


@native
def test_batch_invariant_plans_refuse_the_matrix_engine_hint():
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch_invariant.*amx"):
        ops.cpu_attn_get_scheduler_metadata(1, 4, 1, 64, torch.tensor([8], dtype=torch.int32),
                                            torch.bfloat16, one, True, -1, IsaHint.AMX, True,
                                            batch_invariant=True)


def test_engine_args_refuse_what_cannot_be_invariant():
    with pytest.raises(ValueError, match="linear_impl='torch'"):
        EngineArgs(batch_invariant=True, linear_impl="torch")
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        EngineArgs(batch_invariant=1)


# ------------------------------------------------------------------ the engine

_PREFIX = ("You are a careful assistant. Answer in one short sentence, and never use more "
           "words than you need. ")
_QUESTIONS = [
    "What is the capital of France?", "Name a prime number larger than ten.",
    "Why is the sky blue?", "def fibonacci(n):", "Once upon a time,",
    "The three primary colours are", "Translate 'good morning' into Spanish.",
    "import numpy as np\n", "What does a compiler do?", "List two kinds of trees.",
    "The quick brown fox", "How many legs does a spider have?",
    "Write a haiku about rain.", "SELECT name FROM users WHERE", "What is 17 times 3?",
    "In 1969, astronauts", "Explain recursion to a child.", "The best way to learn is",
    "Give me a synonym for happy.", "A paged KV cache stores", "Water boils at",
    "Who wrote Hamlet?", "The mitochondria is", "My favourite season is",
    "class Stack:\n    def", "Rain in Spain falls", "To make tea, first",
    "The largest planet is", "Once, in a small village,", "Photosynthesis turns",
    "The speed of light is", "A good unit test",
]


def _params(seeded: bool, max_tokens: int):
    from pagedattn import SamplingParams

    if seeded:
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=7,
                              ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _check_mixes(llm, prompts, alone, seeded, mix_sizes, rng):
    """Each mix: ``size`` prompts at once with random max_tokens; every answer is the
    prefix of the prompt's lone answer."""
    for size in mix_sizes:
        order = rng.sample(range(len(prompts)), size)
        lengths = [rng.randint(1, len(alone[i])) for i in order]
        outs = llm.generate([prompts[i] for i in order],
                            [_params(seeded, n) for n in lengths])
        for i, n, out in zip(order, lengths, outs):
            assert list(out.token_ids) == alone[i][:n], (
                f"prompt {i} ({prompts[i]!r}) in a mix of {size}: "
                f"{list(out.token_ids)} != {alone[i][:n]}")


def _campaign(num_prompts: int, max_tokens: int, mix_sizes: tuple[int, ...],
              batch_invariant: bool = True):
    from pagedattn import LLM

    rng = random.Random(num_prompts)
    # half the prompts share a 2-block prefix: the mixes hit the prefix cache
    prompts = [(_PREFIX + q) if i % 2 else q for i, q in enumerate(_QUESTIONS[:num_prompts])]
    threads = torch.get_num_threads()
    llm = LLM(model="smollm2", batch_invariant=batch_invariant, kv_cache_memory="256MiB")
    try:
        results = {}
        for seeded in (False, True):
            torch.set_num_threads(1)  # the lone runs on one thread, the mixes on all
            alone = [list(llm.generate(p, _params(seeded, max_tokens))[0].token_ids)
                     for p in prompts]
            torch.set_num_threads(threads)
            assert all(len(a) == max_tokens for a in alone)
            _check_mixes(llm, prompts, alone, seeded, mix_sizes, rng)
            results[seeded] = alone
        assert results[True] != results[False], "seeded sampling at 0.8 looks greedy"
        # chunked prefill: a 24-token budget splits every prompt with the prefix
        chunked = LLM(model="smollm2", batch_invariant=batch_invariant, kv_cache_memory="256MiB",
                      max_num_batched_tokens=24, enable_prefix_caching=False)
        for seeded in (False, True):
            _check_mixes(chunked, prompts, results[seeded], seeded, mix_sizes[:1], rng)
    finally:
        torch.set_num_threads(threads)


@native
@pytest.mark.skipif(SMOLLM2 is None, reason=SMOLLM2_WHY)
def test_tokens_do_not_depend_on_the_batch():
    _campaign(num_prompts=6, max_tokens=6, mix_sizes=(6,))


@native
@pytest.mark.slow  # 32 prompts alone and in mixes of 8 and 32, greedy and seeded: ~2 min
@pytest.mark.skipif(SMOLLM2 is None, reason=SMOLLM2_WHY)
def test_tokens_do_not_depend_on_the_batch_32_prompts():
    _campaign(num_prompts=32, max_tokens=16, mix_sizes=(8, 32, 8))
