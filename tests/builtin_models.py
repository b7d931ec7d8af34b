"""The built-in models' files (installed by make setup), and skip marks for their absence."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from pagedattn.models.loader import resolve_model


def _resolve(name: str) -> tuple[str | None, str]:
    try:
        return resolve_model(name), ""
    except (OSError, ValueError) as exc:  # pragma: no cover - set-up installs them
        return None, str(exc)


SMOLLM2, SMOLLM2_WHY = _resolve("smollm2")
MINILM, MINILM_WHY = _resolve("minilm")
# Resolved at import, before conftest points XDG_CACHE_HOME at a session directory: the
# GGUF assembled from its chunk packages is kept in the real per-machine cache.
GEMMA3, GEMMA3_WHY = _resolve("gemma3")
_MODEL_CACHE_HOME = os.environ.get("XDG_CACHE_HOME")


@contextmanager
def model_file_cache():
    """Load a model with the real per-machine cache, where the model files derived once
    live (the assembled Gemma 3 GGUF, the tokenizer rebuilt from a GGUF: 16 s for Gemma 3's
    vocabulary, 4 s from the cache). Only for engines that measure nothing there
    (``linear_impl="packed"``): conftest keeps measurements in a session directory."""
    saved = os.environ.get("XDG_CACHE_HOME")
    if _MODEL_CACHE_HOME is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = _MODEL_CACHE_HOME
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=f"smollm2 is not installed: {SMOLLM2_WHY}")
needs_minilm = pytest.mark.skipif(MINILM is None, reason=f"minilm is not installed: {MINILM_WHY}")
needs_gemma3 = pytest.mark.skipif(GEMMA3 is None, reason=f"gemma3 is not installed: {GEMMA3_WHY}")
