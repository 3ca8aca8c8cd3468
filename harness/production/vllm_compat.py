"""What differs between the vLLM releases the harness judges, in one place.

The production path reaches vLLM internals that are not a stable API (a loader
helper, the speculator classes the planted bugs patch, a kernel probe). Each is
named here once, by what it is, with the places the supported releases keep it
(first found wins); the production code asks ``internal("speculator.MTPSpeculator")``
and never compares version strings. A release that moves one more internal costs
one more location in its entry.

Something no location provides is ``CannotJudge("cannot judge: vLLM X.Y.Z: <what>")``:
exit 125, one line, never a traceback (``missing()`` lists them all at once).

Behaviour that differs between releases without a renamed name is recorded in
``DIFFERENCES`` (for the report and the README), not branched on: the harness
reads what the running vLLM did (the speculator class it built, the kernels it
picked) instead of predicting it from the version.

May import: ``harness.exitcodes`` (and vLLM lazily).
"""

from __future__ import annotations

import dataclasses
import importlib

from harness.exitcodes import CannotJudge

# The releases this checkout was written against and judged on (README "vLLM versions").
# Another version is judged too, as long as every internal below resolves.
SUPPORTED_RELEASES = ("0.33.0", "0.34.0")


@dataclasses.dataclass(frozen=True)
class Internal:
    """One vLLM internal: ``locations`` are ``module:qualname`` (dots walk attributes)."""

    name: str
    locations: tuple[str, ...]
    what: str  # what the harness uses it for (the cannot-judge line names it)
    # an optional one only adds to a report where it resolves: its absence is recorded
    # ("unavailable"), never a cannot-judge (``available``)
    optional: bool = False


INTERNALS: dict[str, Internal] = {i.name: i for i in (
    Internal("hy_v4.HYV4MTP", ("vllm.models.hy_v4.nvidia.mtp:HYV4MTP",),
             "the MTP draft model under test"),
    Internal("loader.initialize_model", ("vllm.model_executor.model_loader.utils:initialize_model",),
             "build HYV4MTP as vLLM's loader does"),
    Internal("loader.process_weights_after_loading",
             ("vllm.model_executor.model_loader.utils:process_weights_after_loading",),
             "the post-load pass vLLM's BaseModelLoader runs after load_weights"),
    Internal("torch_utils.set_default_torch_dtype", ("vllm.utils.torch_utils:set_default_torch_dtype",),
             "build the draft under its model dtype"),
    Internal("worker.AttentionGroup", ("vllm.v1.worker.utils:AttentionGroup",),
             "the runner's per-layer metadata builder wrapper"),
    Internal("worker.AttentionGroup.build_metadata", ("vllm.v1.worker.utils:AttentionGroup.build_metadata",),
             "per-step attention metadata as the V2 speculator builds it (gpu/attn_utils.build_attn_metadata)"),
    Internal("attention.CommonAttentionMetadata", ("vllm.v1.attention.backend:CommonAttentionMetadata",),
             "the batch description every metadata builder takes"),
    Internal("mla.split_kv_b_proj", ("vllm.model_executor.layers.attention.mla_attention:split_kv_b_proj",),
             "re-derive the absorbed MLA weights of a reloaded draft"),
    Internal("speculator.MTPSpeculator", ("vllm.v1.worker.gpu.spec_decode.mtp.speculator:MTPSpeculator",),
             "the single-module MTP speculator (planted bugs patch its lifecycle hooks)"),
    Internal("speculator.TargetDependentARSpeculator",
             ("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator:TargetDependentARSpeculator",),
             "MTPSpeculator's base (propose)"),
    Internal("speculator.target_dependent_ar_module",
             ("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator:",),
             "the module whose prepare_prefill_inputs the speculator looks up at call time"),
    Internal("speculator.MultiModuleMTPSpeculator",
             ("vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator:MultiModuleMTPSpeculator",),
             "the speculator that cycles MTP modules by draft step"),
    Internal("speculator.dp_utils_module", ("vllm.v1.worker.gpu.dp_utils:",),
             "the CUDA-graph dispatch of the V2 runner (dispatch_cg_and_sync_dp: its need_eager runs a "
             "graph-mode case's drafter eager again)"),
    Internal("worker.CudaGraphManager", ("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager",),
             "the speculator's CUDA-graph managers (run_fullgraph: which draft steps replayed a graph)"),
    Internal("hy_v4.compute_skip_topk_layers",
             ("vllm.model_executor.models.utils:compute_skip_topk_layers",
              "vllm.models.hy_v4.nvidia.attention:compute_skip_topk_layers"),
             "which layers reuse another layer's top-k"),
    Internal("kernels.cute_dsl_available",
             ("vllm.model_executor.kernels.linear.cute_dsl.ll_bf16:is_available",),
             "whether the CUTLASS DSL (CuTe) router GEMMs can run"),
    Internal("kernels.deep_gemm_supported", ("vllm.utils.deep_gemm:is_deep_gemm_supported",),
             "whether DeepGEMM (FP8 GEMMs, the indexer's MQA logits) is usable"),
    Internal("kernels.has_flashinfer", ("vllm.utils.flashinfer:has_flashinfer",),
             "whether FlashInfer (sampler, some MoE/attention paths) imports"),
    Internal("reload.reload_weights", ("vllm.model_executor.model_loader.reload.inplace:reload_weights",),
             "vLLM's in-place (layerwise) weight reload, the path the model runner's reload_weights takes, "
             "applied to the drafter (the reload cases)", optional=True),
    Internal("metrics.per_request_spec_decode",
             ("vllm.engine.arg_utils:EngineArgs.per_request_spec_decode_metrics",),
             "the engine argument that puts vLLM's per-request spec-decode counters on each output "
             "(the engine report records them beside the harness's acceptance)", optional=True),
    Internal("kernel_config.enable_jit_warmup", ("vllm.config.kernel:KernelConfig.enable_jit_warmup",),
             "vLLM's start-up JIT warmup switch (HYV4_ENGINE_JIT_WARMUP=0 turns it off; the engine report "
             "records which way it ran)", optional=True),
)}

# what every production run needs; the optional internals are asked for with ``available``
REQUIRED = tuple(n for n, i in INTERNALS.items() if not i.optional)

# Behaviour that moved between the supported releases (read from the two wheels). The harness
# does not branch on these: it observes them at run time; they are listed for the report.
DIFFERENCES = {
    "0.34.0": (
        "MoE router logits of more than 32 rows on SM90: bf16x3 CuteDSL GEMM (was fp32 F.linear / cuBLAS)",
        "FlashMLA sparse: BF16 small-head prefill kernel without head padding (8/16/32 heads)",
        ">= 2 MTP layers with index_share_for_mtp_iteration: MTPSpeculator (layer 0 every step), "
        "not MultiModuleMTPSpeculator",
        "V1 proposers removed, with AttentionGroup.build_metadata_for_drafting",
        "the loader no longer warns of parameters that received no checkpoint value",
        "compute_skip_topk_layers moved to model_executor/models/utils.py",
    ),
}


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def vllm_version_unimported() -> str | None:
    """``vllm.__version__`` without importing vLLM (seconds of imports): the string its
    ``version.py`` takes from the generated ``_version.py``, run on its own. None where that
    cannot be said so (no vLLM, a tree without ``_version.py``, a ``version.py`` that does not
    take it from there): ask ``vllm_version`` then."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("vllm")
        where = list(spec.submodule_search_locations or []) if spec else []
        if len(where) != 1:
            return None
        with open(os.path.join(where[0], "version.py")) as f:
            if "from ._version import __version__" not in f.read():
                return None
        gen = importlib.util.spec_from_file_location("_hyv4_vllm_version", os.path.join(where[0], "_version.py"))
        mod = importlib.util.module_from_spec(gen)
        gen.loader.exec_module(mod)
        version = mod.__version__
    except Exception:  # noqa: BLE001 - any doubt: the caller imports vLLM instead
        return None
    return version if isinstance(version, str) and version else None


def _resolve(location: str):
    module, _, qual = location.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qual.split(".")):
        obj = getattr(obj, part)
    return obj


def _try(entry: Internal):
    """(object, None) from the first location that resolves, else (None, why)."""
    errors = []
    for loc in entry.locations:
        try:
            return _resolve(loc), None
        except (ImportError, AttributeError) as exc:
            errors.append(f"{loc} ({exc.__class__.__name__})")
    return None, "; ".join(errors)


def internal(name: str):
    """The vLLM object behind ``INTERNALS[name]``; CannotJudge naming it where none resolves."""
    obj, why = _try(INTERNALS[name])
    if why is not None:
        entry = INTERNALS[name]
        raise CannotJudge(f"vLLM {vllm_version()}: {entry.name} ({entry.what}) not found: {why}")
    return obj


def available(name: str) -> bool:
    """Whether ``INTERNALS[name]`` resolves in the installed vLLM (for an optional one)."""
    return _try(INTERNALS[name])[1] is None


def missing(names=None) -> list[str]:
    """``name: what (tried locations)`` for every internal of ``names`` (default: the required
    ones) that does not resolve in the installed vLLM."""
    out = []
    # the registry as it is now (not REQUIRED, fixed at import): an optional entry never counts
    for name in names or [n for n, i in INTERNALS.items() if not i.optional]:
        _, why = _try(INTERNALS[name])
        if why is not None:
            out.append(f"{name} ({INTERNALS[name].what}): {why}")
    return out


# what the module-level path (compare, bisect-check's side-by-side cases, goldens, module mutants)
# needs; the speculator internals are checked where an engine runs (engine/hook_points.py), the
# kernel probes by kernel_paths (a missing optional kernel is its verdict, not this one's)
MODULE_PATH = tuple(n for n in REQUIRED if not n.startswith(("speculator.", "kernels.")))


def cannot_judge_reason(names=MODULE_PATH) -> str | None:
    """One line when the installed vLLM lacks one of ``names`` (default: what the module-level
    path needs), else None."""
    gone = missing(names)
    if not gone:
        return None
    more = f" (+{len(gone) - 1} more)" if len(gone) > 1 else ""
    return f"vLLM {vllm_version()}: {gone[0]}{more}"
