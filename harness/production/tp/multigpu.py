"""Tensor-parallel production runs: vLLM's ``HYV4MTP`` on N GPUs, one process per rank.

vLLM's workers each join one TP group (``init_distributed_environment`` with
``world_size`` = TP, their rank, their GPU) and build the same model; the
linear layers shard themselves by rank, ``load_weights`` narrows every tensor
to the rank's part (the learnable sink by head range), and collectives
(all-reduce after row-parallel layers, all-gather of the vocab-parallel
logits) run over NCCL. ``TPWorkers`` starts exactly that: TP spawned
processes that stay up and run many cases (build, load, K proposer steps,
hooks) each, so the CUDA/JIT start-up is paid once per pool.

Every rank writes its own trace. ``merge_ranks`` turns the per-rank traces
into one trace of full shapes, with a rule per component that says what TP
does to it (the rules are asserted, not guessed: a component whose ranks
disagree with its rule is reported):

- replicated (embeddings, norms, the MLA down-projections, the indexer and its
  top-k, router, post-all-reduce outputs, logits): every rank holds the same
  full tensor; ranks must be bitwise equal; rank 0's is used. Top-k index rows
  compare as sets (the kernels' output order is free); rows whose sets differ
  across ranks are "rank-variant": ``run_case_tp`` judges every rank's rows
  against the reference (score ties allowed);
- head-sharded (``attn.q``, ``attn.core``, ``attn.gate``): rank r holds heads
  [r*H/TP, (r+1)*H/TP); concatenated along the head dimension;
- partial sums (``moe.shared``): rank r's output covers its slice of the
  intermediate dimension; summed over ranks (float32);
- anything else whose rank shape differs from the full shape (found by the
  template trace: TP = 1 or the reference) is concatenated along the one
  dimension that differs, and reported as such.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback

import torch

from harness.trace_compare import index_rows_differing
# The merge rule of each component is its registry record's ``tp``. HYV4MoE builds its shared
# experts with reduce_results=False: each rank's module output is its intermediate slice's partial
# sum, all-reduced later together with the routed experts' partial sums inside FusedMoE.
from harness.components import HEAD_SHARDED, INDEX_COMPONENTS, PARTIAL_SUM
from harness.verdict import Verdict


def _worker(rank: int, world: int, init_method: str, jobs, results) -> None:
    """One TP rank: joins the group, then runs cases from ``jobs`` until it gets None."""
    import dataclasses

    from safetensors.torch import save_file

    import reference as R
    from harness.production.module.runner import ProductionSession
    from harness.production.case_inputs import _case_from_dict, case_inputs

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    while True:
        job = jobs.get()
        if job is None:
            return
        job_id, case_json, out_path = job
        try:
            case = _case_from_dict(json.loads(case_json))
            hf, ckpt, _ = case_inputs(case)
            cfg = R.MTPConfig.from_hf_dict(hf)
            first = R.make_case(cfg, case.seed, case.requests, case.tokens)
            sess = ProductionSession(hf, num_speculative_tokens=case.steps, device=dev,
                                     tensor_parallel_size=world, rank=rank, init_method=init_method,
                                     kv_cache_dtype=case.kv_cache_dtype)
            sess.load(ckpt, strict=not case.known_audit)
            prod = sess.run(first, case.steps)
            torch.cuda.synchronize(dev)
            sinks = {n: p.detach().float().cpu().tolist() for n, p in sess.model.named_parameters()
                     if "learnable_sink" in n}
            save_file({k: v.contiguous() for k, v in prod.items()}, out_path)
            results.put((rank, job_id, {"ok": True, "path": out_path, "audit": sess.audit_problems,
                                         "step_notes": [dataclasses.asdict(n) for n in sess.notes],
                                         "sinks": sinks}))
            del sess
            torch.cuda.empty_cache()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
            from harness.production.module.audit import LoadAuditError

            results.put((rank, job_id, {"ok": False, "error": f"{exc.__class__.__name__}: {exc}",
                                      "traceback": traceback.format_exc(),
                                      "audit_problems": list(exc.problems) if isinstance(exc, LoadAuditError)
                                      else None}))


class TPWorkerError(RuntimeError):
    pass


class TPWorkers:
    """``with TPWorkers(2) as w: ranks, info = w.run(case)`` runs ``case`` at TP = 2.

    ``ranks`` is the list of per-rank traces (``{"step{k}.{component}": tensor}``),
    ``info`` per rank: audit problems, step notes, the loaded sink values.
    """

    def __init__(self, tp: int, *, timeout_s: float = 900.0) -> None:
        if tp < 2:
            raise ValueError(f"TPWorkers needs tp >= 2, got {tp}")
        if torch.cuda.device_count() < tp:
            raise TPWorkerError(f"TP={tp} needs {tp} GPUs, found {torch.cuda.device_count()}")
        self.tp = tp
        self.timeout_s = timeout_s
        self.dir = tempfile.mkdtemp(prefix=f"hyv4-tp{tp}-")
        self.procs: list = []
        self._job = 0

    def __enter__(self) -> "TPWorkers":
        import torch.multiprocessing as mp

        from harness.production.module.build import free_port

        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(self.tp)]
        init = f"tcp://127.0.0.1:{free_port()}"
        for r in range(self.tp):
            p = ctx.Process(target=_worker, args=(r, self.tp, init, self.jobs[r], self.results),
                            daemon=True)
            p.start()
            self.procs.append(p)
        return self

    def run(self, case, hf_config: dict | None = None) -> tuple[list[dict], list[dict]]:
        """Run ``case`` on every rank; waits for all ranks' answers (stale answers of an
        earlier, failed job are dropped), then raises the first rank's error if any.
        ``hf_config``: the case's config where the caller holds it (checked against TP here)."""
        import dataclasses
        import queue

        from safetensors.torch import load_file

        import reference as R
        from harness.presets import check_kernel_constraints
        from harness.production.case_inputs import case_inputs

        hf = hf_config if hf_config is not None else case_inputs(case)[0]
        check_kernel_constraints(R.MTPConfig.from_hf_dict(hf), quantized=case.quant != "bf16", tp=self.tp)
        self._job += 1
        job = self._job
        case_json = json.dumps(dataclasses.asdict(case), sort_keys=True)
        for r in range(self.tp):
            self.jobs[r].put((job, case_json, os.path.join(self.dir, f"{case.id}.rank{r}.safetensors")))
        got: dict[int, dict] = {}
        while len(got) < self.tp:
            try:
                rank, job_id, info = self.results.get(timeout=self.timeout_s)
            except queue.Empty:
                dead = [f"rank {r} exit {p.exitcode}" for r, p in enumerate(self.procs) if not p.is_alive()]
                raise TPWorkerError(f"TP={self.tp} case {case.id}: no answer in {self.timeout_s:.0f} s"
                                    + (f" ({', '.join(dead)})" if dead else "")) from None
            if job_id == job:
                got[rank] = info
        for r in range(self.tp):
            if not got[r]["ok"] and got[r].get("audit_problems"):  # vLLM's load failed: a bad commit (exit 1)
                from harness.production.module.audit import LoadAuditError

                raise LoadAuditError([f"rank {r}: {p}" for p in got[r]["audit_problems"]])
            if not got[r]["ok"]:
                raise TPWorkerError(f"TP={self.tp} case {case.id}, rank {r}: {got[r]['error']}\n"
                                    f"{got[r]['traceback']}")
        traces = [load_file(got[r]["path"]) for r in range(self.tp)]
        for r in range(self.tp):
            os.unlink(got[r]["path"])
        return traces, [got[r] for r in range(self.tp)]

    def __exit__(self, *exc) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)


def _component(key: str) -> str:
    return key.split(".", 1)[1] if key.startswith("step") and "." in key else key


def merge_ranks(ranks: list[dict], template: dict) -> tuple[dict, dict]:
    """One full-shape trace from per-rank traces; (trace, {key: rule or problem}).

    ``template`` holds the full shapes (a TP = 1 trace or the reference's). The
    rules are in the module docstring; a replicated component whose ranks are
    not bitwise equal, or a sharded one whose shapes do not add up, is reported
    in the second dict under ``"problem: ..."`` (a replicated one keeps rank 0's
values, so the comparison with the reference still runs; a tiling problem is
left out of the trace).
    """
    tp = len(ranks)
    merged: dict = {}
    rules: dict = {}
    for key in ranks[0]:
        parts = [r[key] for r in ranks]
        full = template.get(key)
        shapes = {tuple(p.shape) for p in parts}
        if _component(key) in PARTIAL_SUM and len(shapes) == 1 and (
                full is None or tuple(parts[0].shape) == tuple(full.shape)):
            merged[key] = torch.stack([p.float() for p in parts]).sum(0)
            rules[key] = "partial-sum: summed over ranks"
            continue
        if full is None or tuple(parts[0].shape) == tuple(full.shape):
            if len(shapes) == 1 and all(torch.equal(parts[0], p) for p in parts[1:]):
                merged[key] = parts[0]
                rules[key] = "replicated"
            elif len(shapes) == 1 and _component(key) in INDEX_COMPONENTS:
                # top-k rows: the kernel's output order is not part of the contract
                differ = sum(len(index_rows_differing(p, parts[0])) for p in parts[1:])
                merged[key] = parts[0]
                rules[key] = ("replicated (same sets, order differs)" if differ == 0
                              else f"rank-variant: {differ} row(s) select different sets across ranks")
            else:
                diff = max(float((p.double() - parts[0].double()).abs().max()) for p in parts[1:]) \
                    if len(shapes) == 1 else None
                rules[key] = f"problem: replicated component differs across ranks (max diff {diff})"
                merged[key] = parts[0]  # judged as rank 0's; the problem is reported
            continue
        dims = [d for d in range(full.dim()) if parts[0].shape[d] != full.shape[d]]
        if (len(shapes) == 1 and parts[0].dim() == full.dim() and len(dims) == 1
                and parts[0].shape[dims[0]] * tp == full.shape[dims[0]]):
            merged[key] = torch.cat(parts, dim=dims[0])
            kind = "head-sharded" if _component(key) in HEAD_SHARDED else "sharded"
            rules[key] = f"{kind}: concatenated along dim {dims[0]}"
        else:
            rules[key] = (f"problem: rank shapes {sorted(shapes)} do not tile the full shape "
                          f"{tuple(full.shape)} over {tp} ranks")
    return merged, rules


def run_case_tp(workers: TPWorkers, case, inputs=None) -> Verdict:
    """``case`` at TP = ``workers.tp`` and in this process at TP = 1, each judged against
    the reference; plus TP vs TP = 1: a ``Verdict`` of kind "tp" whose ``parts`` are the two
    judged runs ("tp1", "tpn") and their comparison ("tp_vs_tp1", a ``trace_compare.Report``), its
    ``details`` the merge rules, the rank-variant rows and the bitwise-equal keys. ``inputs``: the
    case's ``CaseInputs`` (else built here); each rank's process builds its own from the case."""
    from harness import trace_compare
    from harness.components import PRODUCTION_COMPONENTS
    from harness.production.module.side_by_side import run_case
    from harness.production.judging.trace_judge import judge
    from harness.production.judging.tolerances import tolerances_for
    from harness.production.case_inputs import build_inputs

    inputs = inputs if inputs is not None else build_inputs(case)  # this process's TP = 1 run and both judges
    tp1 = run_case(case, inputs=inputs)
    ranks, infos = workers.run(case, hf_config=inputs.hf_config)
    merged, rules = merge_ranks(ranks, tp1.trace)
    tpn = judge(case, merged, {"audit": sorted({p for i in infos for p in i["audit"]}),
                               "step_notes": infos[0]["step_notes"]}, inputs=inputs)
    tols = tolerances_for(case.quant)
    # rank-variant top-k rows: every rank's own rows against the reference (ties allowed)
    variant = []
    for key, rule in rules.items():
        if rule.startswith("rank-variant") and key in tpn.reference:
            step = key.split(".", 1)[0]
            for r, tr in enumerate(ranks):
                res = trace_compare.compare_index_sets(f"{key}[rank {r}]", tr[key], tpn.reference[key],
                                                 tpn.reference.get(f"{step}.indexer.scores"),
                                                 tols["indexer.scores"].atol)
                variant.append(res)
    vs = compare_tp(tpn, tp1, tols, PRODUCTION_COMPONENTS)
    bitwise = sorted(k for k in merged if k in tp1.trace and merged[k].shape == tp1.trace[k].shape
                     and torch.equal(merged[k], tp1.trace[k]))
    return Verdict(kind="tp", passed=tpn.passed and vs.passed, first_divergent=tpn.first_divergent, rows=tpn.rows,
                   regimes=tpn.regimes, notes=tpn.notes, trace=merged, reference=tpn.reference,
                   trace_compared=tpn.trace_compared, comparison=tpn.comparison,
                   parts={"tp1": tp1, "tpn": tpn, "tp_vs_tp1": vs},
                   details={"case": case.id, "tp": workers.tp, "rules": rules, "rank_variant_vs_reference": variant,
                            "bitwise_equal_to_tp1": bitwise, "sinks": {r: i["sinks"] for r, i in enumerate(infos)}})


def compare_tp(tpn: Verdict, tp1: Verdict, tols: dict, components: tuple):
    """TP = N vs TP = 1 (two ``judge`` results): step 0 component by component, draft tokens at every step.

    Both traces are normalised as ``judge`` normalises them (indexer scale
    recovered, expert ids sorted; rows with a routing near-tie against the
    reference masked as NaN: on either side, so on both). Index-set ties are
    judged on the reference's scores. Steps >= 1 run on each run's own
    previous output (the proposer feeds it back), so their inputs already
    differ and only the draft tokens are compared there (exact where the logit
    margin decides). The bounds are the reference tables: each run is within
    them of the spec, and TP moves only the reduction order (per-rank partial
    sums rounded to bf16 before the all-reduce, ~1 ulp at step 0).
    """
    from harness import trace_compare

    a, e = {}, {}
    for key, v in tpn.trace_compared.items():
        step = key.split(".", 1)[0]
        if key not in tp1.trace_compared or not (step == "step0" or key.endswith(".draft_token")
                                               or key.endswith(".logits")):
            continue
        w = tp1.trace_compared[key]
        if v.is_floating_point() and w.is_floating_point() and v.shape == w.shape:
            m = torch.isnan(v.double()) | torch.isnan(w.double())
            if m.any():
                v = v.double().masked_fill(m, float("nan"))
                w = w.double().masked_fill(m, float("nan"))
        a[key], e[key] = v, w
    e.update({k: v for k, v in tp1.reference.items() if k.startswith("step0.") and k.endswith(".indexer.scores")})
    wanted = tuple(components)
    rep = trace_compare.compare_traces(a, e, tols, components=wanted)
    # steps >= 1: only the tokens (their logits serve as the margin for the token check)
    return trace_compare.Report([r for r in rep.results
                                 if r.name.startswith("step0.") or r.name.endswith(".draft_token")])


def summary(res: Verdict) -> dict:
    """The JSON-able part of ``run_case_tp``'s verdict, for reports."""
    vs, tp1, tpn, d = res.parts["tp_vs_tp1"], res.parts["tp1"], res.parts["tpn"], res.details
    return {
        "case": d["case"], "tp": d["tp"],
        "tp1_vs_reference": tp1.passed, "tpn_vs_reference": tpn.passed,
        "tpn_first_divergent": tpn.first_divergent,
        "tp_vs_tp1": vs.passed, "tp_vs_tp1_first_divergent": vs.first_divergent.name if vs.first_divergent else None,
        "tp_vs_tp1_rows": [{"key": r.name, "passed": r.passed, "max_abs": r.max_abs, "note": r.note}
                           for r in vs.results],
        "rules": d["rules"], "bitwise_equal_to_tp1": d["bitwise_equal_to_tp1"],
        "rank_variant_vs_reference": [{"key": r.name, "passed": r.passed, "ties": r.ties, "note": r.note}
                                      for r in d["rank_variant_vs_reference"]],
        "tokens": {"tp1": tp1.details["tokens"]["production"], "tpn": tpn.details["tokens"]["production"]},
    }
