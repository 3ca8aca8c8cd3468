"""HF transformers' ``hy_v4`` (5.23) set up to compute what the reference computes.

Every convention difference between HF transformers 5.23's ``hy_v4`` modeling
and vLLM 0.33 (which the reference follows) is aligned HERE and nowhere else,
each by one named alignment (``ALIGNMENTS``). ``build(cfg, weights,
skip={...})`` leaves the named ones out, so a test can show that each of them
is needed (``test_each_alignment_is_needed``). Everything not listed here
must agree to float64 rounding.

HF 5.23 has no MTP module (``HYV4PreTrainedModel`` ignores the checkpoint's
``model.mtp_layers.*``) and its decoder layer always wraps attention and MLP in
iHC hyper-connections, which vLLM's MTP block does not have. So the
cross-check takes HF's components, the ones the MTP block is built from
(``HYV4RMSNorm``, ``HYV4RotaryEmbedding``, ``HYV4Attention`` with its
``HYV4Indexer``, sinks and output gate, ``HYV4MoE`` = ``HYV4TopkRouter`` +
``HYV4Experts`` + shared ``HYV4MLP``, ``HYV4MLP``), loads the reference's
weights into them, and wires them the way vLLM's MTP layer does (``mtp_step``;
that glue - embedding mask at position 0, [enorm(e); hnorm(h)], eh_proj,
residual adds, the LM head - is the test's own and plain torch).

Nothing here is copied from transformers: the HF classes are imported and run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch.overrides import TorchFunctionMode
import transformers
from transformers.models.hy_v4 import modeling_hy_v4 as hf
from transformers.models.hy_v4.configuration_hy_v4 import HYV4Config

import reference.fp8
from reference import MTPConfig
from reference.numerics import EXACT

transformers.logging.set_verbosity_error()  # tiny configs: token ids outside the vocabulary etc.

# name -> what it aligns (HF 5.23 behaviour vs vLLM 0.33 behaviour). The table
# of HF-vs-vLLM differences in tests/hf/README.md lists the same entries.
ALIGNMENTS = {
    "float64": "HF forces float32 in HYV4RMSNorm (x.to(float32)), the RoPE table (inv_freq, angles), "
               "the indexer scores and weights (.float()) and the router (.type(float32)): inside "
               "HF's forward those casts are lifted to float64 (Float64Casts), so only float64 "
               "rounding is left",
    "rope_layout": "HF rotates rotate-half (NeoX) pairs (j, j + r/2) of the rope slice, vLLM "
                   "interleaved pairs (2i, 2i+1): the rope rows of q_b_proj, kv_a_proj_with_mqa, "
                   "indexer.wq_b / wk and k_norm's weight/bias are de-interleaved for HF (dot products "
                   "are unchanged by the common permutation)",
    "qkv_a_norm_eps": "HF builds q_a_layernorm / kv_a_layernorm with HYV4RMSNorm's default eps 1e-6; "
                      "vLLM uses rms_norm_eps (1e-5): HF's variance_epsilon is set to rms_norm_eps",
    "index_k_norm_eps": "HF's indexer k_norm LayerNorm uses rms_norm_eps (1e-5); vLLM hard-codes 1e-6: "
                        "HF's k_norm.eps is set to 1e-6",
    "softmax_scale": "HF multiplies the softmax scale by yarn_get_mscale(factor, mscale_all_dim)**2 "
                     "for any non-default rope type; vLLM 0.33 uses qk_head_dim**-0.5: the reference "
                     "runs with MTPConfig.softmax_scale_convention='hf'",
    "indexer_fp8": "vLLM quantizes the indexer q and k to FP8 (UE8M0 token groups); HF scores in "
                   "full precision: the reference's quantizer is made the identity (scale 1) while "
                   "it runs (reference_without_indexer_fp8)",
    "swiglu_limit": "HF clamps routed experts with swiglu_limit whatever its value (limit 0 zeroes "
                    "every routed expert: clamp(up, -0, 0)), vLLM clamps only when > 0: for "
                    "swiglu_limit <= 0 HF's experts get limit +inf (no clamp)",
    "sink": "HF always adds its sinks (every layer, no learnable_sink switch; default logit 0.0); "
            "vLLM only when learnable_sink on a sparse-attention layer: where the reference applies "
            "none, HF's sinks are -inf (exp(-inf) = 0 in the denominator)",
    "gate": "HF always gates elementwise (gate_proj [nh*v_head_dim, H], no gated_mla / gating_type): "
            "headwise gates are loaded as each head's row repeated v_head_dim times; no gate "
            "(gated_mla false) as a zero gate_proj (sigmoid(0) = 0.5 exactly) and o_proj x 2 (exact)",
    "dense_attention": "HF has no dense-attention layer: every layer runs its indexer (layer_types "
                       "only names the mask); for a reference layer with dense attention HF's "
                       "index_topk is raised to the context length, so its top-k is every causal key",
}

# ---------------------------------------------------------------------------
# float64: HF's forced float32 casts


class Float64Casts(TorchFunctionMode):
    """Inside it, every cast to float32 that HF's code asks for becomes float64.

    Aligns "float64" (see ``ALIGNMENTS``): ``t.float()``, ``t.to(float32)``,
    ``t.type(float32)`` and ``dtype=float32`` keyword arguments (e.g. RoPE's
    ``torch.arange(..., dtype=torch.float)``). ``lifted`` counts the lifted
    casts (by op name). Also records the inputs of ``Tensor.topk`` (the
    indexer's score rows, the router's choice scores) in ``topk_inputs``.
    """

    def __init__(self, lift: bool = True):
        super().__init__()
        self.lift = lift
        self.lifted: dict[str, int] = {}
        self.topk_inputs: list[torch.Tensor] = []

    def _count(self, name: str) -> None:
        self.lifted[name] = self.lifted.get(name, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__qualname__", "") or ""
        if name.endswith("topk") and args and isinstance(args[0], torch.Tensor):
            self.topk_inputs.append(args[0].detach().clone())
        if self.lift:
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
                self._count(f"{name}(dtype=float32)")
            if name == "TensorBase.float":
                self._count(name)
                return torch.Tensor.double(*args, **kwargs)
            if name in ("TensorBase.to", "TensorBase.type") and any(a is torch.float32 for a in args[1:]):
                self._count(f"{name}(float32)")
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def hf_float64(lift: bool = True):
    """float64 default dtype (parameters built by HF) plus ``Float64Casts``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    mode = Float64Casts(lift)
    try:
        with mode:
            yield mode
    finally:
        torch.set_default_dtype(old)


# ---------------------------------------------------------------------------
# indexer_fp8: the reference side


def _identity_quantize(x: torch.Tensor, group: int, ue8m0: bool, eps: float = 1e-10):
    t, d = x.shape
    return x.to(torch.float64), torch.ones(t, d // group, dtype=torch.float64, device=x.device)


@contextlib.contextmanager
def reference_without_indexer_fp8(enabled: bool = True):
    """Aligns "indexer_fp8": the reference's token-group quantizer returns (x, scale 1),
    so its indexer scores sum_h w_h D^-0.5 ih^-0.5 relu(q_h . k_j) in float64 as HF does."""
    if not enabled:
        yield
        return
    saved = reference.fp8.quantize_token_groups
    reference.fp8.quantize_token_groups = _identity_quantize
    try:
        yield
    finally:
        reference.fp8.quantize_token_groups = saved


def reference_cfg(cfg: MTPConfig, skip: frozenset = frozenset()) -> MTPConfig:
    """Aligns "softmax_scale" on the reference side (its existing switch)."""
    return cfg if "softmax_scale" in skip else cfg.replace(softmax_scale_convention="hf")


# ---------------------------------------------------------------------------
# config and weights


def hf_config(cfg: MTPConfig, *, context: int, max_position_embeddings: int = 4096) -> HYV4Config:
    """An HYV4Config (one decoder layer's worth) with the reference config's numbers.

    ``context``: the longest sequence a test runs (for "dense_attention").
    """
    r = cfg.rope
    if r.rope_type not in ("default", "yarn"):
        raise ValueError(f"HF 5.23 has no rope_type {r.rope_type!r}")
    if cfg.rotary_dim != cfg.qk_rope_head_dim:
        raise ValueError("HF 5.23's HYV4 rotates the whole qk_rope_head_dim slice (no partial rotary)")
    rope = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "yarn":
        rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_position,
                    beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(r, key) is not None:
                rope[key] = getattr(r, key)
    c = HYV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads, rms_norm_eps=cfg.rms_norm_eps,
        n_routed_experts=cfg.n_routed_experts, n_shared_experts=cfg.n_shared_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=cfg.norm_topk_prob, n_group=1, topk_group=1,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, index_topk=cfg.index_topk, index_head_dim=cfg.index_head_dim,
        index_n_heads=cfg.index_n_heads, swiglu_limit=float(cfg.swiglu_limit),
        layer_types=["indexed_attention"], mlp_layer_types=["sparse" if cfg.mlp_moe else "dense"],
        indexer_types=["full"], rope_parameters=rope, max_position_embeddings=max_position_embeddings,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    c._attn_implementation = "eager"  # the index mask is applied on the eager / sdpa paths only
    c._experts_implementation = "eager"
    if not cfg.attention_sparse:
        c.index_topk = max(c.index_topk, context)  # "dense_attention" (build undoes it when skipped)
    return c


def rope_perm(r: int, device=None) -> torch.Tensor:
    """HF slot j of a rotated slice of width r holds reference entry perm[j]:
    [0, 2, ..., r-2, 1, 3, ..., r-1] (rotate-half pair (j, j + r/2) = interleaved (2j, 2j+1))."""
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]).to(device)


def _permute_tail(w: torch.Tensor, block: int, r: int, dim: int = 0) -> torch.Tensor:
    """Within every block of ``block`` rows along ``dim``, permute the last r rows by ``rope_perm``."""
    w = w.movedim(dim, 0)
    n = w.shape[0]
    idx = torch.arange(n).reshape(n // block, block).clone()
    idx[:, block - r:] = idx[:, block - r:][:, rope_perm(r)]
    return w[idx.reshape(-1)].movedim(0, dim)


@dataclasses.dataclass
class HFBlock:
    """HF modules holding one MTP layer's weights, and the alignments applied."""

    cfg: MTPConfig
    config: HYV4Config
    norms: dict  # name -> HYV4RMSNorm
    attn: hf.HYV4Attention
    mlp: torch.nn.Module  # HYV4MoE or HYV4MLP
    rotary: hf.HYV4RotaryEmbedding
    lw: dict  # the reference weights (eh_proj, embed_tokens, lm_head are plain torch here)
    skip: frozenset


def build(cfg: MTPConfig, lw: dict, *, context: int, skip=frozenset()) -> HFBlock:
    """HF modules for one MTP layer, float64, loaded from the reference's layer weights
    ``lw`` (``reference.layer_weights``), with every alignment except those in ``skip``."""
    skip = frozenset(skip)
    unknown = skip - set(ALIGNMENTS)
    if unknown:
        raise ValueError(f"unknown alignments {sorted(unknown)}")
    config = hf_config(cfg, context=context)
    if not cfg.attention_sparse and "dense_attention" in skip:
        config.index_topk = cfg.index_topk
    with hf_float64(lift="float64" not in skip):
        attn = hf.HYV4Attention(config, 0)
        mlp = hf.HYV4MoE(config) if cfg.mlp_moe else hf.HYV4MLP(config)
        rotary = hf.HYV4RotaryEmbedding(config)
        norms = {n: hf.HYV4RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
                 for n in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "final_layernorm")}
    for m in (attn, mlp, *norms.values()):
        m.to(torch.float64)  # HF makes e_score_correction_bias float32 explicitly
    if "float64" not in skip:
        rotary.to(torch.float64)
    else:  # HF as it is: its RoPE table float32
        rotary.inv_freq = rotary.inv_freq.float()

    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    nh, lkv, idim = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.index_head_dim
    perm = (lambda w, block, dim=0: w) if "rope_layout" in skip else \
        (lambda w, block, dim=0: _permute_tail(w, block, dr, dim))
    sd = {
        "q_a_proj.weight": lw["attn.q_a_proj"],
        "q_a_layernorm.weight": lw["attn.q_a_layernorm"],
        "q_b_proj.weight": perm(lw["attn.q_b_proj"], dn + dr),
        "kv_a_proj_with_mqa.weight": perm(lw["attn.kv_a_proj_with_mqa"], lkv + dr),
        "kv_a_layernorm.weight": lw["attn.kv_a_layernorm"],
        "kv_b_proj.weight": lw["attn.kv_b_proj"],
        "o_proj.weight": lw["attn.o_proj"],
    }
    # gate
    if cfg.gated_mla and cfg.gating_type == "elementwise":
        sd["gate_proj.weight"] = lw["attn.linear_gate"]
    elif cfg.gated_mla:  # headwise: [nh, H] -> each row repeated v_head_dim times
        if "gate" in skip:
            raise ValueError("HF's gate_proj cannot hold a headwise gate as it is ([nh, H] vs [nh*v_head_dim, H])")
        sd["gate_proj.weight"] = lw["attn.linear_gate"].repeat_interleave(dv, dim=0)
    elif "gate" not in skip:  # no gate: sigmoid(0) = 0.5 exactly, undone by o_proj x 2 (exact)
        sd["gate_proj.weight"] = torch.zeros(nh * dv, cfg.hidden_size, dtype=torch.float64)
        sd["o_proj.weight"] = lw["attn.o_proj"] * 2
    # sink
    if cfg.sink_applied:
        sd["sinks"] = lw["attn.sink"]
    elif "sink" not in skip:
        sd["sinks"] = torch.full((nh,), float("-inf"), dtype=torch.float64)
    elif cfg.learnable_sink:
        sd["sinks"] = lw["attn.sink"]  # HF applies the loaded sink (vLLM drops it on dense layers)
    # indexer
    if cfg.attention_sparse:
        sd.update({
            "indexer.wq_b.weight": perm(lw["indexer.wq_b"], idim),
            "indexer.wk.weight": perm(lw["indexer.wk"], idim),
            "indexer.k_norm.weight": perm(lw["indexer.k_norm.weight"], idim),
            "indexer.k_norm.bias": perm(lw["indexer.k_norm.bias"], idim),
            "indexer.weights_proj.weight": lw["indexer.weights_proj"],
        })
    else:  # HF runs an indexer anyway; with "dense_attention" it keeps every causal key
        gen = torch.Generator().manual_seed(0)
        for name, p in attn.indexer.named_parameters():
            sd[f"indexer.{name}"] = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1
    _load(attn, sd)
    if "qkv_a_norm_eps" not in skip:
        attn.q_a_layernorm.variance_epsilon = cfg.rms_norm_eps
        attn.kv_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    if "index_k_norm_eps" not in skip:
        attn.indexer.k_norm.eps = 1e-6

    if cfg.mlp_moe:
        msd = {
            "gate.weight": lw["mlp.gate"], "gate.e_score_correction_bias": lw["mlp.expert_bias"],
            "experts.gate_up_proj": torch.cat([lw["mlp.experts.gate_proj"], lw["mlp.experts.up_proj"]], dim=1),
            "experts.down_proj": lw["mlp.experts.down_proj"],
        }
        if cfg.n_shared_experts > 0:
            msd.update({f"shared_experts.{p}.weight": lw[f"mlp.shared_experts.{p}"]
                        for p in ("gate_proj", "up_proj", "down_proj")})
        _load(mlp, msd)
        if not (cfg.swiglu_limit and cfg.swiglu_limit > 0) and "swiglu_limit" not in skip:
            mlp.experts.swiglu_limit = math.inf
    else:
        _load(mlp, {f"{p}.weight": lw[f"mlp.{p}"] for p in ("gate_proj", "up_proj", "down_proj")})
    for n, m in norms.items():
        _load(m, {"weight": lw[n]})
    return HFBlock(cfg, config, norms, attn, mlp, rotary, lw, skip)


def _load(module: torch.nn.Module, sd: dict) -> None:
    """Copy every tensor in; the module's own parameters/buffers not named keep their values."""
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    missing = sorted(set(sd) - set(own))
    if missing:
        raise KeyError(f"{type(module).__name__} has no {missing}")
    with torch.no_grad():
        for k, v in sd.items():
            if tuple(own[k].shape) != tuple(v.shape):
                raise ValueError(f"{type(module).__name__}.{k}: shape {tuple(own[k].shape)} vs {tuple(v.shape)}")
            own[k].copy_(v.to(own[k].dtype))


def causal_mask(length: int) -> torch.Tensor:
    """HF's eager additive causal mask [1, 1, S, S]: 0 where visible, finfo.min above the diagonal."""
    m = torch.full((length, length), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    return m[None, None]


# ---------------------------------------------------------------------------
# one MTP step through HF's modules


def mtp_step(block: HFBlock, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
             request: torch.Tensor) -> dict:
    """The MTP layer's forward (vLLM's wiring) over a request-major batch whose every request
    starts at position 0 (step 0), each request one HF call (batch 1). Returns the reference's
    trace names for what HF computes, plus ``indexer.scores`` / ``moe.*`` from HF's router and
    indexer (rows request-major, score rows padded with -inf as the reference's)."""
    lw, cfg = block.lw, block.cfg
    out: dict[str, list] = {}
    rows_by_req = [torch.nonzero(request == r).flatten() for r in torch.unique(request).tolist()]
    span = int(positions.max()) + 1
    with hf_float64(lift="float64" not in block.skip) as mode, torch.no_grad():
        for rows in rows_by_req:
            pos = positions[rows]
            if not torch.equal(pos, torch.arange(pos.numel())):
                raise ValueError("mtp_step runs step 0 only: each request from position 0")
            emb = lw["embed_tokens"][ids[rows]]
            emb = torch.where((pos == 0)[:, None], torch.zeros_like(emb), emb)  # vLLM's MTP rule
            e = block.norms["enorm"](emb)
            h = block.norms["hnorm"](hidden[rows])
            x0 = torch.cat([e, h], dim=-1) @ lw["eh_proj"].T
            x = block.norms["input_layernorm"](x0)
            cos_sin = block.rotary(x[None], pos[None])
            n_before = len(mode.topk_inputs)
            a, _, topk = block.attn(x[None], cos_sin, causal_mask(pos.numel()), position_ids=pos[None])
            a = a[0]
            if cfg.attention_sparse:
                s = mode.topk_inputs[n_before][0]  # the indexer's masked score rows [L, L]
                pad = torch.full((pos.numel(), span), float("-inf"), dtype=torch.float64)
                pad[:, : pos.numel()] = torch.where(s > torch.finfo(s.dtype).min / 2, s,
                                                    torch.full_like(s, float("-inf")))
                out.setdefault("indexer.scores", []).append(pad)
                out.setdefault("indexer.topk_sets", []).extend(
                    [sorted(set(t.tolist()) & set(range(i + 1))) for i, t in enumerate(topk[0])])
            r1 = a + x0
            m_in = block.norms["post_attention_layernorm"](r1)
            if cfg.mlp_moe:
                logits, weights, idx = block.mlp.gate(m_in)
                out.setdefault("moe.router_logits", []).append(logits)
                out.setdefault("moe.topk_ids", []).append(idx)
                out.setdefault("moe.topk_weights", []).append(weights)
                routed = block.mlp.experts(m_in, idx, weights)
                shared = block.mlp.shared_experts(m_in)
                out.setdefault("moe.routed", []).append(routed)
                out.setdefault("moe.shared", []).append(shared)
                m = block.mlp(m_in)
            else:
                m = block.mlp(m_in)
            y = block.norms["final_layernorm"](m + r1)
            for name, v in (("enorm", e), ("hnorm", h), ("eh_proj", x0), ("attn.out", a),
                            ("attn.residual", r1), ("mlp.out", m), ("final_norm", y)):
                out.setdefault(name, []).append(v)
            out.setdefault("logits", []).append(y[-1:] @ lw["lm_head"].T)
    res = {k: (torch.cat(v) if isinstance(v[0], torch.Tensor) else v) for k, v in out.items()}
    res["draft_token"] = torch.argmax(res["logits"], dim=-1)
    res["lifted_casts"] = dict(mode.lifted)
    return res


def reference_step(cfg: MTPConfig, weights: dict, first, skip=frozenset()) -> dict:
    """The reference's step-0 trace with the reference-side alignments applied."""
    from reference import draft

    rcfg = reference_cfg(cfg, frozenset(skip))
    with reference_without_indexer_fp8("indexer_fp8" not in skip):
        return draft(rcfg, weights, first, steps=1, num=EXACT).traces[0]


__all__ = ["ALIGNMENTS", "Float64Casts", "HFBlock", "build", "causal_mask", "hf_config", "hf_float64",
           "mtp_step", "reference_cfg", "reference_step", "reference_without_indexer_fp8",
           "rope_perm"]
