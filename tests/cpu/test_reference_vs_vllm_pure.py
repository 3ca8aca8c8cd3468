"""The reference against vLLM's own pure-PyTorch functions, run on CPU.

These pin the reference to what vLLM 0.33 computes for RoPE (all three rope
types HY V4 configs use) and MoE routing, without any GPU kernel. The
comparisons live in ``harness.mutants`` (the CPU mutants reuse them); each
says which rounding its tolerance absorbs.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed")

from harness.mutants import ROPE_PARAMS, rope_cross_check, routing_cross_check  # noqa: E402


@pytest.mark.parametrize("kind", sorted(ROPE_PARAMS))
def test_rope_matches_vllm(kind):
    assert rope_cross_check(kind) == []


@given(st.integers(0, 2**16), st.sampled_from([(8, 2), (16, 4), (256, 8)]), st.booleans())
def test_routing_matches_vllm_grouped_topk(seed, shape, renorm):
    experts, topk = shape
    assert routing_cross_check(seed, experts, topk, renorm, tokens=5) == []
