"""Engine level: ``vllm.LLM`` with MTP speculative decoding, its draft tokens checked against the reference.

    python -m harness.production.engine [--case ID ...] [--out DIR]      # exit 0 / 1 / 2 / 125 (harness.exitcodes)
    python -m harness.production.engine --rejudge DIR [--out DIR2]       # CPU, no vLLM: re-judge saved runs

Each run also saves its recording under --out (``engine_calls_<case>.safetensors`` +
``.json``: every tensor the replay needs, the calls' metadata, the load audit), so
``--rejudge`` can replay and judge it offline.

DESIGN.md's "engine capture and replay". What runs (vLLM 0.33.0, all in this process,
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
   component hooks of ``capture.py`` record the top-k rows the sparse attention
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

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from harness.atomic import atomic_write_json
from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK

from . import audit, build, capture
from .checkpoint_cast import cast_for_vllm
from .engine_replay import (DraftCall, component_errors, expects_logits, judge_tokens, load_recording, replay,
                            run_facts, save_recording)


@dataclasses.dataclass(frozen=True)
class EngineCase:
    id: str
    overrides: tuple = ()
    preset: str = "tiny"
    seed: int = 0
    num_speculative_tokens: int = 3
    prompt_lens: tuple = (200, 37, 150)  # one longer than index_topk (128): the indexer's choice matters
    max_tokens: int = 32
    gpu_memory_utilization: float = 0.3


ENGINE_CASES: dict[str, EngineCase] = {c.id: c for c in (
    # index sharing: step 0 runs the indexer, steps 1..K-1 reuse its rows compacted to the sampled rows
    EngineCase("engine-tiny-k3-share", overrides=(("index_share_for_mtp_iteration", True),), seed=31),
    # no sharing: every draft step runs the indexer
    EngineCase("engine-tiny-k2", num_speculative_tokens=2, seed=32, prompt_lens=(160, 9, 140)),
)}


# ---- building the engine and reaching the drafter ---------------------------------------------

def engine_kwargs(model_dir: str, case: EngineCase) -> dict:
    """``vllm.LLM`` / ``EngineArgs`` arguments: eager, block 64, no tokenizer, dummy weights, MTP."""
    from .vllm_config import BLOCK_SIZE

    return dict(
        model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
        block_size=BLOCK_SIZE, max_model_len=1024, max_num_batched_tokens=2048, max_num_seqs=8,
        enforce_eager=True, load_format="dummy", gpu_memory_utilization=case.gpu_memory_utilization,
        enable_prefix_caching=False,  # a cache hit would skip draft KV writes the reference needs
        seed=case.seed,
        speculative_config={"method": "mtp", "num_speculative_tokens": case.num_speculative_tokens},
    )


def build_llm(hf_config: dict, case: EngineCase):
    """``vllm.LLM`` in this process for ``hf_config`` (target + MTP draft, dummy weights)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core + worker in this process
    from vllm import LLM

    from .vllm_config import write_model_dir

    return LLM(**engine_kwargs(write_model_dir(hf_config), case))


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


def load_draft_weights(runner, draft, ckpt: dict) -> dict:
    """Load ``ckpt`` into the live draft as vLLM's loader does; audit; check it landed."""
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
    inner = draft.model
    layer = next(iter(inner.layers.values()))
    name = next(k for k in ckpt if k.endswith(".enorm.weight"))
    landed = {
        "embed_tokens": bool(torch.equal(inner.embed_tokens.weight[: ckpt["model.embed_tokens.weight"].shape[0]].cpu(),
                                         ckpt["model.embed_tokens.weight"].to(inner.embed_tokens.weight.dtype))),
        "enorm": bool(torch.equal(layer.enorm.weight.cpu(), ckpt[name].to(layer.enorm.weight.dtype))),
    }
    return {"loaded_params": len(loaded), "audit": problems, "audit_raw": raw,
            "derived_weights": {n: ok for n, ok in derived.items()}, "landed": landed}


# the absorbed MLA weights MLAAttention.process_weights_after_loading derives from kv_b_proj
DERIVED_MLA_WEIGHTS = ("W_UK_T", "W_UV")


def derived_weight_check(model) -> dict[str, object]:
    """{full name of each MLA derived weight: True when it equals vLLM's own recomputation
    from the live ``kv_b_proj`` (``split_kv_b_proj``, permuted as process_weights_after_loading
    stores it), else why not}."""
    from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

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


class DrafterTap:
    """Hooks on the proposer and its ``HYV4MTP`` that record one ``DraftCall`` per draft forward."""

    def __init__(self, proposer, draft) -> None:
        self.proposer, self.draft = proposer, draft
        self.calls: list[DraftCall] = []
        self.proposals: list[dict] = []
        self.errors: list[str] = []
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

    def _guard(self, what: str, fn) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - never break the engine; report it
            if len(self.errors) < 20:
                self.errors.append(f"{what}: {traceback.format_exc()}")

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
        from vllm.forward_context import get_forward_context

        ids, pos = _arg(args, kwargs, "input_ids", 0), _arg(args, kwargs, "positions", 1)
        hidden = _arg(args, kwargs, "hidden_states", 2)
        spec = int(kwargs.get("spec_step_idx", 0) or 0)
        layer_idx = spec % len(self.mla_layer)
        fc = get_forward_context()
        mds = fc.attn_metadata[0] if isinstance(fc.attn_metadata, list) else fc.attn_metadata
        md = mds.get(self.mla_layer[layer_idx]) if isinstance(mds, dict) else mds
        if md is None:
            raise RuntimeError(f"no attention metadata for {self.mla_layer[layer_idx]}; "
                               f"keys: {sorted(mds)[:12] if isinstance(mds, dict) else type(mds)}")
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
        if self.in_propose and self.draft_step == 0 and torch.is_tensor(lti):
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
        call.logits = logits.detach().float().cpu()
        call.tokens = call.logits.argmax(dim=-1)
        call.notes["ambiguous_sample_rows"] = ambiguous
        lti = getattr(self.proposer, "last_token_indices", None)  # V2 proposer's step-0 sample rows
        if call.draft_step == 0 and torch.is_tensor(lti):
            call.notes["proposer_last_token_indices"] = lti[: rows.numel()].tolist()


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

def prompts_for(case: EngineCase, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(case.seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in case.prompt_lens]


def run_case(case: EngineCase, *, log=print, out: str | None = None) -> dict:
    """Build, load, hook, generate, replay, judge; the report as a JSON-able dict."""
    import reference as R
    from harness.presets import check_kernel_constraints
    from harness.production.side_by_side import GpuCase, case_inputs, versions

    t0 = time.perf_counter()
    hf, ckpt, weights = case_inputs(GpuCase(case.id, preset=case.preset, overrides=case.overrides, seed=case.seed))
    cfg = R.MTPConfig.from_hf_dict(hf)
    check_kernel_constraints(cfg)
    rep: dict = {"case": dataclasses.asdict(case), "versions": versions(), "timing_s": {}}
    llm = build_llm(hf, case)
    rep["timing_s"]["build"] = time.perf_counter() - t0
    runner = model_runner(llm)
    prop, draft, target, kind = drafter_of(runner)
    rep["runner"] = {"kind": kind, "runner": type(runner).__name__, "proposer": type(prop).__name__,
                     "draft_model": type(prop.model).__name__, "target_model": type(target).__name__}
    rep["sharing"] = sharing_facts(draft, target)
    log("engine:", json.dumps(rep["runner"]), "sharing:", json.dumps(rep["sharing"]))
    rep["load"] = load_draft_weights(runner, draft, ckpt)
    log("load:", json.dumps(rep["load"]))
    tap = DrafterTap(prop, draft)
    rep["attach_notes"] = tap.attach_notes
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens, ignore_eos=True, detokenize=False)
    prompts = prompts_for(case, cfg.vocab_size)
    t1 = time.perf_counter()
    tap.armed = True
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        tap.armed = False
        tap.remove()
    rep["timing_s"]["generate"] = time.perf_counter() - t1
    rep["generated"] = [list(o.outputs[0].token_ids) for o in outs]
    for e in tap.errors[:3]:
        log("tap error:", e)
    if out:  # before judging: a crash in the replay still leaves the recording for --rejudge
        try:
            stem = os.path.join(out, f"engine_calls_{case.id}")
            os.makedirs(out, exist_ok=True)
            meta = {"case": dataclasses.asdict(case), "versions": rep["versions"], "runner": rep["runner"],
                    "sharing": rep["sharing"], "load": rep["load"], "tap_errors": tap.errors,
                    "generated": rep["generated"], "prompts": prompts}
            rep["recording"] = save_recording(stem, tap.calls, tap.proposals, meta)
            log("recording:", stem + ".safetensors", json.dumps(rep["recording"]))
        except Exception:  # noqa: BLE001 - the verdict does not depend on it
            rep["recording"] = {"error": traceback.format_exc()}
            log("recording failed:", rep["recording"]["error"])
    rep.update(judge_run(cfg, weights, tap.calls, tap.proposals, tap.errors, case, log=log))
    rep["timing_s"]["reference"] = rep.pop("reference_s")
    rep["timing_s"]["total"] = time.perf_counter() - t0
    rep["passed"] = verdict_problems(rep) == []
    return rep


def judge_run(cfg, weights, recorded: list[DraftCall], proposals: list[dict], tap_errors: list[str],
              case: EngineCase, *, log=print) -> dict:
    """Replay the recorded draft forwards with the float64 reference and judge them (CPU):
    ``counts``, ``facts``, ``mismatch_examples``, ``replay_errors``, ``components``, ``tap_errors``."""
    import reference as R
    from harness.production.tolerances import tolerances_for

    calls = [c for c in recorded if c.engine_step >= 0]
    facts = run_facts(recorded, proposals)
    log(f"recorded {len(recorded)} draft forwards in {facts['engine_steps']} engine steps; facts:", json.dumps(facts))
    for i, c in enumerate(calls[: 2 * case.num_speculative_tokens + 2]):
        span = f"{int(c.positions.min())}..{int(c.positions.max())}" if c.num_tokens else "-"
        lti = None if c.last_token_indices is None else c.last_token_indices.tolist()
        log(f"  call {i}: engine_step {c.engine_step} draft_step {c.draft_step} T={c.num_tokens} "
            f"qsl={c.query_start_loc.tolist()[:9]} keys={c.request_keys.tolist()} pos[{span}] "
            f"positions={c.positions.tolist()[:16] if c.num_tokens <= 16 else '...'} "
            f"seq_lens={None if c.seq_lens is None else c.seq_lens.tolist()} last_token_indices={lti} "
            f"sample_rows={None if c.sample_rows is None else c.sample_rows.tolist()} "
            f"tokens={None if c.tokens is None else c.tokens.tolist()} topk={'yes' if c.topk_rows is not None else 'no'} "
            f"notes={json.dumps(c.notes, default=str)}")
    t = time.perf_counter()
    replays = replay(cfg, weights, calls, R.EXACT)
    t_ref = time.perf_counter() - t
    tols = tolerances_for("bf16")
    tokens = judge_tokens(calls, replays, tols["logits"])
    errors = [(i, r.error) for i, r in enumerate(replays) if r.error]
    counts = {
        "calls": len(calls), "engine_steps": facts["engine_steps"],
        "drafted": tokens["drafted"], "compared": tokens["compared"], "ties": tokens["ties"],
        "ties_differing": tokens["ties_differing"], "mismatches": tokens["mismatches"],
        "not_replayed": tokens["not_replayed"], "replay_errors": len(errors),
        "calls_without_logits": sum(c.tokens is None and expects_logits(c, proposals) for c in calls),
        "sampled_row_not_last_token_index": facts["sampled_row_not_last_token_index"],
        "seq_len_disagreements": facts["seq_len_disagreements"],
        "step0_without_last_token_indices": sum(c.draft_step == 0 and c.last_token_indices is None for c in calls),
        "unmatched_sample_rows": sum(int((c.sample_rows < 0).sum()) for c in calls if c.sample_rows is not None),
        "ambiguous_sample_rows": sum(c.notes.get("ambiguous_sample_rows", 0) for c in calls),
        "calls_without_topk_rows": sum(c.topk_rows is None for c in calls) if cfg.attention_sparse else 0,
        "topk_rows_differing": sum(r.topk_rows_differing for r in replays),
        "max_context": facts["max_context"], "index_topk": cfg.index_topk,
        "max_draft_steps": facts["max_draft_steps"], "num_speculative_tokens": case.num_speculative_tokens,
        "proposal_token_disagreements": facts.get("proposal_token_disagreements"),
        "tap_errors": len(tap_errors),
    }
    return {"counts": counts, "facts": facts, "mismatch_examples": tokens["mismatch_examples"],
            "replay_errors": [f"call {i}: {e}" for i, e in errors[:10]],
            "components": component_errors(calls, replays, tols), "tap_errors": list(tap_errors),
            "reference_s": t_ref}


def verdict_problems(rep: dict) -> list[str]:
    """Why ``rep`` fails the engine-level check (empty: it passes)."""
    c = rep["counts"]
    p = []
    if c["mismatches"]:
        p.append(f"{c['mismatches']} draft token(s) differ from the reference with a decisive margin")
    if c["compared"] < 1:
        p.append("no draft token was compared")
    for key in ("replay_errors", "not_replayed", "calls_without_logits", "unmatched_sample_rows",
                "tap_errors", "proposal_token_disagreements",
                # the replay's model of the proposer (engine_replay's module doc) does not hold
                "sampled_row_not_last_token_index", "seq_len_disagreements", "step0_without_last_token_indices"):
        if c.get(key):
            p.append(f"{key}: {c[key]}")
    if rep.get("load", {}).get("audit"):
        p.append(f"post-load audit: {rep['load']['audit'][:3]}")
    if not all(rep.get("load", {}).get("landed", {}).values()):
        p.append(f"synthetic weights did not land in the live draft: {rep['load'].get('landed')}")
    if c["max_context"] <= c["index_topk"]:
        p.append(f"no call had a context longer than index_topk ({c['max_context']} <= {c['index_topk']})")
    if c["num_speculative_tokens"] >= 2 and c["max_draft_steps"] < 2:
        p.append(f"the drafter ran {c['max_draft_steps']} step(s) per engine step (K={c['num_speculative_tokens']})")
    return p


def main(argv=None) -> int:
    """Exit codes are ``harness.exitcodes``'s; an error is one line (``--debug``: with its traceback)."""
    from harness.exitcodes import OneLineParser, run_guarded

    ap = OneLineParser(prog="python -m harness.production.engine", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(ENGINE_CASES),
                    help="case id (default: all)")
    ap.add_argument("--out", default=None, help="directory for engine_mtp_<case>.json (default $HYV4_REPORT_DIR)")
    ap.add_argument("--rejudge", metavar="DIR", default=None,
                    help="re-judge the recordings engine_calls_<case>.* saved in DIR (CPU, no vLLM); "
                         "reports to --out as engine_mtp_<case>.rejudge.json")
    ap.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    args = ap.parse_args(argv)
    return run_guarded(_main, args, debug=args.debug)


def _check_out_dir(out: str | None) -> None:
    from harness.exitcodes import CLIError

    if out and os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out}: exists and is not a directory")


def _case_failed(title: str, exc: Exception, debug: bool) -> tuple[dict, int]:
    """(report, exit code) of a case that raised: one line (the traceback goes to the report)."""
    from harness.exitcodes import classify

    code, line = classify(exc)
    if debug:
        traceback.print_exception(exc)
    print(f"== {title}: ERROR {line}", flush=True)
    return {"case": title, "error": traceback.format_exc(), "exit_code": code}, code


def _main(args) -> int:
    _check_out_dir(args.out)
    if args.rejudge:
        return rejudge_dir(args.rejudge, args.case, args.out, debug=args.debug)
    from harness.runtime import cannot_run_production_reason

    reason = cannot_run_production_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return EXIT_CANNOT_JUDGE
    out = args.out or os.environ.get("HYV4_REPORT_DIR")
    _check_out_dir(out)
    ids = args.case or list(ENGINE_CASES)
    if len(ids) > 1:  # one engine per process: vLLM's distributed state and GPU memory are per process
        return worst_exit_code([subprocess.call([sys.executable, "-m", "harness.production.engine", "--case", cid]
                                                + (["--out", out] if out else [])
                                                + (["--debug"] if args.debug else [])) for cid in ids])
    codes = []
    for cid in ids:
        try:
            rep = run_case(ENGINE_CASES[cid], out=out)
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
    d["prompt_lens"] = tuple(d.get("prompt_lens", ()))
    return EngineCase(**d)


def rejudge(stem: str, *, log=print) -> dict:
    """Replay and judge one saved recording (``<stem>.safetensors`` + ``.json``) on CPU."""
    import reference as R
    from harness.production.side_by_side import GpuCase, case_inputs

    calls, proposals, doc = load_recording(stem)
    meta = doc["meta"]
    case = case_from_dict(meta["case"])
    _hf, _ckpt, weights = case_inputs(GpuCase(case.id, preset=case.preset, overrides=case.overrides, seed=case.seed))
    cfg = R.MTPConfig.from_hf_dict(_hf)
    rep = {"case": meta["case"], "rejudged_from": stem, "versions": meta.get("versions"),
           "runner": meta.get("runner"), "sharing": meta.get("sharing"), "load": meta.get("load", {}),
           "recording": {k: v for k, v in doc.items() if k not in ("meta", "call_meta", "proposal_meta")}}
    rep.update(judge_run(cfg, weights, calls, proposals, list(meta.get("tap_errors", [])), case, log=log))
    rep["timing_s"] = {"reference": rep.pop("reference_s")}
    rep["passed"] = verdict_problems(rep) == []
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
    problems = verdict_problems(rep)
    print(f"== {title}: {'PASS' if not problems else 'FAIL'} counts {json.dumps(rep['counts'])}", flush=True)
    for line in problems:
        print("   problem:", line)
    print("   components (max |d|, calls out of tol):",
          {k: (round(v["max_abs"], 4), v.get("calls_out_of_tol")) for k, v in rep["components"].items()})
    print("   mismatch examples:", json.dumps(rep["mismatch_examples"][:3]))
    print("   replay errors:", rep["replay_errors"][:3], "tap errors:", [e[-300:] for e in rep["tap_errors"][:2]])
    print("   sharing:", json.dumps(rep.get("sharing")), "facts:", json.dumps(rep["facts"]))
    print("   timing:", {k: round(v, 1) for k, v in rep["timing_s"].items()}, flush=True)
    return EXIT_MISMATCH if problems else EXIT_OK


def worst_exit_code(codes) -> int:
    """2 if any input was bad, else 1 if any case mismatched, else 125 if any could not be judged, else 0."""
    from harness.exitcodes import worst

    return worst(codes)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the report is written: skip the in-process engine's teardown (a hang costs the GPU slot)
