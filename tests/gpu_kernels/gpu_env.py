"""Where the tests of this folder run (imported by conftest.py and the test modules)."""

import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""Triton's interpreter: the kernels run on CPU tensors."""
ON_GPU = torch.cuda.is_available() and not INTERPRETED
"""Compiled kernels on a CUDA GPU."""
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
