"""The layering rules of docs/architecture.md, read off the import statements of every
module in the package (function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedattn"

CORE = ("pagedattn.backend", "pagedattn.paging", "pagedattn.ops", "pagedattn.backends",
        "pagedattn.engine", "pagedattn.models")
SEED_PATH_SHIMS = {"pagedattn.backends.utils"}
"""vLLM's import paths kept for old code: re-exports of compat/, imported by no core module."""

# (modules the rule covers, modules they must not import, why)
RULES = [
    (CORE, ("pagedattn.compat",), "the core imports nothing from compat/"),
    (("pagedattn.ops",), ("pagedattn.backends", "pagedattn.engine", "pagedattn.models",
                          "pagedattn.registry"), "ops/ imports no backend, engine or model"),
    (("pagedattn.models",), ("pagedattn.engine", "pagedattn.backends", "pagedattn.registry"),
     "models/ import neither the engine nor a backend (attention is injected)"),
    (("pagedattn.paging",), ("pagedattn.ops",), "paging.py imports no op"),
    (("pagedattn.backends",), ("pagedattn.engine",), "backends import no engine"),
    (("pagedattn.engine",), ("pagedattn.integrations", "pagedattn.bench", "pagedattn.serve"),
     "the engine imports neither the vLLM plugin, the server nor the bench"),
    (("pagedattn.testing", "pagedattn.backend", "pagedattn.paging", "pagedattn.ops",
      "pagedattn.backends", "pagedattn.engine", "pagedattn.models", "pagedattn.registry",
      "pagedattn.config", "pagedattn.integrations", "pagedattn.compat"),
     ("pagedattn.bench",), "testing.py and the product modules import nothing from bench/"),
    (CORE, SEED_PATH_SHIMS, "no core module imports a seed-path shim"),
    (("pagedattn.checks",), ("pagedattn",), "checks.py imports nothing from the package"),
]

PLUGIN = "pagedattn.integrations.vllm"
OPS_DATA_MODULES = {"pagedattn.ops.isa", "pagedattn.ops.reference", "pagedattn.ops.kernel_shapes"}
"""Parts of ops/ that are definitions, not kernels: anyone may import them."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``pagedattn.*`` module ``path`` imports (``from x import y`` counts both ``x``
    and ``x.y``, since ``y`` may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m == "pagedattn" or m.startswith("pagedattn.")}


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


MODULES = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("covered,forbidden,why", RULES, ids=[r[2] for r in RULES])
def test_layering_rule(covered, forbidden, why):
    broken = sorted(
        f"{mod} imports {imp}"
        for mod, imps in MODULES.items()
        if _within(mod, covered) and mod not in SEED_PATH_SHIMS
        for imp in imps if _within(imp, forbidden))
    assert not broken, f"{why}: " + "; ".join(broken)


def test_the_plugin_reaches_kernels_only_through_the_runtime():
    broken = sorted(
        f"{mod} imports {imp}"
        for mod, imps in MODULES.items() if _within(mod, (PLUGIN,))
        for imp in imps
        if _within(imp, ("pagedattn.ops",)) and not _within(imp, OPS_DATA_MODULES)
        or imp in ("pagedattn.backends.cpu_attn.plan_step",))
    assert not broken, "; ".join(broken)
    assert "pagedattn.backends.cpu_runtime" in MODULES[f"{PLUGIN}.backend"]


def test_the_rules_see_the_imports():
    # The reader must find what is there, or every rule above passes vacuously.
    assert "pagedattn.backends.cpu_runtime" in MODULES["pagedattn.backends.cpu_attn"]
    assert "pagedattn.compat.backend_utils" in MODULES["pagedattn.backends.utils"]
    assert any(_within(m, ("pagedattn.bench",)) for m in MODULES["pagedattn.cli"])
    assert "pagedattn.checks" in MODULES["pagedattn.paging"]


def test_the_seed_path_reexports_its_names():
    from pagedattn.backends import utils as seed_path
    from pagedattn.compat import backend_utils

    assert seed_path.__all__ == backend_utils.__all__
    assert all(getattr(seed_path, n) is getattr(backend_utils, n) for n in backend_utils.__all__)
