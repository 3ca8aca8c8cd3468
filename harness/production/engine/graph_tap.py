"""The drafter as vLLM serves it, under CUDA graphs: what survives graph replay.

Python forward hooks fire while a CUDA graph is captured, not when it is replayed, so in a
graph-mode engine the per-forward taps of ``run.DrafterTap`` see capture only. What runs in
Python at every step is the speculator's own code around its graphs (vLLM's V2
``TargetDependentARSpeculator.propose``, the same seams in every supported release):

    propose(input_batch, ..., last_hidden_states, num_sampled, num_rejected, last_sampled, ...)
      prepare_prefill_inputs            ids / positions / last_token_indices written
      on_prefill_begin(num_reqs)        <- step 0's inputs: input_buffers.input_ids / positions [:T],
                                           hidden_states [:T], last_token_indices [:R]
      draft prefill                     prefill manager: run_fullgraph (FULL) | run_pw_graph | eager
      on_prefill_end(num_reqs)          <- step 0's top-k rows (the attention's top-k buffer [:T],
                                           before the hook compacts it)
      decode inputs prepared
      on_multi_step_decode_begin(R)     <- step 1's inputs: ids / positions / hidden_states [:R]
                                           (the hidden state the drafter keeps from step 0)
      draft decode                      decode manager: run_fullgraph (steps 1..K-1, one graph when
                                        fused) | eager steps
    return draft_tokens[:R]             <- the draft tokens; the top-k buffer [:R] after the last step

``GraphTap`` records those per engine step (``GraphStep``). ``graph_calls`` turns them into
the ``DraftCall`` list the engine replay judges: step 0 and step 1 from the recorded inputs,
steps k >= 2 fed draft token k - 1 and the reference's own hidden state of step k - 1
(``hidden=None``: ``replay`` chains it, rounded to bf16 as production's buffer holds it).
``target_calls`` gives the bookkeeping its target side from the same ``propose`` arguments
(the target's ids, positions and hidden states; its verdict as vLLM's rejection sampler
reported it: ``num_sampled`` tokens per request, ``last_sampled`` the last of them).

Production's per-step logits and per-component values are not visible under replay: draft
tokens and top-k rows are judged. On a mismatch the engine re-runs the same generation with
the drafter forced eager (``drafter_forced_eager``: vLLM's own ``need_eager`` switch of the
speculator's graph dispatch, the target still in graphs) under the full per-component taps;
that run says whether graph replay differs from eager (a capture bug) or both differ from the
reference (a numeric bug), and names the first divergent component.

May import: ``harness.production.engine.draft_replay`` / ``bookkeeping``, ``harness.production.vllm_compat``
(and vLLM lazily).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch

from harness.production.engine.bookkeeping import TargetCall
from harness.production.engine.draft_replay import DraftCall
from harness.production.engine.tap_guard import Guarded


@dataclasses.dataclass
class GraphStep:
    """One ``propose`` of a graph-mode engine (tensors on CPU)."""

    engine_step: int
    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [R + 1]
    request_keys: torch.Tensor  # [R] idx_mapping: the request's state row, stable for its life
    seq_lens: torch.Tensor | None  # [R] the target's
    target_ids: torch.Tensor | None = None  # [T] the target's input ids
    target_positions: torch.Tensor | None = None  # [T]
    target_hidden: torch.Tensor | None = None  # [T, H] last_hidden_states as handed to propose
    num_sampled: torch.Tensor | None = None  # [R] tokens the rejection sampler kept per request
    last_sampled: torch.Tensor | None = None  # [R] the last of them
    ids0: torch.Tensor | None = None  # step 0's inputs at on_prefill_begin
    positions0: torch.Tensor | None = None
    hidden0: torch.Tensor | None = None
    last_token_indices: torch.Tensor | None = None  # [R]
    topk0: torch.Tensor | None = None  # [T, index_topk] step 0's top-k rows
    ids1: torch.Tensor | None = None  # step 1's inputs at on_multi_step_decode_begin
    positions1: torch.Tensor | None = None
    hidden1: torch.Tensor | None = None
    draft_tokens: torch.Tensor | None = None  # [R, K]
    topk_after: torch.Tensor | None = None  # [R, index_topk] the top-k buffer after propose
    num_speculative_tokens: int | None = None
    modes: dict = dataclasses.field(default_factory=dict)  # prefill / decode: FULL, PIECEWISE or NONE
    # what vLLM did on this propose beyond the modes (``graph_regimes``): metadata_rebuild_steps
    # (the draft steps whose attention metadata the host rebuilt), metadata_updates (in-place
    # updates called from Python), decode_eager_steps, decode_graph_tokens / prefill_graph_tokens
    # (the rows the FULL graph ran: above num_reqs / num_tokens when padded)
    facts: dict = dataclasses.field(default_factory=dict)


def _cpu(t, n=None):
    if not torch.is_tensor(t):
        return None
    t = t if n is None else t[:n]
    return t.detach().cpu().clone()


def _arg(args, kwargs, name, index):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def topk_buffer(draft):
    """The top-k buffer the sparse attention of the draft's first MTP layer reads (None: dense)."""
    layer = next(iter(draft.model.layers.values()))
    sa = layer.mtp_block.self_attn
    if not getattr(sa, "is_sparse", False):
        return None
    return getattr(getattr(sa.mla_attn, "impl", None), "topk_indices_buffer", None)


class GraphTap(Guarded):
    """Instance wrappers on the proposer (and its CUDA-graph managers) that record one
    ``GraphStep`` per ``propose``; nothing in vLLM changes. ``remove()`` restores them."""

    def __init__(self, proposer, draft) -> None:
        super().__init__()
        self.proposer, self.draft = proposer, draft
        self.steps: list[GraphStep] = []
        self.armed = False
        self.cur: GraphStep | None = None
        self.buffer = topk_buffer(draft)
        self._wrapped: list[tuple[object, str]] = []  # (object, attribute) wrapped, in order
        self._wrap(proposer, "propose", self._propose)
        for hook, fn in (("on_prefill_begin", self._prefill_begin), ("on_prefill_end", self._prefill_end),
                         ("on_multi_step_decode_begin", self._decode_begin)):
            self._wrap(proposer, hook, self._before_hook(hook, fn))
        for attr, phase in (("prefill_cudagraph_manager", "prefill"), ("decode_cudagraph_manager", "decode")):
            mgr = getattr(proposer, attr, None)
            if mgr is None:
                continue
            for meth, mode in (("run_fullgraph", "FULL"), ("run_pw_graph", "PIECEWISE")):
                if hasattr(mgr, meth):
                    self._wrap(mgr, meth, self._mode_marker(phase, mode))
        # the draft-decode seams the graph regimes are read from (``graph_regimes``); each is
        # wrapped where the installed release has it: the host's per-step metadata rebuild, the
        # in-place update, the eager decode step (``_generate_draft`` / ``_decode`` by release)
        for meth, fn in (("_build_uniform_attn_metadata", self._metadata_rebuilt),
                         ("_update_draft_decode_metadata", self._metadata_updated),
                         ("_generate_draft", self._eager_decode_step), ("_decode", self._eager_decode_step)):
            if callable(getattr(proposer, meth, None)):
                self._wrap(proposer, meth, self._fact_recorder(meth, fn))
        prefill_mgr = getattr(proposer, "prefill_cudagraph_manager", None)
        self.facts = {
            "proposer": type(proposer).__name__,
            "supports_decode_metadata_update": getattr(proposer, "supports_decode_metadata_update", None),
            "index_sharing": getattr(proposer, "share_mtp_topk_indices", None),
            "prefill_breakable": getattr(prefill_mgr, "use_breakable_cg", None),
            "seams": sorted({m for _, m in self._wrapped}),
        }

    # ---- plumbing
    def _wrap(self, obj, attr: str, make) -> None:
        """``obj.attr`` (an instance attribute shadowing the class's) = ``make(the original)``."""
        self._wrapped.append((obj, attr))
        setattr(obj, attr, make(getattr(obj, attr)))

    def remove(self) -> None:
        for obj, attr in reversed(self._wrapped):
            if attr in vars(obj):
                delattr(obj, attr)
        self._wrapped.clear()

    def _before_hook(self, hook: str, record):
        def make(orig):
            def wrapper(num_reqs, *a, **k):
                if self.armed and self.cur is not None:
                    self._guard(hook, lambda: record(int(num_reqs)))
                return orig(num_reqs, *a, **k)
            return wrapper
        return make

    def _mode_marker(self, phase: str, mode: str):
        def make(orig):
            def wrapper(*a, **k):
                if self.armed and self.cur is not None:
                    modes = self.cur.modes
                    modes[phase] = mode if modes.get(phase) in (None, mode) else f"{modes[phase]}+{mode}"
                    modes[f"{phase}_replays"] = modes.get(f"{phase}_replays", 0) + 1
                    desc = a[0] if a else k.get("desc", k.get("batch_desc"))
                    rows = getattr(desc, "num_tokens", None)
                    if mode == "FULL" and isinstance(rows, int):
                        key = f"{phase}_graph_tokens"
                        self.cur.facts[key] = max(self.cur.facts.get(key, 0), rows)
                return orig(*a, **k)
            return wrapper
        return make

    def _fact_recorder(self, name: str, record):
        def make(orig):
            def wrapper(*a, **k):
                if self.armed and self.cur is not None:
                    self._guard(name, lambda: record(a, k))
                return orig(*a, **k)
            return wrapper
        return make

    def _metadata_rebuilt(self, a, k) -> None:
        step = k.get("step")
        self.cur.facts.setdefault("metadata_rebuild_steps", []).append(None if step is None else int(step))

    def _metadata_updated(self, a, k) -> None:
        self.cur.facts["metadata_updates"] = self.cur.facts.get("metadata_updates", 0) + 1

    def _eager_decode_step(self, a, k) -> None:
        self.cur.facts["decode_eager_steps"] = self.cur.facts.get("decode_eager_steps", 0) + 1

    # ---- propose: one engine step
    def _propose(self, orig):
        def propose(*args, **kwargs):
            if not self.armed or kwargs.get("dummy_run"):
                return orig(*args, **kwargs)
            self.cur = None
            self._guard("propose inputs", lambda: self._begin(args, kwargs))
            try:
                out = orig(*args, **kwargs)
            finally:
                step, self.cur = self.cur, None
            if step is not None:
                self._guard("propose outputs", lambda: self._end(step, out))
            return out
        return propose

    def _begin(self, args, kwargs) -> None:
        ib = _arg(args, kwargs, "input_batch", 0)
        r, t = int(ib.num_reqs), int(ib.num_tokens)
        nspec = kwargs.get("num_speculative_tokens")
        if nspec is None:
            nspec = getattr(self.proposer, "num_speculative_steps", None)
        sampled = _arg(args, kwargs, "num_sampled", 5)
        last = _arg(args, kwargs, "last_sampled", 7)
        idx = ib.idx_mapping[:r].long()
        self.cur = GraphStep(
            engine_step=len(self.steps), num_reqs=r, num_tokens=t,
            query_start_loc=_cpu(ib.query_start_loc, r + 1).long(), request_keys=_cpu(idx).long(),
            seq_lens=_cpu(getattr(ib, "seq_lens", None), r),
            target_ids=_cpu(getattr(ib, "input_ids", None), t),
            target_positions=_cpu(getattr(ib, "positions", None), t),
            target_hidden=_cpu(_arg(args, kwargs, "last_hidden_states", 3), t),
            num_sampled=_cpu(sampled, r), last_sampled=_cpu(last[idx] if torch.is_tensor(last) else None),
            num_speculative_tokens=None if nspec is None else int(nspec))

    def _prefill_begin(self, num_reqs: int) -> None:
        s, p, t = self.cur, self.proposer, self.cur.num_tokens
        s.ids0, s.positions0 = _cpu(p.input_buffers.input_ids, t).long(), _cpu(p.input_buffers.positions, t).long()
        s.hidden0 = _cpu(p.hidden_states, t)
        s.last_token_indices = _cpu(p.last_token_indices, num_reqs).long()

    def _prefill_end(self, num_reqs: int) -> None:
        if self.buffer is not None:
            self.cur.topk0 = _cpu(self.buffer, self.cur.num_tokens)

    def _decode_begin(self, num_reqs: int) -> None:
        s, p = self.cur, self.proposer
        s.ids1 = _cpu(p.input_buffers.input_ids, num_reqs).long()
        s.positions1 = _cpu(p.input_buffers.positions, num_reqs).long()
        s.hidden1 = _cpu(p.hidden_states, num_reqs)

    def _end(self, step: GraphStep, out) -> None:
        drafts = out[0] if isinstance(out, tuple) else out
        step.draft_tokens = _cpu(drafts)
        if self.buffer is not None:
            step.topk_after = _cpu(self.buffer, step.num_reqs)
        step.modes.setdefault("prefill", "NONE")
        if (step.num_speculative_tokens or 0) > 1:
            step.modes.setdefault("decode", "NONE")
        self.steps.append(step)

    def proposals(self) -> list[dict]:
        return [{"engine_step": s.engine_step, "num_speculative_tokens": s.num_speculative_tokens,
                 "draft_tokens": s.draft_tokens, "graph_modes": dict(s.modes), "graph_facts": dict(s.facts)}
                for s in self.steps]


# ---- the recording as the engine replay reads it ----------------------------------------------

def graph_calls(steps: list[GraphStep], max_model_len: int) -> list[DraftCall]:
    """The ``DraftCall`` list of a graph-mode run (see the module doc). A step whose inputs were
    not recorded gives no call (``run_facts`` / the verdict then miss its drafts)."""
    calls: list[DraftCall] = []
    for s in steps:
        if s.ids0 is None or s.draft_tokens is None or s.draft_tokens.dim() != 2:
            continue
        r = s.num_reqs
        k_run = s.draft_tokens.shape[1]
        if s.num_speculative_tokens is not None:
            k_run = min(k_run, s.num_speculative_tokens)
        lti = s.last_token_indices
        c0 = DraftCall(s.engine_step, 0, s.ids0, s.positions0, s.hidden0, s.query_start_loc, s.request_keys,
                       seq_lens=None if s.seq_lens is None else s.seq_lens.long(),
                       sample_rows=lti if k_run >= 1 else None,
                       tokens=s.draft_tokens[:, 0].long() if k_run >= 1 else None,
                       topk_rows=s.topk0, last_token_indices=lti)
        c0.notes = {"graph_modes": dict(s.modes), "recorded": "propose seams (graph mode)"}
        calls.append(c0)
        if k_run < 2 or s.ids1 is None:
            continue
        rows = torch.arange(r)
        qsl = torch.arange(r + 1)
        pos = s.positions1.long()
        for k in range(1, k_run):
            if k == 1:
                ids, hidden = s.ids1, s.hidden1
            else:
                ids, hidden = s.draft_tokens[:, k - 1].long(), None
                pos = torch.clamp(pos + 1, max=max_model_len - 1)
            c = DraftCall(s.engine_step, k, ids.long(), pos.clone(), hidden, qsl, s.request_keys,
                          seq_lens=pos + 1, sample_rows=rows, tokens=s.draft_tokens[:, k].long(),
                          topk_rows=s.topk_after if k == k_run - 1 else None)
            c.notes = {"graph_modes": dict(s.modes),
                       "recorded": "inputs at on_multi_step_decode_begin" if k == 1 else
                       "ids = draft token k-1, hidden = the reference's step k-1 (chained)"}
            calls.append(c)
    return calls


def target_calls(steps: list[GraphStep], keys: dict | None = None) -> list[TargetCall]:
    """The bookkeeping's target side of a graph-mode run, one per ``propose``: the target's
    ids, positions and hidden states from the ``propose`` arguments, and as its greedy tokens
    what vLLM's rejection sampler kept (``num_sampled`` per request: the accepted drafts, which
    are the next rows' ids, then ``last_sampled``). ``keys``: {engine step: request keys} of
    the draft calls these are paired with, when those name requests another way (the
    per-forward tap of the eager re-run keys them by first KV block, the seams by state row;
    both list the batch's requests in the same order)."""
    out = []
    for s in steps:
        req = s.request_keys
        if keys is not None and s.engine_step in keys and keys[s.engine_step].numel() == req.numel():
            req = keys[s.engine_step].long()
        if s.target_ids is None or s.num_sampled is None or s.last_sampled is None:
            continue
        qsl = s.query_start_loc.tolist()
        rows, greedy = [], []
        for r in range(s.num_reqs):
            a, b = qsl[r], qsl[r + 1]
            n = int(s.num_sampled[r])
            if b == a or n < 1:
                continue
            if int(s.target_positions[a]) == 0:  # a prefill samples its last row
                rows.append(b - 1)
                greedy.append(int(s.last_sampled[r]))
                continue
            for j in range(min(n, b - a)):  # a decode: n - 1 drafts accepted, then the target's token
                rows.append(a + j)
                greedy.append(int(s.last_sampled[r]) if j == n - 1 else int(s.target_ids[a + j + 1]))
        out.append(TargetCall(s.engine_step, s.target_ids.long(), s.target_positions.long(), s.target_hidden,
                              s.query_start_loc, req, torch.tensor(rows, dtype=torch.long),
                              torch.tensor(greedy, dtype=torch.long)))
    return out


# ---- the eager re-run ------------------------------------------------------------------------

def _dispatch_modules() -> list:
    """The loaded speculator modules that dispatch the drafter's CUDA graphs by name."""
    return [m for name, m in list(sys.modules.items())
            if name.startswith("vllm.v1.worker.gpu.spec_decode") and m is not None
            and callable(getattr(m, "dispatch_cg_and_sync_dp", None))]


@contextlib.contextmanager
def drafter_forced_eager():
    """The drafter runs eagerly for the ``with`` block: every speculator module's
    ``dispatch_cg_and_sync_dp`` is called with ``need_eager=True`` (vLLM's switch for its profile
    run: ``CUDAGraphMode.NONE``); the target's dispatch is left alone."""
    from harness.undo import UndoStack

    mods = _dispatch_modules()
    if not mods:
        raise RuntimeError("no vllm.v1.worker.gpu.spec_decode module dispatches CUDA graphs by "
                           "dispatch_cg_and_sync_dp: the drafter cannot be forced eager")
    undo = UndoStack()
    try:
        for m in mods:
            orig = m.dispatch_cg_and_sync_dp

            def eager(*a, _orig=orig, **k):
                k["need_eager"] = True
                return _orig(*a, **k)

            undo.setattr(m, "dispatch_cg_and_sync_dp", eager)
        yield [m.__name__ for m in mods]
    finally:
        undo.restore()


def compilation_facts(vllm_config) -> dict:
    """What vLLM chose to run the engine with: compile mode, CUDA-graph mode, capture sizes."""
    cc = getattr(vllm_config, "compilation_config", None)
    mc = getattr(vllm_config, "model_config", None)

    def name(x):
        return getattr(x, "name", None) or (None if x is None else str(x))

    sizes = getattr(cc, "cudagraph_capture_sizes", None)
    kc = getattr(vllm_config, "kernel_config", None)
    return {"enforce_eager": bool(getattr(mc, "enforce_eager", False)),
            "jit_warmup": getattr(kc, "enable_jit_warmup", None),  # vLLM's start-up JIT warmup (engine_env)
            "compile_mode": name(getattr(cc, "mode", getattr(cc, "level", None))),
            "cudagraph_mode": name(getattr(cc, "cudagraph_mode", None)),
            "cudagraph_capture_sizes": list(sizes) if sizes is not None else None,
            "max_cudagraph_capture_size": getattr(cc, "max_cudagraph_capture_size", None)}
