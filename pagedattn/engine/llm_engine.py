"""``LLMEngine``: a decoder model with a paged KV cache, a scheduler and a model runner.

It knows requests, not prompts' text: :meth:`add_request` queues token ids, :meth:`step`
runs one scheduler step (one forward pass over every scheduled request), :meth:`abort`
drops a request and frees its blocks. ``LLM`` (offline) and ``pagedattn serve`` (online)
both drive one of these.

A request with ``SamplingParams.n > 1`` runs as ``n`` sequences (``request.py``), each a
handle of its own in :class:`StepResult`; :meth:`progress` says which request and which
of its ``n`` sequences a handle is. :meth:`abort` takes the request's id and ends all of
them.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pagedattn.engine.args import EngineArgs
from pagedattn.engine.block_pool import KVCacheManager
from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.inputs import PromptInputs, check_token_ids
from pagedattn.engine.loading import LoadedModel
from pagedattn.engine.model_runner import ModelRunner
from pagedattn.engine.request import FinishReason, Request, new_sequences
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import ContextLengthError, Scheduler
from pagedattn.engine.structured_output import Grammars, StructuredOutput
from pagedattn.models.loader import describe_model
from pagedattn.thread_policy import StepThreads


@dataclass
class StepStats:
    """Time spent in steps, split by kind (a step with any prefill token is a prefill)."""

    num_prefill_tokens: int = 0
    prefill_time: float = 0.0
    num_decode_tokens: int = 0
    decode_time: float = 0.0
    num_output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`LLMEngine.step` did: the sequences (one per request for n == 1)
    that got a token, and of those the ones that finished; ``failed``: the sequences whose
    own processing (sampling, stop strings) raised, finished with ``error`` (the reason
    in ``Request.error``). A failed sequence that got its token first is in ``sampled``
    and ``finished`` too."""

    sampled: list[Request]
    finished: list[Request]
    failed: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now (:meth:`LLMEngine.load`): for gauges and probes."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    num_preemptions: int
    step_threads: int = 0
    """Threads of the latest step (0 before the first; :class:`StepThreads`)."""
    steps_on_fewer_threads: int = 0
    """Steps that ran on fewer threads than torch's count, other processes being busy."""


@dataclass(frozen=True)
class RequestProgress:
    """One sequence's progress (:meth:`LLMEngine.progress`): what a front end streams."""

    req_id: str
    """The request's id (the one :meth:`LLMEngine.add_request` was given), shared by its
    ``n`` sequences."""
    new_token_ids: list[int]
    """Output tokens from the ``since`` asked for on."""
    new_logprobs: list
    """``sampler.TokenLogprobs`` of ``new_token_ids`` (empty unless asked for)."""
    num_output_tokens: int
    finish_reason: str | None
    """``None`` while the request runs."""
    error: str | None
    index: int = 0
    """Which of the request's ``n`` sequences (``SamplingParams.n``) the tokens are of:
    0 to n - 1, the choice's ``index`` in OpenAI's answers."""
    n: int = 1
    """How many sequences the request has."""


class LLMEngine:
    def __init__(self, loaded: LoadedModel, args: EngineArgs) -> None:
        if loaded.is_encoder:
            raise ValueError("LLMEngine serves decoder models; this one is encoder-only "
                             "(use Embedder)")
        self.args = args
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.attention = loaded.attention
        self.max_model_len = loaded.max_model_len
        cfg = loaded.config
        page_bytes = self.attention.spec.page_size_bytes * cfg.num_layers
        self.num_blocks = args.kv_cache_memory // page_bytes
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={args.kv_cache_memory!r} holds no block of "
                             f"{page_bytes} bytes")
        if args.max_model_len is None:
            # The default is the model's context, but no longer than the pool holds (Gemma
            # 3's 32,768 tokens need 576 MiB of bf16 cache; the default pool is 512 MiB).
            self.max_model_len = min(self.max_model_len, self.num_blocks * args.block_size)
        self.kv = KVCacheManager(self.num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, args.max_num_batched_tokens, self.max_model_len,
                                   args.max_num_seqs, args.scheduling_policy)
        self.runner = ModelRunner(loaded.model, self.attention, num_blocks=self.num_blocks,
                                  max_model_len=self.max_model_len,
                                  max_num_seqs=args.max_num_seqs, seed=args.seed,
                                  huge=args.huge_pages,
                                  threads=StepThreads(args.adaptive_threads))
        if args.calculate_kv_scales:
            for module in loaded.model.modules():
                if hasattr(module, "calibrate_kv_scales"):
                    module.calibrate_kv_scales(args.cache_dtype)
        self.eos_token_id = cfg.eos_token_id
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_id = self.tokenizer.eos_token_id
        self.inputs = PromptInputs(self.tokenizer, cfg.vocab_size, self.max_model_len,
                                   describe_model(args.model))
        """Prompt text and chat messages to checked token ids (``engine/inputs.py``)."""
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, self.eos_token_id)
        """Structured output's compiled grammars, cached by key (``structured_output.py``)."""
        self.stats = StepStats()
        self._ids = itertools.count()

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds (all requests together)."""
        return self.kv.capacity_tokens

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Queue a request: its ``sampling_params.n`` sequences. Returns sequence 0, whose
        ``group`` lists all of them. Raises ``RequestRejectedError`` (a ``ValueError``)
        if it can never run, e.g. a prompt longer than the context."""
        self.check_sampling_params(sampling_params)
        req_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        group = new_sequences(req_id, prompt_token_ids, sampling_params, self.eos_token_id)
        if sampling_params.structured_output is not None:
            for seq in group:  # each sequence walks the grammar on its own tokens
                seq.grammar = self.grammars.new_state(sampling_params.structured_output)
        self.scheduler.add_request(group[0])
        return group[0]

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Raise ValueError where ``params`` name a token this model does not have, or
        ask for structured output that cannot be compiled (``StructuredOutputError``)."""
        check_token_ids(params.stop_token_ids, self.model_config.vocab_size, "stop_token_ids")
        if params.structured_output is not None:
            self.compile_structured_output(params.structured_output)

    def compile_structured_output(self, spec: StructuredOutput):
        """Compile ``spec``'s grammar now (cached by its key), so that adding the request
        later costs no compilation; ``StructuredOutputError`` (a ValueError) naming the
        problem for an invalid schema, regex or grammar, or without xgrammar. The server
        calls this on its input threads, off the event loop."""
        return self.grammars.compile(spec)

    def check_prompt(self, prompt_token_ids: list[int], what: str = "prompt") -> list[int]:
        """The prompt's ids if every one is in the vocabulary and one more token fits in
        the context; else ValueError (``ContextLengthError`` for the length) naming it."""
        ids = check_token_ids(prompt_token_ids, self.model_config.vocab_size, what)
        self.scheduler.check_prompt_length(len(ids), what)
        return ids

    def max_new_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """``requested`` if the prompt and that many new tokens fit in the context (the
        server's rule, as vLLM's: a larger value is an error, not a silent cap);
        ``None``: as many as fit."""
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise ContextLengthError(
                f"max_tokens: {requested} new tokens do not fit: this model's context is "
                f"{self.max_model_len} tokens and the prompt has {num_prompt_tokens}, "
                f"leaving {room}")
        return requested

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request, all its sequences (frees their blocks);
        False if unknown or finished."""
        aborted = self.scheduler.abort_request(request_id)
        for seq in aborted:
            self.runner.forget(seq.req_id)
        return bool(aborted)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        """One engine step."""
        out = self.scheduler.schedule()
        if not out.num_scheduled_tokens:
            return StepResult([], [])
        t0 = time.perf_counter()
        sampled, logprobs = self.runner.execute(out)
        now = time.perf_counter()
        stats = self.stats
        if any(n > 1 for n in out.num_scheduled_tokens.values()):
            stats.num_prefill_tokens += out.total_num_scheduled_tokens
            stats.prefill_time += now - t0
        else:
            stats.num_decode_tokens += len(sampled)
            stats.decode_time += now - t0
        got_token = self.scheduler.update(out, sampled)
        finished, failed = [], []
        for req in got_token:
            if req.grammar is not None and not req.is_finished:
                self._advance_grammar(req)
        for req in out.requests.values():
            if req.failure is not None and not req.is_finished:
                self._fail(req, failed)
                finished.append(req)
        for req in got_token:
            stats.num_output_tokens += 1
            if req.req_id in logprobs:
                req.output_logprobs.append(logprobs[req.req_id])
            if req.first_token_time is None:
                req.first_token_time = now
                stats.ttfts.append(now - req.arrival_time)
            sp = req.sampling_params
            if not req.is_finished and sp.stop and len(req.output_token_ids) >= sp.min_tokens:
                try:
                    hit = self._hit_stop(req)
                except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
                    req.failure = f"stop-string check failed: {type(exc).__name__}: {exc}"
                    self._fail(req, failed)
                    hit = False
                if hit:
                    self.scheduler.finish_request(req, FinishReason.STOP)
            if req.is_finished:
                self.runner.forget(req.req_id)
                finished.append(req)
        return StepResult(got_token, finished, failed)

    def _advance_grammar(self, req: Request) -> None:
        """Feed the sampled token to the request's matcher; finish the request (``stop``)
        when its grammar has terminated. A matcher's failure is the request's alone."""
        try:
            req.grammar.accept(req.output_token_ids[-1])
            if req.grammar.terminated:
                self.scheduler.finish_request(req, FinishReason.STOP)
        except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
            req.failure = f"structured output failed: {type(exc).__name__}: {exc}"

    def _fail(self, req: Request, failed: list[Request]) -> None:
        self.scheduler.finish_request(req, FinishReason.ERROR, req.failure)
        self.runner.forget(req.req_id)
        failed.append(req)

    def load(self) -> EngineLoad:
        """Requests and KV blocks held now, the prefix-cache and preemption counts, and
        the threads steps ran on."""
        sched, pool, threads = self.scheduler, self.kv.pool, self.runner.threads
        return EngineLoad(len(sched.running), len(sched.waiting),
                          pool.num_blocks - pool.num_free_blocks, pool.num_blocks,
                          pool.num_hits, pool.num_queries, sched.num_preemptions,
                          threads.last_threads, threads.steps_on_fewer)

    def progress(self, req: Request, since: int = 0) -> RequestProgress:
        """``req``'s output from its ``since``-th token on, and whether (and why) it has
        finished; ``req`` is a handle (one sequence) from :meth:`add_request` or a
        :class:`StepResult`. A front end keeps ``since`` per request and sequence: the
        handle's ``request_id`` and ``index`` say which, without a call."""
        out = req.output_token_ids
        return RequestProgress(req.request_id, out[since:], req.output_logprobs[since:len(out)],
                               len(out), str(req.finish_reason) if req.is_finished else None,
                               req.error, req.index, len(req.group))

    def running_request_ids(self) -> list[str]:
        """Ids of the requests with a sequence in the running batch, each once."""
        return list(dict.fromkeys(r.request_id for r in self.scheduler.running))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    def _hit_stop(self, req: Request) -> bool:
        if self.tokenizer is None:
            return False
        if req.stop_text is None:
            req.stop_text = IncrementalDetokenizer(self.tokenizer, True, req.sampling_params.stop)
        det = req.stop_text
        det.feed(req.output_token_ids[len(det.tokens):])
        return det.first_stop() is not None
