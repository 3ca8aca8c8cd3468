"""The reference replaying the draft forwards recorded in a ``vllm.LLM`` run (CPU, no vLLM import).

``harness.production.engine`` records every forward the engine's MTP proposer
makes through ``HYV4MTP`` (one ``DraftCall`` each, in order). This module turns
those records into the reference's draft tokens and a verdict:

Requests. Rows of a call belong to requests by the attention metadata's
``query_start_loc`` (request-major, as vLLM lays out a batch). A request is
identified across calls by the first block of its block table, which stays the
request's for its life; a draft step 0 that holds a request's position 0 starts
a new request (its blocks may be recycled ones).

Step 0 (vLLM 0.33.0 V2 runner, ``TargetDependentARSpeculator.propose``). The draft
prefill reuses the target's batch shape, attention metadata and slot mappings: each
request has all its scheduled rows (1 + K for a decode), *including the rejected
draft slots*. ``prepare_prefill_inputs`` (target_dependent_ar/speculator.py,
``_prepare_prefill_inputs_kernel``) sets ``query_len -= num_rejected`` and writes
input ids / positions only for the first ``query_len`` rows; the rejected rows keep
whatever the draft input buffers held (stale ids and positions: seen on the GPU as positions
like 3 next to 200) and ``last_token_indices[r] = query_start +
query_len - 1`` is the row sampled (the last *accepted* row, not the last row).
Rejected rows still run and write KV at the target's slots (positions after the
sampled one), with garbage content. The replay therefore takes step 0's valid rows
(``<= last_token_indices[r]``, recorded by the tap) and marks the rejected slots
unwritten, so that any later read of them is reported (UnwrittenKVError) rather
than silently compared; production overwrites them before reading (steps k >= 1
write sample position + k, the next step 0 rewrites every scheduled slot).

KV context. One ``reference.DraftCache`` for the whole run, written call by call
at the recorded positions, exactly as production's slot mapping writes the draft
KV cache: step 0 writes its valid rows, steps k >= 1 write one position per request,
and a later call overwrites what a rejected draft left behind. A query at position p
reads keys 0..p only, so it never sees a stale entry beyond itself.

Top-k. With sparse attention the reference runs its own indexer wherever
production does (step 0; every step without ``index_share_for_mtp_iteration``),
then, like ``replay.py``, re-runs the step with production's top-k rows forced
(when recorded) so a near-tie in the indexer does not show up as a draft-token
difference. With index sharing, steps >= 1 reuse step 0's rows compacted to the
sampled rows (``compact_topk_indices``).

Verdict. Draft tokens are compared at the rows production passed to
``compute_logits``; exact equality is required where the reference's top-2 logit
margin is decisive (``harness.trace_compare.logit_margin_decisive``), other rows are
counted as ties.
"""

from __future__ import annotations

import dataclasses

import torch

import reference as R
from harness.trace_compare import index_rows_differing
from harness.components import DIAGNOSTIC_COMPONENTS  # float components compared per call (diagnostics)
from harness.production.judging.teacher_forcing import step_with_topk
from reference.mtp import StepInput, compact_topk, forward_step, layer_weights
from reference.tp import shard_all


@dataclasses.dataclass
class DraftCall:
    """One forward of the drafter inside one ``propose`` (all tensors on CPU)."""

    engine_step: int  # index of the propose() call (one per engine step), -1: outside propose
    draft_step: int  # 0: the ragged first pass over every scheduled token; k >= 1: one token per request
    input_ids: torch.Tensor  # [T] long (T = num_actual_tokens, padding dropped)
    positions: torch.Tensor  # [T] long
    hidden: torch.Tensor | None  # [T, H] hidden states fed to the drafter (bf16 as fed); None: a draft step
    # >= 1 inside a CUDA graph, fed the reference's own previous step (``replay`` chains it)
    query_start_loc: torch.Tensor  # [R + 1] long
    request_keys: torch.Tensor  # [R] long, block_table[:, 0] of each request
    seq_lens: torch.Tensor | None = None  # [R] from the attention metadata
    spec_step_idx: int = 0
    sample_rows: torch.Tensor | None = None  # [S] rows passed to compute_logits (None: not called)
    tokens: torch.Tensor | None = None  # [S] production's argmax of those logits
    logits: torch.Tensor | None = None  # [S, V] production logits (float32)
    topk_rows: torch.Tensor | None = None  # [T, index_topk] rows the sparse attention read
    last_token_indices: torch.Tensor | None = None  # [R] step 0: the proposer's sampled row per request
    sample_hidden: torch.Tensor | None = None  # [S, H] the hidden rows passed to compute_logits
    layer_ran: int | None = None  # index of the MTP layer whose forward ran (hooks on every layer)
    trace: dict = dataclasses.field(default_factory=dict)  # production components (capture.py names)
    notes: dict = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclasses.dataclass
class CallReplay:
    tokens: torch.Tensor | None  # [S] reference greedy tokens at the sample rows
    logits: torch.Tensor | None  # [S, V] reference logits there
    trace: dict  # the reference trace of the step (forced top-k when available)
    topk_rows_differing: int = 0  # rows whose reference top-k set differs from production's
    topk_beyond_ties: str | None = None  # the first row that differs beyond score ties (a verdict)
    error: str | None = None
    rows: torch.Tensor | None = None  # rows of the call the reference ran (None: all; step 0: valid rows)


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] batch-local request index of each row from ``query_start_loc`` [R + 1]."""
    qsl = query_start_loc.long().flatten()
    if qsl.numel() < 2 or int(qsl[0]) != 0 or bool((qsl[1:] < qsl[:-1]).any()):
        raise ValueError(f"query_start_loc must start at 0 and not decrease: {qsl.tolist()[:16]}")
    if int(qsl[-1]) != num_tokens:
        raise ValueError(f"query_start_loc ends at {int(qsl[-1])}, the call has {num_tokens} tokens")
    return torch.repeat_interleave(torch.arange(qsl.numel() - 1), qsl[1:] - qsl[:-1])


class RequestRegistry:
    """Stable reference request ids across calls, keyed by each request's first KV block."""

    def __init__(self) -> None:
        self._by_key: dict[int, int] = {}
        self.count = 0

    def peek(self, call: DraftCall) -> torch.Tensor:
        """[T] the reference request id each row of a draft step >= 1 continues (no new requests)."""
        local = token_requests(call.query_start_loc, call.num_tokens)
        keys = call.request_keys.long().tolist()
        gone = [k for k in keys if k not in self._by_key]
        if gone:
            raise ValueError(f"draft step {call.draft_step}: request key(s) {gone[:4]} never seen at a step 0")
        return torch.tensor([self._by_key[k] for k in keys], dtype=torch.long)[local]

    def assign(self, call: DraftCall) -> torch.Tensor:
        """[T] reference request id of each row of ``call``."""
        local = token_requests(call.query_start_loc, call.num_tokens)
        keys = call.request_keys.long().tolist()
        if len(keys) != call.query_start_loc.numel() - 1:
            raise ValueError(f"{len(keys)} request keys for {call.query_start_loc.numel() - 1} requests")
        ids = []
        for r, key in enumerate(keys):
            starts = call.draft_step == 0 and bool((call.positions[local == r] == 0).any())
            if key not in self._by_key or starts:
                self._by_key[key] = self.count
                self.count += 1
            ids.append(self._by_key[key])
        return torch.tensor(ids, dtype=torch.long)[local]


def step0_rows(call: DraftCall, every_step: bool = False) -> tuple[torch.Tensor, dict[int, list[int]]]:
    """(valid rows [T'], {batch-local request: rejected target positions}) of ``call``.

    Step 0: rows up to each request's ``last_token_indices`` (the proposer's; when not
    recorded, the sampled rows if there is one per request); the rejected rows after
    it sit at the target's positions ``pos[last] + 1, ...`` (contiguous slots; their
    recorded ``positions`` are stale). Steps >= 1 and unknown boundaries: every row.
    """
    t = call.num_tokens
    everything = torch.arange(t), {}
    if call.draft_step != 0 and not every_step:  # multi-module: every step runs step 0's rows
        return everything
    qsl = call.query_start_loc.long().tolist()
    nreq = len(qsl) - 1
    last = call.last_token_indices
    if last is None and call.sample_rows is not None and call.sample_rows.numel() == nreq:
        last = call.sample_rows
    if last is None or last.numel() < nreq:
        return everything
    last = last.long().tolist()[:nreq]
    keep, rejected = [], {}
    for r in range(nreq):
        lo, hi = qsl[r], qsl[r + 1]
        if hi == lo:
            continue
        if not lo <= last[r] < hi:
            raise ValueError(f"request {r}: last_token_index {last[r]} outside its rows [{lo}, {hi})")
        keep += range(lo, last[r] + 1)
        if last[r] + 1 < hi:
            p = int(call.positions[last[r]])
            rejected[r] = list(range(p + 1, p + hi - last[r]))
    return torch.tensor(keep, dtype=torch.long), rejected


def _sub_call(call: DraftCall, keep: torch.Tensor) -> DraftCall:
    """``call`` restricted to rows ``keep`` (request-major, each request's rows a prefix)."""
    local = token_requests(call.query_start_loc, call.num_tokens)[keep]
    counts = torch.bincount(local, minlength=call.query_start_loc.numel() - 1)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return dataclasses.replace(
        call, input_ids=call.input_ids[keep], positions=call.positions[keep], hidden=call.hidden[keep],
        query_start_loc=qsl, sample_rows=None, tokens=None, logits=None,
        topk_rows=None if call.topk_rows is None or call.topk_rows.shape[0] != call.num_tokens
        else call.topk_rows[keep], trace={}, notes={})


def replay(cfg: R.MTPConfig, weights: dict, calls: list[DraftCall], num: R.Numerics = R.EXACT, *,
           force_production_topk: bool = True, multi_module: bool = False,
           kv_cache_dtype: str = "auto") -> list[CallReplay]:
    """The reference over ``calls`` in order (see the module doc); one ``CallReplay`` per call.

    The MTP layer of draft step k is the one vLLM's speculator should run, not the
    one production ran (``bookkeeping`` flags a difference): layer 0 for the
    single-module ``MTPSpeculator``, k mod n for ``MultiModuleMTPSpeculator``, whose
    every step runs the rows up to ``last_token_indices`` (``multi_module``).
    A call that cannot be replayed (bad metadata, unwritten KV) gets ``error``
    set and the replay goes on with the next call. ``kv_cache_dtype``: the engine's
    ``--kv-cache-dtype`` (the draft KV's storage, ``reference.kv_cache``).
    """
    cache = R.DraftCache(kv_cache_dtype)
    registry = RequestRegistry()
    shards = {j: shard_all(cfg, layer_weights(weights, j), 1, "tp") for j in range(cfg.num_mtp_layers)}
    shared_rows = None
    chain: dict[int, torch.Tensor] = {}  # reference request -> its last sampled row's output hidden state
    out: list[CallReplay] = []
    for call in calls:
        try:
            res, compacted = _replay_call(cfg, shards, call, cache, registry, num, force_production_topk,
                                          shared_rows, multi_module, chain)
        except (ValueError, R.UnwrittenKVError) as exc:
            res, compacted = CallReplay(None, None, {}, error=f"{exc.__class__.__name__}: {exc}"), None
        if call.draft_step == 0:
            shared_rows = compacted
        out.append(res)
    return out


def _replay_call(cfg, shards, full: DraftCall, cache, registry, num, force, shared_rows, multi_module=False,
                 chain: dict | None = None):
    """(CallReplay, step 0's (top-k rows, scores) compacted to the sampled rows, or None).

    A call recorded without its hidden states (``hidden=None``: a draft step inside a CUDA graph,
    ``graph_tap``) is fed each request's output hidden state of the reference's previous call
    (``chain``: ``final_norm`` at the request's sampled row, rounded to bf16 as production keeps it)."""
    chain = {} if chain is None else chain
    if full.hidden is None:
        if full.draft_step == 0:
            raise ValueError("a draft step 0 without its hidden states (only steps >= 1 are chained)")
        req = registry.peek(full)
        missing = [int(r) for r in req if int(r) not in chain]
        if missing:
            raise ValueError(f"draft step {full.draft_step} without hidden states and no previous reference "
                             f"step of request(s) {sorted(set(missing))[:4]} to chain from")
        full = dataclasses.replace(full, hidden=torch.stack([chain[int(r)] for r in req]))
    keep, rejected = step0_rows(full, every_step=multi_module)
    call = full if keep.numel() == full.num_tokens else _sub_call(full, keep)
    t = call.num_tokens
    request = registry.assign(call)
    layer = call.draft_step % cfg.num_mtp_layers if multi_module else 0
    rows = None
    if full.sample_rows is not None:
        new_index = torch.full((full.num_tokens,), -1, dtype=torch.long)
        new_index[keep] = torch.arange(keep.numel())
        s = full.sample_rows.long()
        if bool(((s >= 0) & (s < full.num_tokens)).all()):
            rows = new_index[s]
            if bool((rows < 0).any()):
                raise ValueError(f"a sampled row is a rejected row: sample_rows {s.tolist()}, "
                                 "last_token_indices "
                                 f"{None if full.last_token_indices is None else full.last_token_indices.tolist()}")
    res, compacted = _replay_rows(cfg, shards, call, cache, request, layer, num, force, shared_rows, rows)
    res.rows = None if call is full else keep
    if rows is not None and "final_norm" in res.trace:
        for row in rows.tolist():
            chain[int(request[row])] = res.trace["final_norm"][row].to(torch.bfloat16)
    if rejected:  # production wrote garbage there: never to be read before rewritten
        req_ids = token_requests(call.query_start_loc, t)
        for r, positions in rejected.items():
            mine = request[req_ids == r]
            if mine.numel():
                cache.invalidate(layer, int(mine[0]), positions)
    return res, compacted


def _replay_rows(cfg, shards, call, cache, request, layer, num, force, shared_rows, rows):
    t = call.num_tokens
    inp = StepInput(call.input_ids.long(), call.positions.long(),
                    call.hidden.to(torch.bfloat16).to(torch.float64), request)
    kw = {"logit_rows": rows} if rows is not None else {}
    step = lambda **k: forward_step(cfg, shards[layer], inp, cache, layer, num, **kw, **k)  # noqa: E731
    if not cfg.attention_sparse:
        return _result(step(), rows), None
    share = cfg.index_share_for_mtp_iteration and call.draft_step >= 1
    prod = call.topk_rows
    if prod is not None and tuple(prod.shape) != (t, cfg.index_topk):
        prod = None
    shared, shared_scores = shared_rows if shared_rows is not None else (None, None)
    tr, own = step_with_topk(step, share=share, prod_rows=prod if force else None, shared_rows=shared, t=t)
    if own is not None:
        ref_rows, ref_scores = own["indexer.topk"], own["indexer.scores"]
    else:
        ref_rows = None if shared is None else shared[:t]
        ref_scores = None if shared_scores is None else shared_scores[:t]
    res = _result(tr, rows)
    if prod is not None and ref_rows is not None:
        res.topk_rows_differing = len(index_rows_differing(prod, ref_rows))
        if res.topk_rows_differing:
            res.topk_beyond_ties = topk_beyond_ties(prod, ref_rows, ref_scores)
    compacted = None
    if own is not None and cfg.index_share_for_mtp_iteration and call.draft_step == 0 and rows is not None:
        compacted = (compact_topk(own["indexer.topk"], rows), compact_topk(own["indexer.scores"], rows))
    return res, compacted


def topk_beyond_ties(prod: torch.Tensor, ref_rows: torch.Tensor, ref_scores: torch.Tensor | None) -> str | None:
    """The first row where production's top-k set differs from the reference's beyond score
    ties (members within the indexer-score tie bound of the k-th score), else None."""
    from harness.trace_compare import compare_index_sets
    from harness.production.judging.tolerances import tolerances_for

    scores = None
    if ref_scores is not None:
        s = ref_scores.double()
        fin = torch.where(torch.isfinite(s), s.abs(), torch.zeros_like(s))
        scores = s / fin.amax(dim=-1, keepdim=True).clamp_min(1e-30)  # tie bound relative to the row
    tie = tolerances_for("bf16")["indexer.scores"].atol
    prod = prod.long().clone()
    prod[prod < 0] = -1
    res = compare_index_sets("attn.topk", prod, ref_rows.long(), scores, tie)
    return None if res.passed else res.note


def _result(tr: dict, rows) -> CallReplay:
    if rows is None:
        return CallReplay(None, None, dict(tr))
    return CallReplay(tr["draft_token"].clone(), tr["logits"].clone(), dict(tr))


# ---- verdicts ----------------------------------------------------------------------------------

def judge_tokens(calls: list[DraftCall], replays: list[CallReplay], logits_tol) -> dict:
    """Counts of the draft-token comparison (see the module doc) plus the first mismatches."""
    from harness.trace_compare import logit_margin_decisive

    c = {"drafted": 0, "compared": 0, "ties": 0, "ties_differing": 0, "mismatches": 0,
         "not_replayed": 0, "mismatch_examples": []}
    for i, (call, rep) in enumerate(zip(calls, replays)):
        if call.tokens is None:
            continue
        c["drafted"] += int(call.tokens.numel())
        if rep.tokens is None:
            c["not_replayed"] += int(call.tokens.numel())
            continue
        for s, (a, e) in enumerate(zip(call.tokens.long().tolist(), rep.tokens.long().tolist())):
            if not logit_margin_decisive(rep.logits[s], logits_tol):
                c["ties"] += 1
                c["ties_differing"] += int(a != e)
                continue
            c["compared"] += 1
            if a != e:
                c["mismatches"] += 1
                if len(c["mismatch_examples"]) < 10:
                    top2 = torch.topk(rep.logits[s].double(), 2)
                    c["mismatch_examples"].append({
                        "call": i, "engine_step": call.engine_step, "draft_step": call.draft_step,
                        "sample_row": int(call.sample_rows[s]), "position": int(call.positions[call.sample_rows[s]]),
                        "production": a, "reference": e,
                        "reference_top2": [[int(x) for x in top2.indices], [float(x) for x in top2.values]],
                        "production_logit_of_reference_token": (float(call.logits[s, e])
                                                                if call.logits is not None else None)})
    return c


def component_errors(calls: list[DraftCall], replays: list[CallReplay], tolerances: dict) -> dict:
    """Per component: max |production - reference| over all calls (and where), and how many
    calls exceed ``tolerances[component]`` (diagnostics: MoE routing ties are not masked here)."""
    from harness.trace_compare import compare_values

    out: dict = {}
    for i, (call, rep) in enumerate(zip(calls, replays)):
        for comp in DIAGNOSTIC_COMPONENTS:
            a, e = call.trace.get(comp), rep.trace.get(comp)
            if a is None or e is None:
                continue
            if rep.rows is not None and a.dim() and a.shape[0] == call.num_tokens:
                a = a[rep.rows]  # step 0: the valid rows the reference ran
            if a.shape[0] < e.shape[0]:
                continue
            a = a[: e.shape[0]]
            if a.shape != e.shape:
                continue
            d = out.setdefault(comp, {"max_abs": 0.0, "call": None, "calls_out_of_tol": 0, "first_out_of_tol": None})
            diff = float((a.double() - e.double()).abs().max()) if a.numel() else 0.0
            if diff >= d["max_abs"]:
                d["max_abs"], d["call"] = diff, i
            tol = tolerances.get(comp)
            if tol is not None and not compare_values(comp, a, e, tol).passed:
                d["calls_out_of_tol"] += 1
                if d["first_out_of_tol"] is None:
                    d["first_out_of_tol"] = {"call": i, "engine_step": call.engine_step,
                                             "draft_step": call.draft_step, "max_abs": diff}
        if call.logits is not None and rep.logits is not None and call.logits.shape == rep.logits.shape:
            d = out.setdefault("logits", {"max_abs": 0.0, "call": None})
            diff = float((call.logits.double() - rep.logits.double()).abs().max())
            if diff >= d["max_abs"]:
                d["max_abs"], d["call"] = diff, i
    return out


def run_facts(calls: list[DraftCall], proposals: list[dict] | None = None, multi_module: bool = False) -> dict:
    """What the engine did: draft steps per engine step, longest context, drafts accepted per
    request and engine step (step 0's sampled row - its first row, decode requests only),
    rejected rows, sampled rows that are not the proposer's ``last_token_indices``, attention
    metadata ``seq_lens`` that disagree with the positions (step 0: the target's, so
    ``seq_lens - query_len`` = the first row's position; steps >= 1: ``seq_lens = position + 1``),
    and whether each propose() returned the argmax tokens its compute_logits calls produced."""
    steps: dict[int, int] = {}
    max_context = 0
    sampled_not_proposer = seq_len_disagree = rejected_rows = 0
    seen: set[int] = set()
    accepted: list[int] = []
    for call in calls:
        if call.engine_step < 0:
            continue
        steps[call.engine_step] = max(steps.get(call.engine_step, 0), call.draft_step + 1)
        try:
            token_requests(call.query_start_loc, call.num_tokens)  # a layout it cannot read: the call is skipped
            keep, rejected = step0_rows(call)
        except ValueError:
            continue
        if keep.numel():
            max_context = max(max_context, int(call.positions[keep].max()) + 1)
        rejected_rows += sum(len(v) for v in rejected.values())
        qsl = call.query_start_loc.long().tolist()
        nreq = len(qsl) - 1
        if call.draft_step == 0:
            lti = call.last_token_indices
            if call.sample_rows is not None and lti is not None and lti.numel() >= call.sample_rows.numel():
                sampled_not_proposer += int((call.sample_rows.long() != lti[: call.sample_rows.numel()].long()).sum())
            if lti is None and call.sample_rows is not None and call.sample_rows.numel() == nreq:
                lti = call.sample_rows  # as step0_rows does
            for r, key in enumerate(call.request_keys.tolist()[:nreq]):
                if qsl[r + 1] == qsl[r]:
                    continue
                if lti is not None and lti.numel() > r and int(key) in seen and int(call.positions[qsl[r]]) > 0:
                    accepted.append(int(lti[r]) - qsl[r])
                seen.add(int(key))
        # (the multi-module proposer re-prefills rejected drafts and runs every step over the
        # whole window: its seq_lens follow other rules, covered by the bookkeeping checks)
        if call.seq_lens is not None and call.seq_lens.numel() >= nreq and not multi_module:
            for r in range(nreq):
                if qsl[r + 1] == qsl[r]:
                    continue
                if call.draft_step == 0:
                    seq_len_disagree += int(int(call.seq_lens[r]) - (qsl[r + 1] - qsl[r])
                                            != int(call.positions[qsl[r]]))
                else:
                    seq_len_disagree += int(int(call.seq_lens[r]) != int(call.positions[qsl[r + 1] - 1]) + 1)
    hist: dict[int, int] = {}
    for n in steps.values():
        hist[n] = hist.get(n, 0) + 1
    facts = {"engine_steps": len(steps), "draft_steps_per_engine_step": hist,
             "max_draft_steps": max(steps.values(), default=0), "max_context": max_context,
             "outside_propose_calls": sum(c.engine_step < 0 for c in calls),
             "step0_rejected_rows": rejected_rows,
             "sampled_row_not_last_token_index": sampled_not_proposer,
             "seq_len_disagreements": seq_len_disagree,
             "accepted_drafts_per_step": {str(k): accepted.count(k) for k in sorted(set(accepted))}}
    if proposals is not None:
        facts["proposal_token_disagreements"] = _proposal_disagreements(calls, proposals)
    return facts


def expects_logits(call: DraftCall, proposals: list[dict] | None) -> bool:
    """False for a call of a propose(num_speculative_tokens=0) (the prefill only keeps the
    draft KV in sync: ``skip_sample``), True otherwise."""
    for p in proposals or ():
        if p.get("engine_step") == call.engine_step and p.get("num_speculative_tokens") is not None:
            return int(p["num_speculative_tokens"]) > call.draft_step
    return True


def _proposal_disagreements(calls: list[DraftCall], proposals: list[dict]) -> int:
    """Rows where propose()'s returned draft token k differs from draft step k's argmax
    (columns of steps that did not run, e.g. a shortened speculation, are skipped)."""
    by_step = {(c.engine_step, c.draft_step): c for c in calls}
    bad = 0
    for p in proposals:
        drafts = p.get("draft_tokens")
        if drafts is None or drafts.dim() != 2:
            continue
        ncols = drafts.shape[1]
        if p.get("num_speculative_tokens") is not None:
            ncols = min(ncols, int(p["num_speculative_tokens"]))  # 0: draft_tokens filled with -1
        for k in range(ncols):
            call = by_step.get((p["engine_step"], k))
            if call is None:
                continue
            if call.tokens is None or call.tokens.numel() != drafts.shape[0]:
                bad += drafts.shape[0]
                continue
            bad += int((call.tokens.long() != drafts[:, k].long()).sum())
    return bad
