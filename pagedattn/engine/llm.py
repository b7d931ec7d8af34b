"""``LLM``: the user-facing engine (vLLM's offline API shape), a thin facade.

    from pagedattn import LLM, SamplingParams
    llm = LLM(model="smollm2", dtype="bfloat16")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)

``LLM(**kwargs)`` takes the fields of :class:`~pagedattn.engine.args.EngineArgs`, loads the
model and builds an :class:`~pagedattn.engine.llm_engine.LLMEngine` (decoders) or an
:class:`~pagedattn.engine.embedder.Embedder` (encoder-only models) behind it.
"""

from __future__ import annotations

import sys
import time
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pagedattn.checks import is_int
from pagedattn.engine.args import DTYPES, LINEAR_IMPLS, EngineArgs  # noqa: F401 (re-exported)
from pagedattn.engine.detokenizer import cut_at_stop
from pagedattn.engine.embedder import Embedder
from pagedattn.engine.llm_engine import LLMEngine, StepStats
from pagedattn.engine.loading import load_model
from pagedattn.engine.request import FinishReason, Request, new_sequences
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import RequestRejectedError
from pagedattn.models.loader import describe_model


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's shape): which of the request's ``n`` it is
    (``index``), its ``text`` and ``token_ids`` (EOS included when generation stopped at
    it), ``finish_reason`` (stop, length, abort, error) and, for ``error``, the reason in
    ``error``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None = None


@dataclass
class RequestOutput:
    """One prompt's result: its ``SamplingParams.n`` completions in ``outputs``, in index
    order. ``text``, ``token_ids``, ``finish_reason`` and ``error`` are the first
    completion's (the whole answer for n == 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def finished(self) -> bool:
        return True


@dataclass
class GenerateStats(StepStats):
    """Throughput of the last ``generate`` call: its share of the engine's step stats,
    and its wall time."""

    wall_time: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.num_prefill_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.num_decode_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.wall_time if self.wall_time else 0.0

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttfts) / len(self.ttfts) if self.ttfts else 0.0

    @classmethod
    def since(cls, before: StepStats, now: StepStats, wall_time: float) -> "GenerateStats":
        """The step stats accumulated from snapshot ``before`` to ``now``."""
        return cls(now.num_prefill_tokens - before.num_prefill_tokens,
                   now.prefill_time - before.prefill_time,
                   now.num_decode_tokens - before.num_decode_tokens,
                   now.decode_time - before.decode_time,
                   now.num_output_tokens - before.num_output_tokens,
                   now.ttfts[len(before.ttfts):], wall_time)

    def line(self) -> str:
        return (f"TTFT {self.mean_ttft * 1e3:.0f} ms | prefill {self.prefill_tok_s:.0f} tok/s | "
                f"decode {self.decode_tok_s:.1f} tok/s | output {self.output_tok_s:.1f} tok/s "
                f"({self.num_output_tokens} tokens in {self.wall_time:.2f} s)")


class LLM:
    """A model ready to generate (decoders) or embed (encoders).

    Args: the fields of :class:`~pagedattn.engine.args.EngineArgs` (``model``, ``dtype``,
    ``kv_cache_dtype``, ``block_size``, ``kv_cache_memory``, ...), as keywords.
    """

    def __init__(self, model: str = "smollm2", **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(unknown)}; the engine's "
                            f"arguments are {', '.join(EngineArgs.field_names())}")
        self.args = EngineArgs(model=model, **kwargs)
        loaded = load_model(self.args)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model = loaded.model
        self.max_model_len = loaded.max_model_len
        self.linear_plan = loaded.linear_plan
        """``linear_impl="auto"``: the path each layer shape and row bucket runs."""
        self.act_dtype = loaded.act_dtype
        """The linear layers' activations (bf16 around an fp32 residual stream, or fp32)."""
        self.weights_on_huge_pages = loaded.weights_on_huge_pages
        """The kernel took the huge-page advice for the weights (``EngineArgs.huge_pages``)."""
        self.engine: LLMEngine | None = None
        self.embedder: Embedder | None = None
        if loaded.is_encoder:
            self.embedder = Embedder(loaded, self.args)
        else:
            self.engine = LLMEngine(loaded, self.args)
            self.max_model_len = self.engine.max_model_len
        self.last_stats = GenerateStats()

    @property
    def dtype(self) -> torch.dtype:
        return self.args.dtype

    @property
    def linear_impl(self) -> str:
        return self.args.linear_impl

    def _decoder(self, what: str) -> LLMEngine:
        if self.engine is None:
            raise ValueError(f"{what} needs a decoder model; {self.args.model!r} is "
                             "encoder-only: use embed()")
        return self.engine

    # ------------------------------------------------------------------ generation

    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        inputs = self._decoder("generate()").inputs
        if isinstance(prompt, str):
            return prompt, inputs.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            return None, inputs.check_ids(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {prompt!r:.80}")

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order, with ``n`` completions each
        (``SamplingParams.n``). A prompt that cannot be served (longer than the context)
        gets ``finish_reason == "error"`` with the reason, and the others still run."""
        engine = self._decoder("generate()")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be SamplingParams (or a list of them)")
        # Every prompt is checked before any is queued, so a bad one leaves nothing behind.
        checked = [self._prompt_ids(prompt) for prompt in prompts]
        for sp in params:
            engine.check_sampling_params(sp)
        reqs, texts = [], []
        for (text, ids), sp in zip(checked, params):
            try:
                req = engine.add_request(ids, sp)
            except RequestRejectedError as exc:
                req = new_sequences(f"rejected-{len(reqs)}", ids, sp)[0]
                for seq in req.group:
                    seq.finish(FinishReason.ERROR, str(exc))
            reqs.append(req)
            texts.append(text)
        self._run(reqs, use_tqdm)
        return [self._output(r, t) for r, t in zip(reqs, texts)]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate answers to one conversation (a list of ``{"role", "content"}``) or a
        list of conversations, through the model's chat template."""
        engine = self._decoder("chat()")
        missing = self.chat_template_missing()
        if missing:
            raise ValueError(f"chat() cannot format messages for model {self.args.model!r}: "
                             f"{missing}; pass a plain prompt to generate() instead")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [engine.inputs.chat(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_template_missing(self) -> str | None:
        """Why this model cannot format chat messages (``None`` when it can): no tokenizer,
        or a tokenizer whose checkpoint carries no chat template (the pretrained Gemma 3
        GGUF, for one)."""
        if self.engine is not None:
            return self.engine.inputs.template_missing()
        if self.tokenizer is None:
            return "it has no tokenizer (built with skip_tokenizer_init=True)"
        if not getattr(self.tokenizer, "chat_template", None):
            return f"the {describe_model(self.args.model)} carries no chat template"
        return None

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request (frees its blocks); False if unknown."""
        return self._decoder("abort()").abort(request_id)

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        return self._decoder("step()").step().finished

    def _run(self, reqs: list[Request], use_tqdm: bool) -> None:
        engine = self._decoder("generate()")
        before = dataclasses.replace(engine.stats, ttfts=list(engine.stats.ttfts))
        start = time.perf_counter()
        seqs = [s for r in reqs for s in r.group]
        total, done = len(seqs), sum(s.is_finished for s in seqs)
        while engine.has_unfinished():
            done += len(engine.step().finished)
            if use_tqdm:
                bar = "#" * (30 * done // max(total, 1))
                print(f"\r[{bar:<30}] {done}/{total} requests", end="", file=sys.stderr, flush=True)
        if use_tqdm:
            print(file=sys.stderr)
        self.last_stats = GenerateStats.since(before, engine.stats, time.perf_counter() - start)

    def _output(self, req: Request, prompt: str | None) -> RequestOutput:
        """``req`` (sequence 0) and its group as a :class:`RequestOutput`; the metrics are
        the request's: its first token is the earliest of any sequence, its finish the
        latest, its cached tokens sequence 0's prefix-cache hits."""
        outputs = [CompletionOutput(s.index, cut_at_stop(self.engine.decode(s.output_token_ids),
                                                         s.sampling_params.stop),
                                    list(s.output_token_ids), str(s.finish_reason), s.error)
                   for s in req.group]
        firsts = [s.first_token_time for s in req.group if s.first_token_time is not None]
        ends = [s.finish_time for s in req.group if s.finish_time is not None]
        metrics = RequestMetrics(req.arrival_time, min(firsts, default=None),
                                 max(ends, default=None), req.num_prompt_tokens,
                                 req.num_prefix_hit_tokens)
        return RequestOutput(req.request_id, prompt, req.prompt_token_ids, outputs, metrics)

    # ------------------------------------------------------------------ embeddings

    def embed(self, texts: str | Sequence[str] | Sequence[Sequence[int]]) -> torch.Tensor:
        """``[n, hidden]`` float32 unit vectors (mean pooling + L2 normalisation), one
        per text (or token-id list), computed in batches under the token budget."""
        if self.embedder is None:
            raise ValueError("embed() needs an encoder model such as 'minilm'; this one is a decoder")
        return self.embedder.embed(texts)


