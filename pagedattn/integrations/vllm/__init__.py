"""vLLM plugin: vLLM's own CPU engine (``LLM(...)``, ``vllm serve``) on pagedattn's kernels.

vLLM loads every entry point of the ``vllm.general_plugins`` group in each of its
processes; ours is ``pagedattn = pagedattn.integrations.vllm:register``. :func:`register`
points vLLM's ``CPU_ATTN`` backend at :class:`~pagedattn.integrations.vllm.backend.
PagedAttnCPUBackend`, whose impl writes and reads the KV cache through :mod:`pagedattn.backends.cpu_runtime`.
Everything else in vLLM (scheduler, model runner, sampler, server) is unchanged.

* ``PAGEDATTN_VLLM=0`` switches the plugin off (vLLM then runs its own kernels);
  ``VLLM_PLUGINS`` (vLLM's allow-list of plugin names) works too.
* What pagedattn cannot serve (fp8 KV caches, head size 512, block sizes its kernels do
  not take, ...) is handed back to vLLM's own implementation, per KV-cache group, with
  one warning saying why; see :mod:`pagedattn.integrations.vllm.backend`.

Importable only where vLLM is installed (it is not a dependency of pagedattn).
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "PAGEDATTN_VLLM"
"""Set to ``0`` (or ``false``/``off``/``no``) to leave vLLM's CPU attention alone."""

BACKEND_PATH = "pagedattn.integrations.vllm.backend.PagedAttnCPUBackend"

_FALSY = ("0", "false", "off", "no")
_disabled_logged: list[bool] = []  # the "disabled" line, like the "enabled" one, once


def _make_logger() -> logging.Logger:
    # vLLM configures its "vllm" logger only when an engine is created, after plugins are
    # loaded, so a line logged through it at load time would be dropped: the plugin keeps
    # its own stderr handler (INFO and up, not propagated, so never printed twice).
    log = logging.getLogger("pagedattn.vllm")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [pagedattn] %(message)s",
                                               "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()


def enabled() -> bool:
    """Whether ``PAGEDATTN_VLLM`` leaves the plugin on (default: on)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _FALSY


def register() -> bool:
    """vLLM plugin entry point: run vLLM's ``CPU_ATTN`` backend on pagedattn's kernels.

    Idempotent (vLLM calls it in every process, possibly more than once); logs one line
    per process when it takes effect. Returns whether the override is in place.
    """
    if not enabled():
        if not _disabled_logged:
            _disabled_logged.append(True)
            logger.info("pagedattn plugin disabled by %s=%s; vLLM's CPU attention is "
                        "unchanged", ENV_VAR, os.environ.get(ENV_VAR))
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    backend = AttentionBackendEnum.CPU_ATTN
    if backend.get_path() == BACKEND_PATH:
        return True
    register_backend(backend, BACKEND_PATH)
    logger.info("pagedattn plugin: vLLM's CPU attention (CPU_ATTN) now runs on pagedattn's "
                "kernels (set %s=0 to disable)", ENV_VAR)
    return True
