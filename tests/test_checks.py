"""pagedattn.checks: the one "an int, bools excluded" rule every layer's argument checks
use, and the one "must be one of" message."""

from __future__ import annotations

import numpy as np
import pytest

from pagedattn.checks import is_int, is_number, require_choice, require_int, require_number


@pytest.mark.parametrize("value,plain,with_numpy", [
    (0, True, True), (-3, True, True), (2 ** 70, True, True),
    (True, False, False), (False, False, False), (np.bool_(True), False, False),
    (np.int64(4), False, True), (np.int32(-1), False, True), (np.uint8(7), False, True),
    (4.0, False, False), ("4", False, False), (None, False, False),
])
def test_is_int(value, plain, with_numpy):
    assert is_int(value) is plain
    assert is_int(value, numpy=True) is with_numpy


@pytest.mark.parametrize("value,expected", [
    (1, True), (-2.5, True), (np.float64(0.5), True), (float("inf"), True),
    (True, False), ("1", False), (None, False),
])
def test_is_number(value, expected):
    assert is_number(value) is expected


@pytest.mark.parametrize("kwargs,value,error,message", [
    (dict(minimum=1), True, ValueError, "block_size must be an int >= 1, got True"),
    (dict(minimum=1), 0, ValueError, "block_size must be an int >= 1, got 0"),
    (dict(minimum=1), 2.0, ValueError, "block_size must be an int >= 1, got 2.0"),
    (dict(minimum=1), np.int64(2), ValueError, "block_size must be an int >= 1, got "),
    (dict(minimum=0, maximum=7), 8, ValueError, r"block_size must be an int in \[0, 7\], got 8"),
    (dict(maximum=7), 8, ValueError, "block_size must be an int <= 7, got 8"),
    (dict(minimum=0, allow_none=True), -1, ValueError, "block_size must be None or an int >= 0, got -1"),
    # A non-int raises `error` (TypeError where a site needs it); out of range stays ValueError.
    (dict(minimum=1, error=TypeError), "2", TypeError, "block_size must be an int >= 1, got '2'"),
    (dict(minimum=1, error=TypeError), 0, ValueError, "block_size must be an int >= 1, got 0"),
    (dict(error=TypeError), False, TypeError, "block_size must be an int, got False"),
    (dict(minimum=1, expected="a positive int"), 0, ValueError, "block_size must be a positive int, got 0"),
])
def test_require_int_rejects(kwargs, value, error, message):
    with pytest.raises(error, match=message):
        require_int("block_size", value, **kwargs)


@pytest.mark.parametrize("kwargs,value", [
    (dict(minimum=1), 1), (dict(), -5), (dict(minimum=0, maximum=7), 7),
    (dict(minimum=0, allow_none=True), None), (dict(minimum=0, numpy=True), np.int64(3)),
])
def test_require_int_returns_the_value(kwargs, value):
    assert require_int("n", value, **kwargs) is value


def test_require_number():
    assert require_number("top_p", 1) == 1.0 and isinstance(require_number("top_p", 1), float)
    with pytest.raises(TypeError, match="top_p must be a number, got True"):
        require_number("top_p", True)
    with pytest.raises(ValueError, match="top_p must be a float, got 'x'"):
        require_number("top_p", "x", error=ValueError, expected="a float")


def test_require_choice_returns_the_value_or_names_it_and_the_choices():
    assert require_choice("mode", "b", ("a", "b")) == "b"
    with pytest.raises(ValueError, match=r"^mode must be one of a, b, got 'c'$"):
        require_choice("mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match=r"got \['a'\]"):
        require_choice("mode", ["a"], ("a", "b"))


@pytest.mark.parametrize("field, bad, allowed", [
    ("kv_cache_dtype", "fp4", "auto, fp8"),
    ("prefill_attention", "fast", "auto, kernel"),
    ("linear_impl", "blas", "auto"),
    ("scheduling_policy", "lifo", "fcfs, shortest_first"),
])
def test_engine_args_name_the_bad_choice_and_the_allowed_ones(field, bad, allowed):
    from pagedattn.engine.args import EngineArgs

    with pytest.raises(ValueError, match=f"{field} must be one of {allowed}.*got '{bad}'"):
        EngineArgs(**{field: bad})


def test_the_retired_flash_prefill_is_refused_by_name():
    from pagedattn.engine.args import EngineArgs

    with pytest.raises(ValueError, match=r"prefill_attention 'flash' was retired.*'auto' or 'kernel'"):
        EngineArgs(prefill_attention="flash")
    assert EngineArgs(prefill_attention="kernel").prefill_attention == "kernel"
