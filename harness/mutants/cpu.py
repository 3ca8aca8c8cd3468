"""CPU: vLLM's pure functions patched (``cpu_apply`` of the RoPE-style and grouped-top-k
mutants) and the reference-vs-vLLM cross-checks that must then report a problem
(``rope_cross_check``, ``routing_cross_check``; tests/cpu/test_mutants_cpu.py,
tests/cpu/test_reference_vs_vllm_pure.py)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


@contextlib.contextmanager
def _patch_module_attr(mod, name: str, wrap: Callable):
    orig = getattr(mod, name)
    setattr(mod, name, wrap(orig))
    try:
        yield
    finally:
        setattr(mod, name, orig)


def cpu_rope_neox():
    from vllm.model_executor.layers import rotary_embedding as m

    def wrap(orig):
        def get_rope(*a, **kw):
            kw["is_neox_style"] = True
            return orig(*a, **kw)
        return get_rope
    return _patch_module_attr(m, "get_rope", wrap)


def _cpu_grouped_topk(edit: Callable[[dict], None]):
    from vllm.model_executor.layers.fused_moe.router import grouped_topk_router as m

    def wrap(orig):
        def grouped_topk(hidden_states, gating_output, topk, renormalize, **kw):
            kw = dict(kw, topk=topk, renormalize=renormalize)
            edit(kw)
            return orig(hidden_states, gating_output, **kw)
        return grouped_topk
    return _patch_module_attr(m, "grouped_topk", wrap)


def cpu_renorm_flipped():
    return _cpu_grouped_topk(lambda kw: kw.__setitem__("renormalize", not kw["renormalize"]))


def cpu_scaling_twice():
    return _cpu_grouped_topk(lambda kw: kw.__setitem__(
        "routed_scaling_factor", kw.get("routed_scaling_factor", 1.0) ** 2))


def cpu_bias_zero():
    def edit(kw):
        b = kw.get("e_score_correction_bias")
        if b is not None:
            kw["e_score_correction_bias"] = torch.zeros_like(b)
    return _cpu_grouped_topk(edit)


ROPE_PARAMS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0},
    "deepseek_yarn": {"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0,
                      "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 0.7},
}


def vllm_hf_config(hf: dict):
    """``hf`` as vLLM 0.33 reads a checkpoint's ``config.json``: its own ``get_config``
    (HYV4Config, transformers' rope standardization and layer-type checks, vLLM's
    rope patches), from a temporary model directory. Raises what vLLM raises."""
    import shutil
    from unittest import mock

    from vllm.transformers_utils import config as vcfg

    from harness.production.module.vllm_config import write_model_dir

    path = write_model_dir(hf)
    try:
        # one attempt: with_retry would sleep 2 s before re-raising a refusal
        with mock.patch.object(vcfg, "with_retry", lambda func, *a, **k: func()):
            return vcfg.get_config(path, trust_remote_code=False)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rope_cross_check(kind: "str | dict" = "default", positions: list[int] | None = None) -> list[str]:
    """The reference's interleaved RoPE vs vLLM's ``get_rope(..., is_neox_style=False)``.

    ``kind``: a ``ROPE_PARAMS`` name, or config keys to set on the tiny preset
    (``rope_parameters`` and any top-level key; None removes one). Both sides
    read the same ``config.json``: vLLM through ``vllm_hf_config`` and the
    ``get_rope`` call ``HYV4MLAAttention`` makes (head size qk_rope_head_dim,
    ``max_position_embeddings``), the reference through ``MTPConfig.from_hf_dict``.
    Compared: refusal (vLLM raises <=> the reference raises ConfigError, except
    that the reference may refuse what it says it does not model), the
    rotated width, the magnitude, the cos/sin table rows and ``forward_native``'s
    q / k at ``positions`` (default: spread over the table, capped at 4000).
    Returns the problems found.
    """
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as re_mod

    from harness.presets import preset
    from reference import ConfigError, MTPConfig, rope

    name = kind if isinstance(kind, str) else "params"
    hf = preset("tiny")
    for key, value in ({"rope_parameters": dict(ROPE_PARAMS[kind])} if isinstance(kind, str) else kind).items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    head = int(hf["qk_rope_head_dim"])
    ref_err = vllm_err = None
    try:
        cfg = MTPConfig.from_hf_dict(hf)
    except ConfigError as exc:
        ref_err = exc
    try:
        vc = vllm_hf_config(hf)
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            vr = re_mod.get_rope(head, max_position=getattr(vc, "max_position_embeddings", 8192),
                                 rope_parameters=vc.rope_parameters, is_neox_style=False, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 (whatever vLLM raises is a refusal)
        vllm_err = exc
    if ref_err is not None or vllm_err is not None:
        if vllm_err is None and "not modelled" in str(ref_err):
            return []  # a documented refusal, naming the key the reference does not model
        if (ref_err is None) != (vllm_err is None):
            return [f"rope[{name}]: vLLM {'refuses' if vllm_err else 'accepts'} ({vllm_err!r:.200}), the reference "
                    f"{'refuses' if ref_err else 'accepts'} ({ref_err!r:.200})"]
        return []
    problems = []
    if vr.rotary_dim != cfg.rotary_dim:
        return [f"rope[{name}]: rotary_dim vLLM {vr.rotary_dim} vs reference {cfg.rotary_dim}"]
    m = rope.mscale(cfg.rope)
    if hasattr(vr, "mscale") and abs(vr.mscale - m) > 1e-12 * max(1.0, abs(m)):
        problems.append(f"rope[{name}].mscale: vLLM {vr.mscale!r} vs reference {m!r}")
    n_rows = vr.cos_sin_cache.shape[0]
    if positions is None:
        top = min(n_rows, 4001) - 1
        positions = sorted({0, 1, 5, top // 7, top // 2, top})
    pos = torch.tensor(positions)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 3, head, generator=g, dtype=torch.float32)
    k = torch.randn(len(positions), 1, head, generator=g, dtype=torch.float32)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        vq, vk = vr.forward_native(pos, q.clone(), k.clone())
    c, s = rope.cos_sin(cfg.rope, head, pos)
    # vLLM builds inv_freq and the angles p * f_i in float32: a few float32 roundings of
    # angles up to ~4000 rad (absolute ~ 4000 * 2^-23 ~ 5e-4), times the magnitude.
    atol = 2e-3 * max(1.0, abs(m))
    for what, got, want in (("cos_sin", vr.cos_sin_cache[pos].double(), torch.cat([c, s], dim=-1)),
                            ("q", vq.double(), rope.apply_interleaved(q.double(), c, s)),
                            ("k", vk.double(), rope.apply_interleaved(k.double(), c, s))):
        try:
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-3)
        except AssertionError as exc:
            problems.append(f"rope[{name}].{what}: {str(exc).splitlines()[0]} "
                            f"(max |d| {float((got - want).abs().max()):.3g})")
    return problems


def routing_cross_check(seed: int = 0, experts: int = 8, topk: int = 2, renorm: bool = True,
                        tokens: int = 64) -> list[str]:
    """``reference.moe.route`` vs vLLM's ``grouped_topk`` (sigmoid + bias, one group);
    expert sets per row and weights per expert; returns the problems found."""
    from vllm.model_executor.layers.fused_moe.router import grouped_topk_router as m

    from reference import EXACT, moe
    from reference.config import MTPConfig

    cfg = MTPConfig().replace(n_routed_experts=experts, num_experts_per_tok=topk, hidden_size=16,
                              routed_scaling_factor=2.827, norm_topk_prob=renorm)
    g = torch.Generator().manual_seed(seed)
    lw = {"mlp.gate": torch.randn(experts, 16, generator=g, dtype=torch.float64),
          "mlp.expert_bias": 0.05 * torch.randn(experts, generator=g, dtype=torch.float64)}
    x = torch.randn(tokens, 16, generator=g, dtype=torch.float64)
    ref = moe.route(cfg, lw, x, EXACT)
    w, ids = m.grouped_topk(x.float(), ref["router_logits"].float(), topk, renorm, num_expert_group=1,
                            topk_group=1, scoring_func="sigmoid", routed_scaling_factor=2.827,
                            e_score_correction_bias=lw["mlp.expert_bias"].float())
    problems = []
    if ids.shape != ref["topk_ids"].shape:
        return [f"routing: shape {tuple(ids.shape)} vs {tuple(ref['topk_ids'].shape)}"]
    bad_ids = bad_w = 0
    for t in range(tokens):
        if set(ids[t].tolist()) != set(ref["topk_ids"][t].tolist()):
            bad_ids += 1
            continue
        got = dict(zip(ids[t].tolist(), w[t].double().tolist()))
        for eid, want in zip(ref["topk_ids"][t].tolist(), ref["topk_weights"][t].tolist()):
            # fp32 sigmoid / normalisation in vLLM vs float64 in the reference
            if abs(got[eid] - want) > 1e-6 + 1e-5 * abs(want):
                bad_w += 1
                break
    if bad_ids:
        problems.append(f"routing: {bad_ids}/{tokens} rows choose other experts")
    if bad_w:
        problems.append(f"routing: {bad_w}/{tokens} rows have other weights")
    return problems
