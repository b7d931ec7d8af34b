"""The built-in models' files (installed by make setup), and skip marks for their absence."""

from __future__ import annotations

import functools
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


@functools.cache
def hf_gguf_causal_lm(path: str, dtype_name: str = "float32"):
    """transformers' model of a built-in GGUF (``Gemma3ForCausalLM``, ``LlamaForCausalLM``)
    in ``dtype_name``, loaded once per test session: transformers takes ~25 s per GGUF load
    on 2 cores, and three test files compare against SmolLM2's. Shared: callers must not
    modify it. The bf16 model is the fp32 one with its parameters rounded to bf16, which is
    what ``from_pretrained(dtype=torch.bfloat16)`` does with the dequantised tensors; its
    buffers (RoPE frequencies) stay fp32, as transformers computes them."""
    import copy

    import torch
    import transformers

    if dtype_name != "float32":
        model = copy.deepcopy(hf_gguf_causal_lm(path))
        for param in model.parameters():
            param.data = param.data.to(getattr(torch, dtype_name))
        model.config.dtype = getattr(torch, dtype_name)
        return model.eval()
    folder, file = os.path.split(path)
    with model_file_cache():
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=file, dtype=torch.float32).eval()
