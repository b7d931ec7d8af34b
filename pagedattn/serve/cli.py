"""``pagedattn serve``: load a model, print what runs where, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from pagedattn.engine.interface import add_engine_arguments, describe_engine, engine_args

# The request body limit's default (--max-request-bytes): 8 MiB, far above a context's
# worth of text or token ids (SmolLM2's 8,192 tokens are ~60 KB as ids), and small enough
# that reading, parsing and checking one body takes well under a second. Defined here,
# where the serve extra is not needed yet.
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20

# The largest n (choices per request) a request may ask for (--max-n). A request's n
# sequences share the prompt's KV, but each decodes and holds its own blocks for its
# output: n=16 costs about what 16 requests cost. vLLM sets no limit; a public server
# wants one, so that one request cannot take the whole batch.
DEFAULT_MAX_N = 16

# A server's clients wait on their first token, and they arrive in bursts: admit the
# shortest prompts first, in steps of 512 tokens, so a burst's median first token waits
# on the prefill of the prompts shorter than it, not on a 2048-token step
# (docs/serving.md measures it). The same tokens are computed; offline runs keep first
# come first served in 2048-token steps (vLLM's LLM and server defaults differ alike).
SERVE_ENGINE_DEFAULTS = dict(scheduling_policy="shortest_first", max_num_batched_tokens=512)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="HF model directory, .gguf file, or built-in name (smollm2, gemma3, minilm)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 503 + Retry-After while this many requests wait (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds to let requests in flight finish before aborting them")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="answer 413 to a request body larger than this, before reading it "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help="the largest n (choices per completion request) a request may ask "
                        f"for; larger is a 400 (default {DEFAULT_MAX_N})")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the sampling of requests that bring no seed")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_arguments(p)
    p.set_defaults(**SERVE_ENGINE_DEFAULTS)


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.max_n < 1:
        raise ValueError(f"--max-n must be >= 1, got {args.max_n}")


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from pagedattn.serve.app import build_app
        from pagedattn.serve.engine_loop import new_torch_thread
    except ImportError as exc:
        print(f"pagedattn serve needs the 'serve' extra (pip install 'pagedattn[serve]'): {exc}",
              file=sys.stderr)
        return 2
    from pagedattn.engine.interface import LLM

    try:
        _check(args)
    except ValueError as exc:
        print(f"pagedattn serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    torch_thread = new_torch_thread()  # loads the model and then runs it
    llm = torch_thread.submit(LLM, **vars(engine_args(args, seed=args.seed))).result()
    name = args.served_model_name or args.model
    app = build_app(llm, name, args.api_key, args.max_queued_requests, torch_thread,
                    args.max_request_bytes, args.max_n)
    print(f"pagedattn serve: http://{args.host}:{args.port}/v1 serving {name!r}", flush=True)
    print(f"  {describe_engine(llm)}", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout)
    graceful_server(uvicorn, app.state.serve)(config).run()
    return 0


ABORT_FLUSH_S = 2.0
"""Seconds a shutdown waits, after aborting what is still running at the end of
--shutdown-timeout, for the engine to end its step and every handler to send its last
event, before uvicorn cancels the handlers."""


def graceful_server(uvicorn, state):
    """A uvicorn server class that shuts ``state``'s engine loop down cleanly."""

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM once its graceful shutdown is done, so
        the process would die of the signal (status -15); a shutdown that finished or
        aborted its requests within --shutdown-timeout is a clean exit (0) here.

        At the end of its grace period uvicorn cancels the handlers still running, and a
        stream cancelled there ends without a finish reason. So when --shutdown-timeout
        ends the engine aborts what is left, and uvicorn's own deadline comes
        ``ABORT_FLUSH_S`` later: each stream then ends with ``finish_reason="abort"`` and
        ``[DONE]``, each whole answer with its partial text."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

        async def shutdown(self, sockets=None) -> None:
            if state.loop is not None:
                grace = self.config.timeout_graceful_shutdown or 0.0
                asyncio.get_running_loop().call_later(grace, state.loop.abort_all)
                self.config.timeout_graceful_shutdown = grace + ABORT_FLUSH_S
            await super().shutdown(sockets)

    return GracefulServer
