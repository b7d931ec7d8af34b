"""The FastAPI application: OpenAI's routes on one :class:`~pagedattn.engine.llm.LLM`.

Decoders serve ``/v1/completions`` and ``/v1/chat/completions`` through one
:class:`~pagedattn.serve.engine_loop.EngineLoop`; encoders serve ``/v1/embeddings`` on a
single worker thread. ``/health`` and ``/metrics`` are open; with an API key every
``/v1`` route needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn.engine.llm import LLM
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.serve.engine_loop import EngineLoop, new_torch_thread
from pagedattn.serve.metrics import ServeMetrics
from pagedattn.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    error_body,
    validation_message,
)
from pagedattn.serve.responses import Kind, merge_logprobs, sse


class ServeState:
    """What the routes share: the model, its engine loop or embedding worker, limits."""

    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None,
                 max_queued_requests: int | None = None,
                 torch_thread: ThreadPoolExecutor | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_queued_requests = max_queued_requests
        self.metrics = ServeMetrics(model_name)
        torch_thread = torch_thread or new_torch_thread()
        self.loop = EngineLoop(llm.engine, self.metrics, torch_thread) if llm.engine else None
        self.embed_pool = torch_thread if llm.embedder else None
        self.started = time.time()

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def decoder_loop(self, route: str) -> EngineLoop:
        if self.loop is None:
            raise APIError(400, f"{route} needs a decoder model; {self.model_name!r} is an "
                                "encoder: use /v1/embeddings", param="model")
        return self.loop

    # ------------------------------------------------------------------ prompts

    def prompt_ids(self, prompt) -> list[int]:
        tok = self.llm.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request, got a list of {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tok is None:
                raise APIError(400, "prompt: text needs a tokenizer; send token ids", param="prompt")
            return tok(prompt).input_ids
        vocab = self.llm.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="prompt")
        return list(prompt)

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.llm.tokenizer
        missing = self.llm.chat_template_missing()
        if missing:
            raise APIError(400, f"model {self.model_name!r} cannot format chat messages: "
                                f"{missing}; use /v1/completions with a prompt",
                           param="messages")
        conv = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids

    def check_length(self, ids: list[int], param: str) -> None:
        limit = self.llm.max_model_len
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        if len(ids) >= limit:
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens; this model's context "
                                f"is {limit} tokens and one more token must fit",
                           param=param, code="context_length_exceeded")


def _check_api_key(request: Request) -> None:
    key = request.app.state.serve.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       type_="authentication_error", code="invalid_api_key")


# ---------------------------------------------------------------------- generation


async def _generate(state: ServeState, request: Request, kind: Kind, ids: list[int],
                    params: SamplingParams, stream: bool, include_usage: bool) -> Response:
    loop = state.decoder_loop(request.url.path)
    limit = state.max_queued_requests
    if limit is not None and loop.num_queued >= limit:
        raise APIError(503, f"the server's queue is full ({loop.num_queued} requests waiting, "
                            f"--max-queued-requests={limit}); retry later",
                       type_="server_overloaded", headers={"Retry-After": "1"})
    handle = loop.submit(kind.req_id, ids, params, arrival=time.perf_counter())
    if stream:
        return StreamingResponse(_stream(state, kind, handle, include_usage),
                                 media_type="text/event-stream")
    try:
        texts, blocks, offset = [], [], 0
        while True:
            delta = await handle.next()
            if delta.error is not None:
                raise APIError(delta.error_status, delta.error,
                               type_="invalid_request_error" if delta.error_status < 500
                               else "server_error")
            blocks.append(kind.logprobs(state.llm.tokenizer, delta, offset))
            texts.append(delta.text)
            offset += len(delta.text)
            if delta.finish_reason is not None:
                return JSONResponse(kind.whole("".join(texts), delta.finish_reason,
                                               merge_logprobs(blocks, kind.chat),
                                               delta.num_prompt_tokens, delta.num_output_tokens))
    finally:
        loop.release(handle)


async def _stream(state: ServeState, kind: Kind, handle, include_usage: bool):
    loop = state.loop
    try:
        if kind.chat:
            yield sse(kind.chunk("", None, None, role=True))
        offset = 0
        while True:
            delta = await handle.next()
            if delta.error is not None:
                yield sse(error_body(delta.error, "server_error" if delta.error_status >= 500
                                     else "invalid_request_error"))
                break
            logprobs = kind.logprobs(state.llm.tokenizer, delta, offset)
            offset += len(delta.text)
            if delta.text or logprobs or delta.finish_reason is not None:
                yield sse(kind.chunk(delta.text, delta.finish_reason, logprobs))
            if delta.finish_reason is not None:
                if include_usage:
                    yield sse(kind.usage_chunk(delta.num_prompt_tokens, delta.num_output_tokens))
                break
        yield sse("[DONE]")
    finally:  # also on a client that went away (the task is cancelled): abort it
        loop.release(handle)


# ---------------------------------------------------------------------- routes


def _routes(state: ServeState) -> APIRouter:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "created": int(state.started), "owned_by": "pagedattn",
                                            "max_model_len": state.llm.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        body.check_n()
        state.decoder_loop("/v1/completions")
        ids = state.prompt_ids(body.prompt)
        state.check_length(ids, "prompt")
        params = body.sampling_params(body.max_tokens, body.logprobs)
        kind = Kind(False, f"cmpl-{uuid.uuid4().hex}", state.model_name)
        return await _generate(state, request, kind, ids, params, body.stream,
                               bool(body.stream_options and body.stream_options.include_usage))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        body.check_n()
        state.decoder_loop("/v1/chat/completions")
        ids = state.chat_ids(body)
        state.check_length(ids, "messages")
        max_tokens = body.requested_max_tokens() or state.llm.max_model_len - len(ids)
        params = body.sampling_params(max_tokens, body.requested_logprobs())
        kind = Kind(True, f"chatcmpl-{uuid.uuid4().hex}", state.model_name)
        return await _generate(state, request, kind, ids, params, body.stream,
                               bool(body.stream_options and body.stream_options.include_usage))

    @v1.post("/embeddings")
    async def embeddings(body: EmbeddingRequest):
        state.check_model(body.model)
        return await _embed(state, body)

    return v1


async def _embed(state: ServeState, body: EmbeddingRequest) -> dict:
    embedder = state.llm.embedder
    if embedder is None:
        raise APIError(400, f"/v1/embeddings needs an encoder model such as 'minilm'; "
                            f"{state.model_name!r} is a decoder", param="model")
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise APIError(400, "input: expected at least one text, got an empty list", param="input")
    try:
        seqs = [embedder.token_ids(x) for x in inputs]
    except ValueError as exc:
        raise APIError(400, f"input: {exc}", param="input") from exc
    vectors = await asyncio.get_running_loop().run_in_executor(state.embed_pool, embedder.embed, seqs)
    data = []
    for i, v in enumerate(vectors):
        emb = (base64.b64encode(v.float().numpy().astype("<f4").tobytes()).decode()
               if body.encoding_format == "base64" else v.tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(map(len, seqs))
    return {"object": "list", "data": data, "model": state.model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        errors = exc.errors()
        message, param = validation_message(errors[0]) if errors else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, code=str(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))


def build_app(llm: LLM, model_name: str | None = None, api_key: str | None = None,
              max_queued_requests: int | None = None,
              torch_thread: ThreadPoolExecutor | None = None) -> FastAPI:
    """The server's app; its lifespan starts and stops the engine thread. ``torch_thread``:
    the thread that loaded ``llm`` (``engine_loop.new_torch_thread``), to run it there."""
    state = ServeState(llm, model_name or llm.args.model, api_key, max_queued_requests,
                       torch_thread)

    @asynccontextmanager
    async def lifespan(_app):
        if state.loop is not None:
            state.loop.start()
        try:
            yield
        finally:
            if state.loop is not None:
                state.loop.stop()
            if state.embed_pool is not None:
                state.embed_pool.shutdown(wait=False)

    app = FastAPI(title="pagedattn", lifespan=lifespan)
    app.state.serve = state
    _add_error_handlers(app)
    app.include_router(_routes(state))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
