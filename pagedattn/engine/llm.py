"""``LLM``: the user-facing engine (vLLM's offline API shape).

    from pagedattn import LLM, SamplingParams
    llm = LLM(model="smollm2", dtype="bfloat16")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pagedattn import ops, registry
from pagedattn.backend import AttentionType
from pagedattn.engine.block_pool import KVCacheManager
from pagedattn.engine.model_runner import ModelRunner, encoder_metadata, make_attention
from pagedattn.engine.request import FinishReason, Request
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import RequestRejectedError, Scheduler
from pagedattn.kv_cache_spec import AttentionSpec
from pagedattn.models.bert import BertConfig, BertModel
from pagedattn.models.layers import pack_linear_layers
from pagedattn.models.linear_paths import install_linear_paths
from pagedattn.models.llama import LlamaConfig, LlamaForCausalLM
from pagedattn.models.loader import load_checkpoint, load_tokenizer, resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def native_half_matmul() -> bool:
    """Whether torch has a fast bf16/fp16 GEMM on this CPU (oneDNN with AVX512-BF16 or
    AMX); without it, torch's bf16 linear runs ~5-10x slower than fp32 here."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


LINEAR_IMPLS = ("auto", "packed", "torch")


def parse_linear_impl(linear_impl: str | None) -> str:
    """``None`` picks ``"auto"`` where the native extension is loaded."""
    if linear_impl is None:
        return "auto" if ops.native_available() else "torch"
    if linear_impl not in LINEAR_IMPLS:
        raise ValueError(f"linear_impl must be one of {', '.join(LINEAR_IMPLS)}, got {linear_impl!r}")
    if linear_impl != "torch" and not ops.native_available():
        raise ValueError(f"linear_impl={linear_impl!r} needs the native extension pagedattn._C, "
                         "which is not loaded; use linear_impl='torch'")
    return linear_impl


def parse_bytes(value: int | str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        for unit, scale in _UNITS.items():
            if value.endswith(unit):
                try:
                    return int(float(value[: -len(unit)]) * scale)
                except ValueError:
                    break
    raise ValueError(f"kv_cache_memory must be a positive number of bytes or a string like "
                     f"'512MiB' / '2GiB', got {value!r}")


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
class RequestOutput:
    """One prompt's result: generated ``text`` and ``token_ids`` (EOS included when
    generation stopped at it), ``finish_reason`` (stop, length, abort, error) and, for
    ``error``, the reason in ``error``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None
    metrics: RequestMetrics

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM keeps completions in ``outputs``; here each request has one."""
        return [self]

    @property
    def finished(self) -> bool:
        return True


@dataclass
class GenerateStats:
    """Throughput of the last ``generate`` call."""

    num_prefill_tokens: int = 0
    prefill_time: float = 0.0
    num_decode_tokens: int = 0
    decode_time: float = 0.0
    num_output_tokens: int = 0
    wall_time: float = 0.0
    ttfts: list[float] = field(default_factory=list)

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

    def line(self) -> str:
        return (f"TTFT {self.mean_ttft * 1e3:.0f} ms | prefill {self.prefill_tok_s:.0f} tok/s | "
                f"decode {self.decode_tok_s:.1f} tok/s | output {self.output_tok_s:.1f} tok/s "
                f"({self.num_output_tokens} tokens in {self.wall_time:.2f} s)")


class LLM:
    """A model with a paged KV cache, a scheduler and a backend, ready to generate.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, or a built-in name
            (``"smollm2"``, ``"minilm"``) served from an installed package.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the KV cache and attention
            dtype, and the weights' unless ``linear_dtype`` says otherwise.
        linear_impl: ``"auto"`` (default with the native extension): fp32 activations,
            weights in ``dtype``, each layer shape and row count on the path measured
            fastest here (:mod:`pagedattn.models.linear_paths`; ``linear_plan`` says which);
            ``"packed"``: every layer on ``pagedattn.ops.packed_linear``, activations fp32;
            ``"torch"``: ``nn.Linear`` in ``linear_dtype``.
        linear_dtype: with ``linear_impl="torch"``, dtype of the weights and activations
            around attention; ``None`` = ``dtype``, except on CPUs without a native
            half-precision GEMM, where torch's bf16/fp16 linear is several times slower than
            fp32: there it is float32. Packed layers take float32 activations only.
        backend: attention backend name (default: the registry's choice).
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV cache pool (int, or ``"512MiB"``).
        max_num_batched_tokens: per-step token budget (longer prefills are chunked).
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        max_model_len: longest request (prompt + output); default the model's context.
        max_num_seqs: most requests running at once.
        skip_tokenizer_init: no tokenizer (prompts must be token-id lists).
    """

    def __init__(self, model: str = "smollm2", dtype: str | torch.dtype = "bfloat16",
                 backend: str | None = None, block_size: int = 16,
                 kv_cache_memory: int | str = "512MiB", max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 max_num_seqs: int = 256, seed: int = 0, skip_tokenizer_init: bool = False,
                 linear_dtype: str | torch.dtype | None = None,
                 linear_impl: str | None = None) -> None:
        self.dtype = parse_dtype(dtype)
        self.linear_impl = parse_linear_impl(linear_impl)
        if self.linear_impl != "torch":
            if linear_dtype is not None and parse_dtype(linear_dtype) != torch.float32:
                raise ValueError(f"linear_impl={self.linear_impl!r} takes float32 activations "
                                 f"(weights in dtype={dtype!r}); linear_dtype={linear_dtype!r} needs "
                                 "linear_impl='torch'")
            self.linear_dtype = torch.float32
        elif linear_dtype is not None:
            self.linear_dtype = parse_dtype(linear_dtype)
        elif self.dtype != torch.float32 and not native_half_matmul():
            self.linear_dtype = torch.float32
        else:
            self.linear_dtype = self.dtype
        path = resolve_model(model)
        ckpt = load_checkpoint(path, need_tokenizer=not skip_tokenizer_init)
        self.tokenizer = load_tokenizer(ckpt)
        self.is_encoder = ckpt.config.get("model_type") == "bert"
        cfg = BertConfig.from_hf(ckpt.config) if self.is_encoder else LlamaConfig.from_hf(ckpt.config)
        self.config = cfg
        limit = cfg.max_position_embeddings
        self.max_model_len = limit if max_model_len is None else max_model_len
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) \
                or not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be an int in [1, {limit}] (the model's "
                             f"context), got {max_model_len!r}")
        attn_type = AttentionType.ENCODER_ONLY if self.is_encoder else AttentionType.DECODER
        num_kv_heads = cfg.num_heads if self.is_encoder else cfg.num_kv_heads
        selector = registry.default_selector_config(cfg.head_dim, self.dtype, block_size=block_size,
                                                    attn_type=attn_type, device="cpu")
        self.backend_cls = registry.select_backend(selector, backend)
        window = None if self.is_encoder else cfg.sliding_window
        builder, impls = make_attention(
            self.backend_cls, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
            num_kv_heads=num_kv_heads, head_dim=cfg.head_dim, dtype=self.dtype,
            block_size=block_size, max_model_len=self.max_model_len, sliding_window=window,
            attn_type=attn_type)
        self.builder = builder
        kv_dtype = self.dtype if self.linear_dtype != self.dtype else None
        net = (BertModel if self.is_encoder else LlamaForCausalLM)(cfg, impls, kv_dtype)
        net.load_weights(ckpt.weights())
        self.model = net.to(self.linear_dtype).eval()
        self.linear_plan = None
        if self.linear_impl == "packed":
            pack_linear_layers(self.model, self.dtype)
        elif self.linear_impl == "auto":
            self.linear_plan = install_linear_paths(self.model, self.dtype)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.last_stats = GenerateStats()
        self._ids = itertools.count()
        if self.is_encoder:
            return
        spec = AttentionSpec(block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, window)
        num_blocks = parse_bytes(kv_cache_memory) // (spec.page_size_bytes * cfg.num_layers)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={kv_cache_memory!r} holds no block of "
                             f"{spec.page_size_bytes * cfg.num_layers} bytes")
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens, self.max_model_len, max_num_seqs)
        self.runner = ModelRunner(self.model, builder, self.backend_cls, num_blocks=num_blocks,
                                  block_size=block_size, max_model_len=self.max_model_len,
                                  max_num_seqs=max_num_seqs, kv_dtype=self.dtype, seed=seed)

    # ------------------------------------------------------------------ generation

    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (the LLM was built with "
                                 "skip_tokenizer_init=True): pass token-id lists")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.config.vocab_size})")
            return None, list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {prompt!r:.80}")

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order. A prompt that cannot be
        served (longer than the context) gets ``finish_reason == "error"`` with the
        reason, and the others still run."""
        if self.is_encoder:
            raise ValueError("this is an encoder-only model: use embed(), not generate()")
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
        eos = getattr(self.config, "eos_token_id", None)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id
        reqs, texts = [], []
        for prompt, sp in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            req = Request(f"req-{next(self._ids)}", ids, sp, eos_token_id=eos)
            try:
                self.scheduler.add_request(req)
            except RequestRejectedError as exc:
                req.finish(FinishReason.ERROR, str(exc))
            reqs.append(req)
            texts.append(text)
        self._run(reqs, use_tqdm)
        return [self._output(r, t) for r, t in zip(reqs, texts)]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate answers to one conversation (a list of ``{"role", "content"}``) or a
        list of conversations, through the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat() needs a tokenizer with a chat template; this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            prompts.append(self.tokenizer(text, add_special_tokens=False).input_ids)
        return self.generate(prompts, sampling_params, use_tqdm)

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request (frees its blocks); False if unknown."""
        req = self.scheduler.abort_request(request_id)
        if req is not None:
            self.runner.forget(request_id)
        return req is not None

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        stats = self.last_stats
        out = self.scheduler.schedule()
        if not out.num_scheduled_tokens:
            return []
        t0 = time.perf_counter()
        sampled = self.runner.execute(out)
        dt = time.perf_counter() - t0
        is_prefill = any(n > 1 for n in out.num_scheduled_tokens.values())
        if is_prefill:
            stats.num_prefill_tokens += out.total_num_scheduled_tokens
            stats.prefill_time += dt
        else:
            stats.num_decode_tokens += len(sampled)
            stats.decode_time += dt
        now = time.perf_counter()
        finished = []
        for req in self.scheduler.update(out, sampled):
            stats.num_output_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
                stats.ttfts.append(now - req.arrival_time)
            if not req.is_finished and req.sampling_params.stop and self._hit_stop(req):
                self.scheduler.finish_request(req, FinishReason.STOP)
            if req.is_finished:
                self.runner.forget(req.req_id)
                finished.append(req)
        return finished

    def _run(self, reqs: list[Request], use_tqdm: bool) -> None:
        self.last_stats = GenerateStats()
        start = time.perf_counter()
        total, done = len(reqs), sum(r.is_finished for r in reqs)
        while self.scheduler.has_unfinished():
            done += len(self.step())
            if use_tqdm:
                bar = "#" * (30 * done // max(total, 1))
                print(f"\r[{bar:<30}] {done}/{total} requests", end="", file=sys.stderr, flush=True)
        if use_tqdm:
            print(file=sys.stderr)
        self.last_stats.wall_time = time.perf_counter() - start

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def _hit_stop(self, req: Request) -> bool:
        text = self._decode(req.output_token_ids)
        return any(s in text for s in req.sampling_params.stop)

    def _output(self, req: Request, prompt: str | None) -> RequestOutput:
        text = self._decode(req.output_token_ids)
        for s in req.sampling_params.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        metrics = RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time,
                                 req.num_prompt_tokens, req.num_prefix_hit_tokens)
        return RequestOutput(req.req_id, prompt, req.prompt_token_ids, text,
                             list(req.output_token_ids), str(req.finish_reason), req.error, metrics)

    # ------------------------------------------------------------------ embeddings

    @torch.inference_mode()
    def embed(self, texts: str | Sequence[str] | Sequence[Sequence[int]]) -> torch.Tensor:
        """``[n, hidden]`` float32 unit vectors (mean pooling + L2 normalisation), one
        per text (or token-id list), computed in batches under the token budget."""
        if not self.is_encoder:
            raise ValueError("embed() needs an encoder model such as 'minilm'; this one is a decoder")
        if isinstance(texts, str):
            texts = [texts]
        seqs = []
        for t in texts:
            if isinstance(t, str):
                if self.tokenizer is None:
                    raise ValueError("text inputs need a tokenizer; pass token-id lists")
                ids = self.tokenizer(t, truncation=True, max_length=self.max_model_len).input_ids
            else:
                ids = list(t)
                if len(ids) > self.max_model_len:
                    raise ValueError(f"input of {len(ids)} tokens exceeds max_model_len={self.max_model_len}")
            if not ids:
                raise ValueError("cannot embed an empty input")
            seqs.append(ids)
        out, batch = [], []
        for ids in seqs + [None]:
            if batch and (ids is None or sum(map(len, batch)) + len(ids) > self.max_num_batched_tokens):
                out.append(self._embed_batch(batch))
                batch = []
            if ids is not None:
                batch.append(ids)
        return torch.cat(out) if out else torch.zeros(0, self.config.hidden_size)

    def _embed_batch(self, batch: list[list[int]]) -> torch.Tensor:
        lens = [len(b) for b in batch]
        common = encoder_metadata(lens)
        input_ids = torch.tensor([t for b in batch for t in b], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lens])
        hidden = self.model(input_ids, positions, self.builder.build(0, common))
        return BertModel.mean_pool(hidden, common.query_start_loc_cpu.tolist())
