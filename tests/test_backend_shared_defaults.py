"""The pieces of pagedattn.backend that several backends share instead of copying:
device_problems in validate_configuration, the flash cache layout, the per-request tensor
check, and the capability defaults."""

from __future__ import annotations

import pytest
import torch

from pagedattn.backend import (
    AttentionBackend,
    check_request_tensors,
    flash_kv_cache_shape,
    subclass_attention_backend_with_overrides,
)
from pagedattn.backends.cpu_attn import CPUAttentionBackend
from pagedattn.backends.triton_attn import TritonAttentionBackend
from pagedattn.backends.xformers import XFormersAttentionBackend
from pagedattn.config import DeviceCapability


def _validate(cls, capability=DeviceCapability(0, 0), head_size=64):
    return cls.validate_configuration(head_size, torch.float16, "auto", 16, False, False,
                                      False, False, capability, "decoder")


def test_device_problems_come_last_and_default_to_none():
    assert AttentionBackend.device_problems(DeviceCapability(9, 0)) == []
    assert _validate(CPUAttentionBackend) == []
    broken = subclass_attention_backend_with_overrides(
        "Broken", CPUAttentionBackend,
        {"device_problems": classmethod(lambda cls, cap: [f"no kernels on {tuple(cap)}"]),
         "get_supported_head_sizes": classmethod(lambda cls: [128])})
    assert _validate(broken) == ["head_size not supported", "no kernels on (0, 0)"]


@pytest.mark.parametrize("backend", [TritonAttentionBackend, XFormersAttentionBackend])
def test_backends_report_their_device_problems_through_validate_configuration(backend):
    for capability in (DeviceCapability(0, 0), DeviceCapability(9, 0)):
        problems = backend.device_problems(capability)
        reasons = _validate(backend, capability)
        assert reasons[len(reasons) - len(problems):] == problems


def test_flash_layout_is_shared():
    assert flash_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert flash_kv_cache_shape(10, 16, 2, 64, "fp8") == (2, 10, 16, 2, 64)
    for backend in (TritonAttentionBackend, XFormersAttentionBackend):
        assert backend.get_kv_cache_shape(3, 32, 4, 128) == (2, 3, 32, 4, 128)
    with pytest.raises(ValueError, match="multiple of 16"):
        XFormersAttentionBackend.get_kv_cache_shape(3, 8, 4, 128)


def test_capability_defaults():
    xf = XFormersAttentionBackend  # overrides none of them
    assert xf.get_supported_dtypes() == [torch.float16, torch.bfloat16]
    assert not any(f() for f in (xf.is_mla, xf.supports_sink, xf.supports_mm_prefix,
                                 xf.is_sparse))
    claims = subclass_attention_backend_with_overrides(
        "Sinks", xf, {"supports_sink": classmethod(lambda cls: True)})
    assert claims.supports_sink() and not claims.is_mla()


def test_check_request_tensors():
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    lens = torch.tensor([4, 7], dtype=torch.int32)
    check_request_tensors(qsl, lens, torch.zeros(3, 4, dtype=torch.int32))  # padding rows
    with pytest.raises(ValueError, match=r"query_start_loc has 2 entries for 2 requests"):
        check_request_tensors(qsl[:2], lens, torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"at least 2 rows, got shape \(1, 4\)"):
        check_request_tensors(qsl, lens, torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least 2 rows"):
        check_request_tensors(qsl, lens, torch.zeros(8, dtype=torch.int32))
