"""Token sampling: greedy, or temperature + top-k + top-p with a per-request generator.

Before picking, :func:`apply_logits_processors` applies the per-request rules that
depend on what the request has seen: the repetition penalty and ``min_tokens`` (which
bans the tokens that would stop it early).

A batch of greedy rows needing nothing else goes through one argmax. Rows sampled at a
temperature alone (no top-k, top-p, penalty, ``min_tokens`` ban, logprobs or grammar)
get their distributions' cumulative sums in one softmax and one cumsum
(:func:`_cumulative_rows`); each then draws its token by inverting its own at one uniform
number of its own generator (:func:`_pick`). Every row's pick is its own: an exception
while processing or picking one request's token fails that request alone (its entry in
``SamplerOutput.tokens`` is ``None`` and ``Request.failure`` says why; the engine
finishes it with ``error``), and the other rows of the batch get their tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedattn import ops
from pagedattn.engine.request import Request

TokenLogprobs = tuple[float, list[tuple[int, float]]]
"""``(logprob of the sampled token, [(token id, logprob)] of the top alternatives)``."""


@dataclass(frozen=True)
class SamplerOutput:
    tokens: list[int | None]
    """One entry per row; ``None`` where picking the token failed (``Request.failure``)."""
    logprobs: list[TokenLogprobs | None]
    """One entry per row; ``None`` where the request asked for no logprobs."""


def _banned_tokens(req: Request) -> list[int]:
    """Tokens that would end ``req`` before its ``min_tokens``."""
    sp = req.sampling_params
    if len(req.output_token_ids) >= sp.min_tokens:
        return []
    banned = list(sp.stop_token_ids)
    if not sp.ignore_eos and req.eos_token_id is not None:
        banned.append(req.eos_token_id)
    return banned


def apply_logits_processors(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """``logits`` (``[n, vocab]`` float32, one row per request) with the repetition
    penalty and ``min_tokens`` bans applied, in place."""
    for row, req in zip(logits, reqs):
        _process_row(row, req)
    return logits


def _process_row(row: torch.Tensor, req: Request) -> None:
    vocab = row.shape[-1]
    penalty = req.sampling_params.repetition_penalty
    if penalty != 1.0:
        seen = torch.tensor(sorted({t for t in req.prompt_token_ids + req.output_token_ids
                                    if 0 <= t < vocab}), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    banned = [t for t in _banned_tokens(req) if 0 <= t < vocab]
    if banned:
        row[banned] = float("-inf")


def _needs_processing(req: Request) -> bool:
    sp = req.sampling_params
    return sp.repetition_penalty != 1.0 or len(req.output_token_ids) < sp.min_tokens


def _logprobs(row: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    logp = torch.log_softmax(row, dim=-1)
    alternatives = []
    if top > 0:
        values, ids = torch.topk(logp, top)
        alternatives = list(zip(ids.tolist(), values.tolist()))
    return float(logp[token]), alternatives


def _no_token(total: float, p) -> ValueError:
    return ValueError(f"no token can be drawn: the probabilities sum to {total} "
                      f"(temperature={p.temperature}, top_p={p.top_p}, top_k={p.top_k}, "
                      f"repetition_penalty={p.repetition_penalty})")


def _pick(row: torch.Tensor | None, req: Request, gen: torch.Generator | None,
          cdf: torch.Tensor | None = None) -> int:
    """``req``'s token from its logits ``row``; or, given ``cdf`` (its distribution's
    cumulative sums, :func:`_cumulative_rows`), the first token whose cumulative
    probability passes ``u x total`` for one uniform ``u`` of ``gen``: exactly the
    distribution, and a token of probability 0 is never drawn."""
    p = req.sampling_params
    if cdf is not None:
        total = float(cdf[-1])
        if not math.isfinite(total) or total <= 0.0:
            raise _no_token(total, p)
        target = torch.rand((), generator=gen) * total
        return min(int(torch.searchsorted(cdf, target, right=True)), cdf.numel() - 1)
    if p.greedy:
        return int(row.argmax())
    row = row / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p; the top token stays even where
        # top_p rounds to 0 in float32
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0.0:
        raise _no_token(total, p)
    return int(torch.multinomial(probs, 1, generator=gen))


ARGMAX_CHUNK = 1024


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[n, vocab]`` logits, the same index (the first
    maximal one; NaN counts as maximal). Natively (:func:`pagedattn.ops.argmax_rows`: two
    vector passes per row) where the extension is loaded; else in two torch passes, each
    chunk's max, then the argmax inside the best chunk. torch's CPU argmax reduces about 4x
    slower than its max, and a batch's greedy argmax over a 262,144-token vocabulary cost
    ~9 ms per step."""
    rows, vocab = logits.shape
    if ops.native_available() and logits.dtype in (torch.float32, torch.bfloat16) \
            and vocab and logits.stride(1) == 1:
        return ops.argmax_rows(logits)
    if vocab % ARGMAX_CHUNK or vocab < 4 * ARGMAX_CHUNK or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(rows, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # the first chunk holding the row's max
    within = chunks[torch.arange(rows), best].argmax(dim=-1)
    return best * ARGMAX_CHUNK + within


def apply_grammar_masks(logits: torch.Tensor, reqs: list[Request]) -> set[int]:
    """Mask, in place, the logits of the rows whose request has a grammar (structured
    output) to the tokens it allows next; the other rows are not touched. Returns the
    rows whose masking failed (``Request.failure`` says why)."""
    failed = set()
    for i, req in enumerate(reqs):
        if req.grammar is None:
            continue
        try:
            req.grammar.mask(logits[i])
        except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
            req.failure = f"structured output failed: {type(exc).__name__}: {exc}"
            failed.add(i)
    return failed


def _temperature_only(req: Request) -> bool:
    """Whether ``req``'s pick is a draw at its temperature from the full distribution."""
    p = req.sampling_params
    return (not p.greedy and p.top_p >= 1.0 and p.top_k <= 0 and p.logprobs is None
            and req.grammar is None and not _needs_processing(req))


def _cumulative_rows(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The cumulative sums of each row's softmax at its request's temperature, every row in
    one softmax and one cumsum (``torch.multinomial`` drew an exponential per vocabulary
    entry, a row at a time: 11 ms of an eight-sample step at 49,152 tokens)."""
    temps = torch.tensor([r.sampling_params.temperature for r in reqs], dtype=torch.float32)
    return torch.softmax(logits.float() / temps[:, None], dim=-1).cumsum_(dim=-1)


def sample(logits: torch.Tensor, reqs: list[Request],
           generators: list[torch.Generator | None]) -> SamplerOutput:
    """One token per row of ``logits`` (``[n, vocab]`` float32), row ``i`` for ``reqs[i]``.
    Rows with a grammar are masked first (in place); the others pay one attribute check."""
    failed = set()
    if any(r.grammar is not None for r in reqs):
        failed = apply_grammar_masks(logits, reqs)
    plain = not any(_needs_processing(r) or r.sampling_params.logprobs is not None for r in reqs)
    if plain and all(r.sampling_params.greedy for r in reqs):
        tokens = argmax_rows(logits).tolist()
        for i in failed:
            tokens[i] = None
        return SamplerOutput(tokens, [None] * len(reqs))
    cdfs: dict[int, torch.Tensor] = {}
    together = [i for i, r in enumerate(reqs) if i not in failed and _temperature_only(r)]
    if together:
        try:
            cdfs = dict(zip(together, _cumulative_rows(logits[together],
                                                       [reqs[i] for i in together])))
        except Exception:  # noqa: BLE001 - each row then goes its own way, failing alone
            cdfs = {}
    if len(cdfs) + len(failed) < len(reqs):
        logits = logits.float()
    tokens: list[int | None] = []
    logprobs: list[TokenLogprobs | None] = []
    for i, (req, gen) in enumerate(zip(reqs, generators)):
        if i in failed:
            tokens.append(None)
            logprobs.append(None)
            continue
        if i in cdfs:
            try:
                token = _pick(None, req, gen, cdf=cdfs[i])
            except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
                req.failure = f"sampling failed: {type(exc).__name__}: {exc}"
                token = None
            tokens.append(token)
            logprobs.append(None)
            continue
        row = logits[i]
        try:
            _process_row(row, req)
            token = _pick(row, req, gen)
            top = req.sampling_params.logprobs
            lp = None if top is None else _logprobs(row, token, top)
        except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
            req.failure = f"sampling failed: {type(exc).__name__}: {exc}"
            token, lp = None, None
        tokens.append(token)
        logprobs.append(lp)
    return SamplerOutput(tokens, logprobs)
