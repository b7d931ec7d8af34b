"""The native step op (``ops.decoder_stack``, driven by
``pagedattn.models.native_stack``) against the Python layer loop it replaces: every step's
final hidden states bit for bit equal, over the Llama family's features (GQA, QKV bias,
sliding window) and Gemma 3's (q/k norms, sandwich norms, GELU, per-layer windows and
rotary tables, soft cap), both activation dtypes, every linear path this CPU runs,
prefill, decode and mixed steps, fp8 caches with calibrated scales and steps that fall
back to Python."""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers

from pagedattn import LLM, SamplingParams, ops
from pagedattn.engine.args import EngineArgs
from pagedattn.engine.cli import add_generate_arguments, engine_args
from pagedattn.models import native_stack
from pagedattn.models.gemma3 import FULL, SLIDING
from pagedattn.models.linear_paths import (FORCE_ENV, ROW_BUCKETS, LinearPath, MeasuredLinear,
                                          candidate_paths)

pytestmark = pytest.mark.skipif(not ops.native_available(),
                                reason="the native step op needs the native extension")

FAMILIES = {
    # GQA (4 query heads on 2 KV heads), head size 32
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    # a bias on the QKV projection
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    # a sliding window shorter than the prompts
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        sliding_window=24),
    # Gemma 3: five sliding layers (window 16) then a global one, a soft cap on the scores
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=16, max_position_embeddings=256, attn_logit_softcapping=5.0,
        rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1e6},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}},
        pad_token_id=0, bos_token_id=2, eos_token_id=1),
}

# prompts of several lengths: prefill steps, then decodes beside later chunks
PROMPTS = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate((5, 41, 17, 70))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for name, make in FAMILIES.items():
        torch.manual_seed(len(name))
        path = tmp_path_factory.mktemp(name)
        model = transformers.AutoModelForCausalLM.from_config(make())
        with torch.no_grad():  # norms away from 1 so that their weights matter
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(path, safe_serialization=True)
        paths[name] = str(path)
    return paths


def hidden_per_step(llm: LLM, native: bool | None,
                    monkeypatch) -> tuple[list[torch.Tensor], int]:
    """Every step's final hidden states, and how many steps ran on the native op
    (``native``: the model's switch; None leaves it as the engine set it)."""
    model = llm.engine.runner.model
    if native is not None:
        model.native_stack = native
    outputs, native_steps = [], 0
    forward, stack_op = model.forward, ops.decoder_stack

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        outputs.append(out.clone())
        return out

    def counting_op(*args, **kwargs):
        nonlocal native_steps
        native_steps += 1
        return stack_op(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(model, "forward", recording_forward)
        m.setattr(ops, "decoder_stack", counting_op)
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return outputs, native_steps


def assert_native_equals_python(llm: LLM, monkeypatch, all_native: bool = True,
                                native_llm: LLM | None = None) -> None:
    """``native_llm``: a second engine for the native run (default: ``llm`` again)."""
    native_llm = native_llm or llm
    python, python_native = hidden_per_step(llm, False, monkeypatch)
    native, native_steps = hidden_per_step(native_llm, True, monkeypatch)
    assert python_native == 0
    assert len(native) == len(python) >= 12
    if all_native:
        assert native_steps == len(native), native_stack.describe(native_llm.engine.runner.model)
    else:
        assert 0 < native_steps < len(native)
    for step, (a, b) in enumerate(zip(python, native)):
        assert a.dtype == b.dtype and a.shape == b.shape, step
        assert torch.equal(a, b), f"step {step}: max |diff| {(a.float() - b.float()).abs().max()}"


def engine(path: str, **kwargs) -> LLM:
    # small steps: prompts are chunked, so steps mix decodes with prefill chunks; the two
    # loops are compared at one thread count, whatever else runs on the machine
    args = dict(skip_tokenizer_init=True, max_num_batched_tokens=48, kv_cache_memory="8MiB",
                max_model_len=256, block_size=16,
                enable_prefix_caching=False, adaptive_threads=False)
    return LLM(path, **{**args, **kwargs})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_linear_path_matches_the_python_loop(checkpoints, family, dtype, monkeypatch):
    paths = candidate_paths(getattr(torch, dtype))
    assert paths
    for path in paths:
        monkeypatch.setenv(FORCE_ENV, path.value)
        llm = engine(checkpoints[family], dtype=dtype)
        assert_native_equals_python(llm, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_every_isa_matches_the_python_loop(checkpoints, family, dtype, isa, monkeypatch):
    # The engine's default paths, measured under each instruction set of this CPU.
    llm = engine(checkpoints[family], dtype=dtype)
    assert_native_equals_python(llm, monkeypatch)


def test_the_last_layer_runs_the_paths_of_its_output_rows(checkpoints, monkeypatch):
    # A prefill step's last layer carries only the sampled rows past attention: its
    # projections take the path of that row count, not the step's.
    monkeypatch.setattr(MeasuredLinear, "release_unused", lambda self: None)
    llm = engine(checkpoints["qwen2"], dtype="float32")
    few, many = LinearPath.PACKED, LinearPath.TORCH
    for module in llm.engine.runner.model.modules():
        if isinstance(module, MeasuredLinear):
            module.set_choices([few, few] + [many] * (len(ROW_BUCKETS) - 2))
    assert_native_equals_python(llm, monkeypatch)


def test_new_choices_reach_the_op_after_steps_have_run(checkpoints, monkeypatch):
    # The op's paths and weights are resolved once per row bucket and reused; a later
    # set_choices (a re-measurement) must reach the next step, not the stale resolution.
    monkeypatch.setattr(MeasuredLinear, "release_unused", lambda self: None)
    llm = engine(checkpoints["qwen2"], dtype="float32")
    seen = []
    stack_op = ops.decoder_stack

    def recording_op(*args, **kwargs):
        seen.append(list(args[7]))  # linear_paths
        return stack_op(*args, **kwargs)

    monkeypatch.setattr(ops, "decoder_stack", recording_op)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for path in (LinearPath.PACKED, LinearPath.TORCH, LinearPath.PACKED):
        for module in llm.engine.runner.model.modules():
            if isinstance(module, MeasuredLinear):
                module.set_choices([path] * len(ROW_BUCKETS))
        seen.clear()
        llm.generate(PROMPTS[:1], params)
        assert seen
        codes = {native_stack.PATH_CODES[path]}
        if path == LinearPath.PACKED:
            codes.add(native_stack.PACKED_GATED)
        assert all(set(step) <= codes for step in seen), (path, seen[0])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_measured_paths_and_packed_layers_match_the_python_loop(checkpoints, family,
                                                                monkeypatch):
    # linear_impl="auto" measures a path per row bucket (a step's paths differ by its rows);
    # "packed" holds PackedLinear layers, whose gate/up fuses its SiLU.
    for impl in ("auto", "packed"):
        llm = engine(checkpoints[family], dtype="bfloat16", linear_impl=impl)
        assert_native_equals_python(llm, monkeypatch)


def test_fp8_cache_with_calibrated_scales(checkpoints, monkeypatch):
    # A fresh engine's first step calibrates the scales, in Python; the later ones run
    # natively with them.
    def fp8_engine():
        return engine(checkpoints["llama"], dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
                      calculate_kv_scales=True)
    assert_native_equals_python(fp8_engine(), monkeypatch, all_native=False,
                                native_llm=fp8_engine())


def test_models_it_cannot_run_say_why(checkpoints):
    llm = engine(checkpoints["llama"], dtype="float32", linear_impl="torch")
    model = llm.engine.runner.model
    reason = model.stack_layout()
    assert isinstance(reason, str) and "Linear" in reason
    assert native_stack.describe(model) == f"layers in Python ({reason})"
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    native = engine(checkpoints["llama"], dtype="float32")
    assert native_stack.describe(native.engine.runner.model).startswith("layers in one native op")


def test_the_engine_option_turns_it_off(checkpoints, monkeypatch):
    with pytest.raises(ValueError, match="native_step must be a bool, got 'no'"):
        EngineArgs(native_step="no")
    off = engine(checkpoints["llama"], dtype="float32", native_step=False)
    assert native_stack.describe(off.engine.runner.model) == "layers in Python (native step off)"
    _, native_steps = hidden_per_step(off, None, monkeypatch)
    assert native_steps == 0
    on = engine(checkpoints["llama"], dtype="float32")
    assert hidden_per_step(on, None, monkeypatch)[1] > 0
    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    assert engine_args(parser.parse_args(["--no-native-step"])).native_step is False
    assert engine_args(parser.parse_args([])).native_step is True


def stack_args(layers: int = 1) -> dict:
    """Arguments of a one-token, ``layers``-layer step (hidden 32, one head of 32, packed
    fp32 weights)."""
    h, hd, inter = 32, 32, 32
    w = lambda o, i: ops.pack_linear_weight(torch.randn(o, i), torch.float32)  # noqa: E731
    per_layer = [w(3 * hd, h), w(h, hd), w(2 * inter, h), w(h, inter)]
    caches = [torch.zeros(2, 2, 1, 16, hd) for _ in range(layers)]
    qsl, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    return dict(
        style="llama", x=torch.randn(1, h), positions=torch.zeros(1, dtype=torch.long),
        cos_sin=[torch.ones(8, hd)] * layers, norm_weights=[torch.ones(h)] * (2 * layers + 1),
        linear_weights=per_layer * layers, linear_biases=[None] * (4 * layers),
        linear_paths=[0] * (4 * layers), linear_out_features=[3 * hd, h, 2 * inter, h],
        kv_caches=caches, slot_mapping=torch.zeros(1, dtype=torch.long),
        query_start_loc=qsl, seq_lens=lens, block_table=torch.zeros(1, 1, dtype=torch.int32),
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=1, num_kv_heads=1, head_dim=hd, seq_lens=lens,
            dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1,
            isa="vec", enable_kv_split=False),
        causal=True, attn_scalars=[hd ** -0.5, 0.0, 1.0, 1.0] * layers,
        windows=[-1, -1] * layers, output_rows=None, num_heads=1, num_kv_heads=1, eps=1e-6,
        act_dtype=torch.float32)


def test_a_well_formed_call_runs():
    args = stack_args(layers=2)
    out = ops.decoder_stack(**args)
    assert out.shape == (1, 32) and torch.isfinite(out).all()
    assert args["kv_caches"][1][0, 0, 0, 0].abs().sum() > 0  # the step's key was cached


@pytest.mark.parametrize("change, error, message", [
    (dict(norm_weights=[torch.ones(32)] * 2), ValueError, r"norm_weights must hold 2 entries "
     r"per layer plus one \(3 for 1 layers\), got 2"),
    (dict(linear_paths=[0, 0, 0, 9]), ValueError, r"linear_paths\[3\] \(9\) is not a linear path"),
    (dict(linear_paths=[4, 0, 0, 0]), ValueError, r"linear_paths\[0\]: only the gate/up"),
    (dict(attn_scalars=[1.0]), ValueError, r"attn_scalars .* must hold 4 entries per layer"),
    (dict(windows=[-1]), ValueError, r"windows \(left, right\) must hold 2 entries"),
    (dict(kv_caches=[]), ValueError, r"kv_caches must hold one cache per layer, got none"),
    (dict(num_heads=2), ValueError, r"the qkv projection's width \(96\) must be"),
    (dict(act_dtype=torch.float16), TypeError, r"act_dtype must be float32 or bfloat16"),
    (dict(linear_out_features=[96, 32]), ValueError, r"linear_out_features must hold 4"),
    (dict(style="gpt2"), ValueError, r"style must be 'llama' or 'gemma3', got 'gpt2'"),
    (dict(style="gemma3"), ValueError, r"norm_weights must hold 6 entries per layer"),
    (dict(cos_sin=[]), ValueError, r"cos_sin must hold 1 entries per layer"),
    # rotary and the cache write: checked once per step, before any layer runs
    (dict(positions=torch.tensor([8])), ValueError,
     r"positions\[0\] \(8\) is outside cos_sin\[0\]'s \[0, 8\)"),
    (dict(positions=torch.zeros(2, dtype=torch.long)), ValueError,
     r"positions must hold one entry per token \(1\), got 2"),
    (dict(positions=torch.zeros(1, dtype=torch.int32)), TypeError, r"positions must have dtype"),
    (dict(slot_mapping=torch.tensor([32])), ValueError,
     r"slot_mapping\[0\] \(32\) is out of range for kv_caches\[0\] of 32 slots"),
    (dict(slot_mapping=torch.zeros(2, dtype=torch.long)), ValueError,
     r"slot_mapping has 2 entries but there are only 1 tokens"),
    (dict(kv_caches=[torch.zeros(2, 2, 1, 16, 32, dtype=torch.bfloat16)]), TypeError,
     r"kv_caches\[0\] dtype .*BFloat16 must be the activations' \(Float\) or an fp8 format"),
    (dict(kv_caches=[torch.zeros(2, 2, 2, 16, 32)]), ValueError,
     r"kv_caches\[0\] shape .* does not match num_kv_heads 1 and head_size 32"),
    (dict(kv_caches=[torch.zeros(2, 2, 16, 32)]), ValueError, r"kv_caches\[0\] must be \[2, "),
    (dict(attn_scalars=[32 ** -0.5, 0.0, -1.0, 1.0]), ValueError,
     r"k_scale must be a finite positive number, got -1"),
    (dict(cos_sin=[torch.ones(8, 32, dtype=torch.float64)]), TypeError,
     r"cos_sin tables must be float32"),
])
def test_bad_arguments_are_named(change, error, message):
    args = stack_args()
    if change.get("kv_caches") == []:  # no layers: every per-layer list is empty too
        args.update(norm_weights=[torch.ones(32)], linear_weights=[], linear_biases=[],
                    linear_paths=[], attn_scalars=[], windows=[], cos_sin=[])
    args.update(change)
    with pytest.raises(error, match=message):
        ops.decoder_stack(**args)
