"""The reference replaying production's own per-step inputs (teacher forcing).

A free-running comparison diverges as soon as one draft token flips on a
near-tie; after that every later step compares different inputs. The proposer
feeds step k the tokens and hidden states production itself produced, so the
reference here takes those (``step{k}.input_ids / positions / hidden_in`` from
the production trace) and runs ``reference.forward_step`` on them, with its own
draft KV cache built from the same inputs.

Sparse steps run twice:
1. with the reference's own indexer: gives ``indexer.*`` (compared with
   production's indexer, ties allowed);
2. with production's top-k rows forced (``attn.topk`` from the trace): gives
   every component after the selection, conditioned on the same key set, so a
   near-tie in the top-k does not show up as an attention error.
With index sharing, steps >= 1 report the reference's own compacted rows as
``attn.topk`` (and the step-0 scores of those rows for tie checks).
"""

from __future__ import annotations

import torch

import reference as R
from reference.mtp import StepInput, compact_topk, forward_step, layer_weights
from reference.tp import shard_all


def step_with_topk(step, *, share: bool, prod_rows, shared_rows, t: int):
    """One sparse step as the replays run it: (trace, the own-indexer trace or None).

    ``step(**kw)`` runs ``forward_step`` on the step's inputs. Without index
    sharing the reference first runs its own indexer. Attention then reads
    production's top-k rows when given (``prod_rows``, negatives = none), else
    the reference's own rows, else (sharing) step 0's compacted rows
    ``shared_rows[:t]``.
    """
    own = None if share else step(run_indexer=True)
    if prod_rows is not None:
        forced = prod_rows.long().clone()
        forced[forced < 0] = -1
        return step(run_indexer=False, topk_rows=forced), own
    if own is not None:
        return own, own
    if shared_rows is None:
        raise ValueError("index sharing: a draft step >= 1 with neither production's top-k rows "
                         "nor a replayed step 0 to take them from")
    return step(run_indexer=False, topk_rows=shared_rows[:t]), own


def replay(cfg: R.MTPConfig, weights: dict, prod: dict, first: StepInput, steps: int,
           num: R.Numerics = R.EXACT, *, layer_policy: str = "proposer", device: str | None = None,
           kv_cache_dtype: str = "auto") -> dict:
    """{"step{k}.{component}": tensor} of the reference on production's inputs (on CPU).

    layer_policy: "proposer" (MTP layer 0 every step, as vLLM's proposers call
    the model without ``spec_step_idx``) or "cycle" (k mod num_mtp_layers, as
    ``reference.draft`` does). ``device``: where the reference computes (it follows
    its inputs; float64 on a GPU agrees with the CPU to float64 rounding, a GPU test
    checks it); the result is on the CPU either way. ``kv_cache_dtype``: how the draft's KV is
    stored (production's ``--kv-cache-dtype``; "fp8": the FP8 ``fp8_ds_mla`` rows, ``reference.kv_cache``).
    """
    if device is not None and device != "cpu":
        weights = {k: v.to(device) for k, v in weights.items()}
        prod = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in prod.items()}
        first = first.to(device)
        out = replay(cfg, weights, prod, first, steps, num, layer_policy=layer_policy, device=None,
                     kv_cache_dtype=kv_cache_dtype)
        return {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in out.items()}
    cache = R.DraftCache(kv_cache_dtype)
    shards = {j: shard_all(cfg, layer_weights(weights, j), 1, "tp") for j in range(cfg.num_mtp_layers)}
    out: dict = {}
    shared_rows = shared_scores = None
    num_req = int(first.request.max()) + 1
    for k in range(steps):
        request = first.request if k == 0 else torch.arange(num_req, device=first.request.device)
        inp = StepInput(prod[f"step{k}.input_ids"].long(), prod[f"step{k}.positions"].long(),
                        prod[f"step{k}.hidden_in"].to(torch.bfloat16).double(), request.long())
        layer = 0 if layer_policy == "proposer" else k % cfg.num_mtp_layers
        t = inp.input_ids.numel()
        share = cfg.attention_sparse and cfg.index_share_for_mtp_iteration and k >= 1
        prod_rows = prod.get(f"step{k}.attn.topk")
        if not cfg.attention_sparse:
            tr = forward_step(cfg, shards[layer], inp, cache, layer, num)
        else:
            tr, own = step_with_topk(lambda **k: forward_step(cfg, shards[layer], inp, cache, layer, num, **k),
                                     share=share, prod_rows=prod_rows, shared_rows=shared_rows, t=t)
            if own is not None:
                for name, v in own.items():
                    if name.startswith("indexer."):
                        tr[name] = v
                tr["attn.topk"] = own["indexer.topk"]
                if k == 0 and cfg.index_share_for_mtp_iteration:
                    last = inp.last_rows()
                    shared_rows = compact_topk(own["indexer.topk"], last)
                    shared_scores = compact_topk(own["indexer.scores"], last)
            else:
                tr["attn.topk"] = shared_rows[:t]
                tr["indexer.scores"] = shared_scores[:t]
        out[f"step{k}.input_ids"] = inp.input_ids
        out[f"step{k}.positions"] = inp.positions
        out[f"step{k}.hidden_in"] = inp.hidden
        for name, v in tr.items():
            out[f"step{k}.{name}"] = v
    return out
