"""Argument checks every layer shares: an int is an int, and a bool is not one.

``bool`` subclasses ``int``, so ``isinstance(True, int)`` holds and ``True`` would pass as a
block size or a world size of 1. Every check of an int (or number) argument in the package
goes through these helpers, which exclude bools. A leaf module: it imports nothing from
the package, so any layer may use it (``docs/architecture.md``).

Errors name the argument, what it must be and the value given, e.g.
``ValueError: block_size must be an int >= 1, got 0``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["is_int", "is_number", "require_choice", "require_int", "require_number"]


def is_int(value: Any, *, numpy: bool = False) -> bool:
    """Whether ``value`` is an int, bools excluded; with ``numpy=True`` numpy integer
    scalars count too (``np.bool_`` is not one)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, np.integer) if numpy else int)


def is_number(value: Any) -> bool:
    """Whether ``value`` is an int or a float (numpy's float64 is one), bools excluded."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _expected(kind: str, minimum, maximum, allow_none: bool) -> str:
    if minimum is not None and maximum is not None:
        what = f"{kind} in [{minimum}, {maximum}]"
    elif minimum is not None:
        what = f"{kind} >= {minimum}"
    elif maximum is not None:
        what = f"{kind} <= {maximum}"
    else:
        what = kind
    return f"None or {what}" if allow_none else what


def require_int(name: str, value: Any, minimum: int | None = None, *, maximum: int | None = None,
                allow_none: bool = False, numpy: bool = False, error: type[Exception] = ValueError,
                expected: str | None = None) -> Any:
    """``value`` if it is an int (bools excluded; numpy integers with ``numpy=True``) in
    ``[minimum, maximum]`` (``None``: unbounded on that side), or ``None`` with
    ``allow_none``.

    Raises ``error`` (ValueError by default; TypeError where a site's callers expect it)
    for a value that is not an int, ValueError for one out of range. The message is
    ``"{name} must be {expected}, got {value!r}"``; ``expected`` defaults to the rule,
    e.g. ``"an int >= 1"`` or ``"None or an int in [0, 7]"``.
    """
    if value is None and allow_none:
        return value
    text = expected or _expected("an int", minimum, maximum, allow_none)
    if not is_int(value, numpy=numpy):
        raise error(f"{name} must be {text}, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {text}, got {value!r}")
    return value


def require_number(name: str, value: Any, *, error: type[Exception] = TypeError,
                   expected: str = "a number") -> float:
    """``float(value)`` if ``value`` is an int or a float (bools excluded), else ``error``
    (TypeError by default) saying ``"{name} must be {expected}, got {value!r}"``."""
    if not is_number(value):
        raise error(f"{name} must be {expected}, got {value!r}")
    return float(value)


def require_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else ValueError saying
    ``"{name} must be one of a, b, got {value!r}"``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value
