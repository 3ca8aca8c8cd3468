"""A recorded ``vllm.LLM`` run on disk, for re-judging it offline on any machine (CPU, no vLLM
import): ``save_recording`` writes every tensor the replay (``draft_replay``) needs, plus
production's diagnostic components while they fit, and ``load_recording`` reads it back as
``DraftCall`` records, refusing a file that is not one (bounded reads: ``harness.input_checks``).
"""

from __future__ import annotations

import torch

from harness.components import DIAGNOSTIC_COMPONENTS
from harness.production.engine.draft_replay import DraftCall

RECORDING_FORMAT = 1
_CALL_TENSORS = ("input_ids", "positions", "hidden", "query_start_loc", "request_keys", "seq_lens",
                 "sample_rows", "tokens", "logits", "topk_rows", "last_token_indices", "sample_hidden")
_TARGET_TENSORS = ("input_ids", "positions", "hidden", "query_start_loc", "request_keys", "sample_rows", "greedy")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if torch.is_tensor(x):
        return x.tolist() if x.numel() <= 64 else f"tensor{tuple(x.shape)}"
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bfloat16 when that is lossless (a bf16 value held in float32), else as is."""
    if t.dtype in (torch.float32, torch.float64) and t.numel():
        b = t.to(torch.bfloat16)
        if torch.equal(b.to(t.dtype), t):
            return b
    return t


def save_recording(path_stem: str, calls: list[DraftCall], proposals: list[dict], meta: dict, *,
                   max_bytes: int = 9 * 2**20, trace_components=DIAGNOSTIC_COMPONENTS,
                   targets: list | None = None) -> dict:
    """Write ``<path_stem>.safetensors`` (every tensor the replay needs, plus production's
    diagnostic components while they fit in ``max_bytes``) and ``<path_stem>.json``
    (per-call metadata, proposals' step counts, ``meta``). Returns a summary."""
    from safetensors.torch import save_file

    from harness.atomic import atomic_write, atomic_write_json

    tensors: dict[str, torch.Tensor] = {}

    def put(name, t):
        tensors[name] = t.detach().cpu().contiguous().clone()

    call_meta = []
    for i, c in enumerate(calls):
        for f in _CALL_TENSORS:
            t = getattr(c, f)
            if t is not None:
                put(f"call{i:05d}.{f}", t)
        call_meta.append({"engine_step": c.engine_step, "draft_step": c.draft_step,
                          "spec_step_idx": c.spec_step_idx, "layer_ran": c.layer_ran, "notes": _jsonable(c.notes)})
    target_meta = []
    for i, tc in enumerate(targets or []):
        for f in _TARGET_TENSORS:
            t = getattr(tc, f)
            if t is not None:
                put(f"target{i:05d}.{f}", t)
        target_meta.append({"engine_step": tc.engine_step})
    prop_meta = []
    for j, p in enumerate(proposals):
        if torch.is_tensor(p.get("draft_tokens")):
            put(f"prop{j:05d}.draft_tokens", p["draft_tokens"])
        prop_meta.append({k: _jsonable(v) for k, v in p.items() if k != "draft_tokens"})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    kept, dropped = [], []
    for comp in trace_components:  # diagnostics, in dataflow order, while they fit
        extra = {f"call{i:05d}.trace.{comp}": _narrow(c.trace[comp]) for i, c in enumerate(calls)
                 if torch.is_tensor(c.trace.get(comp))}
        nbytes = sum(t.numel() * t.element_size() for t in extra.values())
        if not extra:
            continue
        if size + nbytes > max_bytes:
            dropped.append(comp)
            continue
        for k, t in extra.items():
            put(k, t)
        size += nbytes
        kept.append(comp)
    atomic_write(path_stem + ".safetensors", lambda tmp: save_file(tensors, tmp))
    summary = {"format": RECORDING_FORMAT, "calls": len(calls), "proposals": len(proposals),
               "tensor_bytes": size, "trace_components": kept, "trace_components_dropped": dropped}
    atomic_write_json(path_stem + ".json", {**summary, "meta": _jsonable(meta), "call_meta": call_meta,
                                            "proposal_meta": prop_meta, "target_meta": target_meta})
    return summary


# what one engine recording's tensors may weigh (a few MiB for the harness's cases): more is not a recording
MAX_RECORDING_BYTES = 4 << 30


def load_recording(path_stem: str) -> tuple[list[DraftCall], list[dict], dict]:
    """Inverse of ``save_recording``: (calls, proposals, the JSON document)."""
    from safetensors.torch import load as load_bytes

    from harness.input_checks import read_bytes, read_json

    # read whole, bounded, regular files only: a FIFO never blocks, /dev/zero never fills the memory,
    # and no memory map outlives a file truncated under it (a SIGBUS)
    doc = read_json(f"{path_stem}.json", path_stem + ".json")
    if not isinstance(doc, dict) or doc.get("format") != RECORDING_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise ValueError(f"{path_stem}.json: recording format {str(found)[:40]}, expected {RECORDING_FORMAT}")
    tensors = load_bytes(read_bytes(f"{path_stem}.safetensors", path_stem + ".safetensors", MAX_RECORDING_BYTES))
    calls = []
    for i, m in enumerate(doc["call_meta"]):
        pre = f"call{i:05d}."
        get = {f: tensors.get(pre + f) for f in _CALL_TENSORS}
        trace = {k[len(pre + "trace."):]: v for k, v in tensors.items() if k.startswith(pre + "trace.")}
        call = DraftCall(m["engine_step"], m["draft_step"], spec_step_idx=m["spec_step_idx"], trace=trace,
                         notes=m.get("notes", {}), layer_ran=m.get("layer_ran"), **get)
        calls.append(call)
    if doc.get("target_meta"):
        from harness.production.engine.bookkeeping import TargetCall

        doc["targets"] = [TargetCall(m["engine_step"],
                                     **{f: tensors.get(f"target{j:05d}.{f}") for f in _TARGET_TENSORS})
                          for j, m in enumerate(doc["target_meta"])]
    props = []
    for j, m in enumerate(doc["proposal_meta"]):
        props.append({**m, "draft_tokens": tensors.get(f"prop{j:05d}.draft_tokens")})
    return calls, props, doc
