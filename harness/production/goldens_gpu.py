"""Production goldens: vLLM's own trace of a GPU case, recorded on a known-good
vLLM and platform, checked with tolerances far tighter than the reference's.

They catch production drift that the reference tolerance (bf16 / FP8 noise)
would hide, e.g. a kernel change of one bf16 ulp. A golden belongs to its
platform (GPU model, torch, CUDA, vLLM): on another one the check reports "no
golden for this platform" instead of failing.

    python -m harness.production.goldens_gpu record --root DIR [--case ID ...]
    python -m harness.production.goldens_gpu check [--case ID ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from harness import goldens
from harness.compare import INDEX_COMPONENTS, Report, Tolerance, compare_traces, index_rows_differing
from harness.production.tolerances import GPU_VS_REFERENCE

KIND = "production"
GOLDEN_CASES = ("tiny-k3-share", "tiny-k2-long")
# Components stored (small, and spanning the dataflow): tensors of one step.
STORED = ("eh_proj", "attn.kv_c", "indexer.topk", "attn.topk", "attn.core", "attn.out", "moe.router_logits",
          "moe.topk_ids", "moe.topk_weights", "mlp.out", "final_norm", "logits", "draft_token")
# Same platform, same inputs: the kernels should reproduce themselves. bf16
# values: any change is >= 1 ulp = 2^-8 relative, so rtol 2^-10 flags it;
# fp32 values (router logits, logits, top-k weights): 1e-6 relative absorbs
# reduction-order jitter of split-K kernels, nothing more.
TIGHT = {
    "bf16": Tolerance(0.0, 2.0**-10, "none: any bf16 change is one ulp (2^-8) or more"),
    "fp32": Tolerance(1e-7, 1e-6, "fp32 reduction-order jitter only"),
}


# Measured on an H200 (vLLM 0.33.0, torch 2.11+cu130): two runs of
# tiny-k2-long differ in a few of 317 step-0 rows (1 row on 2026-11-30, 4 rows
# on 2026-12-01), all queries with a context longer than index_topk:
# attn.core by one bf16 ulp, propagated through that row's o_proj, router
# logits and MLP, with equal top-k sets. The likely cause is the order in which
# FlashMLA sparse sums the selected keys (the top-k kernel's output order is not
# run-to-run stable). Such "order-variant" rows (position + 1 > index_topk) are
# therefore judged at the reference tolerance (GPU_VS_REFERENCE), and a routing
# or token flip there is reported, not failed; every other row keeps the tight
# tolerance, so a one-ulp kernel change in the short-context rows still fails.


def platform() -> dict:
    import vllm

    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "vllm": vllm.__version__}


def _subset(prod: dict) -> dict:
    return {k: v.detach().cpu().contiguous() for k, v in prod.items() if k.split(".", 1)[1] in STORED}


def _tolerances(stored: dict) -> dict:
    out = {}
    for key, v in stored.items():
        comp = key.split(".", 1)[1]
        out[comp] = TIGHT["fp32" if v.dtype in (torch.float32, torch.float64) else "bf16"]
    return out


def record(case_id: str, prod: dict, root: Path = goldens.ROOT) -> Path:
    return goldens.write(KIND, case_id, _subset(prod), {
        "case": case_id, "platform": platform(), "versions": platform(),
        "components": list(STORED), "tolerance": {k: [t.atol, t.rtol] for k, t in TIGHT.items()}}, root)


def has_golden(case_id: str, root: Path = goldens.ROOT) -> bool:
    """Whether a production golden of ``case_id`` exists for this platform."""
    entry = goldens.read_manifest(root)["cases"].get(f"{KIND}/{case_id}")
    return entry is not None and entry.get("platform") == platform()


def check_production_golden(case_id: str, prod: dict, root: Path = goldens.ROOT) -> Report | None:
    """Report vs the stored golden; None when there is no golden for this platform."""
    if not has_golden(case_id, root):
        return None
    stored, _ = goldens.load(KIND, case_id, root)
    now = _subset(prod)
    tols = _tolerances(stored)
    report = compare_traces(now, stored, tols, components=STORED)
    index_topk = _index_topk(case_id)
    for r in report.results:
        comp = r.name.split(".", 1)[1]
        if r.passed or r.name not in now or now[r.name].shape != stored[r.name].shape:
            continue
        variant = _order_variant_rows(prod, r.name, stored[r.name].shape[0] if stored[r.name].dim() else 1,
                                      index_topk)
        if variant is None:
            continue
        if comp in INDEX_COMPONENTS or comp == "draft_token":
            n = stored[r.name].shape[0] if stored[r.name].dim() else 1  # draft tokens: one per row
            rows = index_rows_differing(now[r.name].reshape(n, -1), stored[r.name].reshape(n, -1))
            loose_ok = True
        else:
            rows = _rows_out_of_tolerance(now[r.name], stored[r.name], tols[comp])
            loose = GPU_VS_REFERENCE.get(comp)
            loose_ok = loose is not None and not _rows_out_of_tolerance(now[r.name], stored[r.name], loose)
        if rows and loose_ok and all(bool(variant[i]) for i in rows):
            r.passed = True
            r.note = (f"{len(rows)} of {len(variant)} rows differ, all order-variant (context > index_topk "
                      f"{index_topk}; rows {rows[:6]}), within the reference tolerance")
    report.meta.update(case=case_id, kind=KIND)
    return report


def _index_topk(case_id: str) -> int | None:
    from .side_by_side import GPU_CASES

    case = GPU_CASES.get(case_id)
    return None if case is None else case.hf_config().get("index_topk")


def _order_variant_rows(prod: dict, key: str, n_rows: int, index_topk: int | None) -> torch.Tensor | None:
    """Per row of ``key``: does its query read keys through the top-k (position + 1 > index_topk)?

    Rows are the step's tokens, or (logits, draft tokens at step 0) each
    request's last token; None when the rows cannot be matched to positions.
    """
    pos = prod.get(f"{key.split('.', 1)[0]}.positions")
    if pos is None:
        return None
    pos = pos.long().flatten()
    if index_topk is None:
        return torch.zeros(n_rows, dtype=torch.bool)
    if n_rows != pos.numel():  # one row per request: its last token (requests are position-major runs)
        last = torch.cat([torch.nonzero(pos[1:] <= pos[:-1]).flatten(), torch.tensor([pos.numel() - 1])])
        if n_rows != last.numel():
            return None
        pos = pos[last]
    return pos + 1 > index_topk


def _rows_out_of_tolerance(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> list[int]:
    a, e = actual.double(), expected.double()
    bad = (a - e).abs() > tol.atol + tol.rtol * e.abs()
    bad |= torch.isnan(a) != torch.isnan(e)
    if bad.dim() == 0:
        return [0] if bool(bad) else []
    return torch.nonzero(bad.reshape(bad.shape[0], -1).any(-1)).flatten().tolist()


def main(argv=None) -> int:
    from .side_by_side import GPU_CASES, run_case

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("record", "check"))
    ap.add_argument("--case", action="append")
    ap.add_argument("--root", default=str(goldens.ROOT))
    args = ap.parse_args(argv)
    status = 0
    for cid in args.case or GOLDEN_CASES:
        result = run_case(GPU_CASES[cid])
        if args.action == "record":
            print(f"recorded {record(cid, result['_prod'], Path(args.root))}")
            continue
        rep = check_production_golden(cid, result["_prod"], Path(args.root))
        if rep is None:
            print(f"{cid}: no golden for this platform {platform()}")
            continue
        print(rep.table())
        status |= 0 if rep.passed else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
