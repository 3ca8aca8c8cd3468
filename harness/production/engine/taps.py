"""Engine level, recording: hooks on vLLM's proposer and its ``HYV4MTP`` (no change to vLLM)
that record each draft forward as a ``replay.DraftCall`` (``DrafterTap``) and each target
forward's sampled rows (``TargetTap``); the graph-mode seams are ``graph_tap.py``.

What is hooked and why: step 3 of ``session.py``'s module doc.
"""

from __future__ import annotations

import traceback

import torch

from harness.production.engine.draft_replay import DraftCall
from harness.production.engine.tap_guard import Guarded
from harness.production.module import capture

# ---- recording -----------------------------------------------------------------------------------

def _arg(args, kwargs, name, index):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def real_requests(metadata_reqs: int, batch_reqs: int | None) -> int:
    """The requests a draft forward's attention metadata holds that are the batch's own: in a
    CUDA-graph engine vLLM pads the batch to a capture size, and a drafter forced eager still
    gets the padded metadata (``num_reqs`` the capture size, the padded requests with no query
    tokens at step 0); ``batch_reqs`` is the input batch's ``num_reqs`` (``propose``'s
    argument), None where unknown (a forward outside ``propose``: no padding)."""
    if batch_reqs is None or not 0 < batch_reqs < metadata_reqs:
        return metadata_reqs
    return batch_reqs


def _batch_requests(args, kwargs) -> int | None:
    ib = _arg(args, kwargs, "input_batch", 0)
    n = getattr(ib, "num_reqs", None)
    return int(n) if n is not None else None


class DrafterTap(Guarded):
    """Hooks on the proposer and its ``HYV4MTP`` that record one ``DraftCall`` per draft forward."""

    def __init__(self, proposer, draft) -> None:
        super().__init__()
        self.proposer, self.draft = proposer, draft
        self.calls: list[DraftCall] = []
        self.proposals: list[dict] = []
        self.armed = False
        self.engine_step, self.draft_step, self.in_propose = -1, 0, False
        self.batch_reqs: int | None = None  # the running propose's input batch: its real requests
        self._last_out: torch.Tensor | None = None
        # attention layer names of the MTP layers ("model.layers.<n>.self_attn.attn" in 0.33)
        self.mla_layer = {i: layer.mtp_block.self_attn.mla_attn.layer_name
                          for i, layer in enumerate(draft.model.layers.values())}
        self.layer_prefixes = tuple(n.split("self_attn")[0] for n in self.mla_layer.values())
        self.rec = capture.Recorder()
        self.attach_notes = capture.attach(draft, self.rec)
        self.rec.enabled = False
        self._handles = [draft.register_forward_pre_hook(self._pre, with_kwargs=True),
                         draft.register_forward_hook(self._post)]
        for i, layer in enumerate(draft.model.layers.values()):  # which MTP layer actually runs
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(i)))
        self._orig_propose, self._orig_logits = proposer.propose, draft.compute_logits
        proposer.propose = self._propose
        draft.compute_logits = self._compute_logits

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self.rec.remove()
        for obj, attr in ((self.proposer, "propose"), (self.draft, "compute_logits")):
            if attr in vars(obj):
                delattr(obj, attr)

    def _layer_hook(self, index: int):
        def hook(_module, _args):
            if self.armed and self.rec.enabled and self.calls:
                self.calls[-1].layer_ran = index
        return hook

    # proposer.propose: one call per engine step
    def _propose(self, *args, **kwargs):
        if not self.armed or kwargs.get("dummy_run"):
            return self._orig_propose(*args, **kwargs)
        self.engine_step += 1
        self.draft_step, self.in_propose = 0, True
        self.batch_reqs = None
        self._guard("propose input batch", lambda: setattr(self, "batch_reqs", _batch_requests(args, kwargs)))
        try:
            out = self._orig_propose(*args, **kwargs)
        finally:
            self.in_propose = False
        drafts = out[0] if isinstance(out, tuple) else out
        nspec = kwargs.get("num_speculative_tokens")
        if nspec is None:
            nspec = getattr(self.proposer, "num_speculative_steps", None)
        self.proposals.append({"engine_step": self.engine_step,
                               "num_speculative_tokens": None if nspec is None else int(nspec),
                               "draft_tokens": drafts.detach().cpu().clone() if torch.is_tensor(drafts) else None})
        return out

    def _pre(self, _module, args, kwargs):
        if self.armed:
            self._guard("forward pre-hook", lambda: self._record_inputs(args, kwargs))

    def _record_inputs(self, args, kwargs) -> None:
        ids, pos = _arg(args, kwargs, "input_ids", 0), _arg(args, kwargs, "positions", 1)
        hidden = _arg(args, kwargs, "hidden_states", 2)
        spec = int(kwargs.get("spec_step_idx", 0) or 0)
        layer_idx = spec % len(self.mla_layer)
        mds, md = layer_metadata(self.mla_layer[layer_idx])
        num_reqs = real_requests(int(md.num_reqs), self.batch_reqs if self.in_propose else None)
        qsl = md.query_start_loc[: num_reqs + 1].long().cpu()
        t = int(qsl[-1])
        bt = getattr(md, "block_table", None)
        seq = getattr(md, "seq_lens", None)
        call = DraftCall(
            engine_step=self.engine_step if self.in_propose else -1,
            draft_step=self.draft_step if self.in_propose else 0,
            input_ids=ids[:t].long().cpu(), positions=pos[:t].long().cpu(),
            hidden=hidden[:t].detach().cpu().clone(), query_start_loc=qsl,
            request_keys=bt[:num_reqs, 0].long().cpu(), spec_step_idx=spec,
            seq_lens=None if seq is None else seq[:num_reqs].long().cpu())
        call.notes = {"rows_fed": int(ids.shape[0]), "num_actual_tokens": int(getattr(md, "num_actual_tokens", -1)),
                      "padded_requests": int(md.num_reqs) - num_reqs, "metadata": _describe(mds, self.layer_prefixes)}
        lti = getattr(self.proposer, "last_token_indices", None)  # written by prepare_prefill_inputs
        if self.in_propose and torch.is_tensor(lti):  # steps >= 1 too: the multi-module proposer's rows
            call.last_token_indices = lti[:num_reqs].long().cpu().clone()
        if self.in_propose:
            self.draft_step += 1
        self.calls.append(call)
        self.rec.trace.clear()
        self.rec.enabled = True

    def _post(self, _module, _args, output):
        if self.armed and self.rec.enabled:
            self._guard("forward hook", lambda: self._record_outputs(output))
        self.rec.enabled = False

    def _record_outputs(self, output) -> None:
        call = self.calls[-1]
        out = output[0] if isinstance(output, tuple) else output
        self._last_out = out[: call.num_tokens].detach().cpu()
        call.trace = {k: (v[: call.num_tokens] if v.dim() and v.shape[0] >= call.num_tokens else v)
                      for k, v in self.rec.trace.items()}
        call.topk_rows = call.trace.get("attn.topk")

    # HYV4MTP.compute_logits: the rows the proposer samples, and their argmax
    def _compute_logits(self, hidden_states, *args, **kwargs):
        logits = self._orig_logits(hidden_states, *args, **kwargs)
        if self.armed and self.in_propose and self.calls:
            self._guard("compute_logits", lambda: self._record_logits(hidden_states, logits))
        return logits

    def _record_logits(self, hidden_states, logits) -> None:
        call = self.calls[-1]
        if call.sample_rows is not None:
            raise RuntimeError(f"compute_logits called twice after draft forward {len(self.calls) - 1}")
        x = hidden_states.detach().cpu()
        rows, ambiguous = match_rows(x, self._last_out)
        call.sample_rows = rows
        call.sample_hidden = x.clone()
        call.logits = logits.detach().float().cpu()
        call.tokens = call.logits.argmax(dim=-1)
        call.notes["ambiguous_sample_rows"] = ambiguous
        lti = getattr(self.proposer, "last_token_indices", None)  # V2 proposer's step-0 sample rows
        if call.draft_step == 0 and torch.is_tensor(lti):
            call.notes["proposer_last_token_indices"] = lti[: rows.numel()].tolist()


def layer_metadata(layer_name: str):
    """(all attention metadata of the running forward, the metadata of ``layer_name``)."""
    from vllm.forward_context import get_forward_context

    fc = get_forward_context()
    mds = fc.attn_metadata[0] if isinstance(fc.attn_metadata, list) else fc.attn_metadata
    md = mds.get(layer_name) if isinstance(mds, dict) else mds
    if md is None:
        raise RuntimeError(f"no attention metadata for {layer_name}; "
                           f"keys: {sorted(mds)[:12] if isinstance(mds, dict) else type(mds)}")
    return mds, md


class TargetTap(Guarded):
    """Hooks on the target model: one ``bookkeeping.TargetCall`` per armed forward (ids,
    positions, the hidden states it returns, i.e. what the drafter is fed, and the greedy
    token at every row: the LM head over those hidden states, the same function the runner
    samples from)."""

    def __init__(self, target) -> None:
        super().__init__()
        self.target = target
        self.calls: list = []
        self.armed = False
        first = next(iter(target.model.layers))
        self.layer_name = first.self_attn.mla_attn.layer_name
        self._orig_logits = target.compute_logits
        self._handles = [target.register_forward_pre_hook(self._pre, with_kwargs=True),
                         target.register_forward_hook(self._post)]
        self._pending = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, _module, args, kwargs):
        if self.armed:
            try:
                self._pending = (_arg(args, kwargs, "input_ids", 0), _arg(args, kwargs, "positions", 1))
            except Exception:  # noqa: BLE001 - never break the engine
                self._pending = None
                self.errors.append(traceback.format_exc())

    def _post(self, _module, _args, output):
        if not self.armed or self._pending is None:
            return
        self._guard("target tap", lambda: self._record(output))
        self._pending = None

    def _record(self, output) -> None:
        from harness.production.engine.bookkeeping import TargetCall

        ids, pos = self._pending
        _, md = layer_metadata(self.layer_name)
        num_reqs = int(md.num_reqs)
        qsl = md.query_start_loc[: num_reqs + 1].long().cpu()
        t = int(qsl[-1])
        out = output[0] if isinstance(output, tuple) else output
        with torch.no_grad():
            greedy = self._orig_logits(out[:t]).argmax(dim=-1).cpu()
        self.calls.append(TargetCall(
            engine_step=len(self.calls), input_ids=ids[:t].long().cpu(), positions=pos[:t].long().cpu(),
            hidden=out[:t].detach().cpu().clone(), query_start_loc=qsl,
            request_keys=md.block_table[:num_reqs, 0].long().cpu(),
            sample_rows=torch.arange(t), greedy=greedy))


def match_rows(x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Row of ``out`` [T, H] that each row of ``x`` [S, H] is a bitwise copy of (the proposer gathers
    the sampled rows before compute_logits); ambiguous rows take the first match, -1 when none."""
    if out is None:
        return torch.full((x.shape[0],), -1, dtype=torch.long), x.shape[0]
    eq = (x[:, None, :] == out[None, :, :]).all(dim=-1)  # [S, T]
    rows, ambiguous = [], 0
    for s in range(x.shape[0]):
        hits = torch.nonzero(eq[s]).flatten()
        ambiguous += int(hits.numel() != 1)
        rows.append(int(hits[0]) if hits.numel() else -1)
    return torch.tensor(rows, dtype=torch.long), ambiguous


def _describe(mds, prefixes) -> dict:
    """Batch classification per draft layer (FlashMLA sparse / indexer metadata)."""
    out = {}
    if not isinstance(mds, dict):
        return out
    for name, m in mds.items():
        if not name.startswith(prefixes) or m is None:
            continue
        d = {"type": type(m).__name__}
        for attr in ("num_reqs", "num_decodes", "num_prefills", "num_decode_tokens", "max_query_len"):
            if isinstance(getattr(m, attr, None), int):
                d[attr] = getattr(m, attr)
        out[name] = d
    return out


def graph_replay_counts(steps) -> dict:
    """Draft prefills and decodes per CUDA-graph mode over a graph-mode run's engine steps."""
    out: dict = {"prefill": {}, "decode": {}}
    for s in steps:
        for phase in ("prefill", "decode"):
            mode = s.modes.get(phase)
            if mode is not None:
                out[phase][mode] = out[phase].get(mode, 0) + 1
    return out
