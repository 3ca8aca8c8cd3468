"""Optional instrumentation: quantities a component computes but does not output.

Off by default. Inside ``with recording() as rec:`` the reference appends,
per call, detached copies of
  "moe.routed.gate_up"   [2, T_e, I]  routed-expert SwiGLU inputs (gate ; up) BEFORE the clamp
  "attn.sink_share"      [nh]         exp(sink_h) / (sum_j exp(logit_h(j)) + exp(sink_h)), one query
  "indexer.q_prequant"   [T, ih, D]   indexer q (after RoPE) before the FP8 token-group quantization
  "indexer.k_prequant"   [T, D]       indexer k (after RoPE) before the cache quantization
to ``rec[name]`` (a list). Recording only reads values: every output of the
reference is bitwise the same with or without it (tests/cpu/test_regimes.py).
Used by ``harness.regimes`` to say how strongly a case exercises a regime.
"""

from __future__ import annotations

import contextlib

import torch

_stack: list[dict] = []


@contextlib.contextmanager
def recording():
    rec: dict[str, list[torch.Tensor]] = {}
    _stack.append(rec)
    try:
        yield rec
    finally:
        _stack.remove(rec)


def active() -> bool:
    return bool(_stack)


def note(name: str, value: torch.Tensor) -> None:
    if _stack:
        _stack[-1].setdefault(name, []).append(value.detach().clone())
