"""Greedy token parity with transformers for random-weight Llama, Mistral and Qwen2
checkpoints (fp32), through the whole engine: plain, chunked prefill forced by a small
token budget, preemption forced by a small pool, prefix-cache hits, and the shortest-first
admission order; every prefill on the paged kernel."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers")

from pagedattn import LLM, SamplingParams  # noqa: E402

from forward_rows import assert_output_rows_match_all_rows  # noqa: E402

MAX_NEW = 12


def _save_random(kind: str, path) -> None:
    common = dict(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=8, head_dim=32)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if kind == "qwen2":  # random biases, so a wrong bias path cannot pass
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 128, (37,), generator=g).tolist()
    lens = [5, 23, 40, 17, 61, 9]
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lens]
    # shared prefixes: two full-prefix variants and an exact repeat
    prompts += [shared + [4, 5, 6], shared + [7, 8], shared + [4, 5, 6]]
    return prompts


def _reference(path, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine ignores EOS here too
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _save_random(request.param, path)
    return path, _reference(path, _prompts())


MODES = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(kv_cache_memory=7 * 2 * (2 * 16 * 2 * 32 * 4), max_model_len=96),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    # The retired option's remaining value, kept for scripts that pass it.
    "kernel": dict(prefill_attention="kernel"),
    # The server's admission order: shortest prompt first, in small chunks.
    "shortest_first": dict(scheduling_policy="shortest_first", max_num_batched_tokens=16),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_match_transformers(checkpoint, mode):
    path, expected = checkpoint
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, **MODES[mode])
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    if mode == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    # Again, now that the first run's blocks are cached: prefix-cache hits, same tokens.
    again = llm.generate(_prompts()[-3:], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                         ignore_eos=True))
    assert [o.token_ids for o in again] == expected[-3:]
    hit_tokens = sum(o.metrics.num_cached_tokens for o in again)
    if mode == "no_prefix_cache":
        assert hit_tokens == 0
    else:
        assert hit_tokens >= 3 * 32, "the shared prefixes gave no prefix-cache hit"
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_sampled_rows_only_leave_the_last_layer(checkpoint):
    """The engine runs the last layer's MLP on the sampled rows only: those rows' hidden
    states are the full forward's, bit for bit."""
    path, _ = checkpoint
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, linear_impl="packed")
    assert_output_rows_match_all_rows(llm, [5, 23, 40, 1])
