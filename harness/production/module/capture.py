"""Forward hooks on vLLM's ``HYV4MTP`` that record each component under the reference's names.

Nothing in vLLM is modified: we register ``torch.nn.Module`` forward (pre-)hooks
and, for the MoE router (not an ``nn.Module``), wrap ``select_experts`` on the
router *instance*. Captured tensors are copied to CPU right away.

Component -> where it is read (module paths relative to the MTP layer):
  embed              model.embed_tokens output
  embed_masked       enorm input (after the position==0 mask)
  enorm / hnorm      enorm / hnorm outputs
  eh_proj            eh_proj output
  attn.q_c           mtp_block.self_attn.q_a_layernorm output
  attn.kv_c          mtp_block.self_attn.kv_a_layernorm output
  attn.q, attn.k_pe  mla_attn inputs (q after RoPE, k_pe after RoPE)
  attn.topk          top-k buffer rows the sparse attention reads (mla_attn pre-hook)
  attn.core          mla_attn output (before the output gate)
  attn.gate          sigmoid(linear_gate output)   (sigmoid applied here, in its dtype)
  attn.out           o_proj output
  attn.residual      post_attention_layernorm input (attention out + residual)
  indexer.q_fp8/k/weights   indexer_op inputs (weights carry the folded q scale)
  indexer.topk       top-k buffer rows after indexer_op
  moe.router_logits  mlp.gate output
  moe.topk_ids/weights  router.select_experts result
  moe.shared         mlp.shared_experts output (when called as a module)
  mlp.out            mlp output
  final_norm         final_layernorm output[0]
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy in the captured dtype (fp8 stays fp8: compact to store)."""
    return t.detach().to("cpu").clone()


class Recorder:
    """Holds one step's captures; ``hooks`` stay registered until ``remove``."""

    def __init__(self) -> None:
        self.trace: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.enabled = True
        self._handles: list = []
        self._restore: list = []
        self.buffer: torch.Tensor | None = None
        self.num_tokens = 0

    def put(self, name: str, t) -> None:
        if self.enabled and torch.is_tensor(t):
            self.trace[name] = _cpu(t)

    def out(self, module, name: str, fn=None) -> None:
        def hook(_m, _args, output):
            v = _first(output)
            self.put(name, fn(v) if fn else v)
        self._handles.append(module.register_forward_hook(hook))

    def inp(self, module, name: str, index: int = 0, fn=None) -> None:
        def hook(_m, args, kwargs):
            if len(args) > index:
                v = args[index]
            else:
                return
            self.put(name, fn(v) if fn else v)
        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for obj, attr, old in self._restore:
            if old is None:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, old)
        self._handles.clear()
        self._restore.clear()


def _find_router(experts):
    seen = set()
    stack = [experts]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if hasattr(obj, "select_experts") and callable(obj.select_experts) and not isinstance(obj, torch.nn.Module):
            return obj
        for attr in ("router", "runner", "_runner", "moe_runner", "quant_method"):
            stack.append(getattr(obj, attr, None))
    return None


def attach(model, rec: Recorder) -> list[str]:
    """Register every hook on ``model`` (an ``HYV4MTP``); returns notes on what was not hookable."""
    notes = []
    inner = model.model
    rec.out(inner.embed_tokens, "embed")
    for layer in inner.layers.values():
        rec.inp(layer.enorm, "embed_masked")
        rec.out(layer.enorm, "enorm")
        rec.out(layer.hnorm, "hnorm")
        rec.out(layer.eh_proj, "eh_proj")
        rec.out(layer.final_layernorm, "final_norm")
        blk = layer.mtp_block
        sa = blk.self_attn
        if getattr(sa, "q_a_layernorm", None) is not None:
            rec.out(sa.q_a_layernorm, "attn.q_c")
        rec.out(sa.kv_a_layernorm, "attn.kv_c")
        rec.inp(sa.mla_attn, "attn.q", 0)
        rec.inp(sa.mla_attn, "attn.k_pe", 2, fn=lambda t: t.reshape(t.shape[0], -1))

        def topk_rows(_m, _args, _kwargs, _sa=sa):
            buf = getattr(_sa.mla_attn.impl, "topk_indices_buffer", None)
            n = _args[0].shape[0] if _args else 0
            if _sa.is_sparse and buf is not None and n:
                rec.put("attn.topk", buf[:n])
        rec._handles.append(sa.mla_attn.register_forward_pre_hook(topk_rows, with_kwargs=True))
        rec.out(sa.mla_attn, "attn.core")
        if getattr(sa, "linear_gate", None) is not None:
            if getattr(sa, "use_hpc_gated_mla", False):
                notes.append("attn.gate: HPC fused gated-MLA GEMM in use; gate not observable")
            rec.out(sa.linear_gate, "attn.gate", fn=torch.sigmoid)
        rec.out(sa.o_proj, "attn.out")
        rec.inp(blk.post_attention_layernorm, "attn.residual")
        if getattr(sa, "indexer", None) is not None:
            op = sa.indexer.indexer_op
            rec.inp(op, "indexer.q_fp8", 1)
            rec.inp(op, "indexer.k", 2)
            rec.inp(op, "indexer.weights", 3)
            # raw per-head weights (before the q scale is folded in): lets the
            # harness recover the UE8M0 q scale and compare dequantized q
            rec.out(sa.indexer.wk_weights_proj, "indexer.kw")

            def after_indexer(_m, args, output, _sa=sa):
                n = args[0].shape[0]
                buf = output if torch.is_tensor(output) else _sa.indexer.topk_indices_buffer
                rec.put("indexer.topk", buf[:n])
            rec._handles.append(op.register_forward_hook(after_indexer))
        mlp = blk.mlp
        rec.out(mlp, "mlp.out")
        if hasattr(mlp, "gate") and isinstance(mlp.gate, torch.nn.Module):
            rec.out(mlp.gate, "moe.router_logits")
        if getattr(mlp, "shared_experts", None) is not None:
            rec.out(mlp.shared_experts, "moe.shared")
        if hasattr(mlp, "experts"):
            router = _find_router(mlp.experts)
            if router is None:
                notes.append("moe.topk_ids: no router with select_experts found")
            else:
                orig = router.select_experts

                def select_experts(*a, _orig=orig, **kw):
                    w, ids = _orig(*a, **kw)
                    rec.put("moe.topk_weights", w)
                    rec.put("moe.topk_ids", ids)
                    return w, ids
                had = "select_experts" in vars(router)
                rec._restore.append((router, "select_experts", orig if had else None))
                router.select_experts = select_experts
    return notes
