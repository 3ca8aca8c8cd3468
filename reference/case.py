"""Seeded draft cases: ragged requests with target hidden states and token ids."""

from __future__ import annotations

import torch

from .config import MTPConfig
from .mtp import StepInput


def request_lengths(requests: int, tokens: int) -> list[int]:
    """Ragged lengths: tokens, tokens - 3, tokens + 5, ... (at least 1 each)."""
    pattern = (0, -3, 5, -7, 2, 9, -1, 4)
    return [max(1, tokens + pattern[r % len(pattern)]) for r in range(requests)]


def make_case(cfg: MTPConfig, seed: int, requests: int = 2, tokens: int = 8,
              lengths: list[int] | None = None) -> StepInput:
    """Step 0's batch: R requests (positions 0..L_r-1), ids ~ U(vocab), hidden ~ N(0, 1) (bf16 values)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    lengths = lengths or request_lengths(requests, tokens)
    ids, pos, req = [], [], []
    for r, n in enumerate(lengths):
        ids.append(torch.randint(0, cfg.vocab_size, (n,), generator=gen))
        pos.append(torch.arange(n))
        req.append(torch.full((n,), r, dtype=torch.long))
    t = sum(lengths)
    hidden = torch.randn(t, cfg.hidden_size, generator=gen, dtype=torch.float64)
    return StepInput(torch.cat(ids), torch.cat(pos), hidden.to(torch.bfloat16).to(torch.float64),
                     torch.cat(req))
