"""The sampler's per-request rules (min_tokens, repetition_penalty, logprobs) and the
validation of the SamplingParams fields that carry them; no model needed."""

from __future__ import annotations

import math

import pytest
import torch

from pagedattn import ops
from pagedattn.engine.request import Request
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

    def faulty(row, req, gen):
        if req.req_id == "bad":
            raise RuntimeError("injected")
        return original(row, req, gen)

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
