"""Comparing two engines' greedy paths token for token (vLLM engine tests)."""

from __future__ import annotations

# fp32 rounding (another summation order: plugin vs not, one rank vs two) may flip a
# greedy choice only where the top-2 log-probs are this close.
TIE_LOGPROB_GAP = 1e-4


def assert_same_greedy(first: list[dict], second: list[dict], what: str) -> list[str]:
    """Identical generated ids per prompt in two runs (``what`` names them, first one
    first), except after a top-2 tie in the first run; returns a note per tie split."""
    notes = []
    assert len(first) == len(second)
    for i, (a, b) in enumerate(zip(first, second)):
        assert a["prompt_ids"] == b["prompt_ids"], f"{what} prompt {i}: different prompts"
        if a["ids"] == b["ids"]:
            continue
        k = next(k for k, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y)
        top = sorted(a["top"][k].values(), reverse=True)
        gap = top[0] - top[1] if len(top) > 1 else float("inf")
        assert gap < TIE_LOGPROB_GAP, (
            f"{what} prompt {i}: greedy tokens differ at step {k} ({a['ids'][k]} in the first "
            f"run, {b['ids'][k]} in the second) where the top-2 log-prob gap is {gap:.3g}, not "
            f"a tie; first: {a['ids']}, second: {b['ids']}")
        notes.append(f"{what} prompt {i}: paths split at step {k} on a top-2 tie ({gap:.2g})")
    return notes
