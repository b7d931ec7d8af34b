"""What the generate_*_header.py scripts share: paths, and loading a pagedattn module by path
(importing the pagedattn package would pull in torch and the extension)."""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def load_by_path(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclass/enum machinery looks the module up
    spec.loader.exec_module(mod)
    return mod


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
