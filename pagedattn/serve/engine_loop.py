"""The bridge between asyncio handlers and the engine: one thread owns the engine.

Handlers never touch the engine. They :meth:`EngineLoop.submit` a request (which puts a
command in a thread-safe inbox and returns a :class:`RequestStream`) and read
:class:`Delta` s from it; :meth:`EngineLoop.abort` queues an abort the same way. The
engine thread drains the inbox between steps (so a request that arrives mid-step joins
the next one), runs ``step()`` while anything is unfinished, turns each sampled sequence
into a delta (new text, tokens, logprobs, finish reason, and which of the request's ``n``
choices it is) and hands a step's deltas to the asyncio loop in one
``call_soon_threadsafe``. A failure while handling one request (the sampling, stop
strings or text of any of its choices) fails that request alone, all its choices, with
one error delta; the loop goes on. An aborted request's stream gets a last delta with
``finish_reason="abort"`` for each choice still running. The metrics' gauges are
refreshed after every step and every batch of commands.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from pagedattn.engine.interface import (
    FinishReason,
    LLMEngine,
    RequestProgress,
    SamplingParams,
    StreamingText,
)
from pagedattn.serve.metrics import ServeMetrics

log = logging.getLogger("pagedattn.serve")


def new_torch_thread() -> ThreadPoolExecutor:
    """The one thread that runs the model: load it there, then step it there.

    libgomp keeps one OpenMP team per thread that starts parallel regions, and once
    there are more of its threads than cores it stops spinning between regions: a
    decode step, dozens of short regions, then ran 2.4x slower (SmolLM2 on 2 cores:
    42 ms instead of 17.5) when the model was loaded on the main thread and stepped on
    another. One thread for both keeps a single team."""
    return ThreadPoolExecutor(1, "pagedattn-engine")


@dataclass
class Delta:
    """What one choice of a request got in one step (or its end)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    """``sampler.TokenLogprobs`` of ``token_ids`` (empty unless asked for)."""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    error_status: int = 500
    """HTTP status for ``error``: 400 for a request the engine rejects, 500 otherwise."""
    index: int = 0
    """Which of the request's ``n`` choices this is about (an error is the request's)."""


class RequestStream:
    """The asyncio side of one request: its deltas, in order, its ``n`` choices'
    interleaved (each delta says which). It is finished after an error, or once every
    choice has had its finish reason."""

    def __init__(self, req_id: str, n: int = 1) -> None:
        self.req_id = req_id
        self.n = n
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.finished = False
        self._running = n

    async def next(self) -> Delta:
        delta = await self.queue.get()
        if delta.error is not None:
            self.finished = True
        elif delta.finish_reason is not None:
            self._running -= 1
            self.finished = self._running == 0
        return delta


@dataclass
class _Choice:
    """Engine-thread state of one of a request's ``n`` choices (one engine sequence)."""

    text: StreamingText | None = None
    sent_tokens: int = 0
    last_token: float | None = None
    finish_reason: str | None = None


@dataclass
class _Tracked:
    """Engine-thread state of one request."""

    stream: RequestStream
    aloop: asyncio.AbstractEventLoop
    num_prompt_tokens: int
    arrival: float
    params: SamplingParams | None = None
    first_token: float | None = None
    """The first token of any choice (the request's TTFT)."""
    choices: list[_Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [_Choice() for _ in range(self.params.n if self.params else 1)]

    @property
    def sent_tokens(self) -> int:
        """Tokens sent, all choices together."""
        return sum(c.sent_tokens for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


@dataclass(frozen=True)
class _Add:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tracked: _Tracked


@dataclass(frozen=True)
class _AbortAll:
    """Abort every request (the server's grace period is ending)."""


class EngineLoop:
    """Owns ``engine`` in a background thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, metrics: ServeMetrics | None = None,
                 torch_thread: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        # Best the thread that loaded the model (see new_torch_thread): its OpenMP team is
        # then the process's only one.
        self._torch_thread = torch_thread or new_torch_thread()
        self._done: Future | None = None
        self._stopping = threading.Event()
        # Written by the engine thread, read by handlers (ints: atomic under the GIL).
        self.num_running = 0
        self.num_in_flight = 0  # submitted and not finished (handler side)

    # ------------------------------------------------------------------ asyncio side

    def start(self) -> None:
        self._done = self._torch_thread.submit(self._run)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and wait for the engine thread's loop to end."""
        self._stopping.set()
        self._inbox.put(None)
        if self._done is not None:
            wait([self._done], timeout)

    @property
    def num_queued(self) -> int:
        """Requests accepted and not yet running."""
        return max(0, self.num_in_flight - self.num_running)

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
               arrival: float | None = None) -> RequestStream:
        stream = RequestStream(req_id, params.n)
        tracked = _Tracked(stream, asyncio.get_running_loop(), len(prompt_ids),
                           arrival if arrival is not None else time.perf_counter(), params)
        self.num_in_flight += 1
        self._inbox.put(_Add(req_id, list(prompt_ids), params, tracked))
        return stream

    def release(self, stream: RequestStream) -> None:
        """The handler is done with ``stream``: abort the request if it still runs
        (client gone, or the server shutting down)."""
        self.num_in_flight -= 1
        if not stream.finished:
            self._inbox.put(stream.req_id)

    def abort(self, stream: RequestStream) -> None:
        """Abort the request before the next step; its stream then gets a last delta
        with ``finish_reason="abort"``."""
        if not stream.finished:
            self._inbox.put(stream.req_id)

    def abort_all(self) -> None:
        """Abort every request before the next step, each stream ending with
        ``finish_reason="abort"`` (a shutdown whose grace period is running out)."""
        self._inbox.put(_AbortAll())

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished())
            except Exception:  # noqa: BLE001 - the engine thread must outlive any command
                log.exception("handling the engine loop's commands failed")
            if self.engine.has_unfinished() and not self._stopping.is_set():
                self._step()
        for req_id in list(self._tracked):
            self._fail(req_id, "the server is shutting down", 503)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, str):
                self._abort(cmd)
            elif isinstance(cmd, _AbortAll):
                for req_id in list(self._tracked):
                    self._abort(req_id)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._refresh()

    def _refresh(self) -> None:
        load = self.engine.load()
        # requests, not sequences: the handlers count requests in flight
        self.num_running = len(self.engine.running_request_ids())
        if self.metrics is not None:
            self.metrics.refresh(load)

    def _add(self, cmd: _Add) -> None:
        self._tracked[cmd.req_id] = cmd.tracked
        try:
            self.engine.add_request(cmd.prompt_ids, cmd.params, cmd.req_id)
        except ValueError as exc:
            self._fail(cmd.req_id, str(exc), 400)

    def _abort(self, req_id: str) -> None:
        tracked = self._tracked.pop(req_id, None)
        aborted = self.engine.abort(req_id)
        if tracked is None:
            return
        if self.metrics is not None and aborted:
            self.metrics.finished(FinishReason.ABORT.value, time.perf_counter() - tracked.arrival)
        deltas = []
        for index, choice in enumerate(tracked.choices):
            if choice.finish_reason is not None:
                continue
            try:
                text = choice.text.flush() if choice.text is not None else ""
            except Exception:  # noqa: BLE001 - the abort must reach the stream regardless
                log.exception("request %s: decoding its last text failed", req_id)
                text = ""
            deltas.append((tracked.stream, Delta(
                text, finish_reason=FinishReason.ABORT.value,
                num_prompt_tokens=tracked.num_prompt_tokens,
                num_output_tokens=choice.sent_tokens, index=index)))
        _post(tracked.aloop, deltas)

    def _fail(self, req_id: str, message: str, status: int) -> None:
        tracked = self._tracked.pop(req_id, None)
        self.engine.abort(req_id)
        if tracked is not None:
            _post(tracked.aloop, [(tracked.stream, Delta(error=message, error_status=status))])
            if self.metrics is not None:
                self.metrics.finished(FinishReason.ERROR.value, time.perf_counter() - tracked.arrival)

    def _step(self) -> None:
        try:
            result = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one step's failure must not end the loop
            # The step cannot say which request broke it: fail the ones it ran.
            log.exception("engine step failed")
            for req_id in self.engine.running_request_ids():
                self._fail(req_id, f"internal error in the engine step: {exc}", 500)
            self._refresh()
            return
        now = time.perf_counter()
        for seq in result.failed:  # a choice that failed fails its whole request
            progress = self.engine.progress(seq)
            log.error("request %s (choice %d) failed: %s", progress.req_id, progress.index,
                      progress.error)
            self._fail(progress.req_id,
                       f"internal error while processing the request: {progress.error}", 500)
        out: dict[asyncio.AbstractEventLoop, list] = {}
        for seq in result.sampled:
            tracked = self._tracked.get(seq.request_id)
            if tracked is None:
                continue
            try:
                progress = self.engine.progress(seq, tracked.choices[seq.index].sent_tokens)
                delta = self._process(progress, tracked, now)
            except Exception as exc:  # noqa: BLE001 - fail this request alone
                log.exception("request %s failed", seq.request_id)
                self._fail(seq.request_id,
                           f"internal error while processing the request: {exc}", 500)
                continue
            out.setdefault(tracked.aloop, []).append((tracked.stream, delta))
            if tracked.finished:
                self._tracked.pop(seq.request_id, None)
                if self.metrics is not None:
                    self.metrics.finished(progress.finish_reason, now - tracked.arrival)
                self._log_finished(progress.req_id, tracked, now)
        for aloop, items in out.items():
            _post(aloop, items)
        self._refresh()

    def _process(self, progress: RequestProgress, tracked: _Tracked, now: float) -> Delta:
        """The delta of one choice of a request since its last one (``progress`` from its
        last sent token): its new tokens, and the new text that is final
        (``StreamingText``: decoded incrementally, held back while it may begin a stop
        string, cut before one)."""
        choice = tracked.choices[progress.index]
        new_tokens, logprobs = progress.new_token_ids, progress.new_logprobs
        choice.sent_tokens += len(new_tokens)
        if self.metrics is not None:
            if tracked.first_token is None:
                self.metrics.ttft.observe(now - tracked.arrival)
            elif choice.last_token is not None:
                self.metrics.itl.observe(now - choice.last_token)
        if tracked.first_token is None:
            tracked.first_token = now
        choice.last_token = now
        if choice.text is None and self.tokenizer is not None:
            sp = tracked.params
            choice.text = StreamingText(self.tokenizer, sp.skip_special_tokens, sp.stop)
        finish = progress.finish_reason
        delta_text = choice.text.add(new_tokens, finish is not None) if choice.text else ""
        choice.finish_reason = finish
        return Delta(delta_text, list(new_tokens), list(logprobs), finish,
                     tracked.num_prompt_tokens, progress.num_output_tokens, index=progress.index)

    def _log_finished(self, req_id: str, tracked: _Tracked, now: float) -> None:
        ttft = (tracked.first_token - tracked.arrival) if tracked.first_token else 0.0
        n = tracked.sent_tokens
        decode_time = now - tracked.first_token if tracked.first_token else 0.0
        rate = (n - len(tracked.choices)) / decode_time if n > 1 and decode_time > 0 else 0.0
        reasons = ",".join(c.finish_reason or "?" for c in tracked.choices)
        log.info("%s: %d prompt + %d completion tokens, TTFT %.1f ms, %.1f tok/s, finish %s",
                 req_id, tracked.num_prompt_tokens, n, ttft * 1e3, rate, reasons)


def _deliver(items: list[tuple[RequestStream, Delta]]) -> None:
    for stream, delta in items:
        stream.queue.put_nowait(delta)


def _post(aloop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, Delta]]) -> None:
    try:
        aloop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the asyncio loop is closed: nobody is listening any more
        pass
