"""pagedattn's OpenMP wait policy (pagedattn.thread_policy): applied when pagedattn loads
torch, never over the user's own settings, never leaked to child processes, and reported.
libgomp prints the settings it read when OMP_DISPLAY_ENV=verbose, so each case runs in a
fresh interpreter and reads that."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pagedattn import thread_policy


def run_fresh(code: str, **env: str) -> tuple[str, str]:
    """``(stdout, libgomp's GOMP_SPINCOUNT)`` of ``code`` in a new interpreter."""
    clean = {k: v for k, v in os.environ.items() if k not in thread_policy.USER_VARIABLES}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, "OMP_DISPLAY_ENV": "verbose", **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", proc.stdout + proc.stderr)
    if spin is None:
        pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in its report)")
    return proc.stdout, spin.group(1)


REPORT = ("import os; from pagedattn import thread_policy; print(thread_policy.describe()); "
          "print('child sees', os.environ.get('GOMP_SPINCOUNT'))")


def test_importing_pagedattn_first_loads_torch_with_its_spin_count():
    out, spin = run_fresh("import pagedattn\n" + REPORT.replace("; ", "\n"))
    assert spin == str(thread_policy.SPIN_COUNT)
    assert f"spins {thread_policy.SPIN_COUNT} then sleeps (pagedattn's default)" in out
    assert "child sees None" in out  # set only while torch loaded


@pytest.mark.parametrize("name, value", [("GOMP_SPINCOUNT", "1234"),
                                         ("OMP_WAIT_POLICY", "active")])
def test_the_users_own_setting_wins(name, value):
    out, spin = run_fresh("import pagedattn\n" + REPORT.replace("; ", "\n"), **{name: value})
    if name == "GOMP_SPINCOUNT":
        assert spin == "1234"
    else:
        assert spin != str(thread_policy.SPIN_COUNT)
    assert f"from the environment ({name}={value})" in out


def test_torch_imported_first_keeps_openmps_default_and_says_so():
    out, spin = run_fresh("import torch\nimport pagedattn\n" + REPORT.replace("; ", "\n"))
    assert spin != str(thread_policy.SPIN_COUNT)
    assert "torch was imported before pagedattn" in out


def test_the_engine_line_names_the_policy():
    from pagedattn.engine.cli import describe_engine

    class FakeLLM:  # describe_engine reads args and engine only
        class args:
            model, dtype, linear_impl, huge_pages = "m", "bfloat16", "auto", False
        engine = None
        embedder = type("E", (), {"builder": object()})()
        act_dtype = "bfloat16"
        weights_on_huge_pages = False

    assert describe_engine(FakeLLM()).endswith(thread_policy.describe())
    assert "threads" in thread_policy.describe()
