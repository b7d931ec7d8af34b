"""Shared by the serve tests: an in-process server on a free 127.0.0.1 port, and the
offline reference answers its outputs are compared with."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from pagedattn.serve.app import build_app  # noqa: E402
from pagedattn.serve.cli import graceful_server  # noqa: E402

HOST = "127.0.0.1"  # every test server listens here and nowhere else


BATCH_INVARIANT = dict(batch_invariant=True)
"""The engine's batch-invariant mode (``EngineArgs.batch_invariant``): a request's tokens
do not depend on what it is batched with, how its prompt was chunked or the prefix cache,
so tests compare served answers with offline ones token for token, the load test's
included. (The default measured paths choose kernels by row count and key splits by batch
size, so a near-tie can break differently in another batch, as in vLLM.)"""


@contextmanager
def serve_in_thread(llm, **app_kwargs):
    """``(base_url, app)`` of a server on ``llm`` running in a thread until the block ends.
    The socket is bound here (port 0), so no other process can take the port meanwhile."""
    app = build_app(llm, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = graceful_server(uvicorn, app.state.serve)(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://{HOST}:{port}", app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextmanager
def serve_process(*args: str, timeout: float = 120):
    """``(base_url, proc)`` of ``pagedattn serve --host 127.0.0.1 --port <free> *args`` in a
    child process, once its ``/health`` answers; killed at the end if it is still running.
    Its stdout and stderr are one text pipe."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    url = f"http://{HOST}:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedattn", "serve", "--host", HOST, "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, proc.stdout.read()
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not come up")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def client(base_url: str, api_key: str = "none", **kwargs):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                         timeout=120, **kwargs)


def async_client(base_url: str, api_key: str = "none"):
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                              timeout=300)


def wait_idle(app, timeout: float = 5.0) -> tuple[int, int, int]:
    """Wait until the server's engine holds no request; ``(blocks used, running, waiting)``."""
    engine = app.state.serve.llm.engine
    deadline = time.monotonic() + timeout
    while True:
        pool, sched = engine.kv.pool, engine.scheduler
        state = (pool.num_blocks - pool.num_free_blocks, len(sched.running), len(sched.waiting))
        if state == (0, 0, 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def expected_text(tokenizer, ids: list[int], eos: int, max_tokens: int) -> tuple[str, str]:
    """``(text, finish_reason)`` of a greedy answer cut at ``max_tokens`` from the offline
    token ids ``ids`` of a longer (or EOS-ended) run."""
    cut = ids[:max_tokens]
    if eos in cut:
        cut = cut[:cut.index(eos) + 1]
        return tokenizer.decode(cut, skip_special_tokens=True), "stop"
    assert len(cut) == max_tokens, "the offline reference is shorter than max_tokens"
    return tokenizer.decode(cut, skip_special_tokens=True), "length"
