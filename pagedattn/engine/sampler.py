"""Token sampling: greedy, or temperature + top-k + top-p with a per-request generator."""

from __future__ import annotations

import torch

from pagedattn.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` (``[n, vocab]``)."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    out = []
    for row, p, gen in zip(logits.float(), params, generators):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always the top token)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
