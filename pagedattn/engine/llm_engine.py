"""``LLMEngine``: a decoder model with a paged KV cache, a scheduler and a model runner.

It knows requests, not prompts' text: :meth:`add_request` queues token ids, :meth:`step`
runs one scheduler step (one forward pass over every scheduled request), :meth:`abort`
drops a request and frees its blocks. ``LLM`` (offline) and ``pagedattn serve`` (online)
both drive one of these.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pagedattn.engine.args import EngineArgs
from pagedattn.engine.block_pool import KVCacheManager
from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.loading import LoadedModel
from pagedattn.engine.model_runner import ModelRunner
from pagedattn.engine.request import FinishReason, Request
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import Scheduler


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
    """What one :meth:`LLMEngine.step` did: the requests that got a token, and of those
    the ones that finished."""

    sampled: list[Request]
    finished: list[Request]


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
                                  max_num_seqs=args.max_num_seqs, seed=args.seed)
        if args.calculate_kv_scales:
            for module in loaded.model.modules():
                if hasattr(module, "calibrate_kv_scales"):
                    module.calibrate_kv_scales(args.cache_dtype)
        self.eos_token_id = cfg.eos_token_id
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_id = self.tokenizer.eos_token_id
        self.stats = StepStats()
        self._ids = itertools.count()

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds (all requests together)."""
        return self.kv.capacity_tokens

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Queue a request. Raises ``RequestRejectedError`` (a ``ValueError``) if it can
        never run, e.g. a prompt longer than the context."""
        req_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(req_id, list(prompt_token_ids), sampling_params,
                      eos_token_id=self.eos_token_id)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request (frees its blocks); False if unknown."""
        req = self.scheduler.abort_request(request_id)
        if req is not None:
            self.runner.forget(request_id)
        return req is not None

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
        finished = []
        for req in got_token:
            stats.num_output_tokens += 1
            if req.req_id in logprobs:
                req.output_logprobs.append(logprobs[req.req_id])
            if req.first_token_time is None:
                req.first_token_time = now
                stats.ttfts.append(now - req.arrival_time)
            sp = req.sampling_params
            if not req.is_finished and sp.stop and len(req.output_token_ids) >= sp.min_tokens \
                    and self._hit_stop(req):
                self.scheduler.finish_request(req, FinishReason.STOP)
            if req.is_finished:
                self.runner.forget(req.req_id)
                finished.append(req)
        return StepResult(got_token, finished)

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
