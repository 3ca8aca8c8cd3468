"""One MTP draft step and the multi-step proposer loop, as vLLM runs them.

One step over T tokens (ids, positions, previous hidden states h_prev):
  e   = embed(ids), zeroed where position == 0            (embed, embed_masked)
  x0  = eh_proj [enorm(e) ; hnorm(h_prev)]                 (order: embedding first)
  a   = MLA(input_layernorm(x0)) ;  r1 = a + x0             (attn.*, attn.residual)
  m   = MLP(post_attention_layernorm(r1))                   (moe.* / mlp.out)
  y   = RMSNorm(m + r1)   (final_layernorm, fused add)      (final_norm)
  logits = lm_head y  (float32 head) on each request's last token; greedy token.
The block has no iHC (vLLM builds MTP blocks with enable_ihc=False).

The loop (K steps, R requests): step 0 runs over every request's new tokens
(the target's hidden states and the next-token ids) on MTP layer 0; step
k >= 1 runs one token per request: the previous step's greedy token at
position last + k, fed with the previous step's output y (the normed hidden
state), on MTP layer k mod num_mtp_layers: vLLM 0.33's MultiModuleMTPSpeculator
(picked when min(num_nextn_predict_layers, K) > 1) cycles this way; its
single-module MTPSpeculator, and the module-level runner in
harness/production, call layer 0 at every step (harness.production.replay's
default policy). With index_share_for_mtp_iteration
the indexer runs only at step 0; its rows for each request's last token are
compacted to the front of the top-k buffer and steps >= 1 reuse them.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from . import attention, indexer, kv_cache, moe
from .cache import DraftCache
from .config import MTPConfig
from .norms import rms_norm
from .numerics import EXACT, Numerics
from .tp import Shard, shard_all

Trace = "OrderedDict[str, torch.Tensor]"


@dataclasses.dataclass
class StepInput:
    """A flat batch of tokens from several requests (request-major order)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    hidden: torch.Tensor  # [T, H] previous hidden states
    request: torch.Tensor  # [T] long, request index of each token

    def to(self, device) -> "StepInput":
        return StepInput(*(t.to(device) for t in (self.input_ids, self.positions, self.hidden, self.request)))

    def last_rows(self) -> torch.Tensor:
        """Row of each request's last token, in request order: [R]."""
        ids, slot = torch.unique(self.request, return_inverse=True)  # slot: request order 0..R-1
        rows = torch.arange(self.request.numel(), device=self.request.device)
        return rows.new_zeros(ids.numel()).scatter_reduce(0, slot, rows, "amax", include_self=False)


def _row_blocks(t: int, per_row: int, budget: int = 1 << 24) -> list[slice]:
    """Consecutive query rows, at most ``budget`` // ``per_row`` per block: bounds the memory of
    the keys gathered per query (a block's [rows, S, ...] tensors), not the math."""
    n = max(1, budget // max(per_row, 1))
    return [slice(i, min(i + n, t)) for i in range(0, t, n)]


def layer_weights(weights: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The canonical weights of MTP layer ``layer`` without their prefix, plus shared ones."""
    prefix = f"layers.{layer}."
    lw = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    lw["embed_tokens"] = weights["embed_tokens"]
    lw["lm_head"] = weights["lm_head"]
    return lw


def forward_step(cfg: MTPConfig, shards: list[Shard], inp: StepInput, cache: DraftCache,
                 layer: int, num: Numerics = EXACT, *, run_indexer: bool = True,
                 topk_rows: torch.Tensor | None = None,
                 logit_rows: torch.Tensor | None = None) -> "OrderedDict[str, torch.Tensor]":
    """One MTP layer forward over ``inp``; returns the trace of every component.

    ``shards``: the layer's weights per TP rank (one shard = unsharded).
    ``topk_rows``: [T, index_topk] key positions to attend (-1 = none), used
    when ``run_indexer`` is False (index sharing); written into the trace as
    ``attn.topk``. ``logit_rows``: the rows whose logits / greedy token are
    computed (default: each request's last row; the engine's proposer samples
    each request's last *accepted* row). Writes this step's KV into ``cache``
    before attending, in the cache's ``kv_cache_dtype`` (``reference.kv_cache``).
    """
    lw = shards[0].weights  # replicated parts are identical on every rank
    tr: OrderedDict[str, torch.Tensor] = OrderedDict()
    ids, pos, req = inp.input_ids, inp.positions, inp.request
    t = ids.numel()
    dev = ids.device

    emb = num.store(lw["embed_tokens"][ids])
    tr["embed"] = emb
    emb = torch.where((pos == 0)[:, None], torch.zeros_like(emb), emb)
    tr["embed_masked"] = emb
    tr["enorm"] = e = rms_norm(emb, lw["enorm"], cfg.rms_norm_eps, num)
    tr["hnorm"] = h = rms_norm(num.store(inp.hidden), lw["hnorm"], cfg.rms_norm_eps, num)
    tr["eh_proj"] = x0 = num.linear(torch.cat([e, h], dim=-1), lw["eh_proj"])

    x = rms_norm(x0, lw["input_layernorm"], cfg.rms_norm_eps, num)
    lat = attention.latents(cfg, lw, x, pos, num)
    tr["attn.q_c"], tr["attn.kv_c"], tr["attn.k_pe"] = lat["q_c"], lat["kv_c"], lat["k_pe"]
    # what the cache reads back: as computed (bf16 cache), or through fp8_ds_mla's FP8 latent
    stored_c, stored_pe = kv_cache.stored_kv(getattr(cache, "kv_cache_dtype", "auto"), lat["kv_c"], lat["k_pe"])
    cache.write(layer, req, pos, kv_c=stored_c, k_pe=stored_pe)
    span = int(pos.max()) + 1
    causal = torch.arange(span, device=dev)[None, :] <= pos[:, None]  # [T, span]: keys 0..p
    causal_rows = torch.where(causal, torch.arange(span, device=dev), -1)

    # ---- which keys each query attends ------------------------------------
    if cfg.attention_sparse and run_indexer:
        idx = indexer.project(cfg, lw, x, lat["q_c"], pos, num)
        tr["indexer.q_fp8"], tr["indexer.q_scale"] = idx["q_fp8"], idx["q_scale"]
        tr["indexer.k"], tr["indexer.weights"] = idx["k"], idx["weights"]
        deq_k = idx["k_fp8"] * idx["k_scale"].repeat_interleave(indexer.QUANT_GROUP, -1)
        cache.write(layer, req, pos, index_k=deq_k)
        score_rows = torch.full((t, span), float("-inf"), dtype=torch.float64, device=dev)
        for b in _row_blocks(t, span * (cfg.index_head_dim + cfg.index_n_heads)):
            keys = cache.read(layer, req[b], causal_rows[b], "index_k")  # [rows, span, D]
            s = indexer.scores(idx["q_fp8"][b], idx["weights"][b], keys)
            score_rows[b] = s.masked_fill(~causal[b], float("-inf"))
        rows = indexer.select_topk(score_rows, cfg.index_topk)
        tr["indexer.scores"], tr["indexer.topk"] = score_rows, rows
    elif cfg.attention_sparse:
        if topk_rows is None or topk_rows.shape != (t, cfg.index_topk):
            raise ValueError("index sharing needs topk_rows of shape [T, index_topk]")
        rows = topk_rows
    else:
        rows = None  # dense causal attention
    if rows is not None:
        tr["attn.topk"] = rows
    keys = causal_rows if rows is None else rows  # [T, S] key positions per query, -1 = none

    # ---- per-rank attention, summed (the o_proj all-reduce) ----------------
    q_parts, core_parts, gate_parts, out = [], [], [], None
    for sh in shards:
        c, w = sh.cfg, sh.weights
        q = attention.queries(c, w, lat["q_c"], pos, num)
        sink = w.get("attn.sink") if cfg.sink_applied else None  # none on dense layers (config.py)
        core = torch.empty((t, c.num_attention_heads * c.v_head_dim), dtype=num.act, device=dev)
        for b in _row_blocks(t, keys.shape[1] * (c.kv_lora_rank + c.qk_rope_head_dim)):
            kv_c = cache.read(layer, req[b], keys[b], "kv_c")  # [rows, S, Lkv], zeros at -1
            k_pe = cache.read(layer, req[b], keys[b], "k_pe")
            core[b] = attention.attend(c, w, q[b], kv_c, k_pe, sink, num, valid=keys[b] >= 0)
        gated = core
        if cfg.gated_mla:
            g = attention.gate(c, w, x, num)
            gate_parts.append(g)
            gated = attention.apply_gate(c, core, g, num)
        part = num.up(num.linear(gated, w["attn.o_proj"]))
        out = part if out is None else out + part
        q_parts.append(q)
        core_parts.append(core)
    tr["attn.q"] = torch.cat(q_parts, dim=1)
    tr["attn.core"] = torch.cat(core_parts, dim=1)
    if gate_parts:
        tr["attn.gate"] = torch.cat(gate_parts, dim=1)
    tr["attn.out"] = a = num.store(out)
    tr["attn.residual"] = r1 = num.store(num.up(a) + num.up(x0))

    # ---- MLP ---------------------------------------------------------------
    m_in = rms_norm(r1, lw["post_attention_layernorm"], cfg.rms_norm_eps, num)
    if cfg.mlp_moe:
        rt = moe.route(cfg, lw, m_in, num)
        tr["moe.router_logits"], tr["moe.topk_ids"], tr["moe.topk_weights"] = (
            rt["router_logits"], rt["topk_ids"], rt["topk_weights"])
        routed = sum(num.up(moe.routed(sh.cfg, sh.weights, m_in, rt["topk_ids"], rt["topk_weights"],
                                       num, sh.experts)) for sh in shards)
        tr["moe.routed"] = num.store(routed)
        if cfg.n_shared_experts > 0:
            shared = sum(num.up(moe.shared(sh.cfg, sh.weights, m_in, num)) for sh in shards)
            tr["moe.shared"] = num.store(shared)
            mlp_out = routed + shared
        else:
            mlp_out = routed
    else:
        mlp_out = sum(num.up(moe.dense(sh.cfg, sh.weights, m_in, num)) for sh in shards)
    tr["mlp.out"] = m = num.store(mlp_out)

    tr["final_norm"] = y = rms_norm(num.up(m) + num.up(r1), lw["final_layernorm"], cfg.rms_norm_eps, num)
    last = inp.last_rows() if logit_rows is None else logit_rows
    head_dtype = num.fp32 if cfg.lm_head_fp32 else num.act
    tr["logits"] = logits = num.linear(y[last], lw["lm_head"], out=head_dtype)
    tr["draft_token"] = torch.argmax(logits, dim=-1)
    return tr


@dataclasses.dataclass
class DraftResult:
    traces: list  # one OrderedDict per step
    tokens: torch.Tensor  # [R, K] greedy draft tokens
    inputs: list  # StepInput per step


def compact_topk(rows: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """``compact_topk_indices``: buffer[:n] = buffer[slot_ids] (a gather of rows)."""
    out = rows.clone()
    out[: slot_ids.numel()] = rows[slot_ids]
    return out


def draft(cfg: MTPConfig, weights: dict[str, torch.Tensor], first: StepInput, steps: int,
          num: Numerics = EXACT, *, tp: int = 1, moe_mode: str = "tp",
          cache: DraftCache | None = None, kv_cache_dtype: str = "auto") -> DraftResult:
    """Run ``steps`` draft steps as vLLM's MTP proposer does (see module doc).

    ``first``: step 0's batch (every request's new tokens, request-major).
    ``kv_cache_dtype``: how the draft's KV is stored (``reference.kv_cache``; ignored when a
    ``cache`` is given: it carries its own).
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    cache = cache or DraftCache(kv_cache_dtype)
    shards_by_layer = {
        j: shard_all(cfg, layer_weights(weights, j), tp, moe_mode) for j in range(cfg.num_mtp_layers)
    }
    traces, inputs, tokens = [], [], []
    inp = first
    shared_rows: torch.Tensor | None = None
    for k in range(steps):
        layer = k % cfg.num_mtp_layers  # spec_step_idx cycling
        share = cfg.attention_sparse and cfg.index_share_for_mtp_iteration and k >= 1
        tr = forward_step(cfg, shards_by_layer[layer], inp, cache, layer, num,
                          run_indexer=not share,
                          topk_rows=shared_rows[: inp.input_ids.numel()] if share else None)
        traces.append(tr)
        inputs.append(inp)
        tok = tr["draft_token"]
        tokens.append(tok)
        last = inp.last_rows()
        if k == 0 and cfg.attention_sparse and cfg.index_share_for_mtp_iteration:
            shared_rows = compact_topk(tr["indexer.topk"], last)
        inp = StepInput(
            input_ids=tok.clone(),
            positions=inp.positions[last] + 1,
            hidden=tr["final_norm"][last],
            request=inp.request[last],
        )
    return DraftResult(traces, torch.stack(tokens, dim=1), inputs)
