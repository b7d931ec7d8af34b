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

from typing import Callable, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn.engine.interface import LLM, ContextLengthError, SamplingParams, StructuredOutput
from pagedattn.serve.body import (
    DEFAULT_MAX_REQUEST_BYTES,
    UNREAD_BODY,
    check_content_type,
    parse_json,
    read_body,
)
from pagedattn.serve.cli import DEFAULT_MAX_N
from pagedattn.serve.engine_loop import EngineLoop, new_torch_thread
from pagedattn.serve.metrics import ServeMetrics
from pagedattn.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    error_body,
    pick_error,
    validation_message,
)
from pagedattn.serve.responses import Choice, Kind, sse

Body = TypeVar("Body", bound=BaseModel)

# Bodies up to this size are parsed and tokenized on the event loop (well under a
# millisecond); larger ones on the input threads, so a long prompt's tokenization (seconds
# for megabytes: the tokenizer releases the GIL) never stalls other clients or /health.
INLINE_BODY_BYTES = 32 * 1024


class ServeState:
    """What the routes share: the model, its engine loop or embedding worker, limits."""

    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None,
                 max_queued_requests: int | None = None,
                 torch_thread: ThreadPoolExecutor | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_n: int = DEFAULT_MAX_N) -> None:
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_queued_requests = max_queued_requests
        self.max_request_bytes = max_request_bytes
        self.max_n = max_n
        self.metrics = ServeMetrics(model_name)
        torch_thread = torch_thread or new_torch_thread()
        self.loop = EngineLoop(llm.engine, self.metrics, torch_thread) if llm.engine else None
        self.embed_pool = torch_thread if llm.embedder else None
        # Tokenizing and checking large inputs: off the event loop and off the engine thread.
        self.input_pool = ThreadPoolExecutor(2, "pagedattn-inputs")
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

    async def parse(self, request: Request, schema: type[Body]) -> tuple[Body, bool]:
        """The body as ``schema``, and whether it is large (see ``INLINE_BODY_BYTES``)."""
        check_content_type(request)
        raw = await read_body(request, self.max_request_bytes)
        large = len(raw) > INLINE_BODY_BYTES
        return await self.run_inputs(large, _validate, raw, schema), large

    async def run_inputs(self, large: bool, fn: Callable, *args):
        """``fn(*args)`` on the input threads for a large body, inline otherwise."""
        if not large:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.input_pool, fn, *args)

    # ------------------------------------------------------------------ prompts

    def prompt_ids(self, prompt) -> list[int]:
        inputs = self.llm.engine.inputs
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request, got a list of {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = _as_400(inputs.encode, prompt, "prompt", param="prompt")
        return self.check_prompt(prompt, "prompt")

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        missing = self.llm.chat_template_missing()
        if missing:
            raise APIError(400, f"model {self.model_name!r} cannot format chat messages: "
                                f"{missing}; use /v1/completions with a prompt",
                           param="messages")
        conv = [{"role": m.role, "content": m.text()} for m in body.messages]
        return _as_400(self.llm.engine.inputs.chat, conv, "messages")

    def check_prompt(self, ids: list[int], param: str) -> list[int]:
        return _as_400(self.llm.engine.check_prompt, ids, param, param=param)

    async def structured_output(self, body) -> StructuredOutput | None:
        """The request's structured output, its grammar compiled on an input thread (never
        on the event loop; cached by key, so a repeated schema costs a lookup). A 400
        names the field for an invalid schema, regex or grammar, or a missing xgrammar."""
        spec, param = body.structured_output()
        if spec is not None:
            await asyncio.get_running_loop().run_in_executor(
                self.input_pool, _as_400_param, self.llm.engine.compile_structured_output,
                param, spec)
        return spec

    def prepare(self, body, chat: bool, structured: StructuredOutput | None = None
                ) -> tuple[list[int], SamplingParams]:
        """Token ids and sampling parameters of a completion request, every input checked
        (runs on an input thread for large bodies). ``structured``: from
        :meth:`structured_output`, compiled already."""
        engine = self.llm.engine
        ids = self.check_prompt(self.chat_ids(body), "messages") if chat \
            else self.prompt_ids(body.prompt)
        requested = body.requested_max_tokens()
        room = engine.max_model_len - len(ids)
        if not chat and body.defaulted_max_tokens():
            requested = min(requested, room)  # OpenAI's default of 16, not asked for: fit it
        max_tokens = _as_400(engine.max_new_tokens, len(ids), requested, param="max_tokens")
        logprobs = body.requested_logprobs() if chat else body.logprobs
        params = body.sampling_params(max_tokens, logprobs, structured)
        _as_400(engine.check_sampling_params, params, param="stop_token_ids")
        return ids, params


def _as_400(fn: Callable, *args, param: str | None = None):
    """``fn(*args)``, its ValueError / TypeError answered as a 400 with its message."""
    try:
        return fn(*args)
    except (TypeError, ValueError) as exc:
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        raise APIError(400, str(exc), param=param, code=code) from None


def _as_400_param(fn: Callable, param: str, *args):
    return _as_400(fn, *args, param=param)


def _validate(raw: bytes, schema: type[Body]) -> Body:
    try:
        return schema.model_validate(parse_json(raw))
    except ValidationError as exc:
        message, param = validation_message(pick_error(exc.errors()))
        if exc.error_count() > 1:
            message += f" (and {exc.error_count() - 1} more problem(s))"
        raise APIError(400, message, param=param) from None


def _check_api_key(request: Request) -> None:
    key = request.app.state.serve.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       type_="authentication_error", code="invalid_api_key",
                       headers=UNREAD_BODY if request.method == "POST" else None)


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
        return StreamingResponse(_stream(state, kind, handle, params.n, include_usage),
                                 media_type="text/event-stream")
    # Nothing is sent before the answer, so only the connection tells that the client has
    # gone: abort then, before the engine's next step, instead of generating to the end.
    watcher = asyncio.create_task(_abort_on_disconnect(request, loop, handle))
    try:
        choices = [Choice() for _ in range(params.n)]
        while True:
            delta = await handle.next()
            if delta.error is not None:
                raise APIError(delta.error_status, delta.error,
                               type_="invalid_request_error" if delta.error_status < 500
                               else "server_error")
            choices[delta.index].add(kind, state.llm.tokenizer, delta)
            if handle.finished:
                return JSONResponse(kind.whole(choices, delta.num_prompt_tokens))
    finally:
        watcher.cancel()
        loop.release(handle)


async def _abort_on_disconnect(request: Request, loop: EngineLoop, handle) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    loop.abort(handle)


async def _stream(state: ServeState, kind: Kind, handle, n: int, include_usage: bool):
    """Server-sent events: (chat) a role chunk per choice, then each delta as a chunk of
    the choice it is about, the usage chunk once every choice has finished, ``[DONE]``."""
    loop = state.loop
    try:
        if kind.chat:
            for index in range(n):
                yield sse(kind.chunk("", None, None, role=True, index=index))
        choices = [Choice() for _ in range(n)]
        while True:
            delta = await handle.next()
            if delta.error is not None:
                yield sse(error_body(delta.error, "server_error" if delta.error_status >= 500
                                     else "invalid_request_error"))
                break
            logprobs = choices[delta.index].add(kind, state.llm.tokenizer, delta)
            if delta.text or logprobs or delta.finish_reason is not None:
                yield sse(kind.chunk(delta.text, delta.finish_reason, logprobs,
                                     index=delta.index))
            if handle.finished:
                if include_usage:
                    completion = sum(c.num_output_tokens for c in choices)
                    yield sse(kind.usage_chunk(delta.num_prompt_tokens, completion))
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

    async def complete(request: Request, chat: bool):
        route = "/v1/chat/completions" if chat else "/v1/completions"
        schema = ChatCompletionRequest if chat else CompletionRequest
        body, large = await state.parse(request, schema)
        state.check_model(body.model)
        body.check_n(state.max_n)
        state.decoder_loop(route)
        structured = await state.structured_output(body)
        ids, params = await state.run_inputs(large, state.prepare, body, chat, structured)
        kind = Kind(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", state.model_name)
        return await _generate(state, request, kind, ids, params, body.stream,
                               bool(body.stream_options and body.stream_options.include_usage))

    @v1.post("/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @v1.post("/embeddings")
    async def embeddings(request: Request):
        body, _ = await state.parse(request, EmbeddingRequest)
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
    def token_ids():
        return _as_400(lambda: [embedder.token_ids(x) for x in inputs], param="input")

    seqs = await state.run_inputs(True, token_ids)
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
              torch_thread: ThreadPoolExecutor | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              max_n: int = DEFAULT_MAX_N) -> FastAPI:
    """The server's app; its lifespan starts and stops the engine thread. ``torch_thread``:
    the thread that loaded ``llm`` (``engine_loop.new_torch_thread``), to run it there.
    ``max_n``: the largest ``n`` (choices per request) a request may ask for."""
    state = ServeState(llm, model_name or llm.args.model, api_key, max_queued_requests,
                       torch_thread, max_request_bytes, max_n)

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
            state.input_pool.shutdown(wait=False)

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
