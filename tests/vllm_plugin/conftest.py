"""Fixtures for the vLLM plugin tests. They run where vLLM is installed (``.venv-vllm``,
``make vllm-test``); elsewhere every test module skips itself with the reason."""

from __future__ import annotations

import pytest

VLLM_MISSING = (
    "vLLM is not installed in this environment; the vLLM plugin tests run in .venv-vllm "
    "(make vllm-test)"
)


def make_vllm_config(tmp_dir, dtype: str, block_size: int, num_heads: int = 8,
                     num_kv_heads: int = 2, head_size: int = 64, cache_dtype: str = "auto"):
    """A VllmConfig for a one-layer Llama geometry saved to ``tmp_dir`` (config only: the
    attention builders read head counts, dtype and block size from it)."""
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    LlamaConfig(hidden_size=num_heads * head_size, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, head_dim=head_size, num_hidden_layers=1,
                intermediate_size=64, vocab_size=128, max_position_embeddings=4096,
                ).save_pretrained(tmp_dir)
    model_config = ModelConfig(model=str(tmp_dir), dtype=dtype, skip_tokenizer_init=True,
                               max_model_len=4096)
    cache_config = CacheConfig(block_size=block_size, cache_dtype=cache_dtype)
    return VllmConfig(model_config=model_config, cache_config=cache_config)


@pytest.fixture(scope="session")
def vllm_configs(tmp_path_factory):
    """``{dtype: VllmConfig}`` with block size 32 (float32 and bfloat16)."""
    pytest.importorskip("vllm", reason=VLLM_MISSING)  # the modules skip first; belt and braces
    return {dtype: make_vllm_config(tmp_path_factory.mktemp(f"cfg_{dtype}"), dtype, 32)
            for dtype in ("float32", "bfloat16")}
