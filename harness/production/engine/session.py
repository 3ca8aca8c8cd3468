"""Engine level, building: ``vllm.LLM`` with MTP speculative decoding built in this process, the
harness's seeded MTP weights loaded into its live drafter and audited (``build_session``).
Recording is ``taps.py``, judging ``judge.py``; the command is ``harness.commands.engine``.

    python -m harness engine [--case ID ...] [--out DIR]      # exit 0 / 1 / 2 / 125 (harness.exitcodes)
    python -m harness engine --rejudge DIR [--out DIR2]       # CPU, no vLLM: re-judge saved runs

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
5. ``draft_replay.replay``: the float64 reference over the recorded calls in
   order; draft tokens compared where the reference's logit margin is decisive.
   Step 0 of a decode runs over the rejected slots too, with stale ids / positions
   there: the replay keeps rows <= the proposer's ``last_token_indices`` (see
   ``draft_replay``'s module doc).

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

import dataclasses
import json
import os
import time

import torch

from harness.exitcodes import first_line
from harness.production.engine.engine_env import ENGINE_KV_GIB_ENV, JIT_WARMUP_ENV
from harness.case_specs import EngineCase
from harness.production.module import audit, build
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
    if os.environ.get(JIT_WARMUP_ENV, "").strip() == "0" and vllm_compat.available("kernel_config.enable_jit_warmup"):
        kw["kernel_config"] = {"enable_jit_warmup": False}  # compiled on first call (engine_env.JIT_WARMUP_ENV)
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
        kv_cache_dtype=case.kv_cache_dtype,  # "fp8": fp8_ds_mla rows on the sparse layers
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
    from harness.production import run_hooks

    run_hooks.fire("vllm_imported")  # e.g. the GC pause of `python -m harness engine` ends
    kw = engine_kwargs(write_model_dir(hf_config), case)
    try:
        llm = LLM(**kw)
        fallback = None
    except Exception as exc:  # only a compile failure is retried
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
        "embed_tokens_is_target's": (t_inner is not None
                                     and inner.embed_tokens is getattr(t_inner, "embed_tokens", None)),
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


def engine_inputs(case: EngineCase):
    """(hf config, checkpoint tensors for the draft, reference weights, acceptance plan or None)."""
    import reference as R
    from harness.production.case_inputs import case_inputs
    from harness.case_specs import GpuCase

    from harness.checkpoint.names import to_checkpoint

    hf, ckpt, weights = case_inputs(GpuCase(case.id, preset=case.preset, overrides=case.overrides, seed=case.seed))
    if case.target != "acceptance":
        return hf, ckpt, weights, None
    from harness.production.engine.acceptance import acceptance_weights, plan_for

    cfg = R.MTPConfig.from_hf_dict(hf)
    plan = plan_for(cfg.hidden_size, cfg.vocab_size, case.seed)
    weights = acceptance_weights(cfg, weights, plan, case.seed)
    return hf, to_checkpoint(cfg, weights), weights, plan  # bf16, mtp_layers naming, split experts


def prompts_for(case: EngineCase, vocab: int, plan=None) -> list[list[int]]:
    if case.target == "acceptance":
        from harness.production.engine.acceptance import prompts
        return prompts(plan, case.patterns, case.prompt_lens, case.seed)
    g = torch.Generator().manual_seed(case.seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in case.prompt_lens]


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
    phases = {"inputs": time.perf_counter() - t0}
    base: dict = {"case": dataclasses.asdict(case), **run_facts()}
    phases["facts"] = time.perf_counter() - t0 - phases["inputs"]
    llm = build_llm(hf, case, log=log)
    build_s = time.perf_counter() - t0
    phases["llm"] = build_s - phases["inputs"] - phases["facts"]  # vLLM's engine: model, KV cache, capture
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
    base["kv_cache"] = kv_cache_facts(draft)
    base["sharing"] = sharing_facts(draft, target)
    log("engine:", json.dumps(base["runner"]), "sharing:", json.dumps(base["sharing"]))
    # graphs were captured while the engine was built: what is loaded or edited from here on must
    # land at the addresses they read (in place), or graph replay would judge vLLM's dummy weights
    ptrs = _param_addresses(draft, target) if case.graphs else None
    t_load = time.perf_counter()
    base["load"] = load_draft_weights(runner, draft, ckpt, known_audit=case.known_audit)
    phases["load"] = time.perf_counter() - t_load
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
    base["build_phases_s"] = {k: round(v, 2) for k, v in phases.items()}  # where the build's seconds went
    return {"case": case, "cfg": cfg, "weights": weights, "plan": plan, "llm": llm, "proposer": prop,
            "draft": draft, "target": target, "base": base, "build_s": build_s}


def kv_cache_facts(draft) -> dict[str, str | None]:
    """{draft attention module: the KV cache dtype its MLA layer stores} (``fp8_ds_mla`` where the
    engine was asked for fp8 and vLLM promoted it): the proof a case ran the cache it names."""
    return {name: getattr(m.mla_attn, "kv_cache_dtype", None)
            for name, m in draft.named_modules() if hasattr(m, "mla_attn")}


def _param_addresses(draft, target) -> dict[str, int]:
    """{"draft.<name>" / "target.<name>": data pointer} of every parameter and buffer."""
    out = {}
    for tag, m in (("draft", draft), ("target", target)):
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            out[f"{tag}.{name}"] = t.data_ptr()
    return out
