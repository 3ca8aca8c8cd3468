"""Post-load audit of the production draft model: fail loudly, naming the parameter.

vLLM's MTP loader only *warns* when a draft parameter receives no checkpoint
value; the parameter then keeps its sentinel init (``-inf`` sink,
``finfo(float32).min`` FP8 scales, uninitialised memory) and the draft silently
degrades. The harness turns each of those into an error.

It also compares every module's quant method with the checkpoint's quantization config
(``quant_method_problems``, a pure function of the config's exclusion rules and the
{module: method class name} map): a module the config excludes (stored bf16, no scale) built
with a quantized method, or a module the config quantizes built unquantized, is named first.
Where the checkpoint's exclusion does not reach the module because of a known vLLM limitation
(compressed-tensors' ``ignore`` is not remapped onto the draft prefixes, ``quant.CT_GAP``), the
problem starts with "vLLM gap:" and says why (``gap_problems`` / ``unexplained_by_gaps``).
"""

from __future__ import annotations

import torch


class LoadAuditError(AssertionError):
    """The loaded production model has a parameter no checkpoint value reached.

    ``problems``: one ``<parameter>: <problem>`` string each (``harness.exitcodes``
    prints the first ones on the command's one line; exit 1, a bad vLLM commit).
    """

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("production post-load audit failed:\n  " + "\n  ".join(self.problems))


def quant_prefix(module_name: str) -> str:
    """The prefix vLLM built a draft module's quant method under: its name without ``.mtp_block``
    (``HYV4MultiTokenPredictorLayer`` builds its decoder block with the layer's own prefix);
    an MTP layer's shared head is built as ``lm_head`` (the backbone's head prefix), the routed
    experts module (``...mlp.experts.routed_experts``) under its MoE layer's ``...mlp.experts``."""
    if module_name.endswith(".shared_head.head"):
        return "lm_head"
    return module_name.replace(".mtp_block.", ".").removesuffix(".routed_experts")


def module_quant_methods(model) -> dict[str, str]:
    """{module name: its ``quant_method`` class name} for every module that has one; a method
    wrapping the one the quant config chose (the MoE modular kernel's ``old_quant_method``)
    is named by the wrapped one."""
    out = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None or isinstance(qm, str):
            continue
        while getattr(qm, "old_quant_method", None) is not None:
            qm = qm.old_quant_method
        out[name] = type(qm).__name__
    return out


def is_unquantized_method(method: str) -> bool:
    return method.startswith("Unquantized")


def quant_method_problems(hf_config: dict, methods: dict[str, str]) -> list[str]:
    """Modules whose quant method disagrees with ``hf_config``'s quantization config.

    ``methods``: ``module_quant_methods``. A module the config excludes
    (``Fp8Plan.excluded_by`` on its quant prefix; every module when the MTP layers are
    unquantized) must have an ``Unquantized*`` method; a module the plan holds in FP8 must
    not. Only the modules vLLM builds with the MTP quant config are judged (the MTP layers'
    quantizable linears and routed experts, ``harness.checkpoint.quant``, and the shared head
    ``lm_head``); KV-cache methods (``*KVCacheMethod``) are not weight quantization and are
    skipped, as are private (``_``-named) platform wrappers.
    """
    from reference.config import MTPConfig

    from harness.checkpoint.quant import _QUANT_MODULES, mtp_fp8_plan

    cfg = MTPConfig.from_hf_dict(hf_config)
    plan = mtp_fp8_plan(hf_config, cfg)
    n = cfg.num_hidden_layers
    fp8_modules = {} if plan is None else {
        f"model.layers.{n + i}.{_QUANT_MODULES[leaf][0]}": i
        for i, leaves in plan.quantized.items() for leaf in leaves}
    # the modules vLLM builds with the MTP quant config (the rest, e.g. the router gate or the
    # indexer's wk_weights_proj, are built without one: no exclusion rule governs them)
    governed = {"lm_head"} | {f"model.layers.{n + i}.{module}" for i in range(cfg.num_mtp_layers)
                              for module, _ in _QUANT_MODULES.values()}
    problems = []
    for name, method in methods.items():
        if method.endswith("KVCacheMethod") or method.startswith("_"):  # KV cache scales; private wrappers
            continue
        prefix = quant_prefix(name)
        if prefix not in governed:
            continue
        if plan is None:
            why = f"the MTP layers are unquantized (mtp_quant_algo={hf_config.get('mtp_quant_algo')!r})"
        else:
            hit = plan.excluded_by(prefix)
            why = None if hit is None else f"quantization_config.{plan.exclusion_key} excludes it ({hit!r})"
        if why is not None and not is_unquantized_method(method):
            gap = plan.vllm_gap(prefix) if plan is not None else None
            problems.append(f"{name}: {gap + '; ' if gap else ''}{why}, so the checkpoint holds it in bf16 "
                            f"without a scale, but vLLM built it with {method} (quantized)")
        elif why is None and prefix in fp8_modules and is_unquantized_method(method):
            problems.append(f"{name}: FP8 in the checkpoint ({plan.where()}), but vLLM built it with {method}")
    return problems


GAP_MARK = "vLLM gap:"


def gap_modules(problems: list[str]) -> list[str]:
    """The modules the audit's "vLLM gap:" problems name (a known vLLM limitation, not the harness)."""
    return [p.split(": ", 1)[0] for p in problems if f": {GAP_MARK}" in p]


def unexplained_by_gaps(problems: list[str]) -> list[str]:
    """``problems`` less the vLLM gaps and their consequences (a problem naming a parameter or
    loader warning of a gap module: its scale never loaded, its weight never reached)."""
    mods = gap_modules(problems)
    out = []
    for p in problems:
        if f": {GAP_MARK}" in p:
            continue
        if mods and any(m + "." in p for m in mods):
            if not p.startswith("loader warning:"):
                continue
            names = [n.strip() for n in p.rsplit(": ", 1)[-1].split(",")]
            if all(any(n.startswith(m + ".") for m in mods) for n in names):
                continue
        out.append(p)
    return out


def audit_loaded_model(model, loaded: set[str], pre_process_params: dict, warnings: list[str],
                       hf_config: dict | None = None) -> list[str]:
    """Problems found (empty when clean). Call after ``process_weights_after_loading``.

    With ``hf_config``, the quant-method mismatches (``quant_method_problems``) come first."""
    problems: list[str] = []
    if hf_config is not None:
        problems += quant_method_problems(hf_config, module_quant_methods(model))
    try:
        from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter
    except ImportError:  # pragma: no cover
        KVCacheScaleParameter = ()
    for name, p in pre_process_params.items():
        if name in loaded or isinstance(p, KVCacheScaleParameter):
            continue
        problems.append(f"{name}: received no checkpoint value")
    for msg in warnings:
        if "Skipping unknown" in msg or "received no checkpoint value" in msg:
            problems.append(f"loader warning: {msg}")
    fmin = torch.finfo(torch.float32).min
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        if not torch.is_tensor(t) or t.numel() == 0 or not t.is_floating_point():
            continue
        tf = t.detach()
        if tf.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            tf = tf.float()
        if bool(torch.isnan(tf).any()):
            problems.append(f"{name}: contains NaN")
        if "sink" in name and bool(torch.isinf(tf).any()):
            problems.append(f"{name}: still -inf (sink never loaded)")
        if "scale" in name and bool((tf.float() == fmin).any()):
            problems.append(f"{name}: holds finfo(float32).min (scale sentinel never loaded)")
    return problems


def check_loaded_model(model, loaded, pre_process_params, warnings) -> None:
    problems = audit_loaded_model(model, loaded, pre_process_params, warnings)
    if problems:
        raise LoadAuditError(problems)
