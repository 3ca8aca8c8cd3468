"""Which optional kernel paths the installed vLLM found on this host, and which of them a
normal install would have.

vLLM falls back quietly when an optional kernel package is missing (the CUTLASS DSL
router GEMMs log one info line; FlashInfer and DeepGEMM paths switch off). A harness
that judged the fallback would judge a path a pip-installed vLLM never runs, and a
golden recorded there would be another path's golden. So every report's metadata
carries ``host_paths()``, and ``cannot_judge_reason()`` answers 125 where a path that
a normal install provides is missing here, unless ``HYV4_ALLOW_MISSING_KERNELS=1``
(then the verdict line says what was judged without it: ``judged_without()``).

"A normal install provides it" is read from the installed vLLM itself, not from a list
per version: the distribution behind the path is among vLLM's own requirements
(``importlib.metadata.requires("vllm")``), or (DeepGEMM) vLLM's wheel vendors it.

May import: ``harness.production.vllm_compat`` (and vLLM lazily).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

ALLOW_ENV = "HYV4_ALLOW_MISSING_KERNELS"


@dataclasses.dataclass(frozen=True)
class KernelPath:
    name: str
    distribution: str | None  # the PyPI distribution that provides it (None: vendored in vLLM's wheel)
    probe: str  # a vllm_compat internal answering "usable here"
    what: str


PATHS = (
    KernelPath("cute_dsl", "nvidia-cutlass-dsl", "kernels.cute_dsl_available",
               "CUTLASS DSL (CuTe) kernels: the MoE router GEMM tiers ll_bf16 / ll_fp32w / bf16x3"),
    KernelPath("flashinfer", "flashinfer-python", "kernels.has_flashinfer",
               "FlashInfer: sampler and FlashInfer MoE / attention paths"),
    KernelPath("deep_gemm", None, "kernels.deep_gemm_supported",
               "DeepGEMM: FP8 block GEMMs, the indexer's MQA logits (vendored in vLLM's wheel)"),
)


def _vllm_requirements() -> set[str]:
    """Normalised names of the distributions vLLM requires outside extras."""
    import importlib.metadata as md

    try:
        reqs = md.requires("vllm") or []
    except md.PackageNotFoundError:
        return set()
    out = set()
    for r in reqs:
        if "extra ==" in r:
            continue
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)", r)
        if m:
            out.add(re.sub(r"[-_.]+", "-", m.group(1)).lower())
    return out


def _probe(path: KernelPath) -> tuple[bool, str]:
    from harness.production import vllm_compat

    try:
        fn = vllm_compat.internal(path.probe)
        ok = bool(fn())
        return ok, "" if ok else f"{path.probe}() is False"
    except Exception as exc:  # noqa: BLE001 - a probe that fails is a path that is not there
        return False, f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def host_paths() -> dict:
    """{path: {"available", "expected", "why"}} for this host's vLLM (CUDA initialised or not)."""
    reqs = _vllm_requirements()
    out = {}
    for p in PATHS:
        ok, why = _probe(p)
        if p.distribution is None:
            try:
                expected = importlib.util.find_spec("vllm.third_party.deep_gemm") is not None
            except ImportError:  # no vllm.third_party at all: nothing vendored
                expected = False
        else:
            expected = re.sub(r"[-_.]+", "-", p.distribution).lower() in reqs
        out[p.name] = {"available": ok, "expected": expected, "why": why}
    return out


def missing_expected(paths: dict) -> list[str]:
    """``name (why)`` for each path a normal install provides that this host lacks."""
    return [f"{n} ({v['why'] or 'unavailable'})" for n, v in paths.items() if v["expected"] and not v["available"]]


def allowed() -> bool:
    """Exactly ``1`` (``harness.input_checks`` refuses any other value before a run starts)."""
    return os.environ.get(ALLOW_ENV, "") == "1"


def cannot_judge_reason(paths: dict | None = None) -> str | None:
    """One line when a path a normal install uses is missing here (and not allowed), else None."""
    gone = missing_expected(paths if paths is not None else host_paths())
    if not gone or allowed():
        return None
    return (f"optional kernel path(s) a normal vLLM install uses are missing on this host: {'; '.join(gone)} "
            f"(the harness would judge a fallback; {ALLOW_ENV}=1 judges it anyway and says so)")


def judged_without(paths: dict | None = None) -> str:
    """'' or the words every verdict line carries when judging without an expected path
    (only with ``ALLOW_ENV`` set: without it such a host cannot judge at all)."""
    if not allowed():
        return ""
    gone = missing_expected(paths if paths is not None else host_paths())
    if not gone:
        return ""
    return f" [judged WITHOUT {', '.join(g.split(' (')[0] for g in gone)}: {ALLOW_ENV}=1]"


def model_paths(model) -> dict:
    """What the built draft picked: each MoE router gate's tier switches (its ``allow_*``
    attributes, whatever the release names them) and each attention layer's backend."""
    gates, backends = {}, {}
    for name, mod in model.named_modules():
        if type(mod).__name__ == "GateLinear":
            gates[name] = {k: bool(v) for k, v in vars(mod).items() if k.startswith("allow_") and isinstance(v, bool)}
        get_backend = getattr(mod, "get_attn_backend", None)
        if callable(get_backend) and hasattr(mod, "get_kv_cache_spec"):
            try:
                b = get_backend()
                backends[name] = getattr(b, "get_name", lambda: b.__name__)()
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                backends[name] = f"unknown ({exc.__class__.__name__})"
    return {"router_gates": gates, "attention_backends": backends}
