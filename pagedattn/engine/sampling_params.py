"""``SamplingParams``: how one request picks its tokens and when it stops (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedattn.checks import require_int, require_number


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules.

    ``temperature == 0`` is greedy (argmax); otherwise logits are divided by it and
    filtered by ``top_k`` (``-1`` or ``0`` = off) and ``top_p`` (nucleus, ``1.0`` = off)
    before sampling with a generator seeded by ``seed`` (``None`` = the engine's seed
    mixed with the request index, so runs are reproducible). Generation stops at
    ``max_tokens`` new tokens, at the model's EOS token (unless ``ignore_eos``), at one
    of ``stop_token_ids``, or when the text contains one of ``stop`` (the text is cut
    before it); none of these stops it before ``min_tokens`` new tokens.

    ``repetition_penalty`` (> 0, ``1.0`` = off) divides the positive logits and multiplies
    the negative ones of every token already in the prompt or the output (CTRL's rule).
    ``logprobs`` (``None`` = off) asks for the log-probability of each sampled token plus
    the ``logprobs`` most likely alternatives, from the model's distribution after the
    penalty and before temperature. ``skip_special_tokens`` drops special tokens (EOS)
    from the text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            return require_number(name, getattr(self, name))

        if number("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < number("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if number("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name, low in (("top_k", -1), ("max_tokens", 1), ("min_tokens", 0)):
            require_int(name, getattr(self, name), low)
        require_int("seed", self.seed, allow_none=True, error=TypeError, expected="an int or None")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        require_int("logprobs", self.logprobs, 0, allow_none=True)
        if not isinstance(self.skip_special_tokens, bool):
            raise TypeError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", [int(t) for t in self.stop_token_ids])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
