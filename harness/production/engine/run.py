"""Engine level: ``vllm.LLM`` with MTP speculative decoding, its draft tokens checked against the reference.

    python -m harness.production.engine [--case ID ...] [--out DIR]      # exit 0 / 1 / 2 / 125 (harness.exitcodes)
    python -m harness.production.engine --rejudge DIR [--out DIR2]       # CPU, no vLLM: re-judge saved runs

Each run also saves its recording under --out (``engine_calls_<case>.safetensors`` +
``.json``: every tensor the replay needs, the calls' metadata, the load audit), so
``--rejudge`` can replay and judge it offline.

Engine capture and replay. What runs (vLLM 0.33.0, all in this process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

1. ``vllm.LLM`` builds a tiny synthetic HY V4 target (``HYV4ForCausalLM``, dummy
   weights) with ``speculative_config={"method": "mtp"}``: vLLM rewrites the draft
   to ``HYV4MTP``, loads it with dummy weights and shares the target's embedding,
   LM head and top-k buffer with it (V2 runner: ``load_eagle_model``; V1:
   ``SpecDecodeBaseProposer.load_model``). Eager, block size 64, no tokenizer.
2. We reach the worker's model runner through ``LLM.collective_rpc`` (a callable,
   run in-process), take its proposer (``model_runner.speculator`` on the V2
   runner, ``model_runner.drafter`` on V1) and load the harness's seeded MTP
   checkpoint into ``proposer.model`` with ``HYV4MTP.load_weights`` +
   ``process_weights_after_loading`` (``build.load_checkpoint``), then audit it.
   The embedding / LM head being shared, this also writes the target's (recorded
   under ``sharing``).
3. Hooks, no change to vLLM: forward pre/post hooks on ``HYV4MTP`` record each
   draft forward's ids, positions, hidden states and the forward context's
   attention metadata (``query_start_loc``, ``seq_lens``, block table); the
   component hooks of ``module/capture.py`` record the top-k rows the sparse attention
   read (and the other components, for diagnostics); instance wrappers of
   ``proposer.propose`` (engine-step boundaries, returned draft tokens) and
   ``HYV4MTP.compute_logits`` (the rows sampled and their argmax) complete it.
4. ``LLM.generate`` greedily on token-id prompts (one longer than index_topk),
   so the proposer's real loop runs: step 0 over every scheduled token (with
   rejected positions), steps >= 1 one token per request, metadata rebuilt by
   vLLM's builders, ``set_skip_topk`` / ``compact_topk_indices`` with index sharing.
5. ``engine_replay.replay``: the float64 reference over the recorded calls in
   order; draft tokens compared where the reference's logit margin is decisive.
   Step 0 of a decode runs over the rejected slots too, with stale ids / positions
   there: the replay keeps rows <= the proposer's ``last_token_indices`` (see
   ``engine_replay``'s module doc).

Reloading the draft: ``MLAAttention.process_weights_after_loading`` (vLLM 0.33.0
model_executor/layers/attention/mla_attention.py, ``split_kv_b_proj`` then
``replace_parameter(self, "W_UV"/"W_UK_T", ...)``) recomputes the absorbed
``W_UK_T`` / ``W_UV`` from ``kv_b_proj`` on every call, copying in place when they
already exist. On a reload they are registered parameters the checkpoint has no
value for, so HYV4MTP's loader and the audit name them: ``derived_weight_check``
recomputes them from the live ``kv_b_proj`` with vLLM's own ``split_kv_b_proj`` and
only parameters that match are exempt from the audit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from harness.atomic import atomic_write_json
from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, first_line
from harness.production.engine.cases import ENGINE_CASES, ENGINE_KV_GIB_ENV, EngineCase
from harness.production.engine.cli import check_out_dir
from harness.production.engine.tap_guard import Guarded
from harness.production.engine.replay import (DraftCall, component_errors, expects_logits, judge_tokens, load_recording,
                                              replay, run_facts, save_recording)
from harness.production.module import audit, build, capture
from harness.production.module.checkpoint_cast import cast_for_vllm

# ---- building the engine and reaching the drafter ---------------------------------------------


def engine_kwargs(model_dir: str, case: EngineCase) -> dict:
    """``vllm.LLM`` / ``EngineArgs`` arguments: eager, block 64, no tokenizer, dummy weights, MTP."""
    from harness.production.module.vllm_config import BLOCK_SIZE

    kw = {}
    gib = os.environ.get(ENGINE_KV_GIB_ENV, "").strip()
    if gib:
        # a fixed KV size: vLLM then skips its memory profiling, which fails when another
        # process on the same GPU (a parallel test worker) frees memory meanwhile
        kw["kv_cache_memory_bytes"] = int(float(gib) * (1 << 30))
    # with a fixed KV size, gpu_memory_utilization only sets vLLM's start-up check "free
    # memory >= utilization x total": 0.3 of a 141 GiB GPU is 42 GiB, more than is free while
    # five other workers hold their models; 0.1 (14 GiB) still covers weights + 4 GiB KV
    util = min(case.gpu_memory_utilization, 0.1) if gib else case.gpu_memory_utilization
    from harness.production import vllm_compat
    if vllm_compat.available("metrics.per_request_spec_decode"):
        # vLLM's own per-request accepted/drafted counts, recorded beside the harness's (spec_counts)
        kw["per_request_spec_decode_metrics"] = "detailed"
    return dict(
        **kw, model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
        block_size=BLOCK_SIZE, max_model_len=1024, max_num_batched_tokens=2048, max_num_seqs=8,
        # graphs: nothing set, so vLLM picks what `vllm serve` runs by default (recorded: compilation)
        enforce_eager=not case.graphs, load_format="dummy", gpu_memory_utilization=util,
        enable_prefix_caching=False,  # a cache hit would skip draft KV writes the reference needs
        disable_log_stats=False,  # LLM.get_metrics() (vLLM's spec-decode counters) needs stat logging
        seed=case.seed,
        speculative_config={"method": "mtp", "num_speculative_tokens": case.num_speculative_tokens},
    )


# what a failed torch.compile says (Dynamo / Inductor / Triton codegen): a graph-mode case then
# runs CUDA graphs without compile, and its verdict line says so
_COMPILE_ERRORS = ("torch._dynamo", "torch._inductor", "inductor", "dynamo", "torch.compile",
                   "BackendCompilerFailed", "InductorError")


def build_llm(hf_config: dict, case: EngineCase, *, log=print):
    """``vllm.LLM`` in this process for ``hf_config`` (target + MTP draft, dummy weights).
    A graph-mode case whose torch.compile fails on this host is built again with compilation
    mode NONE (CUDA graphs kept); ``llm.hyv4_compile_fallback`` holds why, else None."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core + worker in this process
    from vllm import LLM

    from harness.production.module.vllm_config import write_model_dir
    from harness.runtime import end_gc_deferral

    end_gc_deferral()  # `python -m harness.production.engine` paused it for its imports
    kw = engine_kwargs(write_model_dir(hf_config), case)
    try:
        llm = LLM(**kw)
        fallback = None
    except Exception as exc:  # noqa: BLE001 - only a compile failure is retried
        text = f"{exc.__class__.__name__}: {exc}"
        if not case.graphs or not any(k in text for k in _COMPILE_ERRORS):
            raise
        fallback = f"torch.compile failed on this host ({first_line(text)[:200]}): CUDA graphs without compile"
        log("graph mode:", fallback)
        llm = LLM(**kw, compilation_config={"mode": 0})  # CompilationMode.NONE, CUDA graphs kept
    llm.hyv4_compile_fallback = fallback
    return llm


def _model_runner_of(worker):
    """Runs inside the worker (``collective_rpc``): ``worker`` is its ``WorkerWrapperBase``."""
    return worker.model_runner


def model_runner(llm):
    """The worker's model runner (in-process engine), via ``LLM.collective_rpc``."""
    try:
        return llm.collective_rpc(_model_runner_of)[0]
    except Exception:  # noqa: BLE001 - fall back on the attribute path of the in-process engine
        core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
        return core.model_executor.driver_worker.worker.model_runner


def drafter_of(runner):
    """(proposer, HYV4MTP, target model, runner kind) of a model runner."""
    prop = getattr(runner, "speculator", None)
    kind = "v2 (vllm/v1/worker/gpu/model_runner.py, speculator)"
    if prop is None:
        prop = getattr(runner, "drafter", None)
        kind = "v1 (vllm/v1/worker/gpu_model_runner.py, drafter)"
    if prop is None or not hasattr(prop, "model"):
        raise RuntimeError(f"model runner {type(runner).__name__} has no speculator/drafter with a model")
    draft = prop.model
    while type(draft).__name__ != "HYV4MTP" and hasattr(draft, "unwrap"):
        draft = draft.unwrap()
    if type(draft).__name__ != "HYV4MTP":
        raise RuntimeError(f"proposer {type(prop).__name__}.model is {type(prop.model).__name__}, not HYV4MTP")
    target = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return prop, draft, target, kind


def sharing_facts(draft, target) -> dict:
    """Which draft tensors are the target's (vLLM shares embedding, LM head, top-k buffer)."""
    inner, t_inner = draft.model, getattr(target, "model", None)
    t_head = getattr(target, "lm_head", None)
    heads = [layer.shared_head.head for layer in inner.layers.values()]
    d_buf = getattr(inner, "topk_indices_buffer", None)
    t_buf = getattr(t_inner, "topk_indices_buffer", None)
    return {
        "embed_tokens_is_target's": t_inner is not None and inner.embed_tokens is getattr(t_inner, "embed_tokens", None),
        "lm_head_is_target's": t_head is not None and all(h is t_head for h in heads),
        "topk_buffer_is_target's": (d_buf is not None and t_buf is not None
                                    and d_buf.data_ptr() == t_buf.data_ptr()),
        "draft_layers": list(inner.layers.keys()),
    }


def load_draft_weights(runner, draft, ckpt: dict, known_audit: tuple = ()) -> dict:
    """Load ``ckpt`` into the live draft as vLLM's loader does; audit; check it landed.

    Audit problems naming one of ``known_audit`` (known vLLM 0.33 issues, see the case)
    are reported under ``known_issues``, not failed; an MTP layer head the loader left
    unloaded that way gets the checkpoint's ``lm_head`` copied in, so the steps that
    layer serves can still be judged (noted in ``known_issues``)."""
    ckpt = cast_for_vllm(ckpt)
    dev = torch.device(runner.device)
    try:
        loaded, pre, warnings = build.load_checkpoint(draft, runner.vllm_config, ckpt, dev)
    except RuntimeError as exc:
        if "inference" not in str(exc).lower():
            raise
        with torch.inference_mode():  # parameters created under inference mode
            loaded, pre, warnings = build.load_checkpoint(draft, runner.vllm_config, ckpt, dev)
    raw = audit.audit_loaded_model(draft, loaded, pre, warnings)
    derived = derived_weight_check(draft)
    problems = exempt_derived(raw, {n for n, ok in derived.items() if ok is True})
    problems += [f"{n}: derived weight does not match vLLM's recomputation from kv_b_proj ({ok})"
                 for n, ok in derived.items() if ok is not True]
    known = [p for p in problems if any(k in p for k in known_audit)]
    problems = [p for p in problems if p not in known]
    inner = draft.model
    params = dict(draft.named_parameters())
    for k in known_audit:
        if k.endswith("shared_head.head.weight") and k in params and any(k in p for p in known):
            with torch.no_grad():
                params[k].copy_(ckpt["lm_head.weight"].to(params[k].dtype))
            known.append(f"{k}: copied lm_head.weight in (the loader only fills MTP layer 0's head)")
    layer = next(iter(inner.layers.values()))
    name = next(k for k in ckpt if k.endswith(".enorm.weight"))
    landed = {
        "embed_tokens": bool(torch.equal(inner.embed_tokens.weight[: ckpt["model.embed_tokens.weight"].shape[0]].cpu(),
                                         ckpt["model.embed_tokens.weight"].to(inner.embed_tokens.weight.dtype))),
        "enorm": bool(torch.equal(layer.enorm.weight.cpu(), ckpt[name].to(layer.enorm.weight.dtype))),
    }
    return {"loaded_params": len(loaded), "audit": problems, "known_issues": known, "audit_raw": raw,
            "derived_weights": {n: ok for n, ok in derived.items()}, "landed": landed}


# the absorbed MLA weights MLAAttention.process_weights_after_loading derives from kv_b_proj
DERIVED_MLA_WEIGHTS = ("W_UK_T", "W_UV")


def derived_weight_check(model) -> dict[str, object]:
    """{full name of each MLA derived weight: True when it equals vLLM's own recomputation
    from the live ``kv_b_proj`` (``split_kv_b_proj``, permuted as process_weights_after_loading
    stores it), else why not}."""
    from harness.production import vllm_compat

    split_kv_b_proj = vllm_compat.internal("mla.split_kv_b_proj")

    out: dict[str, object] = {}
    for mname, m in model.named_modules():
        if not (hasattr(m, "kv_b_proj") and hasattr(m, "W_UK_T") and hasattr(m, "W_UV")):
            continue
        try:
            w_uv_live, w_ukt_live = m.W_UV, m.W_UK_T
            with torch.no_grad():
                w_uk, w_uv = split_kv_b_proj(m.kv_b_proj, w_uv_live.dtype, m.kv_lora_rank, m.num_heads,
                                             m.qk_nope_head_dim, m.v_head_dim)
            expect = {"W_UK_T": w_uk.permute(1, 2, 0), "W_UV": w_uv.transpose(0, 1)}
            live = {"W_UK_T": w_ukt_live, "W_UV": w_uv_live}
            for n in DERIVED_MLA_WEIGHTS:
                a, e = live[n].detach(), expect[n].detach()
                name = f"{mname}.{n}" if mname else n
                if tuple(a.shape) != tuple(e.shape):
                    out[name] = f"shape {tuple(a.shape)} vs {tuple(e.shape)}"
                elif torch.equal(a, e.to(a.dtype)):
                    out[name] = True
                else:
                    out[name] = f"max |d| {float((a.float() - e.float()).abs().max()):.4g}"
        except Exception as exc:  # noqa: BLE001 - report, do not exempt
            out[f"{mname}.W_UK_T/W_UV"] = f"check failed: {exc.__class__.__name__}: {exc}"
    return out


def exempt_derived(problems: list[str], derived_ok: set[str]) -> list[str]:
    """``problems`` less the "received no checkpoint value" of verified derived weights (a loader
    warning listing names keeps the others); every other problem stays."""
    out = []
    for p in problems:
        name = p.split(": ", 1)[0]
        if p.endswith("received no checkpoint value") and name in derived_ok:
            continue
        if p.startswith("loader warning:") and "received no checkpoint value:" in p:
            head, names = p.rsplit(": ", 1)
            rest = [n for n in (x.strip() for x in names.split(",")) if n and n not in derived_ok]
            if not rest:
                continue
            p = f"{head}: {', '.join(rest)}"
        out.append(p)
    return out


# ---- recording -----------------------------------------------------------------------------------

def _arg(args, kwargs, name, index):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


class DrafterTap(Guarded):
    """Hooks on the proposer and its ``HYV4MTP`` that record one ``DraftCall`` per draft forward."""

    def __init__(self, proposer, draft) -> None:
        super().__init__()
        self.proposer, self.draft = proposer, draft
        self.calls: list[DraftCall] = []
        self.proposals: list[dict] = []
        self.armed = False
        self.engine_step, self.draft_step, self.in_propose = -1, 0, False
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
        num_reqs = int(md.num_reqs)
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
                      "metadata": _describe(mds, self.layer_prefixes)}
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


# ---- one case end to end --------------------------------------------------------------------------

def prompts_for(case: EngineCase, vocab: int, plan=None) -> list[list[int]]:
    if case.target == "acceptance":
        from harness.production.engine.acceptance import prompts
        return prompts(plan, case.patterns, case.prompt_lens, case.seed)
    g = torch.Generator().manual_seed(case.seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in case.prompt_lens]


def engine_inputs(case: EngineCase):
    """(hf config, checkpoint tensors for the draft, reference weights, acceptance plan or None)."""
    import reference as R
    from harness.production.cases import case_inputs, GpuCase

    from harness.checkpoint.names import to_checkpoint

    hf, ckpt, weights = case_inputs(GpuCase(case.id, preset=case.preset, overrides=case.overrides, seed=case.seed))
    if case.target != "acceptance":
        return hf, ckpt, weights, None
    from harness.production.engine.acceptance import acceptance_weights, plan_for

    cfg = R.MTPConfig.from_hf_dict(hf)
    plan = plan_for(cfg.hidden_size, cfg.vocab_size, case.seed)
    weights = acceptance_weights(cfg, weights, plan, case.seed)
    return hf, to_checkpoint(cfg, weights), weights, plan  # bf16, mtp_layers naming, split experts


def run_case(case: EngineCase, *, log=print, out: str | None = None, mutant: str | None = None) -> dict:
    """Build, load, hook, generate, replay, judge; the report as a JSON-able dict. ``mutant``
    is planted before the engine is built (as ``bisect-check`` passes it on)."""
    t0 = time.perf_counter()
    planted = None
    if mutant:
        from harness.production.engine.speculator_mutants import apply_mutant
        planted = apply_mutant(mutant)
        log("planted speculator bug:", json.dumps(planted))
    sess = build_session(case, log=log)
    return generate_and_judge(sess, out=out, log=log, mutant=planted, t0=t0)


def mtp_layers_run(proposer: str, num_mtp_layers: int) -> str:
    """Which MTP layer drafts step k under the speculator vLLM picked (the replay and the
    bookkeeping judge against that layer; the reference's own ``draft`` cycles k mod n)."""
    if "MultiModule" in proposer:
        return f"layer k mod {num_mtp_layers} at draft step k ({proposer})"
    if num_mtp_layers > 1:
        return (f"layer 0 at every draft step ({proposer}, single module): the checkpoint's other "
                f"{num_mtp_layers - 1} MTP layer(s) are loaded but never run, so its drafts are layer 0's, "
                f"not the k mod {num_mtp_layers} cycle the reference drafts with")
    return f"layer 0 ({proposer})"


def build_session(case: EngineCase, *, log=print) -> dict:
    """The engine of ``case``, built and loaded (the drafter with the harness's weights; an
    acceptance case's target edited): what ``generate_and_judge`` runs on, once or many times."""
    import reference as R
    from harness.presets import check_kernel_constraints
    from harness.production.module.side_by_side import run_facts

    t0 = time.perf_counter()
    hf, ckpt, weights, plan = engine_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    check_kernel_constraints(cfg)
    base: dict = {"case": dataclasses.asdict(case), **run_facts()}
    llm = build_llm(hf, case, log=log)
    build_s = time.perf_counter() - t0
    runner = model_runner(llm)
    prop, draft, target, kind = drafter_of(runner)
    base["runner"] = {"kind": kind, "runner": type(runner).__name__, "proposer": type(prop).__name__,
                      "draft_model": type(prop.model).__name__, "target_model": type(target).__name__,
                      "max_model_len": int(runner.vllm_config.model_config.max_model_len)}
    from harness.production.kernel_paths import model_paths
    base["model_kernel_paths"] = model_paths(draft)
    base["runner"]["mtp_layers_run"] = mtp_layers_run(type(prop).__name__, cfg.num_mtp_layers)
    from harness.production.engine.graph_tap import compilation_facts
    base["compilation"] = compilation_facts(runner.vllm_config)
    base["compilation"]["compile_fallback"] = getattr(llm, "hyv4_compile_fallback", None)
    log("compilation:", json.dumps(base["compilation"]))
    if case.graphs and "MultiModule" in type(prop).__name__:
        raise RuntimeError(f"graph mode is judged for single-module MTP speculators; vLLM picked {type(prop).__name__}")
    log("MTP layers run:", base["runner"]["mtp_layers_run"])
    base["sharing"] = sharing_facts(draft, target)
    log("engine:", json.dumps(base["runner"]), "sharing:", json.dumps(base["sharing"]))
    # graphs were captured while the engine was built: what is loaded or edited from here on must
    # land at the addresses they read (in place), or graph replay would judge vLLM's dummy weights
    ptrs = _param_addresses(draft, target) if case.graphs else None
    base["load"] = load_draft_weights(runner, draft, ckpt, known_audit=case.known_audit)
    log("load:", json.dumps(base["load"]))
    if plan is not None:
        from harness.production.engine.acceptance import edit_target
        base["target_edits"] = edit_target(target, weights["embed_tokens"], weights["lm_head"])
        log("target edited:", len(base["target_edits"]["zeroed"]), "output projections zeroed")
    if ptrs is not None:
        moved = sorted(k for k, v in _param_addresses(draft, target).items() if ptrs.get(k) != v)
        if moved:
            raise RuntimeError(f"loading the harness's weights after CUDA-graph capture re-allocated "
                               f"{len(moved)} tensor(s) ({', '.join(moved[:4])}): the graphs read the old ones")
    return {"case": case, "cfg": cfg, "weights": weights, "plan": plan, "llm": llm, "proposer": prop,
            "draft": draft, "target": target, "base": base, "build_s": build_s}


def _param_addresses(draft, target) -> dict[str, int]:
    """{"draft.<name>" / "target.<name>": data pointer} of every parameter and buffer."""
    out = {}
    for tag, m in (("draft", draft), ("target", target)):
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            out[f"{tag}.{name}"] = t.data_ptr()
    return out


def generate_and_judge(sess: dict, *, out: str | None = None, log=print, mutant: dict | None = None,
                       t0: float | None = None, stem: str | None = None, eager_drafter: bool = False) -> dict:
    """One greedy generation on ``sess``'s engine with fresh taps, recorded (under ``out``, as
    ``stem``: default ``engine_calls_<case>``), replayed by the reference and judged: the report.

    A graph-mode case (``case.graphs``) is recorded at the speculator's Python seams
    (``graph_tap``); when it fails, the generation runs again with the drafter forced eager
    (``eager_drafter``: every draft forward tapped, the target still in graphs) and the verdict's
    first line says which of the two differs from the reference (``_graph_attribution``)."""
    from harness.production.engine.graph_tap import GraphTap, drafter_forced_eager, graph_calls, target_calls

    t0 = time.perf_counter() if t0 is None else t0
    case, cfg, weights, plan = sess["case"], sess["cfg"], sess["weights"], sess["plan"]
    rep: dict = {**sess["base"], "timing_s": {"build": sess["build_s"]}}
    if mutant is not None:
        rep["mutant"] = mutant
    graphs = case.graphs
    rep["drafter_mode"] = ("eager (forced) in a CUDA-graph engine" if graphs and eager_drafter
                           else "CUDA graphs" if graphs else "eager")
    # graph mode: the seams always (they give the target side); the per-forward taps only when
    # the drafter runs eager (attached after, so its propose wrapper calls the seams')
    gtap = GraphTap(sess["proposer"], sess["draft"]) if graphs else None
    tap = DrafterTap(sess["proposer"], sess["draft"]) if not graphs or eager_drafter else None
    ttap = None if graphs else TargetTap(sess["target"])
    taps = [t for t in (tap, gtap, ttap) if t is not None]
    rep["attach_notes"] = tap.attach_notes if tap is not None else []
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens, ignore_eos=True, detokenize=False)
    prompts = prompts_for(case, cfg.vocab_size, plan)
    from harness.production.engine import spec_counts
    before = spec_counts.read_metric_totals(sess["llm"])  # cumulative over the process: a difference
    t1 = time.perf_counter()
    for t in taps:
        t.armed = True
    try:
        with drafter_forced_eager() if eager_drafter else contextlib.nullcontext():
            outs = sess["llm"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        for t in taps:
            t.armed = False
            t.remove()
    rep["timing_s"]["generate"] = time.perf_counter() - t1
    rep["generated"] = [list(o.outputs[0].token_ids) for o in outs]
    rep["vllm_spec_decode"] = spec_counts.vllm_counters(outs, before, spec_counts.read_metric_totals(sess["llm"]))
    log("vLLM's spec-decode counters:", json.dumps(rep["vllm_spec_decode"]))
    errors = [e for t in taps for e in t.errors]
    if gtap is not None:
        rep["graph_replays"] = graph_replay_counts(gtap.steps)
        log("draft steps by CUDA-graph mode:", json.dumps(rep["graph_replays"]))
        if tap is not None:  # the eager re-run: the target side keyed as the per-forward tap keys requests
            calls, proposals = tap.calls, tap.proposals
            targets = target_calls(gtap.steps, keys={c.engine_step: c.request_keys for c in calls
                                                     if c.draft_step == 0 and c.engine_step >= 0})
        else:
            targets = target_calls(gtap.steps)
            calls = graph_calls(gtap.steps, rep["runner"]["max_model_len"])
            proposals = gtap.proposals()
    else:
        calls, proposals, targets = tap.calls, tap.proposals, ttap.calls
    for e in errors[:3]:
        log("tap error:", e)
    if plan is not None:  # the edited target must continue every prompt with f
        from harness.production.engine.acceptance import target_tokens
        rep["target_follows_f"] = [g == target_tokens(plan, p[-1], len(g)) for p, g in zip(prompts, rep["generated"])]
    if out:  # before judging: a crash in the replay still leaves the recording for --rejudge
        try:
            stem = os.path.join(out, stem or f"engine_calls_{case.id}")
            os.makedirs(out, exist_ok=True)
            meta = {"case": dataclasses.asdict(case), "versions": rep["versions"], "runner": rep["runner"],
                    "sharing": rep["sharing"], "load": rep["load"], "tap_errors": errors,
                    "generated": rep["generated"], "prompts": prompts, "mutant": rep.get("mutant"),
                    "target_follows_f": rep.get("target_follows_f"), "vllm_spec_decode": rep["vllm_spec_decode"]}
            rep["recording"] = save_recording(stem, calls, proposals, meta, targets=targets)
            log("recording:", stem + ".safetensors", json.dumps(rep["recording"]))
        except Exception:  # noqa: BLE001 - the verdict does not depend on it
            rep["recording"] = {"error": traceback.format_exc()}
            log("recording failed:", rep["recording"]["error"])
    rep.update(judge_run(cfg, weights, calls, proposals, errors, case, targets=targets,
                         multi_module="MultiModule" in rep["runner"]["proposer"],
                         max_model_len=rep["runner"]["max_model_len"], prompts=prompts,
                         generated=rep["generated"], log=log))
    rep["timing_s"]["reference"] = rep.pop("reference_s")
    rep["timing_s"]["total"] = time.perf_counter() - t0
    rep["problems"] = verdict_problems(rep)
    rep["acceptance_disagreements"] = acceptance_disagreements(rep)
    rep["passed"] = rep["problems"] == []
    if graphs and not eager_drafter and not rep["passed"]:
        log("graph-mode run failed: the same generation again with the drafter eager")
        t2 = time.perf_counter()
        eager = generate_and_judge(sess, log=lambda *a, **k: None, mutant=mutant, eager_drafter=True)
        rep["eager_rerun"] = {"passed": eager["passed"], "problems": eager["problems"][:8],
                              "counts": eager.get("counts"), "acceptance": eager.get("acceptance"),
                              "components": eager.get("components"), "wall_s": time.perf_counter() - t2}
        rep["problems"] = _graph_attribution(rep["problems"], eager)
        rep["timing_s"]["eager_rerun"] = rep["eager_rerun"]["wall_s"]
    return rep


def graph_replay_counts(steps) -> dict:
    """Draft prefills and decodes per CUDA-graph mode over a graph-mode run's engine steps."""
    out: dict = {"prefill": {}, "decode": {}}
    for s in steps:
        for phase in ("prefill", "decode"):
            mode = s.modes.get(phase)
            if mode is not None:
                out[phase][mode] = out[phase].get(mode, 0) + 1
    return out


def _graph_attribution(graph_problems: list[str], eager: dict) -> list[str]:
    """The problems of a failed graph-mode run, first line saying whether graph replay or the
    drafter itself (eager too) differs from the reference."""
    first = graph_problems[0] if graph_problems else "failed"
    if eager["passed"]:
        return [f"graph replay differs from eager (capture bug: the same generation with the drafter eager "
                f"passes): {first}", *graph_problems[1:]]
    return [f"graph replay and eager both differ from the reference (a numeric bug, not capture): "
            f"eager: {eager['problems'][0]}", f"graph replay: {first}", *graph_problems[1:]]


def run_mutant_sweep(case: EngineCase, mutants: list[str], *, log=print, out: str | None = None) -> dict:
    """One engine of ``case`` for a pristine run, then per mutant a planted run and a pristine
    run again (the restore checked by the engine's own verdict): measured ~4 s per run
    instead of ~40 s per engine process. A mutant is caught when its run fails with the
    mutant's quantity named first. Recordings are not kept (a failing run keeps its problems)."""
    from harness.production.engine.speculator_mutants import MUTANTS, planted

    t0 = time.perf_counter()
    sess = build_session(case, log=log)
    runs = []

    def one(label: str, mutant: str | None) -> dict:
        if mutant is None:
            rep = generate_and_judge(sess, log=lambda *a, **k: None)
        else:
            with planted(mutant) as desc:
                rep = generate_and_judge(sess, log=lambda *a, **k: None, mutant=desc)
        first = (rep["problems"] or [""])[0]
        row = {"label": label, "mutant": mutant, "passed": rep["passed"], "problems": rep["problems"][:5],
               "counts": rep.get("counts"), "timing_s": rep["timing_s"]}
        if mutant is None:
            row["ok"] = rep["passed"]
        else:
            row["caught"], row["named_first"] = not rep["passed"], MUTANTS[mutant].expect in first
            row["ok"] = row["caught"] and row["named_first"]
        log(f"{'ok  ' if row['ok'] else 'BAD '} {label}: {'pass' if rep['passed'] else 'FAIL'} {first[:200]}")
        runs.append(row)
        return rep

    one("control-0", None)
    for i, m in enumerate(mutants, 1):
        one(m, m)
        one(f"control-{i}", None)
    doc = {"case": case.id, "mutants": list(mutants), "runs": runs, "build_s": sess["build_s"],
           "wall_s": time.perf_counter() - t0, "ok": all(r["ok"] for r in runs)}
    if out:
        os.makedirs(out, exist_ok=True)
        atomic_write_json(os.path.join(out, f"engine_mtp_{case.id}.sweep.json"), doc, default=str)
    return doc


def judge_run(cfg, weights, recorded: list[DraftCall], proposals: list[dict], tap_errors: list[str],
              case: EngineCase, *, targets: list | None = None, multi_module: bool = False,
              max_model_len: int = 1024, prompts: list | None = None, generated: list | None = None,
              log=print) -> dict:
    """Check the speculator's bookkeeping against the target (``bookkeeping``), replay the
    recorded draft forwards with the float64 reference and judge them (CPU): ``counts``,
    ``facts``, ``findings`` (localised lines), ``acceptance`` (per request, as vLLM counts it:
    ``generated``, the output tokens per prompt, says when each request finished),
    ``mismatch_examples``, ``replay_errors``, ``components``, ``tap_errors``."""
    import reference as R
    from harness.production.verdict.tolerances import tolerances_for

    from harness.production.engine import bookkeeping

    calls = [c for c in recorded if c.engine_step >= 0]
    facts = run_facts(recorded, proposals, multi_module=multi_module)
    log(f"recorded {len(recorded)} draft forwards in {facts['engine_steps']} engine steps; facts:", json.dumps(facts))
    for i, c in enumerate(calls[: 2 * case.num_speculative_tokens + 2]):
        span = f"{int(c.positions.min())}..{int(c.positions.max())}" if c.num_tokens else "-"
        lti = None if c.last_token_indices is None else c.last_token_indices.tolist()
        log(f"  call {i}: engine_step {c.engine_step} draft_step {c.draft_step} layer {c.layer_ran} T={c.num_tokens} "
            f"qsl={c.query_start_loc.tolist()[:9]} keys={c.request_keys.tolist()} pos[{span}] "
            f"seq_lens={None if c.seq_lens is None else c.seq_lens.tolist()} last_token_indices={lti} "
            f"sample_rows={None if c.sample_rows is None else c.sample_rows.tolist()} "
            f"tokens={None if c.tokens is None else c.tokens.tolist()} topk={'yes' if c.topk_rows is not None else 'no'}")
    book = (bookkeeping.check(calls, targets, multi_module=multi_module, num_layers=cfg.num_mtp_layers,
                              max_model_len=max_model_len, prompts=prompts,
                              output_lens=[len(g) for g in generated] if generated is not None else None)
            if targets else None)
    # (engine step, draft step, dataflow rank, line): inputs, then top-k, then KV reads, then tokens
    items = [(f.engine_step, f.draft_step, 0, f.line()) for f in book["findings"]] if book else []
    t = time.perf_counter()
    replays = replay(cfg, weights, calls, R.EXACT, multi_module=multi_module)
    t_ref = time.perf_counter() - t
    tols = tolerances_for("bf16")
    tokens = judge_tokens(calls, replays, tols["logits"])
    errors = [(i, r.error) for i, r in enumerate(replays) if r.error]
    for i, e in errors:
        c = calls[i]
        what = ("production's top-k rows / KV reads reach draft KV that no draft step wrote for this request "
                "(stale or rejected slots)" if "UnwrittenKVError" in e else "the call could not be replayed")
        items.append((c.engine_step, c.draft_step, 2, f"engine step {c.engine_step}, draft step {c.draft_step}: "
                                                     f"{what}: {e}"))
    for i, r in enumerate(replays):
        if r.topk_beyond_ties:
            c = calls[i]
            shared = " (shared step 0 rows, compacted to the sampled rows)" if (
                c.draft_step and cfg.index_share_for_mtp_iteration) else ""
            items.append((c.engine_step, c.draft_step, 1, f"engine step {c.engine_step}, draft step {c.draft_step}: "
                                                         f"attn.topk rows are not the reference's{shared}: "
                                                         f"{r.topk_beyond_ties}"))
    for ex in tokens["mismatch_examples"]:
        items.append((ex["engine_step"], ex["draft_step"], 3,
                      f"engine step {ex['engine_step']}, draft step {ex['draft_step']}, sample row {ex['sample_row']} "
                      f"(position {ex['position']}): draft_token {ex['production']} != reference {ex['reference']} "
                      f"(decisive margin)"))
    findings = [line for *_, line in sorted(items, key=lambda x: x[:3])]
    counts = {
        "calls": len(calls), "engine_steps": facts["engine_steps"], "target_forwards": len(targets or []),
        "drafted": tokens["drafted"], "compared": tokens["compared"], "ties": tokens["ties"],
        "ties_differing": tokens["ties_differing"], "mismatches": tokens["mismatches"],
        "not_replayed": tokens["not_replayed"], "replay_errors": len(errors),
        "bookkeeping_findings": len(book["findings"]) if book else None,
        "bookkeeping_checked": book["checked"] if book else None,
        "calls_without_logits": sum(c.tokens is None and expects_logits(c, proposals) for c in calls),
        "sampled_row_not_last_token_index": facts["sampled_row_not_last_token_index"],
        "seq_len_disagreements": facts["seq_len_disagreements"],
        "step0_without_last_token_indices": sum(c.draft_step == 0 and c.last_token_indices is None for c in calls),
        "unmatched_sample_rows": sum(int((c.sample_rows < 0).sum()) for c in calls if c.sample_rows is not None),
        "ambiguous_sample_rows": sum(c.notes.get("ambiguous_sample_rows", 0) for c in calls),
        "calls_without_topk_rows": sum(c.topk_rows is None for c in calls) if cfg.attention_sparse else 0,
        "topk_rows_differing": sum(r.topk_rows_differing for r in replays),
        "topk_calls_beyond_ties": sum(r.topk_beyond_ties is not None for r in replays),
        "max_context": facts["max_context"], "index_topk": cfg.index_topk,
        "max_draft_steps": facts["max_draft_steps"], "num_speculative_tokens": case.num_speculative_tokens,
        "proposal_token_disagreements": facts.get("proposal_token_disagreements"),
        "tap_errors": len(tap_errors),
    }
    return {"counts": counts, "facts": facts, "findings": findings,
            "acceptance": book["acceptance"] if book else None,
            "mismatch_examples": tokens["mismatch_examples"],
            "replay_errors": [f"call {i}: {e}" for i, e in errors[:10]],
            "components": component_errors(calls, replays, tols), "tap_errors": list(tap_errors),
            "reference_s": t_ref}


def _pattern_rates(rep: dict) -> dict:
    """{pattern: acceptance rate} of the acceptance case's requests (request i = prompt i)."""
    acc = rep.get("acceptance") or {}
    pats = (rep.get("case") or {}).get("patterns") or ()
    out = {}
    for i, name in enumerate(pats):
        a = acc.get(f"request {i}")
        if a and a.get("rate") is not None:
            out[name] = a["rate"]
    return out


def acceptance_disagreements(rep: dict) -> list[str]:
    """vLLM's own spec-decode counters against the harness's figure in vLLM's definition
    (``spec_counts``): reported beside the verdict and in the report, not part of the exit code.
    The harness's figure is derived from the recording alone; vLLM's counters come from its stat
    logging, whose reading in this in-process engine is what this comparison establishes."""
    from harness.production.engine.spec_counts import disagreements
    return disagreements(rep.get("acceptance"), rep.get("vllm_spec_decode"))


def verdict_problems(rep: dict) -> list[str]:
    """Why ``rep`` fails the engine-level check (empty: it passes); localised findings first."""
    c = rep["counts"]
    p = list(rep.get("findings") or [])
    if rep.get("load", {}).get("audit"):
        p.insert(0, f"load: vLLM left parameters unloaded or wrong: {rep['load']['audit'][:3]}")
    if c.get("mismatches") and not any("draft_token" in x for x in p):
        p.append(f"{c['mismatches']} draft token(s) differ from the reference with a decisive margin")
    if c.get("replay_errors") and not any("replay" in x or "reference never wrote" in x for x in p):
        p.append(f"replay_errors: {c['replay_errors']}")
    if c["compared"] < 1:
        p.append("no draft token was compared")
    for key in ("not_replayed", "calls_without_logits", "unmatched_sample_rows",
                "tap_errors", "proposal_token_disagreements",
                # the replay's model of the proposer (engine_replay's module doc) does not hold
                "sampled_row_not_last_token_index", "seq_len_disagreements", "step0_without_last_token_indices"):
        if c.get(key):
            p.append(f"{key}: {c[key]}")
    if not all(rep.get("load", {}).get("landed", {}).values()):
        p.append(f"synthetic weights did not land in the live draft: {rep['load'].get('landed')}")
    if c["max_context"] <= c["index_topk"]:
        p.append(f"no call had a context longer than index_topk ({c['max_context']} <= {c['index_topk']})")
    if rep.get("drafter_mode") == "CUDA graphs":
        g = rep.get("graph_replays") or {}
        if not any(m != "NONE" for phase in g.values() for m in phase):
            p.append(f"CUDA-graph mode not exercised: no draft step ran under a graph ({g}; "
                     f"compilation {rep.get('compilation')})")
    if c["num_speculative_tokens"] >= 2 and c["max_draft_steps"] < 2:
        p.append(f"the drafter ran {c['max_draft_steps']} step(s) per engine step (K={c['num_speculative_tokens']})")
    case = rep.get("case") if isinstance(rep.get("case"), dict) else {}
    if case.get("target") == "acceptance":
        if rep.get("target_follows_f") is not None and not all(rep["target_follows_f"]):
            p.append(f"the edited target did not follow its permutation: {rep['target_follows_f']} "
                     "(acceptance regime not reached)")
        rates = _pattern_rates(rep)
        for name, lo, hi in case.get("expect_rates") or ():
            r = rates.get(name)
            if r is None or not lo <= r <= hi:
                p.append(f"acceptance regime not exercised: pattern {name!r} accepted {r} of its drafts, "
                         f"expected [{lo}, {hi}]")
    return p


def _case_failed(title: str, exc: Exception, debug: bool) -> tuple[dict, int]:
    """(report, exit code) of a case that raised: one line (the traceback goes to the report)."""
    from harness.exitcodes import classify

    code, line = classify(exc)
    if debug:
        traceback.print_exception(exc)
    print(f"== {title}: ERROR {line}", flush=True)
    return {"case": title, "error": traceback.format_exc(), "exit_code": code}, code


def run_checked(args, mutants) -> int:
    """The engine command once its arguments are checked and production can run here
    (``harness.production.engine.cli``): the sweep, or each case (one process per engine)."""
    out = args.out or os.environ.get("HYV4_REPORT_DIR") or None
    check_out_dir(out, "--out" if args.out else "$HYV4_REPORT_DIR")
    if args.sweep:
        try:
            doc = run_mutant_sweep(ENGINE_CASES[args.case[0]], mutants, out=out)
        except Exception as exc:  # noqa: BLE001 - a crash in vLLM: cannot judge (a load failure: 1)
            return _case_failed(args.case[0], exc, args.debug)[1]
        bad = [r["label"] for r in doc["runs"] if not r["ok"]]
        print(f"== {args.case[0]} sweep: {len(mutants)} mutant(s) on one engine, "
              f"{'all caught, named first, pristine runs pass' if not bad else 'NOT OK: ' + ', '.join(bad)} "
              f"({doc['wall_s']:.0f} s)", flush=True)
        return EXIT_OK if not bad else EXIT_MISMATCH
    ids = args.case or list(ENGINE_CASES)
    if len(ids) > 1:  # one engine per process: vLLM's distributed state and GPU memory are per process
        return worst_exit_code([subprocess.call([sys.executable, "-m", "harness.production.engine", "--case", cid]
                                                + (["--out", out] if out else [])
                                                + (["--debug"] if args.debug else [])
                                                + (["--mutant", args.mutant] if args.mutant else [])) for cid in ids])
    codes = []
    for cid in ids:
        try:
            rep = run_case(ENGINE_CASES[cid], out=out, mutant=args.mutant)
        except Exception as exc:  # noqa: BLE001 - a crash in vLLM: cannot judge (a load failure: 1)
            rep, code = _case_failed(cid, exc, args.debug)
        else:
            code = _print_verdict(cid, rep)
        codes.append(code)
        if out:
            os.makedirs(out, exist_ok=True)
            atomic_write_json(os.path.join(out, f"engine_mtp_{cid}.json"), rep, default=str)
    return worst_exit_code(codes)


def case_from_dict(d: dict) -> EngineCase:
    """Inverse of ``dataclasses.asdict`` for an ``EngineCase`` (JSON lists back to tuples)."""
    d = dict(d)
    d["overrides"] = tuple(tuple(x) for x in d.get("overrides", ()))
    for k in ("prompt_lens", "patterns", "known_audit"):
        d[k] = tuple(d.get(k, ()))
    d["expect_rates"] = tuple(tuple(x) for x in d.get("expect_rates", ()))
    d["upstream_gaps"] = tuple(tuple(x) for x in d.get("upstream_gaps", ()))
    return EngineCase(**d)


def _read_recording(stem: str):
    """(calls, proposals, doc, meta, case) of a saved recording; one that cannot be read
    (truncated, edited, another format) is bad input: ``CLIError`` naming it (exit 2)."""
    from harness.exitcodes import CLIError

    try:
        calls, proposals, doc = load_recording(stem)
        meta = doc["meta"]
        return calls, proposals, doc, meta, case_from_dict(meta["case"])
    except CLIError:
        raise
    except Exception as exc:  # noqa: BLE001 - json, safetensors (SafetensorError is no OSError), keys
        raise CLIError(f"{stem}.json / .safetensors: not a readable engine recording: "
                       f"{exc.__class__.__name__}: {first_line(exc)}") from exc


def rejudge(stem: str, *, log=print) -> dict:
    """Replay and judge one saved recording (``<stem>.safetensors`` + ``.json``) on CPU."""
    import reference as R
    calls, proposals, doc, meta, case = _read_recording(stem)
    targets = doc.get("targets")
    _hf, _ckpt, weights, _plan = engine_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(_hf)
    rep = {"case": meta["case"], "rejudged_from": stem, "versions": meta.get("versions"),
           "runner": meta.get("runner"), "sharing": meta.get("sharing"), "load": meta.get("load", {}),
           "recording": {k: v for k, v in doc.items() if k not in ("meta", "call_meta", "proposal_meta")}}
    runner = meta.get("runner") or {}
    rep["target_follows_f"] = meta.get("target_follows_f")
    rep["vllm_spec_decode"] = meta.get("vllm_spec_decode") or {
        "per_request": "unavailable: not in the recording", "totals": "unavailable: not in the recording"}
    rep.update(judge_run(cfg, weights, calls, proposals, list(meta.get("tap_errors", [])), case, targets=targets,
                         multi_module="MultiModule" in str(runner.get("proposer", "")),
                         max_model_len=int(runner.get("max_model_len", 1024)), prompts=meta.get("prompts"),
                         generated=meta.get("generated"), log=log))
    rep["timing_s"] = {"reference": rep.pop("reference_s")}
    rep["problems"] = verdict_problems(rep)
    rep["acceptance_disagreements"] = acceptance_disagreements(rep)
    rep["passed"] = rep["problems"] == []
    return rep


def rejudge_dir(src: str, case_ids, out: str | None, *, debug: bool = False) -> int:
    import glob

    from harness.exitcodes import CLIError

    if not os.path.isdir(src):
        raise CLIError(f"--rejudge {src}: not a directory")
    stems = sorted(p[: -len(".json")] for p in glob.glob(os.path.join(src, "engine_calls_*.json")))
    if case_ids:
        stems = [s for s in stems if os.path.basename(s)[len("engine_calls_"):] in case_ids]
    if not stems:
        print(f"cannot judge: no engine_calls_<case>.json in {src}")
        return EXIT_CANNOT_JUDGE
    codes = []
    for stem in stems:
        cid = os.path.basename(stem)[len("engine_calls_"):]
        try:
            rep = rejudge(stem)
        except Exception as exc:  # noqa: BLE001 - an unreadable recording: cannot judge
            rep, code = _case_failed(f"{cid} (rejudge)", exc, debug)
        else:
            code = _print_verdict(f"{cid} (rejudge)", rep)
        codes.append(code)
        if out:
            os.makedirs(out, exist_ok=True)
            atomic_write_json(os.path.join(out, f"engine_mtp_{cid}.rejudge.json"), rep, default=str)
    return worst_exit_code(codes)


def _print_verdict(title: str, rep: dict) -> int:
    problems = rep["problems"] if rep.get("problems") is not None else verdict_problems(rep)
    comp = rep.get("compilation") or {}
    if rep.get("drafter_mode") == "CUDA graphs":  # which configuration was judged, on the verdict line
        title += (f" [CUDA graphs: cudagraph_mode {comp.get('cudagraph_mode')}, compile {comp.get('compile_mode')}"
                  + (f"; {comp['compile_fallback']}" if comp.get("compile_fallback") else "") + "]")
    print(f"== {title}: PASS" if not problems else f"== {title}: FAIL: {problems[0]}", flush=True)
    for line in problems[1:12]:
        print("   problem:", line)
    if len(problems) > 12:
        print(f"   ... {len(problems) - 12} more problem(s) in the JSON report")
    for line in acceptance_disagreements(rep):
        print("   note (not in the verdict):", line)
    gap = upstream_gap(rep)
    if gap is not None and problems:
        print("   known vLLM gap:", gap[2])
    print("   counts:", json.dumps(rep["counts"]))
    if rep.get("acceptance"):
        print("   acceptance as vLLM counts it (accepted/drafted per request; over every verify step):",
              {k: f"{v['accepted']}/{v['drafted']} ({v['all_verify_steps']['accepted']}/"
                  f"{v['all_verify_steps']['drafted']})" for k, v in sorted(rep["acceptance"].items())})
    vsd = rep.get("vllm_spec_decode") or {}
    per = vsd.get("per_request")
    print("   vLLM's spec-decode counters (accepted/drafted per request):",
          {k: f"{v['accepted']}/{v['drafted']}" for k, v in per.items()} if isinstance(per, dict) else per,
          "totals:", vsd.get("totals"))
    print("   components (max |d|, calls out of tol):",
          {k: (round(v["max_abs"], 4), v.get("calls_out_of_tol")) for k, v in rep["components"].items()})
    print("   mismatch examples:", json.dumps(rep["mismatch_examples"][:3]))
    print("   replay errors:", rep["replay_errors"][:3], "tap errors:", [e[-300:] for e in rep["tap_errors"][:2]])
    print("   sharing:", json.dumps(rep.get("sharing")), "facts:", json.dumps(rep["facts"]))
    print("   timing:", {k: round(v, 1) for k, v in rep["timing_s"].items()}, flush=True)
    return EXIT_MISMATCH if problems else EXIT_OK


def upstream_gap(rep: dict):
    """The case's ``upstream_gaps`` entry whose speculator vLLM picked for this run, or None."""
    case = rep.get("case") if isinstance(rep.get("case"), dict) else {}
    proposer = str((rep.get("runner") or {}).get("proposer", ""))
    return next((tuple(g) for g in case.get("upstream_gaps") or () if g[0] in proposer), None)


def worst_exit_code(codes) -> int:
    """2 if any input was bad, else 1 if any case mismatched, else 125 if any could not be judged, else 0."""
    from harness.exitcodes import worst

    return worst(codes)

