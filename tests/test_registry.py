"""Backend registry: selection by name, by environment, by capability; errors list reasons."""

import pytest
import torch

from pagedattn import registry
from pagedattn.backend import AttentionBackend, AttentionType
from pagedattn.registry import AttentionSelectorConfig, NoUsableBackendError


class _FakeBackend(AttentionBackend):
    supported_dtypes = [torch.float16]

    @staticmethod
    def get_name():
        return "FAKE_FP16"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError

    @staticmethod
    def get_builder_cls():
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_supported_head_sizes(cls):
        return [64]


@pytest.fixture
def fake_backends(monkeypatch):
    saved = dict(registry._REGISTRY)
    monkeypatch.delenv(registry.BACKEND_ENV_VAR, raising=False)
    registry.register_backend("FAKE_FP16", f"{__name__}:_FakeBackend", ("cpu",))
    registry.register_backend("FAKE_MISSING", "pagedattn_no_such_module:Backend", ("cpu",))
    registry.register_backend("FAKE_GPU", f"{__name__}:_FakeBackend", ("cuda",))
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def cfg(**kw):
    base = dict(head_size=64, dtype=torch.float16, block_size=16, device="cpu")
    base.update(kw)
    return AttentionSelectorConfig(**base)


def test_cpu_attn_is_registered_first_and_selected_for_cpu_bf16():
    assert registry.registered_backends()[0] == "CPU_ATTN"
    chosen = registry.select_backend(cfg(head_size=128, dtype=torch.bfloat16))
    assert chosen.get_name() == "CPU_ATTN"


def test_selection_falls_through_priority_order(fake_backends):
    # Both CPU_ATTN and FAKE_FP16 accept this config: the earlier registration wins.
    assert registry.select_backend(cfg()).get_name() == "CPU_ATTN"
    registry.unregister_backend("CPU_ATTN")
    assert registry.select_backend(cfg()).get_name() == "FAKE_FP16"


def test_no_usable_backend_lists_every_backend_with_reasons(fake_backends):
    with pytest.raises(NoUsableBackendError) as info:
        registry.select_backend(cfg(head_size=36, dtype=torch.float32, use_mla=True))
    message = str(info.value)
    # The seed's reason strings come first; the registry adds the value and what is allowed.
    sizes = ", ".join(str(h) for h in range(32, 513, 8))  # every multiple of 8, 32..512
    assert (f"CPU_ATTN: head_size not supported: 36 (supported: {sizes}), MLA not supported"
            ) in message
    assert ("FAKE_FP16: head_size not supported: 36 (supported: 64), dtype not supported: "
            "torch.float32 (supported: torch.float16), MLA not supported") in message
    assert "FAKE_MISSING: not importable: ModuleNotFoundError" in message
    assert "FAKE_GPU: device type cpu not supported (needs cuda)" in message


def test_explicit_name_and_environment_variable(fake_backends, monkeypatch):
    assert registry.select_backend(cfg(), backend="FAKE_FP16").get_name() == "FAKE_FP16"
    monkeypatch.setenv(registry.BACKEND_ENV_VAR, "FAKE_FP16")
    assert registry.select_backend(cfg()).get_name() == "FAKE_FP16"
    with pytest.raises(NoUsableBackendError, match="PAGEDATTN_BACKEND=FAKE_FP16 cannot run this configuration: dtype not supported"):
        registry.select_backend(cfg(dtype=torch.bfloat16))
    monkeypatch.setenv(registry.BACKEND_ENV_VAR, "NOPE")
    with pytest.raises(ValueError, match="unknown attention backend 'NOPE'; registered: CPU_ATTN"):
        registry.select_backend(cfg())


def test_attention_type_reason_and_bad_registrations(fake_backends):
    reasons = registry.unsupported_reasons("FAKE_FP16", cfg(attn_type=AttentionType.ENCODER_ONLY))
    assert reasons == ["attention type encoder_only not supported"]
    with pytest.raises(ValueError, match="UPPER_CASE identifier"):
        registry.register_backend("lower", "m:C", ("cpu",))
    with pytest.raises(ValueError, match="module:Class"):
        registry.register_backend("X", "no_colon", ("cpu",))
    with pytest.raises(ValueError, match="invalid AttentionType 'cross'"):
        cfg(attn_type="cross")


class _Block32Backend(_FakeBackend):
    @staticmethod
    def get_supported_kernel_block_sizes():
        return [32]


def test_block_size_and_cache_dtype_reasons_name_the_value_and_the_supported_set(fake_backends):
    registry.register_backend("FAKE_BLOCK32", f"{__name__}:_Block32Backend", ("cpu",))
    reasons = registry.unsupported_reasons("FAKE_BLOCK32", cfg(block_size=16, kv_cache_dtype="fp8"))
    assert reasons == [
        "kv_cache_dtype not supported: fp8 (supported: auto)",
        "block_size not supported: 16 (supported: 32, 64, 128, 256)",
    ]


class _BrokenBackend(_FakeBackend):
    @classmethod
    def validate_configuration(cls, **kwargs):
        raise ZeroDivisionError("a bug in the backend's checks")


def test_a_bug_in_a_backend_surfaces_instead_of_becoming_a_reason(fake_backends):
    registry.register_backend("FAKE_BROKEN", f"{__name__}:_BrokenBackend", ("cpu",))
    with pytest.raises(ZeroDivisionError, match="a bug in the backend's checks"):
        registry.unsupported_reasons("FAKE_BROKEN", cfg())
    # A class path naming no class is a registration bug, not a missing dependency.
    registry.register_backend("FAKE_TYPO", f"{__name__}:_NoSuchClass", ("cpu",))
    with pytest.raises(AttributeError, match="_NoSuchClass"):
        registry.unsupported_reasons("FAKE_TYPO", cfg())
