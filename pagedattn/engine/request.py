"""A request's life inside the engine: its tokens, its blocks, its state and timings.

A request with ``SamplingParams.n > 1`` is ``n`` sequences (:func:`new_sequences`), each a
:class:`Request` the scheduler runs like any other; they share the request's id
(``request_id``) and differ by ``index``. Sequences 1..n-1 start by forking from
sequence 0 (``parent``) once it has computed the prompt: the scheduler gives them its KV
(``KVCacheManager.fork``) instead of computing the prompt again.
"""

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
    request_id: str = ""
    """The caller's id, shared by the ``n`` sequences of one request (``req_id`` for
    n == 1; empty: ``req_id``). ``req_id`` is the sequence's own (see :func:`sequence_id`)."""
    index: int = 0
    """Which of the request's ``n`` sequences this is (0 for n == 1)."""
    group: list[Request] = field(default=None, repr=False)  # type: ignore[assignment]
    """The request's sequences in index order, this one included (``[self]`` for n == 1)."""
    parent: Request | None = field(default=None, repr=False)
    """Sequence 0, for a sequence 1..n-1 that has not forked from it yet; ``None`` once it
    has (or if sequence 0 ended first: it then computes its prompt as any request)."""

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = self.req_id
        if self.group is None:
            self.group = [self]

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


def sequence_id(request_id: str, index: int) -> str:
    """The id of sequence ``index`` of request ``request_id``: the request's own id for
    sequence 0 (so n == 1 is unchanged), ``"{request_id}#{index}"`` for the others."""
    return request_id if index == 0 else f"{request_id}#{index}"


def new_sequences(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  eos_token_id: int | None = None) -> list[Request]:
    """The ``params.n`` sequences of one request, sequence 0 first; the others fork from
    it (``parent``). One prompt list is shared: no sequence writes to it."""
    prompt = list(prompt_token_ids)
    group = [Request(sequence_id(request_id, i), prompt, params, eos_token_id,
                     request_id=request_id, index=i) for i in range(params.n)]
    for seq in group:
        seq.group = group
        seq.parent = group[0] if seq.index else None
    return group
