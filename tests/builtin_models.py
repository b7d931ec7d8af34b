"""The built-in models' files (installed by make setup), and skip marks for their absence."""

from __future__ import annotations

import pytest

from pagedattn.models.loader import resolve_model


def _resolve(name: str) -> tuple[str | None, str]:
    try:
        return resolve_model(name), ""
    except (FileNotFoundError, ValueError) as exc:  # pragma: no cover - set-up installs them
        return None, str(exc)


SMOLLM2, SMOLLM2_WHY = _resolve("smollm2")
MINILM, MINILM_WHY = _resolve("minilm")
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=f"smollm2 is not installed: {SMOLLM2_WHY}")
needs_minilm = pytest.mark.skipif(MINILM is None, reason=f"minilm is not installed: {MINILM_WHY}")
