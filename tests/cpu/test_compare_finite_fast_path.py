"""The all-finite fast path of the value comparisons gives what the masked path gives, on any data.

``compare_values`` and the judge's ``_max_abs`` skip the NaN / infinity masks when
``finite_everywhere`` (one sum per tensor) says both sides are finite. These tests run each
comparison twice on the same tensors, once as it is and once with ``finite_everywhere`` forced
to False (the masked path, which handles any data), and require the same result, field by field
and bit for bit. The data mixes finite values, NaN, both infinities and values near the float64
maximum, whose sum overflows while every element is finite.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import trace_compare
from harness.components import Tolerance
from harness.production.judging import trace_judge

SPECIAL = [math.nan, math.inf, -math.inf, 1.7e308, -1.7e308, 0.0, -0.0, 5e-324]
TOL = Tolerance(1e-3, 1e-2, "test")


@st.composite
def pairs(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    n = rows * cols
    finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)
    value = st.one_of(finite, finite, finite, st.sampled_from(SPECIAL))
    e = draw(st.lists(value, min_size=n, max_size=n))
    # actual: expected moved a little, or an independent draw (masks that differ, or not)
    if draw(st.booleans()):
        noise = draw(st.lists(st.floats(-1e-2, 1e-2, width=64), min_size=n, max_size=n))
        a = [x + d if math.isfinite(x) else x for x, d in zip(e, noise)]
    else:
        a = draw(st.lists(value, min_size=n, max_size=n))
    shape = (rows, cols)
    return (torch.tensor(a, dtype=torch.float64).reshape(shape), torch.tensor(e, dtype=torch.float64).reshape(shape))


def _bits(x):
    """A float's bit pattern (NaN == NaN, -0.0 != 0.0); other values as they are."""
    if isinstance(x, float):
        return struct.pack("<d", x)
    if isinstance(x, (tuple, list)):
        return type(x)(_bits(v) for v in x)
    return x


def _fields(res) -> dict:
    return {k: _bits(v) for k, v in dataclasses.asdict(res).items()}


@settings(deadline=None)
@given(pairs())
def test_compare_values_fast_path_equals_the_masked_path(pair):
    a, e = pair
    fast = trace_compare.compare_values("step0.mlp.out", a, e, TOL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace_compare, "finite_everywhere", lambda t: False)
        masked = trace_compare.compare_values("step0.mlp.out", a, e, TOL)
    assert _fields(fast) == _fields(masked)


@settings(deadline=None)
@given(pairs())
def test_max_abs_fast_path_equals_the_masked_path(pair):
    a, b = pair
    fast = trace_judge._max_abs(a, b)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace_judge, "finite_everywhere", lambda t: False)
        masked = trace_judge._max_abs(a, b)
    assert _bits(fast) == _bits(masked)


@pytest.mark.parametrize("values,expected", [
    ([1.0, 2.0], True), ([1.0, math.nan], False), ([math.inf, 1.0], False), ([-math.inf, math.inf], False),
    ([1.7e308, 1.7e308], False),  # finite elements whose sum overflows: the masked path decides
])
def test_finite_everywhere(values, expected):
    assert trace_compare.finite_everywhere(torch.tensor(values, dtype=torch.float64)) is expected


def test_the_fast_path_is_taken_on_finite_data(monkeypatch):
    """Finite data never builds the mask: the fast path is what runs on a normal trace."""
    calls = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(t.numel()) or real(t))
    a = torch.randn(64, 32, dtype=torch.float64)
    trace_compare.compare_values("step0.mlp.out", a, a + 1e-6, TOL)
    trace_judge._max_abs(a, a + 1e-6)
    assert calls and all(n == 1 for n in calls), calls  # only the sums' 1-element checks
