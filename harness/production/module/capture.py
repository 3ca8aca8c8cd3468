"""Forward hooks on vLLM's ``HYV4MTP`` that record each component under the reference's names.

Nothing in vLLM is modified: we register ``torch.nn.Module`` forward (pre-)hooks
and, for the MoE router (not an ``nn.Module``), wrap ``select_experts`` on the
router *instance*. Captured tensors are copied to CPU right away.

Where each component is read is its registry record's ``hooks`` (``harness.components``;
``HOOKS`` lists them in dataflow order, module paths relative to the MTP layer):
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
  indexer.kw         wk_weights_proj output (raw per-head weights: the q scale is recovered from it)
  indexer.topk       top-k buffer rows after indexer_op
  moe.router_logits  mlp.gate output
  moe.topk_ids/weights  router.select_experts result
  moe.shared         mlp.shared_experts output (when called as a module)
  mlp.out            mlp output
  final_norm         final_layernorm output[0]

May import: ``harness.components`` and torch (never vLLM).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from harness.components import HOOKS, Hook


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


_TRANSFORMS = {None: None, "sigmoid": torch.sigmoid, "flatten-heads": lambda t: t.reshape(t.shape[0], -1)}


def _resolve(root, path: str):
    """``root``'s attribute at dotted ``path``, or None where a link is missing or None."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _attach_router(rec: Recorder, experts, names: tuple[str, ...], notes: list[str]) -> None:
    router = _find_router(experts)
    if router is None:
        notes.append(f"{names[0]}: no router with select_experts found")
        return
    orig = router.select_experts

    def select_experts(*a, _orig=orig, **kw):
        w, ids = _orig(*a, **kw)
        rec.put("moe.topk_weights", w)
        rec.put("moe.topk_ids", ids)
        return w, ids
    had = "select_experts" in vars(router)
    rec._restore.append((router, "select_experts", orig if had else None))
    router.select_experts = select_experts


def _attach_one(rec: Recorder, layer, sa, hook: Hook, names: tuple[str, ...], notes: list[str]) -> None:
    name = names[0]
    module = _resolve(layer, hook.module)
    if module is None:
        parent_path, _, leaf = hook.module.rpartition(".")
        parent = _resolve(layer, parent_path) if parent_path else layer
        if not hook.optional or (hook.optional == "with-parent" and parent is not None):
            raise AttributeError(f"{name}: {hook.module} not found on the MTP layer")
        if hook.kind == "router" and parent is not None and hasattr(parent, leaf):
            _attach_router(rec, None, names, notes)  # an MoE whose experts are None: noted, no router
        return
    if hook.kind == "router":
        _attach_router(rec, module, names, notes)
        return
    if not isinstance(module, torch.nn.Module):
        return
    if hook.kind == "out":
        if name == "attn.gate" and getattr(sa, "use_hpc_gated_mla", False):
            notes.append("attn.gate: HPC fused gated-MLA GEMM in use; gate not observable")
        rec.out(module, name, _TRANSFORMS[hook.transform])
    elif hook.kind == "in":
        rec.inp(module, name, hook.arg, _TRANSFORMS[hook.transform])
    elif hook.kind == "topk-buffer":  # the rows of the top-k buffer the sparse attention reads
        def topk_rows(_m, _args, _kwargs, _sa=sa):
            buf = getattr(_sa.mla_attn.impl, "topk_indices_buffer", None)
            n = _args[0].shape[0] if _args else 0
            if _sa.is_sparse and buf is not None and n:
                rec.put(name, buf[:n])
        rec._handles.append(module.register_forward_pre_hook(topk_rows, with_kwargs=True))
    elif hook.kind == "indexer-topk":  # the indexer op's output rows (or its buffer)
        def after_indexer(_m, args, output, _sa=sa):
            n = args[0].shape[0]
            buf = output if torch.is_tensor(output) else _sa.indexer.topk_indices_buffer
            rec.put(name, buf[:n])
        rec._handles.append(module.register_forward_hook(after_indexer))
    else:
        raise ValueError(f"{name}: unknown hook kind {hook.kind!r}")


def attach(model, rec: Recorder) -> list[str]:
    """Register every hook of the registry (``harness.components.HOOKS``) on ``model`` (an
    ``HYV4MTP``); returns notes on what was not hookable."""
    notes: list[str] = []
    inner = model.model
    for hook, names in HOOKS:  # the inner model's own modules: once
        if hook.module.startswith("model."):
            _attach_one(rec, inner, None, dataclasses.replace(hook, module=hook.module[len("model."):]), names, notes)
    for layer in inner.layers.values():
        sa = layer.mtp_block.self_attn
        for hook, names in HOOKS:
            if not hook.module.startswith("model."):
                _attach_one(rec, layer, sa, hook, names, notes)
    return notes
