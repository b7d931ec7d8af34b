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


TORCH_OPS_ALLOWED: set[str] = set()
"""Modules of models/ still allowed to call ``torch.ops`` directly."""

ENGINE_BACKEND_IMPORTS_ALLOWED: set[tuple[str, str]] = set()
"""(engine module, backend module) imports still allowed."""


def _torch_ops_uses(path: Path) -> list[str]:
    """Where ``path`` reaches ``torch.ops`` itself: the attribute ``torch.ops``, ``import
    torch.ops`` or ``from torch import ops`` / ``from torch.ops import ...``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Attribute) and node.attr == "ops"
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            found.append(f"line {node.lineno}")
        elif isinstance(node, ast.Import) and any(_within(a.name, ("torch.ops",))
                                                  for a in node.names):
            found.append(f"line {node.lineno}")
        elif isinstance(node, ast.ImportFrom) and (
                _within(node.module or "", ("torch.ops",))
                or node.module == "torch" and any(a.name == "ops" for a in node.names)):
            found.append(f"line {node.lineno}")
    return found


def test_models_reach_kernels_only_through_the_ops_wrappers():
    # models/ call the validated wrappers in pagedattn.ops, never torch.ops itself.
    broken = sorted(
        f"{_module_name(path)} uses torch.ops at {', '.join(uses)}"
        for path in sorted((PACKAGE / "models").rglob("*.py"))
        if _module_name(path) not in TORCH_OPS_ALLOWED
        for uses in [_torch_ops_uses(path)] if uses)
    assert not broken, "models/ use torch.ops only through pagedattn.ops: " + "; ".join(broken)


def test_the_engine_imports_no_backend_module():
    # The engine reaches backends through the registry and the interface (backend.py);
    # a backend's own modules (backends/*) are its private business.
    broken = sorted(
        f"{mod} imports {imp}"
        for mod, imps in MODULES.items() if _within(mod, ("pagedattn.engine",))
        for imp in imps
        if _within(imp, ("pagedattn.backends",)) and imp != "pagedattn.backends"
        and (mod, imp) not in ENGINE_BACKEND_IMPORTS_ALLOWED)
    assert not broken, "the engine imports no backend-private module: " + "; ".join(broken)


SERVE_ENGINE_INTERFACE = "pagedattn.engine.interface"
"""The one engine module ``serve/`` may import: the engine's public interface."""


def test_the_server_uses_only_the_engines_public_interface():
    # serve/ reaches the engine through engine/interface.py (LLM, LLMEngine's methods,
    # EngineLoad, RequestProgress, ...), never a module of its insides (scheduler, block
    # pool, sampler), and no model, backend or op at all.
    broken = sorted(
        f"{mod} imports {imp}"
        for mod, imps in MODULES.items() if _within(mod, ("pagedattn.serve",))
        for imp in imps
        if _within(imp, ("pagedattn.engine", "pagedattn.models", "pagedattn.backends",
                         "pagedattn.ops", "pagedattn.registry", "pagedattn.compat"))
        and not _within(imp, (SERVE_ENGINE_INTERFACE,)))
    assert not broken, "serve/ imports only the engine's public interface: " + "; ".join(broken)
    assert any(_within(m, (SERVE_ENGINE_INTERFACE,)) for m in MODULES["pagedattn.serve.app"])


def test_the_rules_see_the_imports():
    # The reader must find what is there, or every rule above passes vacuously.
    assert "pagedattn.backends.cpu_runtime" in MODULES["pagedattn.backends.cpu_attn"]
    assert "pagedattn.compat.backend_utils" in MODULES["pagedattn.backends.utils"]
    assert any(_within(m, ("pagedattn.bench",)) for m in MODULES["pagedattn.cli"])
    assert "pagedattn.checks" in MODULES["pagedattn.paging"]
    assert _torch_ops_uses(PACKAGE / "ops" / "__init__.py")  # the wrappers call torch.ops


def test_the_seed_path_reexports_its_names():
    from pagedattn.backends import utils as seed_path
    from pagedattn.compat import backend_utils

    assert seed_path.__all__ == backend_utils.__all__
    assert all(getattr(seed_path, n) is getattr(backend_utils, n) for n in backend_utils.__all__)
