"""The sampler's per-request rules (min_tokens, repetition_penalty, logprobs) and the
validation of the SamplingParams fields that carry them (no model needed); ``n`` > 1 on
SmolLM2: n completions of one prompt computed once (shared blocks, copy on write of the
last one), their seed streams, their blocks freed at the end, on abort, under
preemption."""

from __future__ import annotations

import math

import pytest
import torch

from builtin_models import needs_smollm2

from pagedattn import LLM, ops
from pagedattn.engine.request import FinishReason, Request
from pagedattn.ops import reference
from pagedattn.engine.sampler import ARGMAX_CHUNK, apply_logits_processors, argmax_rows, sample
from pagedattn.engine.sampling_params import SamplingParams

EOS = 3


def _req(prompt=(5, 6), output=(), **sp) -> Request:
    req = Request("r", list(prompt), SamplingParams(**{"temperature": 0, **sp}), eos_token_id=EOS)
    req.output_token_ids = list(output)
    return req


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 1] = 1.0
    req = _req(min_tokens=2, stop_token_ids=[7])
    assert sample(logits.clone(), [req], [None]).tokens == [1]
    req.output_token_ids = [1, 1]  # min_tokens reached: EOS allowed again
    assert sample(logits.clone(), [req], [None]).tokens == [EOS]


def test_min_tokens_keeps_eos_with_ignore_eos():
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    req = _req(min_tokens=2, ignore_eos=True)
    assert sample(logits, [req], [None]).tokens == [EOS]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0.5, 0.0, 0.0, 0.0]])
    out = apply_logits_processors(logits.clone(), [_req(prompt=(0, 1), output=(4,),
                                                        repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.25, 0.0, 0.0, 0.0]]


def test_repetition_penalty_changes_the_greedy_pick():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    assert sample(logits.clone(), [_req(prompt=(0,))], [None]).tokens == [0]
    assert sample(logits.clone(), [_req(prompt=(0,), repetition_penalty=2.0)], [None]).tokens == [1]


def test_logprobs_of_sampled_token_and_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sample(logits.clone(), [_req(logprobs=2), _req()][:1], [None])
    lp, top = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert out.tokens == [1]
    assert math.isclose(lp, float(ref[1]), rel_tol=1e-6)
    assert [t for t, _ in top] == [1, 2]
    assert math.isclose(top[1][1], float(ref[2]), rel_tol=1e-6)


def test_logprobs_only_for_requests_that_ask():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    out = sample(logits, [_req(), _req(logprobs=0)], [None, None])
    assert out.tokens == [1, 2]
    assert out.logprobs[0] is None
    assert out.logprobs[1][1] == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_tokens=-1), "min_tokens must be an int >= 0, got -1"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens=4, got 5"),
    (dict(repetition_penalty=0), "repetition_penalty must be >= 0.01"),
    (dict(repetition_penalty=1e-300), r"repetition_penalty must be >= 0.01 \(1 = off\), got 1e-300"),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(top_p=float("inf")), "top_p must be a finite number, got inf"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(stop_token_ids=[5, -1]), "stop_token_ids must be a list of ints >= 0, got -1"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be a list of ints >= 0, got True"),
    (dict(logprobs=-1), "logprobs must be None or an int >= 0, got -1"),
    (dict(n=0), "n must be an int >= 1, got 0"),
    (dict(n=-3), "n must be an int >= 1, got -3"),
    (dict(n=1.5), "n must be an int >= 1, got 1.5"),
    (dict(n=2.0), "n must be an int >= 1, got 2.0"),
    (dict(n=True), "n must be an int >= 1, got True"),
    (dict(n="2"), "n must be an int >= 1, got '2'"),
    (dict(n=None), "n must be an int >= 1, got None"),
])
def test_bad_values_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def _argmax_cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    vocab = 8 * ARGMAX_CHUNK
    x = torch.randn(9, vocab, generator=gen)
    x[1, 5 * ARGMAX_CHUNK + 7] = x[1, 2 * ARGMAX_CHUNK + 3] = 50.0  # tie across chunks
    x[2, 100] = x[2, 101] = 50.0                                     # tie inside a chunk
    x[3, 3 * ARGMAX_CHUNK + 9] = float("nan")                        # NaN counts as maximal
    x[3, 6 * ARGMAX_CHUNK] = float("nan")
    x[4] = float("-inf")
    x[5, -1] = 50.0                                                  # the very last token
    x[6, 0] = float("inf")
    x[7] = 0.0                                                       # all equal
    return {"chunked": x, "odd_vocab": torch.randn(3, 5 * ARGMAX_CHUNK + 1, generator=gen),
            "small_vocab": torch.randn(2, 100, generator=gen),
            "strided": torch.randn(4, 2 * vocab, generator=gen)[:, ::2],
            "no_rows": torch.empty(0, vocab)}


@pytest.mark.parametrize("case", list(_argmax_cases()))
def test_argmax_rows_is_torchs_argmax(case):
    logits = _argmax_cases()[case]
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


needs_native = pytest.mark.skipif(not ops.native_available(),
                                  reason="the native extension is not built")


def _native_argmax_cases() -> dict[str, torch.Tensor]:
    # lengths around the kernel's vector widths (4, 8, 16) and its four chains of them
    # (a strided last dim is rejected, below; the sampler then runs torch)
    gen = torch.Generator().manual_seed(1)
    cases = {name: x for name, x in _argmax_cases().items()
             if name not in ("strided", "no_rows")}
    for n in (1, 3, 15, 16, 17, 63, 64, 65, 100, 257):
        x = torch.randn(5, n, generator=gen)
        x[1] = 2.0                                  # all equal: index 0
        x[2, n // 2:] = 7.0                         # a run of maxima: its first
        x[3, -1] = float("nan")                     # a NaN in the tail
        x[4, 0] = float("-inf")
        cases[f"n{n}"] = x
    return cases


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(_native_argmax_cases()))
def test_native_argmax_rows_is_the_reference(case, dtype, isa):
    logits = _native_argmax_cases()[case].to(dtype)
    got = ops.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, reference.argmax_rows(logits))


@needs_native
@pytest.mark.parametrize("logits, error, match", [
    (torch.zeros(2, 3, dtype=torch.float16), TypeError, "float32 or bfloat16, got Half"),
    (torch.zeros(6), ValueError, r"2-D \[rows, vocab\], got shape \[6\]"),
    (torch.zeros(2, 0), ValueError, r"at least one entry per row, got shape \[2, 0\]"),
    (torch.zeros(3, 4).t(), ValueError, r"last dim must be contiguous, got strides \[1, 4\]"),
])
def test_native_argmax_rows_rejects(logits, error, match):
    with pytest.raises(error, match=match):
        ops.argmax_rows(logits)


@needs_native
def test_native_argmax_rows_opcheck_and_compile():
    x = torch.randn(4, 300)
    torch.library.opcheck(torch.ops.pagedattn.argmax_rows, (x,))
    compiled = torch.compile(ops.argmax_rows, fullgraph=True)
    assert torch.equal(compiled(x), x.argmax(dim=-1))
    assert ops.argmax_rows(torch.empty(0, 5)).shape == (0,)


@pytest.mark.parametrize("kwargs, field, want", [
    (dict(temperature=1e-300), "temperature", 0.01),
    (dict(temperature=0.009), "temperature", 0.01),
    (dict(temperature=0.01), "temperature", 0.01),
    (dict(temperature=0.0), "temperature", 0.0),  # greedy stays greedy
    (dict(top_p=1e-300), "top_p", 1e-6),
    (dict(top_p=0.5), "top_p", 0.5),
])
def test_tiny_temperature_and_top_p_are_raised_to_their_floors(kwargs, field, want):
    assert getattr(SamplingParams(**kwargs), field) == want


@pytest.mark.parametrize("kwargs", [dict(temperature=1e-300), dict(temperature=0.5, top_p=1e-300),
                                    dict(temperature=1e-300, top_p=1e-300, top_k=2)])
def test_tiny_values_sample_the_top_token(kwargs):
    logits = torch.tensor([[1.0, 9.0, 3.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, [_req(**kwargs)], [gen]).tokens == [1]


def test_a_failure_in_one_row_fails_that_request_alone(monkeypatch):
    import pagedattn.engine.sampler as sampler

    original = sampler._pick

    def faulty(row, req, gen, **kwargs):
        if req.req_id == "bad":
            raise RuntimeError("injected")
        return original(row, req, gen, **kwargs)

    monkeypatch.setattr(sampler, "_pick", faulty)
    good, bad = _req(repetition_penalty=1.5), _req(logprobs=2)
    bad.req_id = "bad"
    logits = torch.tensor([[1.0, 9.0, 3.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    out = sample(logits, [bad, good], [None, None])
    assert out.tokens == [None, 0]
    assert out.logprobs == [None, None]
    assert bad.failure == "sampling failed: RuntimeError: injected" and good.failure is None


def test_a_row_with_no_drawable_token_fails_with_a_reason():
    logits = torch.full((1, 4), float("nan"))
    req = _req(temperature=1.0)
    out = sample(logits, [req], [torch.Generator().manual_seed(0)])
    assert out.tokens == [None]
    assert "no token can be drawn" in req.failure


# ---------------------------------------------------------------------- n > 1 on SmolLM2

NEW = 6


@pytest.fixture(scope="module")
def smollm2():
    """Batch-invariant, so a sequence's tokens do not depend on what it shares a step with
    or on how its prompt was split (its fork, the prefix cache, preemption); a pool of 17
    blocks of 16 tokens (6 MiB), small enough to preempt four 100-token sequences."""
    return LLM(model="smollm2", batch_invariant=True, max_model_len=256,
               kv_cache_memory="6MiB")


def _prompt(llm, length: int) -> list[int]:
    ids = llm.engine.inputs.encode("Once upon a time, in a land far away, there lived " * 8)
    return ids[:length]


def _idle(engine) -> bool:
    pool = engine.kv.pool
    return (pool.num_free_blocks == pool.num_blocks and not engine.has_unfinished()
            and all(c == 0 for c in pool.ref_cnt))


@needs_smollm2
@pytest.mark.parametrize("length", [40, 33, 1], ids=["partial-block", "block-boundary",
                                                      "one-token"])
def test_n_greedy_answers_are_the_n1_answer(smollm2, length):
    """40 tokens: the forks copy sequence 0's block of tokens 32-38 (without the copy
    their attention would read another block's KV); 33: no partly filled block."""
    ids = _prompt(smollm2, length)
    one = smollm2.generate(ids, SamplingParams(temperature=0, max_tokens=NEW))[0]
    out = smollm2.generate(ids, SamplingParams(temperature=0, max_tokens=NEW, n=4))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    for c in out.outputs:
        assert (c.token_ids, c.text, c.finish_reason) == (one.token_ids, one.text,
                                                           one.finish_reason)
    assert (out.text, out.token_ids) == (one.text, one.token_ids)  # n == 1's shape: choice 0
    assert _idle(smollm2.engine)


@needs_smollm2
def test_n_seeded_answers_repeat_and_differ_from_each_other(smollm2):
    ids = _prompt(smollm2, 12)
    sp = SamplingParams(temperature=1.0, max_tokens=10, n=4, seed=1234)
    first, again = (smollm2.generate(ids, sp)[0] for _ in range(2))
    answers = [c.token_ids for c in first.outputs]
    assert answers == [c.token_ids for c in again.outputs]
    assert len(set(map(tuple, answers))) > 1, "the n sequences sampled one stream"
    # sequence 0 samples with the request's seed, as a request with n == 1 does
    alone = smollm2.generate(ids, SamplingParams(temperature=1.0, max_tokens=10, seed=1234))[0]
    assert answers[0] == alone.token_ids
    # a neighbouring seed shares no sequence with this one
    other = smollm2.generate(ids, SamplingParams(temperature=1.0, max_tokens=10, n=4,
                                                 seed=1235))[0]
    assert not {tuple(c.token_ids) for c in other.outputs} & set(map(tuple, answers))
    unseeded = smollm2.generate(ids, SamplingParams(temperature=1.0, max_tokens=10, n=4))[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) > 1


@needs_smollm2
@pytest.mark.parametrize("end", ["finish", "abort"])
def test_n_sequences_share_the_prompt_blocks_and_free_them(smollm2, end):
    engine = smollm2.engine
    pool = engine.kv.pool
    ids = _prompt(smollm2, 40)  # blocks 0-1 full, tokens 32-38 in block 2, 39 computed by each
    req = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=NEW, n=3,
                                                 ignore_eos=True))
    seqs = req.group
    while not all(s.output_token_ids for s in seqs):
        engine.step()
    shared = seqs[0].block_ids[:2]
    assert all(s.block_ids[:2] == shared for s in seqs)
    assert [pool.ref_cnt[b] for b in shared] == [3, 3]
    own = [s.block_ids[2] for s in seqs]
    assert len(set(own)) == 3 and all(pool.ref_cnt[b] == 1 for b in own)
    assert pool.num_blocks - pool.num_free_blocks == 5
    if end == "abort":
        assert engine.abort(req.request_id)
        assert [s.finish_reason for s in seqs] == [FinishReason.ABORT] * 3
    while engine.has_unfinished():
        engine.step()
    assert _idle(engine)
    # freed, the prompt's full blocks stay findable in the prefix cache
    assert all(pool.cached.get(h) == b for h, b in zip(seqs[0].block_hashes, shared))


@needs_smollm2
def test_n_sequences_survive_preemption(smollm2):
    """Four 40 + 60-token sequences need 2 shared + 4 x 5 blocks; the pool has 17, so
    forked sequences are preempted and recompute: their answers stay the greedy one."""
    engine = smollm2.engine
    ids = _prompt(smollm2, 40)
    sp = dict(temperature=0, max_tokens=60, ignore_eos=True)
    one = smollm2.generate(ids, SamplingParams(**sp))[0]
    before = engine.scheduler.num_preemptions
    out = smollm2.generate(ids, SamplingParams(**sp, n=4))[0]
    assert engine.scheduler.num_preemptions > before
    assert [c.token_ids for c in out.outputs] == [one.token_ids] * 4
    assert _idle(engine)


def test_rows_drawn_together_follow_their_distribution_and_their_own_generator():
    """Temperature-only rows are drawn in one pass (softmax, cumulative sum, one uniform of
    each row's generator): each row's draws follow its softmax at its temperature (a
    token of probability 0 never comes), a row's draw does not depend on its
    batch-mates, and a seeded generator repeats it."""
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf")], [0.0, 0.0, 3.0, 1.0]])
    reqs = [_req(temperature=1.0), _req(temperature=0.5)]
    counts = torch.zeros(2, 4)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    draws = 4000
    for _ in range(draws):
        for row, token in enumerate(sample(logits.clone(), reqs, gens).tokens):
            counts[row, token] += 1
    want = torch.stack([torch.softmax(logits[0], -1), torch.softmax(logits[1] / 0.5, -1)])
    assert counts[0, 3] == 0
    # each frequency within 5 standard deviations of its probability
    sd = (want * (1 - want) / draws).sqrt()
    assert ((counts / draws - want).abs() <= 5 * sd + 1e-9).all(), (counts / draws, want)
    # alone or beside another row, with the same seed: the same token
    alone = [sample(logits[1:].clone(), [reqs[1]], [torch.Generator().manual_seed(s)]).tokens[0]
             for s in range(20)]
    paired = [sample(logits.clone(), reqs, [torch.Generator().manual_seed(99),
                                            torch.Generator().manual_seed(s)]).tokens[1]
              for s in range(20)]
    assert alone == paired and len(set(alone)) > 1


def test_a_row_drawn_together_with_no_drawable_token_fails_alone():
    logits = torch.tensor([[float("nan")] * 4, [0.0, 5.0, 0.0, 0.0]])
    reqs = [_req(temperature=1.0), _req(temperature=1.0)]
    reqs[0].req_id = "bad"
    out = sample(logits, reqs, [torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)])
    assert out.tokens[0] is None and "no token can be drawn" in reqs[0].failure
    assert out.tokens[1] is not None and reqs[1].failure is None
