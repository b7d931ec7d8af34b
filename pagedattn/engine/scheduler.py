"""The scheduler: which requests run this step, and how many of their tokens.

Continuous batching under a per-step token budget: requests join and leave the running
set between steps. Each step it serves, in order, the running decodes (one token each),
the running chunked prefills, then waiting requests in the order of the scheduling policy
(a waiting request that does not fit blocks the others). A prefill longer than the budget
left is cut into chunks over several steps.

Policies for the waiting queue: ``fcfs``, first come first served; ``shortest_first``,
the request with the fewest tokens left to prefill first, ties first come first served.
Shortest-first is what a server under bursts wants: when many prompts arrive at once,
each prompt's first token waits for the prefill of every prompt admitted before it, so
serving short ones first lowers the median time to first token at no cost in throughput
(the same tokens are computed). A request passed over ``MAX_PASSED_OVER`` times (a
younger one admitted before it) is served next whatever its length, so a long prompt
under a stream of short ones still starts.

When the pool runs out of blocks, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the head of the queue, to be
recomputed (prefix-cache hits make that cheap); it is admitted next under both policies.

Two rules keep a prompt's KV computed once (``_waits``); a request they hold back keeps
its place in the queue while the requests after it may be admitted:

* **Sequences of one request** (``SamplingParams.n > 1``). Sequence 0 computes the prompt
  but its last token; sequences 1..n-1 wait until it has, then fork from it
  (``KVCacheManager.fork``: its full blocks shared, its partly filled block copied on
  write, ``SchedulerOutput.block_copies``) and each computes the last prompt token
  itself, for logits of its own. Sequence 0 computes that token in the same step where
  there is room, so all ``n`` usually sample their first token together. If sequence 0
  ends before a sequence forked (aborted, failed), that one computes its prompt as any
  request; if it is preempted, they wait until it has recomputed the prompt.
* **Requests that share a prefix.** With prefix caching, a waiting request whose next
  full prompt blocks a running request is computing right now (the same digests,
  allocated and not yet cached) waits until they are cached, then takes them as prefix
  hits instead of computing them alongside: a burst of requests with one system prompt
  computes it once. The wait lasts while that request computes them: it ends when the
  blocks are cached, or at once if the request is preempted (it then computes them
  again first, being at the queue's head) or ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedattn.checks import require_choice, require_int
from pagedattn.engine.block_pool import BlockHash, KVCacheManager
from pagedattn.engine.request import FinishReason, Request, RequestStatus


SCHEDULING_POLICIES = ("fcfs", "shortest_first")
MAX_PASSED_OVER = 64


class RequestRejectedError(ValueError):
    """A request that can never be served (too long for the model or the pool)."""


class ContextLengthError(RequestRejectedError):
    """A request whose prompt, or prompt and ``max_tokens``, do not fit in the context."""


@dataclass
class SchedulerOutput:
    """One step's plan: tokens to compute per request, in the order scheduled."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """``(source block, destination block)`` pairs whose KV (every layer) the runner
    copies before the step's forward pass: a forked sequence's copy on write."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_model_len: int,
                 max_num_seqs: int = 256, policy: str = "fcfs") -> None:
        require_choice("scheduling_policy", policy, SCHEDULING_POLICIES)
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            require_int(name, value, 1)
        if kv.capacity_tokens < max_model_len:
            raise ValueError(
                f"the KV cache pool holds {kv.capacity_tokens} tokens "
                f"({kv.pool.num_blocks} blocks of {kv.block_size}), fewer than one request of "
                f"max_model_len={max_model_len}: give it more memory or lower max_model_len")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, list[Request]] = {}
        """Request id -> its sequences, while any of them is unfinished."""
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission

    def check_prompt_length(self, num_tokens: int, what: str) -> None:
        """The one rule on a prompt's length: not empty, and one more token must fit in the
        context. ``RequestRejectedError`` / ``ContextLengthError`` naming ``what``."""
        if num_tokens == 0:
            raise RequestRejectedError(f"{what}: the prompt is empty")
        if num_tokens >= self.max_model_len:
            raise ContextLengthError(
                f"{what}: the prompt has {num_tokens} tokens; this model's context "
                f"(max_model_len) is {self.max_model_len} tokens and one more token must fit")

    def add_request(self, req: Request) -> None:
        """Queue ``req`` with the other sequences of its request (``req.group``); raises
        :class:`RequestRejectedError` if it can never run."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        self.check_prompt_length(req.num_prompt_tokens, f"request {req.request_id!r}")
        self.requests[req.request_id] = req.group
        self.waiting.extend(req.group)

    def abort_request(self, request_id: str) -> list[Request]:
        """Abort every unfinished sequence of ``request_id`` (freeing their blocks);
        returns them (empty: unknown or finished)."""
        aborted = [s for s in self.requests.get(request_id, ()) if not s.is_finished]
        for seq in aborted:
            self._finish(seq, FinishReason.ABORT)
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning

    def _preempt_newest(self, out: SchedulerOutput) -> Request:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        victim.num_passed_over = MAX_PASSED_OVER  # it goes first under every policy
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.num_scheduled_tokens.pop(victim.req_id, None)
        out.requests.pop(victim.req_id, None)
        out.preempted.append(victim.req_id)
        return victim

    def _next_waiting(self, computing: dict[int, set[BlockHash]]) -> Request | None:
        """The waiting request the policy admits next (the queue is in arrival order,
        preempted requests at its head), passing over those that wait for KV being
        computed (:meth:`_waits`); ``None`` if all of them do."""
        ready = (r for r in self.waiting if not self._waits(r, computing))
        if self.policy == "fcfs":
            return next(ready, None)
        ready = list(ready)
        for req in ready:
            if req.num_passed_over >= MAX_PASSED_OVER:
                return req
        return min(ready, key=self._tokens_to_prefill, default=None)

    @staticmethod
    def _tokens_to_prefill(req: Request) -> int:
        """Shortest first's key: tokens left to compute; one for a sequence ready to
        fork (it takes the rest from sequence 0)."""
        return 1 if req.parent is not None else req.num_tokens - req.num_computed_tokens

    def _waits(self, req: Request, computing: dict[int, set[BlockHash]]) -> bool:
        """Whether waiting ``req`` should not be admitted yet, because KV it would compute
        is being computed by a running request (the module docstring's two rules)."""
        parent = req.parent
        if parent is not None:
            return parent.status is not RequestStatus.RUNNING \
                or parent.num_computed_tokens < req.num_prompt_tokens - 1
        if not computing or req.num_computed_tokens:
            return False
        hashes = self.kv.block_hashes(req)
        usable = min(len(hashes), self.kv.max_hit_blocks(req))
        return any(i < usable and hashes[i] in digests for i, digests in computing.items())

    def _computing(self) -> dict[int, set[BlockHash]]:
        """Full blocks that running requests are computing (allocated, their digest known,
        in no cache entry), by block index: each request's first such block. Digests
        chain a block to its whole prefix, so a request that shares any later one of
        these blocks shares the first too."""
        computing: dict[int, set[BlockHash]] = {}
        if self.kv.pool.enable_prefix_caching:
            for req in self.running:
                self._note_computing(req, computing)
        return computing

    def _note_computing(self, req: Request, computing: dict[int, set[BlockHash]]) -> None:
        cached = self.kv.pool.cached
        for i in range(req.num_cached_blocks, min(len(req.block_ids), len(req.block_hashes))):
            digest = req.block_hashes[i]
            if digest not in cached:  # (one that is would be a hit for the waiter)
                computing.setdefault(i, set()).add(digest)
                return

    def _end(self, req: Request, computed: int) -> int:
        """Where this step's tokens of ``req`` end, ``computed`` being done: all its known
        tokens, except that sequence 0 of a request with sequences still to fork stops at
        its prompt's last token (they fork from the KV before it, module docstring)."""
        last = req.num_prompt_tokens - 1
        if computed < last and any(s.parent is req for s in req.group):
            return last
        return req.num_tokens

    def _admit(self, req: Request) -> None:
        for older in self.waiting:
            if older is req:
                break
            older.num_passed_over += 1
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Decodes first, then chunked prefills in progress, each group first come first served.
        ordered = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in ordered:
            budget = self.max_num_batched_tokens - out.total_num_scheduled_tokens
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(self._end(req, req.num_computed_tokens) - req.num_computed_tokens,
                          budget)
            while not self.kv.allocate_slots(req, num_new):
                if self._preempt_newest(out) is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            out.num_scheduled_tokens[req.req_id] = num_new
            out.requests[req.req_id] = req
            budget -= num_new

        budget = self.max_num_batched_tokens - out.total_num_scheduled_tokens
        computing = self._computing() if self.waiting else {}
        while self.waiting and budget > 0 and not out.preempted \
                and len(self.running) < self.max_num_seqs:
            req = self._next_waiting(computing)
            if req is None:
                break
            if req.parent is not None:
                if not self.kv.fork(req, req.parent, out.block_copies):
                    break
                req.parent = None
                num_new = 1
            else:
                hits = self.kv.computed_blocks(req)
                start = req.num_computed_tokens + len(hits) * self.kv.block_size
                num_new = min(self._end(req, start) - start, budget)
                if not self.kv.allocate_slots(req, num_new, hits):
                    if not self.running and not out.requests:
                        raise RuntimeError(  # unreachable given the start-up check
                            f"request {req.req_id!r} does not fit in an empty pool")
                    break
                if self.kv.pool.enable_prefix_caching:
                    self._note_computing(req, computing)
            self._admit(req)
            out.num_scheduled_tokens[req.req_id] = num_new
            out.requests[req.req_id] = req
            budget -= num_new
        assert out.total_num_scheduled_tokens <= self.max_num_batched_tokens
        return out

    # ------------------------------------------------------------------ results

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the computed counts, append sampled tokens, finish requests that
        stopped; returns the requests that got a new token."""
        got_token = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = out.requests[req_id]
            req.num_computed_tokens += n
            self.kv.cache_computed_blocks(req)
            token = sampled.get(req_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            got_token.append(req)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
        return got_token

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling_params
        if len(req.output_token_ids) < sp.min_tokens:  # the sampler banned the stop tokens
            return self._length_reason(req)
        if not sp.ignore_eos and req.eos_token_id is not None and token == req.eos_token_id:
            return FinishReason.STOP
        if token in sp.stop_token_ids:
            return FinishReason.STOP
        return self._length_reason(req)

    def _length_reason(self, req: Request) -> FinishReason | None:
        if len(req.output_token_ids) >= req.sampling_params.max_tokens \
                or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish_request(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Finish a request for a reason found outside the scheduler (stop strings, a
        failure of its own)."""
        if not req.is_finished:
            self._finish(req, reason, error)

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.finish(reason, error)
        for seq in req.group:
            if seq.parent is req:  # it will not fork now: it computes its prompt itself
                seq.parent = None
        if all(seq.is_finished for seq in req.group):
            self.requests.pop(req.request_id, None)
