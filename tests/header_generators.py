"""The csrc/cpu/generate_*_header.py scripts as modules, for the tests that check the
generated headers against the Python names they mirror."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "cpu"))
from header_gen import load_by_path  # noqa: E402


def generator(script: str):
    """A csrc/cpu/generate_*_header.py script, loaded as a module."""
    return load_by_path(os.path.join("csrc", "cpu", script), "_" + script[:-3])
