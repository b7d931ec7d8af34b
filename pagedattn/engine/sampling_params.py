"""``SamplingParams``: how one request picks its tokens and when it stops (vLLM's shape)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedattn.checks import require_int, require_number
from pagedattn.engine.structured_output import StructuredOutput

TEMPERATURE_FLOOR = 0.01
"""Temperatures in ``(0, TEMPERATURE_FLOOR)`` are raised to it (vLLM does the same). The
logits are divided by the temperature in float32: at 1e-300 they overflow to inf, softmax
gives NaN and the draw fails. At 0.01 a gap of one logit is already a factor e**100, so
sampling is as sharp as it can usefully be; ``temperature=0`` is the greedy argmax."""

TOP_P_FLOOR = 1e-6
"""``top_p`` values in ``(0, TOP_P_FLOOR)`` are raised to it. The nucleus keeps the most
likely token whatever ``top_p`` is, so the floor changes no draw; it keeps ``top_p``
meaningful as a float32 (1e-300 rounds to 0 there)."""

REPETITION_PENALTY_MIN = 0.01
"""The smallest ``repetition_penalty`` accepted: a penalty p divides the positive logits
by p, and below about 1e-38 (float32's smallest normal) that is a division by zero."""


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

    ``temperature`` in ``(0, 0.01)`` is raised to 0.01 and ``top_p`` in ``(0, 1e-6)`` to
    1e-6 (:data:`TEMPERATURE_FLOOR`, :data:`TOP_P_FLOOR`), as vLLM does, so no valid
    value can overflow the float32 sampling math.

    ``repetition_penalty`` (>= 0.01, ``1.0`` = off) divides the positive logits and multiplies
    the negative ones of every token already in the prompt or the output (CTRL's rule).
    ``logprobs`` (``None`` = off) asks for the log-probability of each sampled token plus
    the ``logprobs`` most likely alternatives, from the model's distribution after the
    penalty and before temperature. ``skip_special_tokens`` drops special tokens (EOS)
    from the text.

    ``structured_output`` (a :class:`~pagedattn.engine.structured_output.StructuredOutput`,
    ``None`` = off) holds the output to a JSON schema, any JSON object, a regex or an EBNF
    grammar (xgrammar): tokens the grammar does not allow next are masked before the pick,
    and the request finishes (``stop``) once the grammar is complete.

    ``n`` (>= 1) asks for that many completions of the prompt. The prompt is computed
    once: the ``n`` sequences share its KV blocks, each gets its own copy of the partly
    filled last one, and sequence ``i`` samples with its own generator: with ``seed=s``,
    sequence 0 uses ``s`` (as a request with ``n == 1``) and sequence ``i`` a seed derived
    from ``(s, i)``; without a seed, the engine's seed mixed with the sequence's id.
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
    structured_output: StructuredOutput | None = None
    n: int = 1

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = require_number(name, getattr(self, name))
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            return value

        temperature = number("temperature")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if 0 < temperature < TEMPERATURE_FLOOR:
            object.__setattr__(self, "temperature", TEMPERATURE_FLOOR)
        top_p = number("top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if top_p < TOP_P_FLOOR:
            object.__setattr__(self, "top_p", TOP_P_FLOOR)
        if number("repetition_penalty") < REPETITION_PENALTY_MIN:
            raise ValueError(f"repetition_penalty must be >= {REPETITION_PENALTY_MIN} "
                             f"(1 = off), got {self.repetition_penalty}")
        for name, low in (("top_k", -1), ("max_tokens", 1), ("min_tokens", 0), ("n", 1)):
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
        ids = list(self.stop_token_ids)
        for t in ids:
            require_int("stop_token_ids", t, 0, numpy=True, expected="a list of ints >= 0")
        object.__setattr__(self, "stop_token_ids", [int(t) for t in ids])
        if self.structured_output is not None and not isinstance(self.structured_output,
                                                                 StructuredOutput):
            raise TypeError(f"structured_output must be a StructuredOutput or None, "
                            f"got {self.structured_output!r:.100}")
        if self.structured_output is not None and self.min_tokens > 0:
            # the grammar may be complete before min_tokens tokens, and then no token
            # may follow it: refused here rather than failed mid-generation
            raise ValueError(f"min_tokens must be 0 with structured output (its grammar may "
                             f"end sooner), got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
