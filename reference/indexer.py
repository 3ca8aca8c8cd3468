"""The lightning indexer (DeepSeek-V3.2 DSA) as HY V4 runs it in vLLM.

Per query token t (hidden x_t [H], MLA query latent q_c [Lq], position p):
  q   = wq_b q_c                       -> [ih, D], D = index_head_dim
  k,w = wk x_t, weights_proj x_t        -> k [D], w [ih]
  k   = LayerNorm_fp32(k; eps=1e-6)    (HF transformers' hy_v4 uses its own eps:
                                        vLLM hard-codes 1e-6)
  q_pe, k_pe = the LAST rope_dim entries of q (per head) and k, rotated with
        interleaved RoPE at p; the first D - rope_dim entries are unrotated
  q -> per-token-group FP8 (group 128, s_q = 2^ceil(log2(max(amax, 1e-10)/448)))
  k -> the same when written to the indexer cache, with amax clamped at 1e-4
  w' = w * s_q * D^-0.5 * ih^-0.5
  score(t, j) = sum_h w'_h * relu(q8_h . k8_j * s_k_j)    for keys j <= p
              = sum_h w_h D^-0.5 ih^-0.5 relu(deq(q)_h . deq(k)_j)  (s_q > 0)
  topk(t) = the index_topk highest-scoring positions, -1 padded when p + 1 < index_topk.
"""

from __future__ import annotations

import torch

from . import fp8, probes, rope
from .config import MTPConfig
from .norms import layer_norm
from .numerics import Numerics

QUANT_GROUP = 128


def project(cfg: MTPConfig, lw: dict, x: torch.Tensor, q_c: torch.Tensor,
            positions: torch.Tensor, num: Numerics) -> dict[str, torch.Tensor]:
    """Indexer query/key/weights for T tokens.

    x: [T, H] (input_layernorm output), q_c: [T, Lq]. Returns
    q_fp8 [T, ih, D] (e4m3 values, float64), q_scale [T, ih], k [T, D] (before
    cache quantization), k_fp8 [T, D], k_scale [T, D/128], weights [T, ih].
    """
    ih, d, dr = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    t = x.shape[0]
    q = num.linear(q_c, lw["indexer.wq_b"]).reshape(t, ih, d)
    k = num.linear(x, lw["indexer.wk"])
    w = num.linear(x, lw["indexer.weights_proj"])
    k = layer_norm(k, lw["indexer.k_norm.weight"], lw["indexer.k_norm.bias"], 1e-6, num.fp32)
    k = num.store(k)
    cos, sin = rope.cos_sin(cfg.rope, dr, positions, num)
    q_pe = rope.apply_interleaved(num.up(q[..., d - dr:]), cos, sin)
    k_pe = rope.apply_interleaved(num.up(k[:, None, d - dr:]), cos, sin)[:, 0]
    q = torch.cat([q[..., : d - dr], num.store(q_pe)], dim=-1)
    k = torch.cat([k[:, : d - dr], num.store(k_pe)], dim=-1)
    probes.note("indexer.q_prequant", q)
    probes.note("indexer.k_prequant", k)
    q8, q_scale = fp8.quantize_token_groups(q.reshape(t * ih, d), QUANT_GROUP, ue8m0=True)
    # The cache-insert kernel clamps amax at 1e-4 (the q quantizer at 1e-10).
    k8, k_scale = fp8.quantize_token_groups(k, QUANT_GROUP, ue8m0=True, eps=1e-4)
    q_scale_head = q_scale.reshape(t, ih, d // QUANT_GROUP)
    if d // QUANT_GROUP != 1:
        # vLLM folds one q scale per head into the weights: only valid for D == 128.
        raise ValueError("index_head_dim must be 128 (one FP8 group per head)")
    weights = num.up(w).to(num.fp32) * q_scale_head[..., 0].to(num.fp32) * (d ** -0.5) * (ih ** -0.5)
    return {
        "q_fp8": q8.to(torch.float64).reshape(t, ih, d),
        "q_scale": q_scale_head[..., 0],
        "k": k,
        "k_fp8": k8.to(torch.float64),
        "k_scale": k_scale,
        "weights": weights,
    }


def scores(q_fp8: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """score_j = sum_h weights_h relu(q8_h . keys_j), per query.

    q_fp8: [..., ih, D] (e4m3 values), weights: [..., ih] (q scale folded in),
    keys: [..., S, D] dequantized cache keys (k8 * s_k); the leading dims (one
    query: none; a batch of queries: [T]) match. Returns [..., S] float64.
    """
    dots = q_fp8.to(torch.float64) @ keys.to(torch.float64).transpose(-1, -2)  # [..., ih, S]
    return (torch.relu(dots) * weights.to(torch.float64)[..., :, None]).sum(-2)


def select_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k key positions by score (descending), -1 padded to length k.

    score: [..., S] over positions 0..S-1; -inf marks a position the query does
    not see (past its own), never selected. Ties: the lower position first
    (torch.sort is stable); production may order ties differently, so
    comparisons treat rows as sets and report ties.
    """
    order = torch.sort(score, descending=True, stable=True).indices[..., :k]
    picked = torch.gather(score, -1, order) > float("-inf")
    out = torch.full((*score.shape[:-1], k), -1, dtype=torch.long, device=score.device)
    out[..., : order.shape[-1]] = torch.where(picked, order, -1)
    return out
