"""Tests of the Triton kernels and the GPU backends (TRITON_ATTN, XFORMERS_VLLM_V1).

They run on CUDA tensors where a GPU is present, else on CPU tensors under Triton's
interpreter. The interpreter must be chosen before Triton is first imported, so on a
machine without a GPU these tests run in their own pytest process with
``TRITON_INTERPRET=1`` set (``make test`` does it); a plain ``pytest`` there leaves
this folder out instead of half-running it.
"""

import pytest
import torch
from gpu_env import DEVICE, INTERPRETED, ON_GPU

if not (INTERPRETED or ON_GPU):
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (and, for xformers, its kernels)")


@pytest.fixture
def device() -> torch.device:
    """Where the kernels under test run: the GPU, or the CPU under the interpreter."""
    return DEVICE
