"""Drive vLLM's ``HYV4MTP`` through K draft steps exactly as the MTP proposer does.

Step 0: every request's new tokens (positions 0..L_r-1) with the target's
hidden states; sample each request's last token (``compute_logits`` + argmax,
the greedy draft path). Steps k >= 1: one token per request (the previous
draft token at position last+k) fed the previous step's output hidden state,
with attention metadata rebuilt by the real builders (``build_for_drafting``,
draft_index=k). With ``index_share_for_mtp_iteration`` the proposer calls
``set_skip_topk(True)`` + ``compact_topk_indices(last_token_rows)`` after step
0; we do the same. The proposer never passes ``spec_step_idx`` (MTP layer 0
serves every step); ``spec_step_idx="proposer"`` reproduces that, an int
forces a layer.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from . import audit, build, capture, kv
from .checkpoint_cast import cast_for_vllm
from .vllm_config import build_vllm_config
from .. import run_hooks

_SESSIONS: dict[str, "ProductionSession"] = {}


def fresh_compile_state() -> None:
    """Forget what Dynamo compiled earlier in this process, so each session's torch.compile'd
    vLLM functions (``grouped_topk``, dynamic=True) are traced as in a fresh process. Otherwise
    a call whose constants differ from an earlier session's (256 experts top-8 after 8 top-2,
    a planted routed scaling) fails a guard and is recompiled with the earlier call's
    specialisations: another graph, so another Inductor cache key, which depends on which
    cases the process ran before: a warmup that ran a case after others does not cover the same
    case run first in a test worker. Fresh, they share one key; each session pays a re-trace,
    not a compile."""
    import torch._dynamo  # vLLM has imported it by now

    torch._dynamo.reset()


@dataclasses.dataclass
class StepNotes:
    """Per-step facts about how production ran (for reports, not compared)."""

    step: int
    num_tokens: int
    metadata: dict


def _describe_metadata(md: dict) -> dict:
    out = {}
    for name, m in md.items():
        d = {}
        for attr in ("num_decodes", "num_prefills", "num_decode_tokens"):
            if hasattr(m, attr):
                d[attr] = int(getattr(m, attr))
        pre = getattr(m, "prefill", None)
        if pre is not None and hasattr(pre, "use_dense_mha"):
            d["prefill.use_dense_mha"] = bool(pre.use_dense_mha)
        d["type"] = type(m).__name__
        out[name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]] = d
    return out


class ProductionSession:
    """One built ``HYV4MTP`` (per HF config) that can load weights and run cases."""

    def __init__(self, hf_config: dict, *, num_speculative_tokens: int = 3,
                 device: str | torch.device = "cuda", max_model_len: int = 1024,
                 max_num_batched_tokens: int = 1024, max_num_seqs: int = 16,
                 tensor_parallel_size: int = 1, rank: int = 0, init_method: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """``tensor_parallel_size`` > 1: this process is ``rank`` of that TP group
        (``device`` its GPU, ``init_method`` shared by all ranks; see ``multigpu.py``).
        ``kv_cache_dtype``: vLLM's ``--kv-cache-dtype`` ("fp8": the sparse MLA layer stores the
        packed fp8_ds_mla rows, and each step's rows are recorded as ``attn.kv_cache_rows``)."""
        self.hf_config = dict(hf_config)
        self.device = torch.device(device)
        fresh_compile_state()
        extra = {"tensor_parallel_size": int(tensor_parallel_size)} if tensor_parallel_size > 1 else None
        self.vllm_config = build_vllm_config(
            self.hf_config, num_speculative_tokens=num_speculative_tokens,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype, extra_engine_args=extra)
        build.init_distributed(self.vllm_config, self.device, world_size=int(tensor_parallel_size),
                               rank=int(rank), init_method=init_method)
        run_hooks.fire("vllm_imported")  # e.g. the start-up GC pause ends: the model is built after it
        self.model = build.build_model(self.vllm_config, self.device)
        self.block_size = self.vllm_config.cache_config.block_size
        self.index_topk = self.hf_config.get("index_topk")
        draft_hf = self.vllm_config.speculative_config.draft_model_config.hf_config
        self.share_indices = bool(getattr(draft_hf, "index_share_for_mtp_iteration", False))
        self.max_num_batched_tokens = max_num_batched_tokens
        self.loaded = False
        self.audit_problems: list[str] = []
        self.notes: list = []
        self.attach_notes: list[str] = []

    # ---- weights --------------------------------------------------------------
    def load(self, weights_ckpt: dict[str, torch.Tensor], *, strict: bool = True) -> list[str]:
        """Load checkpoint tensors (cast to bf16/fp32 as on disk) and audit the result."""
        if self.loaded:
            raise RuntimeError("weights already loaded: process_weights_after_loading is one-shot; "
                               "make a new ProductionSession")
        ckpt = cast_for_vllm(weights_ckpt)
        # a module built quantized against the checkpoint's exclusion because of a known vLLM gap may
        # also make the load itself raise: the gap is then still what the verdict names first
        built = audit.quant_method_problems(self.hf_config, audit.module_quant_methods(self.model))
        try:
            loaded, pre, warnings = build.load_checkpoint(self.model, self.vllm_config, ckpt, self.device)
        except Exception as exc:
            if not audit.gap_modules(built):
                raise
            raise audit.LoadAuditError(built + [f"loading then raised {exc.__class__.__name__}: {exc}"]) from exc
        self.audit_problems = audit.audit_loaded_model(self.model, loaded, pre, warnings,
                                                       hf_config=self.hf_config)
        self.loaded = True
        if strict and self.audit_problems:
            raise audit.LoadAuditError(self.audit_problems)
        return self.audit_problems

    def reload(self, weights_ckpt: dict[str, torch.Tensor]) -> None:
        """Update the loaded weights in place through vLLM's own layerwise reload
        (``model_loader.reload.inplace.reload_weights``: what the model runner's ``reload_weights``
        does to the target, here applied to the draft), checkpoint format, from an iterator."""
        from vllm.config import set_current_vllm_config

        from harness.production import vllm_compat

        if not self.loaded:
            raise RuntimeError("load() weights first: a reload updates loaded weights")
        reload_weights = vllm_compat.internal("reload.reload_weights")
        ckpt = cast_for_vllm(weights_ckpt)
        with set_current_vllm_config(self.vllm_config):
            reload_weights(self.vllm_config, self.model, iter(sorted(ckpt.items())), None, True)

    # ---- running -------------------------------------------------------------
    @torch.inference_mode()
    def run(self, first, steps: int, *, spec_step_idx="proposer",
            share_indices: bool | None = None, record: bool = True) -> dict[str, torch.Tensor]:
        """{"step{k}.{component}": tensor} for ``steps`` draft steps from ``first`` (a reference.StepInput).

        ``record=False`` attaches no hooks (the trace holds only the step inputs,
        logits and draft tokens): for timing the production path undisturbed.
        """
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        if not self.loaded:
            raise RuntimeError("load() weights first")
        share = self.share_indices if share_indices is None else share_indices
        dev = self.device
        req = first.request.to(torch.long)
        pos = first.positions.to(torch.long)
        num_req = int(req.max()) + 1
        lengths = torch.bincount(req, minlength=num_req)
        if not bool((req[1:] >= req[:-1]).all()):
            raise ValueError("StepInput must be request-major (rows of a request adjacent, in order)")
        last_rows = torch.cumsum(lengths, 0) - 1
        max_len = int(pos.max()) + steps + 1
        layout = kv.BatchLayout(num_req, math.ceil(max_len / self.block_size), self.block_size,
                                kv.block_table_width(self.vllm_config))
        layers = kv.setup_draft_layers(self.vllm_config, dev, layout.num_blocks)
        buffer = torch.full((self.max_num_batched_tokens, self.index_topk or 1), -1,
                            dtype=torch.int32, device=dev)
        model = self.model
        if self.index_topk is not None:
            model.set_topk_indices_buffer(buffer)
            if hasattr(model.model, "set_skip_topk"):
                model.model.set_skip_topk(False)
        rec = capture.Recorder()
        self.attach_notes = capture.attach(model, rec) if record else []
        out: dict[str, torch.Tensor] = {}
        self.notes = []
        ids = first.input_ids.to(torch.long)
        hidden = first.hidden.to(torch.bfloat16)
        try:
            for k in range(steps):
                seq_lens = [int(pos[req == r].max()) + 1 for r in range(num_req)]
                cam = kv.common_metadata(layout, req, pos, seq_lens, dev)
                md, slots = kv.build_step_metadata(layers, cam, k, self.vllm_config)
                self.notes.append(StepNotes(k, int(ids.numel()), _describe_metadata(md)))
                rec.trace.clear()
                kwargs = dict(input_ids=ids.to(dev), positions=pos.to(dev), hidden_states=hidden.to(dev))
                if spec_step_idx != "proposer":
                    kwargs["spec_step_idx"] = int(spec_step_idx) if spec_step_idx != "cycle" else k
                with set_current_vllm_config(self.vllm_config):
                    with set_forward_context(md, self.vllm_config, num_tokens=int(ids.numel()),
                                             slot_mapping=slots):
                        h = model(**kwargs)
                    rows = last_rows.to(dev) if k == 0 else torch.arange(num_req, device=dev)
                    logits = model.compute_logits(h[rows])
                tok = logits.argmax(dim=-1)
                trace = rec.trace
                if record:
                    # (its own name: ``rows`` above holds the sampled rows, read again below)
                    cache_rows = packed_cache_rows(layers, cam.slot_mapping)
                    if cache_rows is not None:
                        trace["attn.kv_cache_rows"] = cache_rows
                trace["logits"] = logits.detach().float().cpu()
                trace["draft_token"] = tok.detach().cpu()
                out[f"step{k}.input_ids"] = ids.clone()
                out[f"step{k}.positions"] = pos.clone()
                out[f"step{k}.hidden_in"] = hidden.float().clone()
                for name, v in trace.items():
                    out[f"step{k}.{name}"] = v
                # next step's inputs, as the proposer builds them
                if k == 0 and share and self.index_topk is not None and steps > 1:
                    model.model.set_skip_topk(True)
                    model.model.compact_topk_indices(last_rows.to(dev))
                lr = last_rows if k == 0 else torch.arange(num_req)
                hidden = h[rows].detach().to("cpu")
                ids = tok.detach().to("cpu").to(torch.long)
                pos = pos[lr] + 1
                req = torch.arange(num_req)
        finally:
            rec.remove()
            if self.index_topk is not None and hasattr(model.model, "set_skip_topk"):
                model.model.set_skip_topk(False)
        return out


def packed_cache_rows(layers: list, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """The packed rows (uint8 [T, bytes]: fp8_ds_mla's 656) the step wrote at ``slot_mapping`` into
    the first MLA layer's cache that holds packed rows (MTP layer 0: the proposer runs it every
    step), copied to the CPU; None for a bf16 cache. The rows are read after the forward: what
    the kernels of the next step (and this step's attention) read."""
    for dl in layers:
        if not getattr(dl.spec, "state_content_bytes", None) or not hasattr(dl.layer, "kv_lora_rank"):
            continue  # a bf16 cache, or the indexer's key cache
        cache = getattr(dl.layer, "kv_cache", None)
        if not torch.is_tensor(cache) or cache.dtype != torch.uint8:
            continue
        flat = cache.reshape(-1, cache.shape[-1])
        return flat[slot_mapping.to(flat.device).long()].detach().to("cpu").clone()
    return None


def session_for(hf_config: dict, **kw) -> ProductionSession:
    """A fresh session per call (weights load is one-shot); kept for symmetry with tests."""
    return ProductionSession(hf_config, **kw)


def run_production(hf_config: dict, weights_ckpt: dict[str, torch.Tensor], first, steps: int,
                   **kw) -> dict[str, torch.Tensor]:
    """Build vLLM's HYV4MTP for ``hf_config``, load ``weights_ckpt``, run ``steps`` draft steps.

    Returns ``{"step{k}.{component}": tensor}`` with the keys of
    ``reference.flatten`` for the components production exposes.
    """
    run_kw = {k: kw.pop(k) for k in ("spec_step_idx", "share_indices") if k in kw}
    kw.setdefault("num_speculative_tokens", steps)
    s = ProductionSession(hf_config, **kw)
    s.load(weights_ckpt)
    return s.run(first, steps, **run_kw)


def describe_notes(session: ProductionSession) -> str:
    return json.dumps([dataclasses.asdict(n) for n in session.notes], indent=1)
