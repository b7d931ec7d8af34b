"""A request's life inside the engine: its tokens, its blocks, its state and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedattn.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens, or the model's context is full
    ABORT = "abort"        # aborted by the caller
    ERROR = "error"        # rejected: see Request.error

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Request:
    """Mutable state of one request; owned by the scheduler.

    ``num_computed_tokens`` counts the tokens whose K/V sit in the cache; the tokens
    ``[num_computed_tokens, num_tokens)`` still have to be run through the model.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    """With ``sampling_params.logprobs``: one ``sampler.TokenLogprobs`` per output token."""
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Digests (``block_pool.hash_block``) of the request's full blocks of known tokens (prefix caching)."""
    num_cached_blocks: int = 0
    """Leading blocks already registered in the prefix cache."""
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_passed_over: int = 0
    """Times a younger request was admitted before this one (the scheduler's aging)."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_text: Any = None
    """With stop strings: the ``detokenizer.IncrementalDetokenizer`` that finds them."""
    grammar: Any = None
    """With ``sampling_params.structured_output``: its
    ``structured_output.GrammarState`` (matcher and token bitmask)."""
    failure: str | None = None
    """Set where processing this request alone raised (its sampling, its stop strings):
    the engine then finishes it with ``error`` and the other requests go on."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()
